"""``python -m glmvit kernels``: where a graph replay's GPU time goes, kernel by kernel, against each op's roofline.

For each layout (one 224² image, four, an 8-frame clip, eight 448² images) and each graph-safe attention backend:

- ``profile``: ``torch.profiler`` over replays of a captured graph (compiled and not): kernels per replay, GPU µs by
  category (GEMM, attention, fused elementwise, fill, copy, …), the top kernels, and the replay's time on the
  device and on the wall, so a replay splits into busy time, gaps between kernels, and host work;
- ``attention``: one layer's rotary + attention timed alone inside a CUDA graph, against its roofline;
- ``gemm``: every matmul shape of the forward timed alone (cuBLAS, and cuBLASLt where torch offers the choice),
  gate and up fused vs apart, each against its roofline at the matmul rate and copy bandwidth measured in the run.

CUDA only::

    python -m glmvit kernels --json data/bench/kernels.json
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..attention import GRAPH_SAFE, attend_qkv, available_backends, resolve
from ..encoder import build_encoder
from ..floor import measure_copy_bandwidth, measure_matmul_tflops
from ..geometry import ItemSpec, grid_specs
from ..graphs import EncoderGraphRunner
from ..metadata import attention_work, build_metadata
from ..modes import RunMode
from ..packing import BudgetConfig
from ..profiling import encoder_gemms, graph_time_us, profile_kernels, roofline_us
from ..provenance import collect
from ..random_weights import random_encoder
from ..records import KernelsProfile, make
from ..rotary import rotary_cos_sin
from ..timing import summarise, time_to_precision
from ..uniform import DENSE_MIN_ROWS
from ..workloads import random_batch
from .common import Parser, check_writable, output_path, vision_config, write_record

if TYPE_CHECKING:
    from .session import Session

LAYOUTS = {
    "1x224": [[1, 16, 16]],
    "4x224": [[1, 16, 16]] * 4,
    "clip8x224": [[4, 16, 16]],
    "8x448": [[1, 32, 32]] * 8,
}
PARTS = ("profile", "attention", "gemm")
# Replays timed per layout and variant (wall, and on the device): at least 20, then 10 more at a time while the
# median is known worse than ±0.5 % (the gaps between kernels are a few % of a replay: a looser median would blur
# them), at most 50
REPLAY_RUNS = (20, 50)
REPLAY_PRECISION = 0.005
PROFILED_CALLS = 5  # replays per profile: a replay's kernels are the same every time, so a few give its mean


def _blas_libraries() -> list[str]:
    """cuBLAS always; cuBLASLt where this torch lets us prefer it."""
    return ["cublas", "cublaslt"] if hasattr(torch.backends.cuda, "preferred_blas_library") else ["cublas"]


def _with_blas(library: str, fn: Callable[[], float]) -> float:
    if library == "cublas":
        return fn()
    saved = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return fn()
    finally:
        torch.backends.cuda.preferred_blas_library(saved)


def _apart(a: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> None:
    F.linear(a, gate)
    F.linear(a, up)


def measure_gemms(config, rows: int, tflops: float, gbps: float) -> list[dict[str, Any]]:
    """Each matmul of the forward alone: µs per call per BLAS library, roofline and the fraction of it reached."""
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, m, k, n, count in encoder_gemms(config, rows):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        roof = roofline_us(2 * m * n * k, 2 * (m * k + n * k + m * n), tflops, gbps)
        row: dict[str, Any] = {"name": name, "m": m, "k": k, "n": n, "count": count, "roofline_us": roof}
        one = partial(F.linear, a, w)
        for lib in _blas_libraries():
            row[f"{lib}_us"] = _with_blas(lib, partial(graph_time_us, one))
        if name.endswith("gate_up"):  # the two matmuls transformers runs, each half as wide
            gate, up = w.chunk(2)
            row["apart_us"] = graph_time_us(partial(_apart, a, gate, up))
        row["best_us"] = min(row[f"{lib}_us"] for lib in _blas_libraries())
        row["roofline_fraction"] = roof / row["best_us"]
        out.append(row)
    return out


def measure_attention(config, grids, backends: list[str], tflops: float, gbps: float) -> dict[str, Any]:
    """One layer's rotary + attention from the qkv projection, per backend, against its roofline."""
    meta = build_metadata(grids, config.spatial_merge_size).to("cuda")
    rows, width = meta.shape.rows, config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(rows, 3 * width, device="cuda", dtype=torch.bfloat16, generator=gen)
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, torch.ones(config.head_dim // 4, device="cuda"))
    assert meta.host is not None  # built for this one batch
    flops = 4 * attention_work(meta.host) * width
    roof = roofline_us(flops, 2 * (3 + 1) * rows * width, tflops, gbps)
    result: dict[str, Any] = {"rows": rows, "flops": flops, "roofline_us": roof}
    for backend in backends:
        us = graph_time_us(partial(attend_qkv, qkv, cos, sin, meta, backend, config.num_heads))
        result[backend] = {"us": us, "roofline_fraction": roof / us}
    return result


def _one_length(grids: list) -> bool:
    """Whether every frame of a layout has one h·w (a batch a uniform graph takes)."""
    return len({h * w for _, h, w in grids}) == 1


def _uniform_rows(budget_rows: int, grids: list) -> int:
    """The rows a one-length layout's batch holds if a uniform graph of a budget of ``budget_rows`` rows has room
    for one of its segments (0 if not): what :meth:`~glmvit.graphs.EncoderGraphRunner.uniform_graph` judges."""
    length = grids[0][1] * grids[0][2]
    return sum(t * h * w for t, h, w in grids) if budget_rows // length else 0


def auto_kernels(text: str) -> list[str]:
    """The comma list ``text`` of backends, ``auto`` standing for the kernels the ``auto`` backend chooses among here:
    ``cudnn`` and ``triton``, and ``fa4`` where FlashAttention-4 runs (``cudnn`` first either way, the backend the
    whole-model and uniform variants run). Each name once, where it first stands: a repeat would profile it twice."""
    from ..kernels.fa4_attention import loads

    names = [b.strip() for b in text.split(",")]
    if "auto" in names:
        i = names.index("auto")
        names = names[:i] + ["cudnn", "triton"] + (["fa4"] if loads() else []) + names[i + 1:]
    return list(dict.fromkeys(names))


def profile_replays(model, layouts: dict[str, list], backends: list[str], quiet: bool) -> dict[str, Any]:
    """Kernel profile and replay times, per backend × compiled × layout.

    Every variant is captured and timed before the first profiler starts: once CUPTI is attached, each later
    kernel launch carries its instrumentation, and the times would no longer be the ones a user sees. Per layout:
    ``replay_wall`` (``runner.replay``: checks, staging and the graph, between synchronisations), ``replay_device``
    (the captured graph alone, replayed back to back between CUDA events) — each timed until its median is known
    to ±:data:`REPLAY_PRECISION` (:data:`REPLAY_RUNS`: the least and most runs; ``runs`` says how many ran) —,
    ``graph_gpu_us_per_call`` (its kernels' busy time), ``gaps_us_per_call`` (device − busy: the boundaries inside
    the graph plus what the back-to-back replays lose to a lower clock than the few profiled ones ran at, under the
    power limit) and ``graph_idle_us_per_call`` (the profiled replays' time with no kernel running, from the kernels'
    own timestamps: the boundaries inside the graph and the launch gaps between replays, so an upper bound on the
    boundaries). ``idle_us_per_call`` (from ``profile_kernels``) is the same reading for ``replay_wall``'s call, its
    host staging included. ``uniform-compiled``: the first backend's
    compiled runner with uniform graphs for every one-length layout's segment length (``build_encoder``'s, from
    :data:`~glmvit.uniform.DENSE_MIN_ROWS` rows), on the layouts whose batch it replays in one (the dense
    attention); absent, and never captured, where none does.
    """
    merge = model.config.spatial_merge_size
    tokens = {name: ItemSpec.total(grid_specs(g, merge)).tokens for name, g in layouts.items()}
    budgets = tuple(sorted(set(tokens.values())))
    items = max(len(g) for g in layouts.values())
    segments = max(sum(t for t, _, _ in g) for g in layouts.values())
    config = BudgetConfig(budgets, min(items, budgets[0]), max(segments, items))
    inputs = {name: random_batch(g, model.config, seed=1) for name, g in layouts.items()}
    variants = [(b, compiled, "blocks") for b in backends for compiled in (False, True)]
    variants.append((backends[0], True, "model"))  # the whole forward compiled as one: what regions cost
    variants.append((backends[0], True, "uniform"))  # the uniform graphs a runner replays on one-length layouts
    # every one-length layout's segment length, whatever its share: the profile asks which graph each layout takes
    lengths = tuple(sorted({g[0][1] * g[0][2] for g in layouts.values() if _one_length(g)}))
    if not any(_uniform_rows(tokens[name] * model.config.merge_area, g) >= DENSE_MIN_ROWS
               for name, g in layouts.items() if _one_length(g)):
        variants.pop()  # no layout would replay in a uniform graph: nothing to capture
    out: dict[str, Any] = {}
    replays: dict[str, dict[str, tuple[Callable[[], Any], Callable[[], Any]]]] = {}
    for backend, compiled, scope in variants:
        uniform = scope == "uniform"
        key = "uniform-compiled" if uniform else \
            f"{backend}{'-compiled' if compiled else ''}{'-model' if scope == 'model' else ''}"
        runner = build_encoder(model, RunMode.GRAPH_COMPILED if compiled else RunMode.GRAPH, config,
                               attention=backend, compile_scope="blocks" if uniform else scope, progress=not quiet,
                               uniform_lengths=lengths if uniform else ())
        assert isinstance(runner, EncoderGraphRunner)  # on CUDA: real graphs
        if uniform:  # only the layouts whose batch replays in a uniform graph (glmvit.uniform.DENSE_MIN_ROWS)
            chosen = {name: runner.uniform_graph(tokens[name], np.asarray(grid)) for name, (_, grid) in inputs.items()}
            graphs = {name: cb.graph for name, cb in chosen.items() if cb is not None and cb.graph is not None}
            if not graphs:
                continue
        else:  # mode "cuda": every budget captured
            graphs = {name: g for name in inputs if (g := runner.graphs[tokens[name]].graph) is not None}
        out[key] = {"capture": {str(k): v.as_dict() for k, v in runner.captures.items()}}
        replays[key] = {name: (partial(runner.replay, tokens[name], pixels.to("cuda", model.dtype), grid, uniform),
                               graphs[name].replay) for name, (pixels, grid) in inputs.items() if name in graphs}
        with torch.inference_mode():
            for name, (replay, graph_replay) in replays[key].items():
                wall = time_to_precision(replay, "cuda", *REPLAY_RUNS, REPLAY_PRECISION, warmup=5)  # stays staged
                device = time_to_precision(graph_replay, "cuda", *REPLAY_RUNS, REPLAY_PRECISION, warmup=5,
                                           on_device=True)
                out[key][name] = {"replay_wall": {**summarise(wall), "runs": len(wall)},
                                  "replay_device": {**summarise(device), "runs": len(device)}}
    with torch.inference_mode():
        for key, per_layout in replays.items():
            for name, (replay, graph_replay) in per_layout.items():
                prof = profile_kernels(replay, calls=PROFILED_CALLS)
                graph_prof = profile_kernels(graph_replay, calls=PROFILED_CALLS, top=0)
                busy = graph_prof["gpu_us_per_call"]
                device_us = out[key][name]["replay_device"]["median_ms"] * 1e3
                out[key][name] = {**prof, **out[key][name], "graph_gpu_us_per_call": busy,
                                  "graph_idle_us_per_call": graph_prof["idle_us_per_call"],
                                  "gaps_us_per_call": device_us - busy}
    del replays
    torch.cuda.empty_cache()
    return out


def print_report(result: dict[str, Any]) -> None:
    for key, per_layout in result.get("profile", {}).items():
        print(f"\nprofile {key}:")
        for name, p in per_layout.items():
            if name == "capture":
                continue
            cats = ", ".join(f"{c} {us:.0f}" for c, us in p["by_category_us"].items())
            print(f"  {name:>10}: {p['gpu_us_per_call']:7.0f} µs busy in {p['kernels_per_call']:.0f} kernels, "
                  f"{p['gaps_us_per_call']:5.0f} µs device − busy, {p['graph_idle_us_per_call']:4.0f} of them idle "
                  f"(replay on device {p['replay_device']['median_ms']:.3f} "
                  f"ms, wall {p['replay_wall']['median_ms']:.3f} ms) — {cats}")
    for name, a in result.get("attention", {}).items():
        cells = ", ".join(f"{b} {v['us']:.1f} µs ({v['roofline_fraction']:.0%})" for b, v in a.items()
                          if isinstance(v, dict))
        print(f"attention/layer {name:>10}: roofline {a['roofline_us']:.1f} µs; {cells}")
    for name, rows in result.get("gemm", {}).items():
        total = sum(r["best_us"] * r["count"] for r in rows)
        roof = sum(r["roofline_us"] * r["count"] for r in rows)
        print(f"gemm {name:>10}: {total:.0f} µs per forward vs roofline {roof:.0f} µs ({roof / total:.0%})")


def main(argv: list[str] | None = None, session: "Session | None" = None) -> int:
    """The command; a ``session`` (a record run) lends its full bf16 tower (seed 0, what this command builds) and
    its measured floor instead of building and measuring them again."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(prog="python -m glmvit kernels", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--backends", default=None, help="graph-safe attention backends to compare, or auto: the "
                        "kernels the auto backend chooses among here (default: every one this GPU has except "
                        "sdpa_masked)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write every number, with provenance, here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    layouts = {n.strip(): LAYOUTS.get(n.strip()) for n in args.layouts.split(",")}
    parts = [p.strip() for p in args.parts.split(",")]
    unknown = [n for n, g in layouts.items() if g is None] + [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown layout or part {unknown}; layouts: {list(LAYOUTS)}, parts: {list(PARTS)}")
    if not torch.cuda.is_available():
        parser.error("kernels profiles CUDA kernels: this machine has no CUDA device")
    # auto is one of cudnn, triton and fa4 by the layout's rows (auto_kernels): each is profiled on its own
    here = available_backends("cuda", torch.bfloat16)
    offered = [b for b in here if b in GRAPH_SAFE and b not in ("sdpa_masked", "auto")]
    backends = offered if args.backends is None else auto_kernels(args.backends)
    if not backends or any(b not in offered for b in backends):
        given = [b.strip() for b in (args.backends or "").split(",")]
        parser.error(f"--backends must be among {offered} here" + (f" (auto: {backends})" if "auto" in given else ""))
    if args.json:
        check_writable(args.json)
    config = vision_config("full")
    if session is None:
        model = random_encoder(config, "cuda", torch.bfloat16)
        tflops, gbps = measure_matmul_tflops("cuda"), measure_copy_bandwidth("cuda")
    else:
        model = session.model(argparse.Namespace(config="full", dtype="bf16", device="cuda", weights=None, seed=0,
                                                 attn_backend=None))
        floor = session.floor(torch.device("cuda"), torch.bfloat16, None)
        tflops, gbps = floor["matmul_tflops"], floor["copy_gbps"]
    result: dict[str, Any] = {
        "floor": {"matmul_tflops": tflops, "copy_gbps": gbps},
        "layouts": {n: g for n, g in layouts.items()},
        "backends": backends,
    }
    valid = {n: g for n, g in layouts.items() if g is not None}
    # what attend_qkv's auto runs at each layout's rows (none where this machine has no auto: no kernel of it ran)
    result["auto"] = {n: resolve("auto", sum(t * h * w for t, h, w in g), 3 * config.hidden_size)
                      for n, g in valid.items()} if "auto" in here else {}
    if "attention" in parts:
        result["attention"] = {n: measure_attention(config, g, backends, tflops, gbps)
                               for n, g in tqdm(valid.items(), desc="attention", disable=args.quiet)}
    if "gemm" in parts:
        rows = {n: sum(t * h * w for t, h, w in g) for n, g in valid.items()}
        result["gemm"] = {n: measure_gemms(config, r, tflops, gbps)
                          for n, r in tqdm(rows.items(), desc="gemm", disable=args.quiet)}
    if "profile" in parts:
        result["profile"] = profile_replays(model, valid, backends, args.quiet)
    print_report(result)
    if args.json:
        command = " ".join([sys.executable, "-m", "glmvit", "kernels", *argv])
        write_record(args.json, make(KernelsProfile, provenance=collect(model.device, command), **result))
    return 0
