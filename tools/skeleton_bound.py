"""How fast can a forward built from today's kernels be? Its matmuls and attention alone, in one CUDA graph.

The **skeleton** of one forward over a workload's grids is every matmul the model runs (the shapes of
``glmvit.profiling.encoder_gemms``, in forward order, with distinct weights per block so that it streams the model's
bytes) and every block's attention over the workload's segments (each temporal patch of each item), and nothing
else: no norms, residual adds, SwiGLU, rotation (unless the attention kernel that wins does it), interpolation,
host work. Each op runs the fastest kernel this machine has for its shape, chosen by timing every candidate alone
(``glmvit.profiling.graph_time_us``: one weight, so warm in L2, where the skeleton streams a weight per block; where
two libraries tie, the pick may not be the faster one streaming) and keeping only candidates whose output checks:

- a matmul: cuBLAS or cuBLASLt behind ``F.linear`` (``tools/blas_ab.py``'s switch; a bias where the model has one),
  for the blocks' gate_up the fused SwiGLU GEMM (``glmvit.model.swiglu_linear``: it does more work, so it may
  stand in for the matmul alone), and where nvmath-python imports (NVIDIA's Python binding of cuBLASLt), each of the
  first ``--lt-algos`` algorithms cuBLASLt's heuristic ranks for the shape (``lt#RANK``: tile, stages, split-K and
  reduction scheme as the heuristic pairs them; torch's cuBLASLt path runs only the first), executed by name, the
  two matmuls with a bias left to ``F.linear`` (nvmath-python's bias epilogue wants a column-major output) — each
  checked against float32, and each captured in the CUDA graph that times it (a call a graph refuses is no
  candidate: the encoder replays graphs);
- the attention: the paths of ``tools/attention_sweep.py`` for the layout (glmvit's ``triton`` and ``cudnn``
  backends with their rotation, dense cuDNN and FlashAttention SDPA when every segment has one length,
  ``varlen_attn``, FlashAttention's varlen where it imports; not those of ``NOT_CANDIDATES``), each checked against
  float32 by that sweep's bounds.

So the skeleton's time is a lower bound for any forward that runs these ops as these kernels: the model can only add
to it. It is measured beside the model's own graph-compiled replay of the same batch, in one process, in two
regimes, since an H200 under its power cap lowers its clock (``tools/sustained_floor.py``):

1. ``burst``: after ``--rest-s`` idle, the model's replay and the skeleton's in turn, ``--burst`` times each,
   ``--gap-s`` idle after each (so the clock stays where an idle GPU starts);
2. ``run``: after a rest, each back to back as many times as the record that times the workload does
   (:data:`RUN_REPLAYS`: a benchmark's requests, the in-process serving run's batches) after 5 warm-up replays; the
   median of all. The regime the records' own medians are taken in: from an idle clock into the power cap;
3. ``sustained``: each back to back for ``--seconds`` (the model first, then the skeleton, after a rest); the
   median of the second half.

Each replay is timed between CUDA events with the SM clock and board power read beside it (``tools/gap_probe.py``'s
``timed``). A target below the skeleton's burst median is out of reach for this design whatever the clock; below
its run median, out of reach for the record that measures it; below its sustained median, out of reach for a
workload that keeps the GPU at its power cap. The model replays the graph its runner would for the batch: a
uniform graph (the dense attention) where ``bench`` captures one for the workload's segment
length (:func:`glmvit.uniform.planned_uniform_lengths`), unless ``--attention`` names a backend. CUDA only (exit 2
elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/skeleton_bound.py --json data/sweeps/skeleton_bound_h200.json
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared helpers
from ab_common import one_line  # noqa: E402

from glmvit.config import VisionConfig  # noqa: E402
from glmvit.profiling import encoder_gemms  # noqa: E402
from glmvit.uniform import planned_uniform_lengths  # noqa: E402

# name: the batch's grids, rows [t, h, w] (the bench workloads', and sixteen clips: a serving batch at budget 4096).
# Four 224² images are the clip's rows in the clip's segments (4 × 256): the same skeleton, so not timed twice.
WORKLOADS: dict[str, list[list[int]]] = {
    "1x224": [[1, 16, 16]], "clip8x224": [[4, 16, 16]], "8x448": [[1, 32, 32]] * 8, "16clips": [[4, 16, 16]] * 16}
# replays back to back in the ``run`` regime: as many as the record timing the workload has — bench's requests
# (img1x224 and video8x224: 50, img8x448: 40; recorder.STATIC_JOBS) and the in-process serving run's batches
# (1000 clips at 15.6 a batch: 64; data/bench/serve_video8x224_in_process.json)
RUN_REPLAYS = {"1x224": 50, "clip8x224": 50, "8x448": 40, "16clips": 64}
BIASED = ("patch_embed", "downsample")  # the model's matmuls with a bias (glmvit.model: embed, head)
CANDIDATE_REPLAYS = 20
LT_ALGOS = 32  # cuBLASLt heuristic algorithms tried per matmul shape where nvmath-python imports (--lt-algos)
# attention_sweep paths that are no candidates: the rotations alone (no attention), cuDNN's ragged entry of torch
# (a plan rebuilt per call, which a graph capture refuses) and the TMA kernel (slower on every layout in
# data/sweeps/tma_ab_h200.json; a fault there would end this process, as the sweep's own docstring warns)
NOT_CANDIDATES = ("rot", "cudnn_ragged", "triton_tma")


@dataclass(frozen=True)
class Op:
    """One op of the skeleton: a matmul (``shape`` = M, K, N; ``gemm`` names its shape in
    :func:`~glmvit.profiling.encoder_gemms`) or a block's attention (``shape`` = the segments' lengths)."""

    name: str
    kind: str  # "matmul" or "attention"
    shape: tuple[int, ...]
    gemm: str = ""

    def flops(self, hidden: int) -> int:
        """2·M·K·N for a matmul; 4·Σ L²·hidden for an attention (QKᵀ and P·V over every head)."""
        if self.kind == "matmul":
            m, k, n = self.shape
            return 2 * m * k * n
        return 4 * sum(length * length for length in self.shape) * hidden


def segment_lengths(grids: list[list[int]]) -> tuple[int, ...]:
    """The attention segments of ``grids``: every temporal patch of every item, h·w rows each, in order."""
    return tuple(h * w for t, h, w in grids for _ in range(t))


def skeleton(config: VisionConfig, grids: list[list[int]]) -> list[Op]:
    """One forward's matmuls and attentions over ``grids``, in the order the model runs them."""
    lengths = segment_lengths(grids)
    gemms = {name: (m, k, n) for name, m, k, n, _ in encoder_gemms(config, sum(lengths))}

    def matmul(name: str, gemm: str) -> Op:
        return Op(name, "matmul", gemms[gemm], gemm)

    ops = [matmul("patch_embed", "patch_embed")]
    for block in range(config.depth):
        ops += [matmul(f"block{block}.qkv", "qkv"), Op(f"block{block}.attention", "attention", lengths),
                matmul(f"block{block}.proj", "proj"), matmul(f"block{block}.gate_up", "gate_up"),
                matmul(f"block{block}.down", "down")]
    return ops + [matmul(name, name) for name in ("downsample", "merger.proj", "merger.gate_up", "merger.down")]


