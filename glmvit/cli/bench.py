"""``python -m glmvit bench``: transformers vs eager vs CUDA graphs (vs torch.compile) vs the GPU's floor.

Modelled on ``vllm bench mm-processor`` with the ``random-mm`` dataset: requests of images and videos drawn from a
bucket config ``{(height, width, frames): probability}`` (or a named preset, :data:`glmvit.workloads.PRESETS`);
every item is resized with GLM-4V's ``smart_resize`` to its patch grid. Each request's pixel rows are generated once
up front (random normal, on the device), so timing excludes preprocessing. Requests are sent one at a time in
arrival order (never sorted). Per request and mode we time the wall time of the encoder call *including its host
preparation* (metadata, planning, copies), between two synchronisations.

Modes (all on the same weights):

- ``transformers``: transformers' ``Glm4vVisionModel`` (attention "sdpa"); a video row [t, h, w] is given to it
  as t rows [1, h, w] (what its tower needs);
- ``eager``: ``GlmVisionEncoder.forward(pixel_values, grid_thw)``;
- ``graph``: ``EncoderGraphRunner(...).capture()`` then ``.run(...)``. Off CUDA the runner's ``emulate`` backend
  does the same bookkeeping without graphs, and the mode is labelled ``graph-emulated`` everywhere;
- ``graph-compiled``: the same runner with ``forward_static`` compiled by ``torch.compile`` before capture (CUDA);
- ``compile``: ``forward`` with ``forward_static`` wrapped in ``torch.compile`` (CUDA only, optional);
- ``transformers-compiled``: the transformers model under ``torch.compile(mode="reduce-overhead")`` (inductor
  kernels replayed through CUDA graphs, one per input shape): what a transformers user would reach for, the peer
  glmvit's ratio is taken against (CUDA only; a mixed workload recompiles for each new shape).

The floor of a request is max(FLOPs / measured matmul rate, weight bytes / measured copy bandwidth), both measured
in the same run on the same device; FLOPs are analytic (:func:`glmvit.floor.encoder_flops`). Examples::

    python -m glmvit bench --workload img1x224 --num-requests 200 --json data/bench/img1x224.json
    python -m glmvit bench --workload mixed-img --num-requests 500 --tables graph=data/bench/latency.json
    python -m glmvit bench --bucket-config "{(224, 224, 1): 0.7, (448, 448, 1): 0.3}" --items-per-request 2

Why one module of this length: the modes, the timed loop and the report are one command, with its CLI.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import torch
from tqdm.auto import tqdm

from ..attention import check_backend
from ..config import VisionConfig
from ..costmodel import LatencyTable, ladder_split, predict_time
from ..defaults import dtype_name
from ..deployment import check_budget_fits
from ..encoder import build_encoder
from ..floor import floor_ms, flops_breakdown, measure_copy_bandwidth, measure_matmul_tflops, weight_bytes
from ..graphs import EncoderGraphRunner
from ..metadata import build_metadata
from ..model import GlmVisionEncoder
from ..modes import TABLE_MODES, GraphMode, RunMode
from ..oracle import flatten_video_grids, hf_twin
from ..packing import LADDER_SPLIT, BudgetConfig, plan_batches
from ..provenance import collect
from ..recorded import recorded_table_for
from ..records import RECORD_DIRS, BenchRecord, make
from ..routing import Router
from ..timing import (
    CHECK_EVERY,
    MAX_PASSES,
    PRECISION,
    WARMUP,
    launch_us,
    quiet_host,
    summarise,
    time_calls,
    time_passes,
)
from ..uniform import planned_uniform_lengths
from ..workloads import PRESETS, MMItem, random_mm_workload
from .common import (
    DTYPES,
    MAX_BUDGET_TOKENS,
    Parser,
    add_model_args,
    bucket_config_arg,
    budgets_arg,
    check_writable,
    device_memory_bytes,
    float_in,
    graph_memory_target,
    int_in,
    model_from_args,
    output_path,
    read_latency_table,
    refuse_outputs_over_inputs,
    refuse_preset_flags,
    resolve_model_args,
    write_record,
)
from .session import capture_timed, runner_key

if TYPE_CHECKING:
    from .session import Session

MODES = ("transformers", "transformers-compiled", "eager", "graph", "graph-compiled", "compile")
COMPILED_MODES = ("transformers-compiled", "graph-compiled", "compile")  # benchmarked on CUDA only
MAX_REQUESTS = 100_000
MAX_ITEMS = 1_000_000  # every item's pixels are generated up front: 10⁶ 224² images alone are 600 GB in bf16
DEFAULT_BUCKETS = "{(224, 224, 1): 1.0}"
MAX_WARMUP = 10_000
MAX_MATMUL = {"cuda": 32_768, "cpu": 4_096}  # cuda: 3 n² bf16 operands = 6 GiB; cpu: 13 matmuls of 2n³ ≈ 30 s
PIXEL_SHARE = 0.5  # the pixels stay resident for every mode: leave the other half for weights, activations, graphs
Encode = Callable[[torch.Tensor, np.ndarray, torch.Tensor], torch.Tensor]


def mode_label(mode: str, device: torch.device) -> str:
    """The name a mode is reported under: ``graph`` off CUDA is emulated (:meth:`RunMode.label
    <glmvit.modes.RunMode.label>`); every other mode as it is (the compiled ones run on CUDA only)."""
    return RunMode.GRAPH.label(GraphMode.for_device(device)) if mode == RunMode.GRAPH else mode


def parse_modes(text: str) -> list[str]:
    """``"transformers,eager,graph"`` → canonical names (``graph-emulated`` is accepted for ``graph``)."""
    modes: list[str] = []
    for word in text.replace(",", " ").split():
        word = "graph" if word == "graph-emulated" else word
        if word not in MODES:
            raise ValueError(f"unknown mode {word!r}; choose from {', '.join(MODES)}")
        if word not in modes:
            modes.append(word)
    if not modes:
        raise ValueError("no modes given")
    return modes


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max / mean |got − ref| and the smallest per-token cosine similarity, in float32."""
    g, r = got.float(), ref.float()
    diff = (g - r).abs()
    cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean())}


def make_mode(mode: str, model: GlmVisionEncoder, budget_config: BudgetConfig, record: dict[str, Any],
              progress: bool, table: LatencyTable | None = None, session: Session | None = None,
              attention: str | None = None, uniform_lengths: tuple[int, ...] = ()
              ) -> tuple[Encode, EncoderGraphRunner | None]:
    """A callable (pixels, grids, flat_grids) -> output [tokens, out_hidden] for one mode, and its runner if any
    (routing each batch by ``table`` when one is given). A ``session`` lends the transformers twin it built, and
    a graph mode's runner when an earlier job captured an identical one (:meth:`Session.runner
    <glmvit.cli.session.Session.runner>`: ``record`` then says so in ``runner_source``). Our
    modes run ``attention`` (None: the model's backend): the graph modes through the encoder
    :func:`~glmvit.encoder.build_encoder` makes (with uniform graphs for ``uniform_lengths``), ``eager`` and
    ``compile`` as the bare forward with that backend."""
    attention = model.attention_backend(attention)
    device = model.device
    if mode == "transformers":
        hf = session.twin(model) if session else hf_twin(model)
        return (lambda pixels, grids, flat: hf(pixels, flat).pooler_output), None
    if mode == "transformers-compiled":
        # static shapes: one specialisation per input shape, never the dynamic-shape compile that a second shape
        # in the same process would otherwise trigger
        compiled = torch.compile(session.twin(model) if session else hf_twin(model), mode="reduce-overhead",
                                 dynamic=False)
        # a CUDA graph's output is overwritten by its next replay: each answer is copied out, as the runner's are
        return (lambda pixels, grids, flat: compiled(pixels, flat).pooler_output.clone()), None
    if mode == RunMode.EAGER:
        return (lambda pixels, grids, flat: model(pixels, grids, attention=attention)), None
    if mode in (RunMode.GRAPH, RunMode.GRAPH_COMPILED):
        def build() -> EncoderGraphRunner:
            built = build_encoder(model, mode, budget_config, attention=attention, latency_table=table,
                                  progress=progress, uniform_lengths=uniform_lengths)
            assert isinstance(built, EncoderGraphRunner)
            return built

        if session is not None:  # a record run: the runner an earlier job captured, if one did
            key = runner_key(model, mode, budget_config, attention, table, uniform_lengths=uniform_lengths)
            runner, source = session.runner(key, build, device)
            capture_s, reserved = source["capture_s"], source["capture_reserved_bytes"]
            record["runner_source"] = source
        else:
            runner, capture_s, reserved = capture_timed(build, device)
        record.update(capture_s=capture_s, runner_mode=runner.mode.value,
                      uniform_captured=sorted([b, n] for b, n in runner.uniform_graphs),
                      uniform_capture={f"{b}x{n}": c.as_dict() for (b, n), c in runner.uniform_captures.items()},
                      uniform_capture_failed={f"{b}x{n}": v for (b, n), v in runner.uniform_failed.items()},
                      routing=table.describe() if table else "off: a batch replays whenever a budget holds it",
                      capture={str(k): v.as_dict() for k, v in runner.captures.items()},
                      capture_failed={str(k): v for k, v in runner.failed.items()})
        if reserved is not None:
            record["capture_reserved_bytes"] = reserved

        def run_graphs(pixels: torch.Tensor, grids: np.ndarray, flat: torch.Tensor) -> torch.Tensor:
            outs = runner.run(pixels, grids)  # per-item clones, ready (run() synchronises)
            return outs[0] if len(outs) == 1 else torch.cat(outs)  # the other modes return one tensor

        return run_graphs, runner
    if mode == "compile":
        static = torch.compile(model.forward_static, dynamic=False)

        def run_compiled(pixels: torch.Tensor, grids: np.ndarray, flat: torch.Tensor) -> torch.Tensor:
            request = model.check_request(pixels, grids)  # validated once, as the eager forward does
            return static(pixels, build_metadata(request).to(device), attention=attention)

        return run_compiled, None
    raise ValueError(f"unknown mode {mode!r}")