def steady(values: list[float]) -> float:
    """The median of the second half of a back-to-back run's readings (the first half is the clock's ramp)."""
    if len(values) < 2:
        raise ValueError(f"a sustained run needs at least 2 readings, not {len(values)}")
    return median(values[len(values) // 2:])


def summary(timed: dict[str, list], sustained: bool) -> dict[str, Any]:
    """A ``timed`` run's median ms (second half when ``sustained``), SM clock and power, and the replays read."""
    pick = steady if sustained else median

    def reading(key: str) -> float | None:
        values = [v for v in timed[key] if v is not None]
        return pick(values) if len(values) >= 2 else (values[0] if values else None)

    return {"ms": pick(timed["device_ms"]), "sm_mhz": reading("sm_mhz"), "power_w": reading("power_w"),
            "replays": len(timed["device_ms"])}


# --- the GPU side --------------------------------------------------------------------------------------------------

def lt_plan(x: torch.Tensor, w: torch.Tensor, limit: int = 0, algorithm: Any = None) -> tuple[Any, list[Any]]:
    """nvmath-python's cuBLASLt matmul ``x @ w.T`` (bf16, float32 accumulation, as ``F.linear``) planned either
    with the first ``limit`` algorithms cuBLASLt's heuristic ranks or with ``algorithm`` alone (one found for
    another matmul of this shape); the plan and its algorithms. ImportError where nvmath-python is missing."""
    from nvmath.linalg.advanced import Matmul

    plan = Matmul(x, w.T)
    if algorithm is not None:
        return plan, plan.plan(algorithms=[algorithm])
    return plan, plan.plan(preferences={"limit": limit})


def lt_call(plan: Any, algorithm: Any = None) -> torch.Tensor:
    """One execution of ``plan`` with ``algorithm`` (None: its first) on the current stream (a capture's, in a
    capture)."""
    return plan.execute(algorithm=algorithm, stream=torch.cuda.current_stream())


def lt_describe(algorithm: Any) -> dict[str, Any]:
    """What a cuBLASLt algorithm is: its id, tile, stages, split-K, reduction scheme, swizzle and cluster."""
    out: dict[str, Any] = {}
    for key in ("algorithm_id", "tile", "stages", "split_k", "reduction_scheme", "cta_swizzling", "cluster_shape"):
        try:
            value = getattr(algorithm, key)
        except Exception as err:  # noqa: BLE001 - a field this cuBLASLt does not report
            value = one_line(err)
        out[key] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return out


def matmul_candidates(op: Op, gen: torch.Generator, lt_algos: int = 0, lt_found: dict[str, Any] | None = None,
                      failed: dict[str, str] | None = None) -> dict[str, Callable[[], torch.Tensor]]:
    """Every kernel that may run ``op``'s matmul, each on operands of its shape, checked against float32 here;
    ``lt#RANK`` for the first ``lt_algos`` cuBLASLt algorithms (their objects put in ``lt_found`` by name, a plan
    cuBLASLt refuses put in ``failed`` as ``lt``)."""
    import torch.nn.functional as F
    from blas_ab import LIBRARIES, with_library

    from glmvit.gate_up import gate_up_tile, pack_gate_up
    from glmvit.model import swiglu_linear

    m, k, n = op.shape
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if op.gemm in BIASED else None
    ref = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
    out: dict[str, Callable[[], torch.Tensor]] = {}
    for library in LIBRARIES:
        out[library] = with_library(library, lambda: F.linear(x, w, b))
    if op.gemm == "gate_up":
        gate, up = ref.chunk(2, dim=-1)
        swiglu_ref = F.silu(gate) * up
        tile = gate_up_tile(n // 2)  # the weight as the model stores it: packed in tiles
        packed = pack_gate_up(w, tile)
        out["swiglu"] = lambda: swiglu_linear(x, packed, tile)
    if lt_algos and b is None:
        try:
            plan, algorithms = lt_plan(x, w, limit=lt_algos)
        except ImportError:
            algorithms = []
        except Exception as err:  # noqa: BLE001 - a plan cuBLASLt refuses leaves torch's candidates
            algorithms = []
            if failed is not None:
                failed["lt"] = one_line(err)
        for rank, algorithm in enumerate(algorithms):
            out[f"lt#{rank}"] = partial(lt_call, plan, algorithm)
            if lt_found is not None:
                lt_found[f"lt#{rank}"] = algorithm
    checks = {name: (swiglu_ref if name == "swiglu" else ref) for name in out}
    return {name: fn for name, fn in out.items() if _matmul_ok(fn, checks[name])}


def _matmul_ok(fn: Callable[[], torch.Tensor], ref: torch.Tensor) -> bool:
    """Whether ``fn`` runs and lands within 2⁻⁶·max|ref| of the float32 result (bf16 inputs and output: a few
    roundings of the output's scale; a wrong kernel misses by the scale itself)."""
    try:
        return (fn().float() - ref).abs().max().item() <= 2**-6 * ref.abs().max().item()
    except Exception:  # noqa: BLE001 - a kernel this machine refuses is no candidate
        return False


def fastest(candidates: dict[str, Callable[[], Any]],
            failed: dict[str, str] | None = None) -> tuple[str, dict[str, float]]:
    """The candidate with the least graph-replayed µs per call, and every candidate's µs (a failure is left out,
    its one line put in ``failed``)."""
    from glmvit.profiling import graph_time_us

    times: dict[str, float] = {}
    for name, fn in candidates.items():
        try:
            times[name] = graph_time_us(fn, repeats=20, runs=CANDIDATE_REPLAYS)
        except torch.AcceleratorError:
            raise  # a fault poisons the context: every later call would fail for it
        except Exception as err:  # noqa: BLE001
            if failed is not None:
                failed[name] = one_line(err)
            continue
    if not times:
        raise RuntimeError(f"no candidate ran: {sorted(candidates)}")
    return min(times, key=times.__getitem__), times


def attention_candidates(lengths: tuple[int, ...]) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """``tools/attention_sweep.py``'s paths for ``lengths`` whose output checks (the rotations alone left out),
    and why each other path is not a candidate."""
    import attention_sweep as sweep

    inputs = sweep.layout_inputs(lengths)
    real = inputs.layout.real_rows
    ok: dict[str, Callable[[], Any]] = {}
    refused: dict[str, str] = {}
    for path, fn in sweep.layout_paths(inputs).items():
        if path.startswith(NOT_CANDIDATES):
            continue
        if isinstance(fn, str):
            refused[path] = fn
            continue
        try:
            check = sweep.check(fn()[:real], inputs.ref, inputs.v[:real])
        except torch.AcceleratorError:
            raise
        except Exception as err:  # noqa: BLE001
            refused[path] = one_line(err)
            continue
        if check["ok"]:
            ok[path] = fn
        else:
            refused[path] = f"output off: {check}"
    return ok, refused


def build_skeleton(config: VisionConfig, grids: list[list[int]], seed: int = 0,
                   lt_algos: int = 0) -> tuple[Callable[[], None], dict[str, Any]]:
    """The skeleton of ``grids`` as one call (each op's fastest kernel, distinct weights per block) and what was
    chosen: per matmul shape and for the attention, the winner and every candidate's µs."""
    import torch.nn.functional as F
    from blas_ab import with_library

    from glmvit.gate_up import gate_up_tile
    from glmvit.model import swiglu_linear

    ops = skeleton(config, grids)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    chosen: dict[str, Any] = {}
    lt_winners: dict[str, Any] = {}  # per shape, the cuBLASLt algorithm that won it
    for op in ops:
        if op.kind == "matmul" and op.gemm not in chosen:
            found: dict[str, Any] = {}
            failed: dict[str, str] = {}
            winner, times = fastest(matmul_candidates(op, gen, lt_algos, found, failed), failed)
            chosen[op.gemm] = {"shape": list(op.shape), "kernel": winner, "us": times, "failed": failed,
                               "lt_ranked": len(found)}
            if winner.startswith("lt#"):
                lt_winners[op.gemm] = found[winner]
                chosen[op.gemm]["lt_algorithm"] = lt_describe(found[winner])
    attention, refused = attention_candidates(ops[2].shape)
    winner, times = fastest(attention)
    chosen["attention"] = {"segments": list(ops[2].shape), "kernel": winner, "us": times, "refused": refused}
    run_attention = attention[winner]
    shapes = {op.gemm: op.shape for op in ops if op.kind == "matmul"}  # one input per shape, read by every block
    inputs = {gemm: torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
              for gemm, (m, k, _) in shapes.items()}
    calls: list[Callable[[], Any]] = []
    for op in ops:
        if op.kind == "attention":
            calls.append(run_attention)
            continue
        m, k, n = op.shape
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if op.gemm in BIASED else None
        kernel, x = chosen[op.gemm]["kernel"], inputs[op.gemm]
        if kernel == "swiglu":  # random rows, taken as packed in the model's tiles (the kernel the model runs)
            calls.append(partial(swiglu_linear, x, w, gate_up_tile(n // 2)))
        elif kernel.startswith("lt#"):  # this block's own plan, with the algorithm that won the shape
            plan, _ = lt_plan(x, w, algorithm=lt_winners[op.gemm])
            calls.append(partial(lt_call, plan))
        else:
            calls.append(with_library(kernel, partial(F.linear, x, w, b)))

    def forward() -> None:
        for call in calls:
            call()

    return forward, chosen


def capture(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph after one eager call (plans built, kernels compiled); the graph's replay,
    which holds ``fn`` (and so every tensor its closures made outside the graph's pool, which the graph reads)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def replay(_keep: Callable[[], Any] = fn) -> None:
        graph.replay()

    return replay


def model_replays(config: VisionConfig, names: list[str],
                  attention: str | None) -> dict[str, tuple[Callable[[], Any], Callable[[], None], str]]:
    """Per workload, the graph-compiled runner's staging of its batch, the captured replay of the graph it runs in
    (as ``tools/gap_probe.py`` builds them) and which graph that is: the budget's (``ragged``), or its ``uniform``
    graph where the runner captures one for the workload's segment length (the lengths bench's default plans, none
    with ``attention`` named). Workloads of one token count share a budget's graph: stage a workload's batch before
    timing its replays."""
    from glmvit.encoder import build_encoder
    from glmvit.geometry import ItemSpec, grid_specs
    from glmvit.graphs import EncoderGraphRunner
    from glmvit.modes import RunMode
    from glmvit.packing import BudgetConfig
    from glmvit.random_weights import random_encoder
    from glmvit.workloads import random_batch

    model = random_encoder(config, "cuda", torch.bfloat16)
    tokens = {n: ItemSpec.total(grid_specs(WORKLOADS[n], config.spatial_merge_size)).tokens for n in names}
    items = max(len(WORKLOADS[n]) for n in names)
    segments = max(len(segment_lengths(WORKLOADS[n])) for n in names)
    budgets = BudgetConfig(tuple(sorted(set(tokens.values()))), min(items, min(tokens.values())),
                           max(segments, items))
    uniform = planned_uniform_lengths([(h * w, t) for n in names for t, h, w in WORKLOADS[n]], "cuda", "bfloat16",
                                      attention)
    runner = build_encoder(model, RunMode.GRAPH_COMPILED, budgets, attention=attention, uniform_lengths=uniform)
    assert isinstance(runner, EncoderGraphRunner)  # on CUDA: real graphs
    out: dict[str, tuple[Callable[[], Any], Callable[[], None], str]] = {}
    for n in names:
        pixels, grid = random_batch(WORKLOADS[n], config, seed=1)
        dense = runner.uniform_graph(tokens[n], np.asarray(grid))
        # copies in, replays once
        stage = partial(runner.replay, tokens[n], pixels.to("cuda", model.dtype), grid, uniform=dense is not None)
        graph = (dense or runner.graphs[tokens[n]]).graph
        assert graph is not None
        out[n] = (stage, graph.replay, "uniform" if dense is not None else "ragged")
    return out


def one_replay(replay: Callable[[], Any]) -> dict[str, float | None]:
    """One replay between CUDA events, on an idle GPU: its device ms, and the SM clock and board power read on the
    host while it runs (None where pynvml does not answer)."""
    from gap_probe import _read

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000)  # the stream busy while the host submits: the start event does not time the launch
    start.record()
    replay()
    end.record()
    clock, power = _read(torch.cuda.clock_rate), _read(lambda: torch.cuda.power_draw() / 1e3)
    end.synchronize()
    return {"device_ms": start.elapsed_time(end), "sm_mhz": clock, "power_w": power}


def measure(names: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from gap_probe import timed

    config = VisionConfig.glm41v()
    with torch.inference_mode():
        staged = model_replays(config, names, args.attention)
        models = {n: replay for n, (_, replay, _) in staged.items()}
        results: dict[str, Any] = {}
        skeletons: dict[str, Callable[[], None]] = {}
        for n in names:
            forward, chosen = build_skeleton(config, WORKLOADS[n], lt_algos=args.lt_algos)
            skeletons[n] = capture(forward)
            ops = skeleton(config, WORKLOADS[n])
            results[n] = {"grids": WORKLOADS[n], "ops": len(ops), "chosen": chosen,
                          "gflop": {"matmul": sum(o.flops(config.hidden_size) for o in ops if o.kind == "matmul") / 1e9,
                                    "attention": sum(o.flops(config.hidden_size) for o in ops
                                                     if o.kind == "attention") / 1e9}}
        for n in names:  # burst: after a rest, one replay of each in turn, idle between
            staged[n][0]()
            time.sleep(args.rest_s)
            runs: dict[str, dict[str, list]] = {path: {"device_ms": [], "sm_mhz": [], "power_w": []}
                                                for path in ("model", "skeleton")}
            for _ in range(args.burst):
                for path, replay in (("model", models[n]), ("skeleton", skeletons[n])):
                    for key, value in one_replay(replay).items():
                        runs[path][key].append(value)
                    time.sleep(args.gap_s)
            results[n]["burst"] = {path: summary(r, sustained=False) for path, r in runs.items()}
        for n in names:  # run: back to back from idle, as many replays as the workload's record, all counted
            staged[n][0]()
            results[n]["model_graph"] = staged[n][2]
            results[n]["run"] = {}
            for path, replay in (("model", models[n]), ("skeleton", skeletons[n])):
                time.sleep(args.rest_s)
                results[n]["run"][path] = summary(timed(replay, RUN_REPLAYS[n]), sustained=False)
        for n in names:  # sustained: back to back, the model first, then the skeleton
            staged[n][0]()
            results[n]["sustained"] = {}
            for path, replay in (("model", models[n]), ("skeleton", skeletons[n])):
                time.sleep(args.rest_s)
                one = timed(replay, 1)
                count = max(2, round(args.seconds * 1e3 / one["device_ms"][0]))
                results[n]["sustained"][path] = summary(timed(replay, count), sustained=True)
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"{'workload':<10} {'regime':<10} {'model ms':>9} {'skeleton ms':>12} {'MHz (model/skel)':>17}  attention")
    for n, r in results.items():
        for regime in ("burst", "run", "sustained"):
            if regime not in r:  # a record made before the regime was
                continue
            m, s = r[regime]["model"], r[regime]["skeleton"]
            clocks = f"{m['sm_mhz'] or 0:.0f}/{s['sm_mhz'] or 0:.0f}"
            print(f"{n:<10} {regime:<10} {m['ms']:9.3f} {s['ms']:12.3f} {clocks:>17}  "
                  f"{r['chosen']['attention']['kernel']}")
        kernels = {gemm: c["kernel"] for gemm, c in r["chosen"].items() if gemm != "attention"}
        print(f"{'':<10} matmuls: {kernels}")


def nvmath_version() -> str | None:
    """nvmath-python's version where it imports (the ``lt#`` candidates run), else None."""
    try:
        import nvmath
    except ImportError:
        return None
    return str(nvmath.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    parser.add_argument("--burst", type=int, default=5, help="replays of each in the burst regime")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of each back to back (sustained)")
    parser.add_argument("--rest-s", type=float, default=3.0, help="idle seconds before each burst and sustained run")
    parser.add_argument("--gap-s", type=float, default=0.2, help="idle seconds between burst replays")
    parser.add_argument("--attention", default=None, help="the model's attention backend (default: the model's)")
    parser.add_argument("--lt-algos", type=int, default=LT_ALGOS,
                        help="cuBLASLt heuristic algorithms tried per matmul shape (nvmath-python; 0: none)")
    parser.add_argument("--json", metavar="PATH", help="write every number, with provenance, here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.workloads.split(",")]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload {unknown[0]!r}; choose among {', '.join(WORKLOADS)}")
    if args.burst < 1 or args.seconds <= 0 or args.rest_s < 0 or args.gap_s < 0 or args.lt_algos < 0:
        parser.error("--burst must be at least 1, --seconds positive, --rest-s, --gap-s and --lt-algos not negative")
    if not torch.cuda.is_available():
        print("skeleton_bound times CUDA kernels: this machine has no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references stay float32
    results = measure(names, args)
    print_table(results)
    if args.json:
        from ab_common import write_record

        write_record(args.json, {"burst": args.burst, "seconds": args.seconds, "rest_s": args.rest_s,
                                 "gap_s": args.gap_s, "attention": args.attention, "lt_algos": args.lt_algos,
                                 "nvmath": nvmath_version(), "workloads": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