def uniform_lengths(args: argparse.Namespace, requests: list[list[MMItem]]) -> tuple[int, ...]:
    """The segment lengths the graph modes capture uniform graphs for: ``--uniform-graphs auto`` takes
    :func:`~glmvit.uniform.planned_uniform_lengths` of the workload; ``off``, none."""
    if args.uniform_graphs == "off":
        return ()
    dtype = str(DTYPES[args.dtype]).removeprefix("torch.")
    return planned_uniform_lengths(((item.grid[1] * item.grid[2], item.grid[0]) for r in requests for item in r),
                                   torch.device(args.device).type, dtype, args.attn_backend)


def _workload(args: argparse.Namespace) -> tuple[dict, int, float, int | None]:
    if args.workload:
        p = PRESETS[args.workload]
        return dict(p.bucket_config), p.items_per_request, p.range_ratio, p.limit_per_request
    buckets = args.bucket_config if args.bucket_config is not None else bucket_config_arg(DEFAULT_BUCKETS)
    return dict(buckets), args.items_per_request or 1, args.range_ratio or 0.0, None


def _floor(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, model: torch.nn.Module,
           session: Session | None = None) -> dict:
    if session is not None:
        measured = session.floor(device, dtype, args.matmul_size)
        tflops, gbps = measured["matmul_tflops"], measured["copy_gbps"]
    else:
        print("measuring the floor: matmul rate and copy bandwidth ...", file=sys.stderr)
        tflops = measure_matmul_tflops(device, dtype, n=args.matmul_size)
        gbps = measure_copy_bandwidth(device)
    return {"matmul_tflops": tflops, "matmul_n": args.matmul_size or (8192 if device.type == "cuda" else 512),
            "matmul_dtype": str(dtype).replace("torch.", ""), "copy_gbps": gbps, "weight_bytes": weight_bytes(model),
            "parameters": sum(p.numel() for p in model.parameters())}


def _warm(fn: Encode, inputs: list[tuple], n: int, warmup: int, device: torch.device) -> float:
    """Run ``warmup`` untimed requests (cycling over the first n); returns the seconds they took."""
    order = itertools.cycle(range(n))
    return sum(time_calls(lambda: fn(*inputs[next(order)]), device, warmup)) / 1e3


def _timed(fn: Encode, inputs: list[tuple], n: int, device: torch.device, label: str, quiet: bool,
           precision: float = 0.0, max_passes: int = 1) -> tuple[list[float], list[float], torch.Tensor, int]:
    """ms per request over the first n requests in arrival order — then again, pass after pass, while the
    median's 95 % interval is wider than ±``precision`` and fewer than ``max_passes`` passes ran
    (:func:`glmvit.timing.time_passes`) —, the CPU ms this thread spent in each, request 0's output and the passes
    run. Timed on a quiet host (:func:`glmvit.timing.quiet_host`)."""
    first: list[torch.Tensor] = []

    def keep(j: int, out: torch.Tensor) -> None:
        if not first:
            first.append(out.float().clone())

    def bar(passes: int, requests: range) -> Iterable[int]:
        desc = f"{label:>14}" + (f" pass {passes}" if passes > 1 else "")
        return tqdm(requests, desc=desc, unit="req", file=sys.stderr, disable=quiet)

    with quiet_host():
        ms, cpu, passes = time_passes(lambda j: fn(*inputs[j]), n, device, precision, max_passes, after=keep,
                                      progress=bar)
    return ms, cpu, first[0], passes


def _per_request_vs(ms: list[float], ref: list[float]) -> dict[str, float]:
    """How a mode compares with a reference request by request: share slower, worst and median ratio."""
    ratios = np.asarray(ms[: len(ref)]) / np.asarray(ref[: len(ms)])
    return {"share_slower": float((ratios > 1).mean()), "share_over_1_1": float((ratios > 1.1).mean()),
            "worst_ratio": float(ratios.max()), "median_ratio": float(np.median(ratios))}


def run_benchmark(args: argparse.Namespace, command: str, session: Session | None = None) -> BenchRecord:
    """Every mode of the workload the flags describe, timed; a ``session`` (a record run) lends its model,
    transformers twin and floor instead of building them."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    modes = parse_modes(args.modes)
    buckets, items_per_request, range_ratio, limit = _workload(args)
    requests = random_mm_workload(buckets, args.num_requests, items_per_request, range_ratio, args.seed, limit)
    requests = [r for r in requests if r]  # vLLM's range can draw 0 items: nothing to encode
    if not requests:
        raise ValueError("the workload drew no items (raise --items-per-request or lower --range-ratio)")
    if session is not None:
        model = session.model(args)
    else:
        model = model_from_args(args)
    attention = model.attention_backend(args.attn_backend)  # a clear error if the backend cannot run here
    config = model.config
    grids = [np.array([item.grid for item in r], dtype=np.int64) for r in requests]
    specs = [[item.spec for item in r] for r in requests]
    budget_config = BudgetConfig.for_requests(specs, args.budgets, args.max_items, args.max_segments)
    uniform = uniform_lengths(args, requests)

    gen = torch.Generator(device=device).manual_seed(args.seed)
    pixels = [torch.randn(int((g[:, 0] * g[:, 1] * g[:, 2]).sum()), config.patch_dim, device=device, dtype=dtype,
                          generator=gen) for g in grids]
    inputs = [(p, g, flatten_video_grids(g).to(device)) for p, g in zip(pixels, grids, strict=True)]
    flops = [flops_breakdown(config, g) for g in grids]
    tokens = [sum(s.tokens for s in r) for r in specs]
    floor = _floor(args, device, dtype, model, session)
    floors = [floor_ms(f["total"], floor["weight_bytes"], floor["matmul_tflops"], floor["copy_gbps"]) for f in flops]
    plans = [plan_batches(r, budget_config) for r in specs]
    tables = resolve_tables(args.tables, model, attention)
    graph_configs = _graph_configs(modes, specs, args, tables)
    _check_graphs_fit(graph_configs, args, device)  # what each mode captures, before any mode runs

    result: dict[str, Any] = {
        "settings": {
            "workload": args.workload, "bucket_config": {str(k): v for k, v in buckets.items()},
            "items_per_request": items_per_request, "range_ratio": range_ratio, "limit_per_request": limit,
            "num_requests": len(requests), "seed": args.seed, "budgets": list(budget_config.token_budgets),
            "max_items": budget_config.max_items, "max_segments": budget_config.max_segments,
            "attn_backend": attention, "uniform_lengths": list(uniform), "dtype": str(dtype).replace("torch.", ""),
            "config": args.config, "vision_config": vars(config).copy(), "weights": args.weights or "random",
            "warmup": args.warmup, "transformers_requests": args.transformers_requests,
            "modes": [mode_label(m, device) for m in modes], "order": "arrival order, one request at a time",
            "timing": "wall time per request of the encoder call incl. host preparation, between synchronizes",
            "precision": args.precision, "max_passes": args.max_passes,
            "passes": "every request once in arrival order, then again while the median's 95 % interval is "
                      "wider than ±precision, up to max_passes, a later pass stopping once it is within "
                      f"±precision (checked every {CHECK_EVERY} requests); ratios use the first pass (every "
                      "request once)",
            "host": "cycle collector off; before each pass the thread is pinned to the CPU quietest then "
                    "(glmvit.timing)",
            "route": not args.no_route, "tables": {m: t.describe() for m, t in tables.items()},
        },
        "workload": {"requests": len(requests), "items": sum(len(g) for g in grids), "tokens": sum(tokens),
                     "patches": sum(int(p.shape[0]) for p in pixels), "grids": [g.tolist() for g in grids]},
        "floor": {**floor, "per_request_ms": floors, "mean_ms": statistics.mean(floors),
                  "definition": "max(FLOPs / matmul rate, weight bytes / copy bandwidth)"},
        "flops": {"per_request": [f["total"] for f in flops], "total": sum(f["total"] for f in flops),
                  "matmul": sum(f["matmul"] for f in flops), "attention": sum(f["attention"] for f in flops)},
        "modes": {}, "skipped": {}, "accuracy": {},
    }
    outputs: dict[str, torch.Tensor] = {}
    for mode in modes:
        label = mode_label(mode, device)
        if mode in COMPILED_MODES and device.type != "cuda":
            result["skipped"][label] = "torch.compile modes are only benchmarked on CUDA"
            continue
        n = len(requests) if mode != "transformers" else min(len(requests), args.transformers_requests or len(requests))
        record: dict[str, Any] = {"requests": n}
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.inference_mode():
                route_table = None if args.no_route else tables.get(mode)
                mode_config = graph_configs.get(mode, budget_config)
                fn, runner = make_mode(mode, model, mode_config, record, not args.quiet, route_table, session,
                                       attention, uniform)
                if runner is not None:
                    record["budgets"] = list(mode_config.token_budgets)
                record["warmup_s"] = _warm(fn, inputs, n, args.warmup, device)
                if runner is not None:  # count only the timed requests
                    runner.stats.reset()
                record["launch_us"] = launch_us(device)  # the host's speed just before this mode's timing
                ms, cpu, outputs[label], record["passes"] = _timed(fn, inputs, n, device, label, args.quiet,
                                                                   args.precision, args.max_passes)
                record["cpu_ms"] = cpu
        except Exception as err:  # noqa: BLE001 - one failing mode (e.g. compile) must not lose the others
            result["skipped"][label] = f"failed: {type(err).__name__}: {err}"
            print(f"{label}: failed ({type(err).__name__}: {str(err)[:300]})", file=sys.stderr)
            continue
        total_s = sum(ms) / 1e3
        timed = [j % n for j in range(len(ms))]  # the request of each time: the last pass may stop part-way
        record.update(summarise(ms), ms=ms, timed_requests=len(ms), cpu_median_ms=float(np.median(record["cpu_ms"])),
                      items_per_s=sum(len(grids[j]) for j in timed) / total_s,
                      tokens_per_s=sum(tokens[j] for j in timed) / total_s,
                      achieved_tflops=sum(flops[j]["total"] for j in timed) / total_s / 1e12,
                      floor_ms_mean=statistics.mean(floors[:n]),
                      vs_floor_median=float(np.median([m / floors[j % n] for j, m in enumerate(ms)])),
                      vs_floor_mean=statistics.mean(ms) / statistics.mean(floors[:n]))
        if runner is not None:
            record["runner"] = runner.settle_stats().as_dict()
            if mode in tables:
                record["predicted_ms"] = [runner_prediction(runner, g, tables[mode], args.no_route) for g in grids[:n]]
        if device.type == "cuda":
            record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["modes"][label] = record
        del fn, runner  # free the transformers copy of the weights and the graphs before the next mode
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _add_comparisons(result, outputs)
    if tables:
        labels = {m: mode_label(m, device) for m in ("eager", *TABLE_MODES)}
        result["prediction"] = _prediction(tables, plans, result["modes"], labels)
    return make(BenchRecord, provenance=collect(device, command), **result)


def _add_comparisons(result: dict, outputs: dict[str, torch.Tensor]) -> None:
    """Median ratios between modes, per-request comparison against eager, and accuracy on request 0."""
    modes = result["modes"]
    labels = list(modes)
    common = min((modes[m]["requests"] for m in labels), default=0)
    med = {m: float(np.median(modes[m]["ms"][:common])) for m in labels}
    result["ratios"] = {a: {b: med[a] / med[b] for b in labels} for a in labels}
    result["ratios_requests"] = common
    if "eager" in modes:
        first = modes["eager"]["ms"][:modes["eager"]["requests"]]
        for label in labels:
            mine = modes[label]["ms"][:modes[label]["requests"]]  # the first pass: every request once
            modes[label]["vs_eager_per_request"] = _per_request_vs(mine, first)
    if not outputs:
        return
    ref = "eager" if "eager" in outputs else next(iter(outputs))
    for label, out in outputs.items():
        result["accuracy"][label] = {"reference": ref, "request": 0, **compare(out, outputs[ref])}
        if "transformers" in outputs:
            result["accuracy"][label]["vs_transformers"] = compare(out, outputs["transformers"])


def resolve_tables(spec: str, model: GlmVisionEncoder, attention: str | None = None) -> dict[str, LatencyTable]:
    """``--tables``: ``auto`` → each graph mode's table recorded in data/bench, where it measured this model
    (config, dtype, attention backend) on this GPU; ``off`` → none; ``graph=PATH,graph-compiled=PATH`` → those."""
    if spec == "off":
        return {}
    if spec != "auto":
        tables = {}
        for part in spec.split(","):
            mode, _, path = part.partition("=")
            tables[mode.strip()] = read_latency_table(path.strip())
        return tables
    tables = {}
    for mode in TABLE_MODES:
        table = recorded_table_for(model, compiled=mode.compiled, attention=attention, dirs=RECORD_DIRS)
        if table is not None:
            tables[mode] = table
    return tables


def _mode_config(mode: str, specs: list, args: argparse.Namespace, tables: dict[str, LatencyTable]) -> BudgetConfig:
    """A graph mode's budgets: the ones given, else the default ladder doubling as far as the mode's own table says
    padding is cheap (:func:`glmvit.costmodel.ladder_split`; 512 without a table)."""
    split = ladder_split(tables[mode]) if mode in tables and not args.budgets else LADDER_SPLIT
    return BudgetConfig.for_requests(specs, args.budgets, args.max_items, args.max_segments, split=split)


def _graph_configs(modes: list[str], specs: list, args: argparse.Namespace,
                   tables: dict[str, LatencyTable]) -> dict[str, BudgetConfig]:
    """What each graph mode of ``modes`` captures: the one config that is both checked to fit and captured."""
    return {mode: _mode_config(mode, specs, args, tables) for mode in modes if mode in TABLE_MODES}


class GraphsDoNotFit(ValueError):
    """A graph mode's budgets cannot be captured on the device (:func:`check_budget_fits` says why)."""


def _check_graphs_fit(configs: dict[str, BudgetConfig], args: argparse.Namespace, device: torch.device) -> None:
    """:class:`GraphsDoNotFit` unless each config's graphs and the weights fit the device."""
    for config in configs.values():
        try:
            check_budget_fits(config, dtype_name(args.dtype), graph_memory_target(device))
        except ValueError as err:
            raise GraphsDoNotFit(str(err)) from None


def parse_tables(text: str) -> str:
    """An argparse ``type`` for --tables: auto, off, or MODE=PATH pairs with MODE a graph mode."""
    if text in ("auto", "off"):
        return text
    for part in text.split(","):
        mode, sep, path = part.partition("=")
        if not sep or mode.strip() not in TABLE_MODES or not path.strip():
            raise argparse.ArgumentTypeError(f"{part!r}: expected auto, off or MODE=PATH with MODE one of "
                                             f"{', '.join(TABLE_MODES)}")
    return text


def runner_prediction(runner: EncoderGraphRunner, grids: np.ndarray, table: LatencyTable, no_route: bool) -> float:
    """The ms the cost model predicts for one request as this runner plans it, each batch routed by the
    :class:`~glmvit.routing.Router` the runner routes with (``no_route``: replayed whenever a budget holds it)."""
    router = Router(table, by_time=not no_route)
    return sum(router.route(s.budget, s.tokens, s.segment_rows2)
               .predicted_ms or 0.0 for s in runner.plan(grids))


def _prediction(tables: dict[str, LatencyTable], plans: list, modes: dict, labels: dict[str, str]) -> dict:
    """The cost model's predicted mean ms per request next to the measured means: each graph mode from its own
    table, as its runner planned and routed the requests; eager (the whole request in one forward) from the graph
    table (the compiled one if that is all there is)."""
    out: dict[str, Any] = {}
    eager_table = tables.get("graph") or next(iter(tables.values()))
    predicted = {"eager": (0.0, eager_table)}  # its mean is taken over the requests eager timed, below
    for mode, table in tables.items():
        if "predicted_ms" in modes.get(labels[mode], {}):
            predicted[mode] = (statistics.mean(modes[labels[mode]]["predicted_ms"]), table)
    for mode, (ms, table) in predicted.items():
        if labels[mode] in modes:
            n = modes[labels[mode]]["requests"]
            if mode == "eager":
                ms = statistics.mean(predict_time(p, table).eager_ms for p in plans[:n])
            measured = modes[labels[mode]]["mean_ms"]
            out[labels[mode]] = {"predicted_mean_ms": ms, "measured_mean_ms": measured, "error": ms / measured - 1,
                                 "table": table.describe()}
    return out


def print_report(record: BenchRecord) -> None:
    result = record.model_dump(mode="json")
    s, w, fl = result["settings"], result["workload"], result["floor"]
    prov = result["provenance"]
    where = prov.get("gpu") or prov.get("cpu") or prov["device"]
    print(f"\nglmvit bench: {s['workload'] or 'random-mm ' + str(s['bucket_config'])} · {w['requests']} requests, "
          f"{w['items']} items, {w['tokens']} tokens · {s['config']} config, {s['dtype']}, attention "
          f"{s['attn_backend']} · {where}")
    print(f"budgets {s['budgets']} (max_items {s['max_items']}, max_segments {s['max_segments']}) · floor: matmul "
          f"{fl['matmul_tflops']:.3g} TFLOP/s, copy {fl['copy_gbps']:.3g} GB/s, weights "
          f"{fl['weight_bytes'] / 2**20:.1f} MiB → {fl['mean_ms']:.3g} ms/request")
    head = f"{'mode':<22}{'reqs':>6}{'mean':>9}{'median':>9}{'±95%':>7}{'P99':>9}{'tok/s':>11}{'TFLOP/s':>9}" \
           f"{'×floor':>8}{'slower':>8}{'worst':>7}"
    print("\n" + head + "\n" + "-" * len(head))
    for label, r in result["modes"].items():
        vs = r.get("vs_eager_per_request", {})
        lo, hi = r.get("median_ci95_ms") or (r["median_ms"], r["median_ms"])
        print(f"{label:<22}{r.get('timed_requests', r['requests']):>6}{r['mean_ms']:>9.3f}{r['median_ms']:>9.3f}"
              f"{(hi - lo) / 2 / r['median_ms']:>7.1%}{r['p99_ms']:>9.3f}"
              f"{r['tokens_per_s']:>11.0f}{r['achieved_tflops']:>9.3g}{r['vs_floor_median']:>8.1f}"
              f"{vs.get('share_slower', float('nan')):>8.1%}{vs.get('worst_ratio', float('nan')):>7.2f}")
    print("(ms per request; ×floor = median of time / floor; slower = share of requests slower than eager; "
          "worst = largest time / eager time)")
    labels = list(result["ratios"])
    if labels:
        print(f"\nmedian ratio row / column (over the first {result['ratios_requests']} requests; > 1: row is slower)")
        print(f"{'':<15}" + "".join(f"{b:>15}" for b in labels))
        for a in labels:
            print(f"{a:<15}" + "".join(f"{result['ratios'][a][b]:>15.2f}" for b in labels))
    for label, r in result["modes"].items():
        if "runner" in r:
            mem = sum(c.get("graph_bytes", 0) for c in r["capture"].values())
            print(f"\n{label}: {len(r['capture'])} budgets prepared in {r['capture_s']:.2f} s, graph pools "
                  f"{mem / 2**20:.1f} MiB; padding {r['runner']['padding_fraction']:.1%}, "
                  f"{r['runner']['replays']} replays, {r['runner']['fallback_items']} eager items")
    for mode, p in (result.get("prediction") or {}).items():
        if isinstance(p, dict) and "error" in p:
            print(f"cost model, {mode}: predicted {p['predicted_mean_ms']:.3f} ms vs measured "
                  f"{p['measured_mean_ms']:.3f} ms ({p['error']:+.1%})")
    if result["accuracy"]:
        print("\naccuracy on request 0 (vs " + next(iter(result["accuracy"].values()))["reference"] + "):")
        for label, a in result["accuracy"].items():
            print(f"  {label:<15} max |Δ| {a['max_abs_diff']:.3g}  mean |Δ| {a['mean_abs_diff']:.3g}  "
                  f"min cosine {a['min_cosine']:.6f}")
    for label, why in result["skipped"].items():
        print(f"{label}: {why}")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m glmvit bench", description=(__doc__ or "").split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload (vLLM random-mm)")
    w.add_argument("--workload", choices=list(PRESETS),
                   help="a named preset: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()))
    w.add_argument("--bucket-config", type=bucket_config_arg, default=None,
                   help=f"{{(height, width, frames): probability, ...}} (default {DEFAULT_BUCKETS}); this and the next "
                   "two are the preset's with --workload, and refused there")
    w.add_argument("--items-per-request", type=int_in(1, MAX_ITEMS), default=None, help="default 1")
    w.add_argument("--range-ratio", type=float_in(0, 1), default=None,
                   help="items per request uniform in n·[1−r, 1+r] (default 0)")
    w.add_argument("--num-requests", type=int_in(1, MAX_REQUESTS), default=100)
    m = p.add_argument_group("what runs")
    m.add_argument("--modes", default="transformers,eager,graph", help="comma list of " + ", ".join(MODES) +
                   " (graph is reported as graph-emulated off CUDA; compile modes are skipped off CUDA)")
    m.add_argument("--transformers-requests", type=int_in(1, MAX_REQUESTS), default=None,
                   help="time only the first N requests in transformers mode (it is slow)")
    m.add_argument("--budgets", type=budgets_arg, default=None, help="graph token budgets, e.g. 64,128,256 "
                   "(default: powers of two from 64 up to the largest request)")
    m.add_argument("--max-items", type=int_in(1, MAX_BUDGET_TOKENS), default=None,
                   help="items per graph batch (default: the most any request of the workload has)")
    m.add_argument("--max-segments", type=int_in(1, MAX_BUDGET_TOKENS), default=None,
                   help="attention segments (temporal patches) per graph batch (default: the most any request has; "
                        "with the varlen and flash_attn backends every slot is a column of the launch grid, so unused "
                        "slots cost time; the triton backend launches nothing for them)")
    m.add_argument("--attn-backend", default=None, help="one of glmvit.attention.BACKENDS: auto, triton, cudnn, "
                   "fa4, varlen, flash_attn, sdpa_masked, segments (default: the device's; on CUDA auto where the "
                   "cuDNN frontend runs, else triton)")
    m.add_argument("--uniform-graphs", choices=("auto", "off"), default="auto",
                   help="graph modes also capture graphs for batches whose segments all have one length, run with "
                        "the dense attention (glmvit.graphs): auto (default) = for the lengths that make up a large "
                        "share of the workload's rows, on CUDA in fp16/bf16 with the device's default attention "
                        "backend; off = none")
    m.add_argument("--threads", type=int_in(1, os.cpu_count() or 1), default=None, help="torch.set_num_threads(N) "
                   "first (CPU runs; on a busy machine 1 is the least noisy)")
    m.add_argument("--precision", type=float_in(0, 1), default=PRECISION,
                   help="time the workload again while the median's 95 %% interval is wider than ±this share "
                        f"(default {PRECISION}), up to --max-passes")
    m.add_argument("--max-passes", type=int_in(1, 100), default=MAX_PASSES,
                   help=f"passes over the workload at most, per mode (default {MAX_PASSES}; the first times every "
                        "request)")
    m.add_argument("--warmup", type=int_in(0, MAX_WARMUP), default=WARMUP,
                   help=f"untimed requests per mode first (default {WARMUP})")
    m.add_argument("--matmul-size", type=int_in(1, max(MAX_MATMUL.values())), default=None,
                   help="n of the floor's n³ matmul (default 8192 CUDA, 512 CPU; at most "
                        + ", ".join(f"{v:,} {k}" for k, v in MAX_MATMUL.items()) + ")")
    add_model_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", type=output_path,
                   help="write every number, with provenance, to this JSON file (-: standard output)")
    o.add_argument("--tables", type=parse_tables, default="auto", metavar="auto|off|MODE=PATH,...",
                   help="latency tables (python -m glmvit latency) that route each graph mode's batches and predict "
                        "every mode's mean: auto (default) = those recorded in data/bench for this model, dtype, "
                        "attention and GPU; off; or graph=PATH,graph-compiled=PATH")
    o.add_argument("--no-route", action="store_true", help="replay whenever a budget holds a batch, as vLLM does "
                   "(the tables then only predict)")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every value checked before any work: one line and exit 2 for a bad one. The workload is drawn here once
    to refuse what cannot run (no items, budgets that do not fit it, pixels that do not fit the device)."""
    resolve_model_args(parser, args)
    refuse_preset_flags(parser, args)
    given = [] if args.tables in ("auto", "off") else \
        [(mode.strip(), path.strip()) for mode, _, path in (part.partition("=") for part in args.tables.split(","))]
    refuse_outputs_over_inputs(parser, {"--json": args.json}, {f"the --tables {m} input": p for m, p in given})
    device = torch.device(args.device)
    if args.matmul_size and args.matmul_size > MAX_MATMUL[device.type]:
        parser.error(f"--matmul-size {args.matmul_size:,}: at most {MAX_MATMUL[device.type]:,} on {device.type}")
    try:
        parse_modes(args.modes)
        if args.attn_backend:
            check_backend(args.attn_backend, device, DTYPES[args.dtype])
        if args.json:
            check_writable(args.json)
        tables = {}
        for mode, path in given:
            tables[mode] = table = read_latency_table(path)
            if table.mode not in (None, mode):
                raise ValueError(f"--tables {mode}={path}: {table.describe()} measured {table.mode}, not {mode}")
        # the tables that decide each mode's budgets, when known before the model is built (auto: only it knows)
        _check_workload(args, device, None if args.tables == "auto" and not args.budgets else tables)
    except (ValueError, OSError) as err:
        parser.error(str(err))


def _check_workload(args: argparse.Namespace, device: torch.device, tables: dict[str, LatencyTable] | None) -> None:
    """The drawn workload fits the limits and the device; its graphs are checked against memory here when
    ``tables`` (those that size each mode's budgets) are known, else by :func:`run_benchmark` before any mode runs."""
    buckets, items_per_request, range_ratio, limit = _workload(args)
    most = min(math.ceil(items_per_request * (1 + range_ratio)), limit or math.inf)
    if args.num_requests * most > MAX_ITEMS:
        raise ValueError(f"{args.num_requests:,} requests of up to {most:,} items is more than {MAX_ITEMS:,} items "
                         "(every item's pixels are generated before timing)")
    requests = [r for r in random_mm_workload(buckets, args.num_requests, items_per_request, range_ratio, args.seed,
                                              limit) if r]
    if not requests:
        raise ValueError("the workload drew no items (raise --items-per-request or lower --range-ratio)")
    specs = [[item.spec for item in r] for r in requests]
    BudgetConfig.for_requests(specs, args.budgets, args.max_items, args.max_segments)  # the limits, for every mode
    if tables is not None:
        _check_graphs_fit(_graph_configs(parse_modes(args.modes), specs, args, tables), args, device)
    rows = sum(spec.rows for r in specs for spec in r)
    need = rows * VisionConfig().patch_dim * DTYPES[args.dtype].itemsize
    have = device_memory_bytes(device)
    if need > PIXEL_SHARE * have:
        raise ValueError(f"the workload's pixels need {need / 2**30:,.1f} GiB, more than half of {device}'s "
                         f"{have / 2**30:,.0f} GiB (they stay resident for every mode): fewer or smaller requests")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = run_benchmark(args, " ".join([sys.executable, "-m", "glmvit", "bench", *argv]))
    except GraphsDoNotFit as err:  # checked once the model chose the tables (--tables auto): still before any mode
        parser.error(str(err))
    finally:
        torch.set_num_threads(threads)  # main() is also called from notebooks and tests: leave no global change
    print_report(result)
    if args.json:
        write_record(args.json, result)
    return 0
