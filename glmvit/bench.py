"""``python -m glmvit bench``: transformers vs eager vs CUDA graphs (vs torch.compile) vs the GPU's floor.

Modelled on ``vllm bench mm-processor`` with the ``random-mm`` dataset (vLLM PR #40576): requests of images and
videos drawn from a bucket config ``{(height, width, frames): probability}``; every item is resized with GLM-4V's
``smart_resize`` to its patch grid. Each request's pixel rows are generated once up front (random normal, on the
device), so timing excludes preprocessing. Per request and mode we time ``encoder_forward_ms``: the wall time of
the encoder call *including its host preparation* (metadata, planning, copies), between two
``torch.cuda.synchronize()`` calls.

Modes (all on the same weights):

- ``transformers``: transformers' ``Glm4vVisionModel`` (attention "sdpa"); a video row [t, h, w] is given to it
  as t rows [1, h, w] (what its tower needs);
- ``eager``: ``GlmVisionEncoder.forward(pixel_values, grid_thw)``;
- ``graph``: ``EncoderGraphRunner(...).capture()`` then ``.run(...)``. Off CUDA the runner's ``emulate`` backend
  does the same bookkeeping without graphs, and the mode is labelled ``graph-emulated`` everywhere;
- ``graph-compiled``: the same runner with ``forward_static`` compiled by ``torch.compile`` before capture (CUDA).
- ``compile``: ``forward`` with ``forward_static`` wrapped in ``torch.compile`` (CUDA only, optional).

The floor of a request is max(FLOPs / measured matmul rate, weight bytes / measured copy bandwidth), both measured
in the same run on the same device; FLOPs are analytic (:func:`encoder_flops`). Examples::

    python -m glmvit bench --workload img1x224 --num-requests 200 --json data/bench/img1x224_h200.json
    python -m glmvit bench --bucket-config "{(224, 224, 1): 0.7, (448, 448, 1): 0.3}" --items-per-request 2
    python -m glmvit bench --latency-table data/bench/latency_h200.json --budgets 64,128,256,512,1024,2048,4096
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from .budget import BudgetConfig, parse_budgets, parse_bucket_config, random_mm_workload
from .config import VisionConfig
from .metadata import build_metadata
from .provenance import git_state, gpu_driver
from .testing import flatten_video_grids

# name -> (bucket config, items per request): fixed workloads (range ratio 0, so every request is the same)
WORKLOADS: dict[str, tuple[dict[tuple[int, int, int], float], int]] = {
    "img1x224": ({(224, 224, 1): 1.0}, 1),  # one 224² image: grid [1, 16, 16], 64 tokens
    "img4x224": ({(224, 224, 1): 1.0}, 4),  # four 224² images: 256 tokens
    "video8x224": ({(224, 224, 8): 1.0}, 1),  # one 8-frame 224² clip: grid [4, 16, 16], 256 tokens (the seed's video)
    "img8x448": ({(448, 448, 1): 1.0}, 8),  # eight 448² images: grids [1, 32, 32], 2048 tokens (the large budget)
}
MODES = ("transformers", "eager", "graph", "graph-compiled", "compile")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------------------------
# FLOPs and the floor
# ---------------------------------------------------------------------------------------------------------------
def flops_breakdown(config: VisionConfig, grids) -> dict[str, int]:
    """Analytic FLOPs of one encoder forward over ``grids`` (rows [t, h, w]), by part.

    Every matmul of an [M, K] by [K, N] product counts 2·M·N·K. With N = Σ t·h·w patch rows, T = N / m² output
    tokens, H = hidden_size, F = out_hidden_size (GLM-4V's block MLP width), I = intermediate_size (merger),
    P = patch_dim (C·T·P² = 1176) and depth blocks:

    - patch_embed: 2·N·P·H (the Conv3d whose kernel is the whole patch is one matmul);
    - per block: qkv 2·N·H·3H, proj 2·N·H·H, MLP gate + up 2·2·N·H·F, down 2·N·F·H;
    - attention per block: 4·Σ_seg L²·H (QKᵀ and P·V, 2·L²·head_dim per head each), L = h·w: every temporal
      patch of every item is its own segment;
    - downsample: 2·T·(m²·H)·F (the 2×2 conv as a matmul);
    - merger: proj 2·T·F·F, gate + up 2·2·T·F·I, down 2·T·I·F.

    Not counted: norms, rotary, softmax, activations, the position-table interpolation, biases (all O(N·H)).
    Padding of a graph's budget is not counted either: these are the useful FLOPs of the request.
    """
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    c = config
    n = int((g[:, 0] * g[:, 1] * g[:, 2]).sum())
    tokens = n // c.merge_area
    h, f, i = c.hidden_size, c.out_hidden_size, c.intermediate_size
    seg_sq = int((g[:, 0] * (g[:, 1] * g[:, 2]) ** 2).sum())
    parts = {
        "patch_embed": 2 * n * c.patch_dim * h,
        "qkv": c.depth * 2 * n * h * 3 * h,
        "proj": c.depth * 2 * n * h * h,
        "mlp": c.depth * 3 * 2 * n * h * f,
        "downsample": 2 * tokens * c.merge_area * h * f,
        "merger": 2 * tokens * f * f + 3 * 2 * tokens * f * i,
        "attention": c.depth * 4 * seg_sq * h,
    }
    parts["matmul"] = sum(v for k, v in parts.items() if k != "attention")
    parts["total"] = parts["matmul"] + parts["attention"]
    return parts


def encoder_flops(config: VisionConfig, grids) -> int:
    """Total analytic FLOPs (matmuls + attention) of one forward over ``grids``; see :func:`flops_breakdown`."""
    return flops_breakdown(config, grids)["total"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn: Callable[[], Any], device: torch.device, warmup: int, runs: int) -> list[float]:
    """Per-call ms: CUDA events on a GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_matmul_tflops(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                          n: int | None = None, runs: int = 10, warmup: int = 3) -> float:
    """Measured dense matmul rate in TFLOP/s: an n³ matmul (default 8192 on CUDA, 512 elsewhere), mean of ``runs``
    after ``warmup`` calls (CUDA events on a GPU)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    ms = statistics.mean(_time_ms(lambda: torch.mm(a, b, out=out), device, warmup, runs))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_copy_bandwidth(device: torch.device | str = "cuda", nbytes: int | None = None, runs: int = 10,
                           warmup: int = 3) -> float:
    """Measured device-to-device copy bandwidth in GB/s (10⁹ B/s), counting bytes read + written: a ``nbytes``
    buffer (default 2 GiB on CUDA, 64 MiB elsewhere) copied into another, mean of ``runs``."""
    device = torch.device(device)
    nbytes = nbytes or (2 * 2**30 if device.type == "cuda" else 64 * 2**20)
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = statistics.mean(_time_ms(lambda: dst.copy_(src), device, warmup, runs))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and persistent buffer: what one forward must read at least once."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def floor_ms(flops: int, nbytes: int, tflops: float, gbps: float) -> float:
    """max(compute time at the matmul rate, time to read the weights at the copy bandwidth), in ms."""
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e3


# ---------------------------------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken optional package is just "not there"
        return None


def provenance(device: torch.device | str, argv: Sequence[str] | None = None) -> dict:
    """Where and how a result was measured: device, driver, library versions, git commit, command line, date."""
    device = torch.device(device)
    info: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), driver=gpu_driver(), cuda=torch.version.cuda)
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    argv = sys.argv[1:] if argv is None else list(argv)
    info.update(
        torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
        python=platform.python_version(),
        **git_state(),
        command=" ".join([sys.executable, "-m", "glmvit", "bench", *argv]),
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    return info


# ---------------------------------------------------------------------------------------------------------------
# Models and modes
# ---------------------------------------------------------------------------------------------------------------
def mode_label(mode: str, device: torch.device) -> str:
    """The name a mode is reported under: ``graph`` off CUDA is ``graph-emulated`` (no CUDA graph is involved)."""
    return "graph-emulated" if mode == "graph" and device.type != "cuda" else mode


def transformers_model(model, dtype: torch.dtype, attn: str = "sdpa"):
    """transformers' ``Glm4vVisionModel`` for ``model.config``, on ``model``'s device, holding ``model``'s weights."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    hf_config = Glm4vVisionConfig(**model.config.to_hf_dict())
    hf_config._attn_implementation = attn
    with torch.device(model.device):
        hf = Glm4vVisionModel(hf_config)
    hf = hf.to(dtype).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def _make_mode(mode: str, model, args, device: torch.device, dtype: torch.dtype, budget_config: BudgetConfig,
               record: dict) -> Callable[[torch.Tensor, np.ndarray, torch.Tensor], torch.Tensor]:
    """A callable (pixels, grids, flat_grids) -> output tensor [tokens, out_hidden] for one mode."""
    if mode == "transformers":
        hf = transformers_model(model, dtype)

        def run(pixels, grids, flat):
            return hf(pixels, flat).pooler_output

        return run
    if mode == "eager":
        return lambda pixels, grids, flat: model(pixels, grids)
    if mode in ("graph", "graph-compiled"):
        from .graphs import EncoderGraphRunner

        backend = "cuda" if device.type == "cuda" else "emulate"
        runner = EncoderGraphRunner(model, budget_config, backend=backend, compile=mode == "graph-compiled")
        if device.type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved()
        start = time.perf_counter()
        runner.capture()
        record["capture_s"] = time.perf_counter() - start
        record["capture"] = {str(k): v for k, v in runner.stats.capture.items()}
        record["capture_failed"] = {str(k): v for k, v in runner.stats.failed.items()}
        if device.type == "cuda":
            record["capture_reserved_bytes"] = torch.cuda.memory_reserved() - before
        record["backend"] = backend
        record["_runner"] = runner
        def run_graphs(pixels, grids, flat):
            outs = runner.run(pixels, grids)  # per-item clones, ready (run() synchronises)
            return outs[0] if len(outs) == 1 else torch.cat(outs)  # the other modes return one tensor

        return run_graphs
    if mode == "compile":
        static = torch.compile(model.forward_static, dynamic=False)
        merge = model.config.spatial_merge_size

        def run(pixels, grids, flat):
            model.check_inputs(pixels, grids)
            return static(pixels, build_metadata(grids, merge).to(device))

        return run
    raise ValueError(f"unknown mode {mode!r}")


def parse_modes(text: str, device: torch.device) -> list[str]:
    """``"transformers,eager,graph"`` → canonical names (``graph-emulated`` is accepted for ``graph``)."""
    modes = []
    for word in text.replace(",", " ").split():
        word = "graph" if word == "graph-emulated" else word
        if word not in MODES:
            raise ValueError(f"unknown mode {word!r}; choose from {', '.join(MODES)}")
        if word not in modes:
            modes.append(word)
    if not modes:
        raise ValueError("no modes given")
    return modes


def summarise(ms: Sequence[float]) -> dict[str, float]:
    a = np.asarray(ms, dtype=np.float64)
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "std_ms": float(a.std()),
            "p99_ms": float(np.percentile(a, 99)), "min_ms": float(a.min()), "max_ms": float(a.max())}


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """max / mean |got − ref| and the smallest per-token cosine similarity, in float32."""
    g, r = got.float(), ref.float()
    diff = (g - r).abs()
    cos = torch.nn.functional.cosine_similarity(g, r, dim=-1)
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "min_cosine": float(cos.min()), "mean_cosine": float(cos.mean())}


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------
def default_budgets(requests_grids: Sequence[np.ndarray], merge_area: int = 4) -> tuple[int, ...]:
    """Powers of two from 64 to the first one ≥ the largest request (in output tokens)."""
    largest = max((int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) // merge_area for g in requests_grids), default=0)
    budgets = [64]
    while budgets[-1] < largest:
        budgets.append(budgets[-1] * 2)
    return tuple(budgets)


def workload_limits(requests_grids: Sequence[np.ndarray], smallest_budget: int, max_items: int | None = None,
                    max_frames: int | None = None) -> tuple[int, int]:
    """(max_items, max_frames) for a workload: the most items / temporal patches of any request, unless given.

    At least 1, capped to fit the smallest budget (≥ 1 token per item); max_frames is at least max_items.
    """
    if max_items is None:
        max_items = min(max([len(g) for g in requests_grids] + [1]), smallest_budget)
    if max_frames is None:
        max_frames = max([max_items] + [int(g[:, 0].sum()) for g in requests_grids])
    return max_items, max_frames


def square_grid(budget: int, merge: int = 2) -> list[int]:
    """A one-image grid [1, h, w] with h·w = m²·budget, h and w multiples of m, as square as possible."""
    a = int(math.isqrt(budget))
    while budget % a:
        a -= 1
    return [1, merge * a, merge * (budget // a)]


def _build(args, device: torch.device, dtype: torch.dtype):
    from .demo import build_model

    config = VisionConfig.glm41v() if args.config == "full" else VisionConfig.tiny()
    model = build_model(config, device, dtype, args.weights, seed=args.seed)
    if args.attn_backend:
        model.attn_backend = args.attn_backend
        model.attention_backend()  # raises a clear error if the backend cannot run here
    return config, model


def _floor(args, device: torch.device, dtype: torch.dtype, model) -> dict:
    print("measuring the floor: matmul rate and copy bandwidth ...", file=sys.stderr)
    tflops = measure_matmul_tflops(device, dtype, n=args.matmul_size)
    gbps = measure_copy_bandwidth(device)
    return {"matmul_tflops": tflops, "matmul_n": args.matmul_size or (8192 if device.type == "cuda" else 512),
            "matmul_dtype": str(dtype).replace("torch.", ""), "copy_gbps": gbps, "weight_bytes": weight_bytes(model),
            "parameters": sum(p.numel() for p in model.parameters())}


def run_benchmark(args, argv) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    modes = parse_modes(args.modes, device)
    for mode in ("compile", "graph-compiled"):
        if mode in modes and device.type != "cuda":
            print(f"{mode}: skipped (torch.compile modes are only benchmarked on CUDA)", file=sys.stderr)

    if args.workload:
        bucket_config, items_per_request = WORKLOADS[args.workload]
        range_ratio = 0.0
    else:
        bucket_config = parse_bucket_config(args.bucket_config)
        items_per_request, range_ratio = args.items_per_request, args.range_ratio
    requests = random_mm_workload(bucket_config, args.num_requests, items_per_request, range_ratio, args.seed)
    requests = [r for r in requests if r]  # vLLM's range can draw 0 items: nothing to encode
    if not requests:
        raise SystemExit("the workload drew no items (raise --items-per-request or lower --range-ratio)")
    config, model = _build(args, device, dtype)
    grids = [np.array([item.grid for item in r], dtype=np.int64) for r in requests]
    budgets = parse_budgets(args.budgets) if args.budgets else None
    budgets = budgets or default_budgets(grids, config.merge_area)
    budget_config = BudgetConfig(budgets, *workload_limits(grids, budgets[0], args.max_items, args.max_frames))

    # inputs, generated once, on the device
    gen = torch.Generator(device=device).manual_seed(args.seed)
    pixels = [torch.randn(int((g[:, 0] * g[:, 1] * g[:, 2]).sum()), config.patch_dim, device=device, dtype=dtype,
                          generator=gen) for g in grids]
    flat = [flatten_video_grids(g).to(device) for g in grids]
    flops = [flops_breakdown(config, g) for g in grids]
    tokens = [int((g[:, 0] * g[:, 1] * g[:, 2]).sum()) // config.merge_area for g in grids]
    floor = _floor(args, device, dtype, model)
    floors = [floor_ms(f["total"], floor["weight_bytes"], floor["matmul_tflops"], floor["copy_gbps"]) for f in flops]

    result: dict[str, Any] = {
        "benchmark": "glmvit.bench",
        "provenance": provenance(device, argv),
        "settings": {
            "workload": args.workload, "bucket_config": {str(k): v for k, v in bucket_config.items()},
            "items_per_request": items_per_request, "range_ratio": range_ratio, "num_requests": len(requests),
            "seed": args.seed, "budgets": list(budget_config.token_budgets), "max_items": budget_config.max_items,
            "max_frames": budget_config.max_frames, "attn_backend": model.attention_backend(),
            "dtype": str(dtype).replace("torch.", ""), "config": args.config, "vision_config": vars(config).copy(),
            "weights": args.weights or "random", "warmup": args.warmup,
            "transformers_requests": args.transformers_requests, "modes": [mode_label(m, device) for m in modes],
            "timing": "wall time per request of the encoder call incl. host preparation, between synchronizes",
        },
        "workload": {"requests": len(requests), "items": sum(len(g) for g in grids), "tokens": sum(tokens),
                     "patches": sum(int(p.shape[0]) for p in pixels), "grids": [g.tolist() for g in grids]},
        "floor": {**floor, "per_request_ms": floors, "mean_ms": statistics.mean(floors),
                  "definition": "max(FLOPs / matmul rate, weight bytes / copy bandwidth)"},
        "flops": {"per_request": [f["total"] for f in flops], "total": sum(f["total"] for f in flops),
                  "matmul": sum(f["matmul"] for f in flops), "attention": sum(f["attention"] for f in flops)},
        "modes": {},
        "skipped": {},
        "accuracy": {},
    }
    outputs: dict[str, torch.Tensor] = {}
    for mode in modes:
        label = mode_label(mode, device)
        if mode in ("compile", "graph-compiled") and device.type != "cuda":
            result["skipped"][label] = "torch.compile modes are only benchmarked on CUDA"
            continue
        n = len(requests) if mode != "transformers" else min(len(requests), args.transformers_requests or len(requests))
        record: dict[str, Any] = {"requests": n}
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            with torch.inference_mode():
                fn = _make_mode(mode, model, args, device, dtype, budget_config, record)
                start = time.perf_counter()
                for i in range(args.warmup):
                    j = i % n
                    fn(pixels[j], grids[j], flat[j])
                _sync(device)
                record["warmup_s"] = time.perf_counter() - start
                runner = record.pop("_runner", None)
                if runner is not None:
                    runner.stats = type(runner.stats)(capture=runner.stats.capture, failed=runner.stats.failed)
                ms = []
                for j in tqdm(range(n), desc=f"{label:>14}", unit="req", file=sys.stderr, disable=args.quiet):
                    _sync(device)
                    t0 = time.perf_counter()
                    out = fn(pixels[j], grids[j], flat[j])
                    _sync(device)
                    ms.append((time.perf_counter() - t0) * 1e3)
                    if j == 0:
                        outputs[label] = out.float().clone()
        except Exception as err:  # noqa: BLE001 - one failing mode (e.g. compile) must not lose the others
            record.pop("_runner", None)
            result["skipped"][label] = f"failed: {type(err).__name__}: {err}"
            print(f"{label}: failed ({type(err).__name__}: {str(err)[:300]})", file=sys.stderr)
            continue
        record.update(summarise(ms))
        total_s = sum(ms) / 1e3
        record.update(
            ms=ms,
            items_per_s=sum(len(g) for g in grids[:n]) / total_s,
            tokens_per_s=sum(tokens[:n]) / total_s,
            achieved_tflops=sum(f["total"] for f in flops[:n]) / total_s / 1e12,
            floor_ms_mean=statistics.mean(floors[:n]),
            vs_floor_median=float(np.median([m / fl for m, fl in zip(ms, floors)])),
            vs_floor_mean=statistics.mean(ms) / statistics.mean(floors[:n]),
        )
        if runner is not None:
            record["runner"] = runner.stats.as_dict()
            record["runner"]["capture"] = {str(k): v for k, v in record["runner"]["capture"].items()}
            record["runner"]["failed"] = {str(k): v for k, v in record["runner"]["failed"].items()}
        if device.type == "cuda":
            record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["modes"][label] = record
        if mode == "transformers":
            del fn  # free the second copy of the weights before the next mode
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # ratios over the requests every mode timed (transformers may time fewer)
    labels = list(result["modes"])
    common = min((result["modes"][m]["requests"] for m in labels), default=0)
    med = {m: float(np.median(result["modes"][m]["ms"][:common])) for m in labels}
    result["ratios"] = {a: {b: med[a] / med[b] for b in labels} for a in labels}
    result["ratios_requests"] = common
    ref = "eager" if "eager" in outputs else (labels[0] if labels else None)
    for label, out in outputs.items():
        result["accuracy"][label] = {"reference": ref, "request": 0, **compare(out, outputs[ref])}
        if "transformers" in outputs:
            result["accuracy"][label]["vs_transformers"] = compare(out, outputs["transformers"])
    return result


def print_report(result: dict) -> None:
    s, w, fl = result["settings"], result["workload"], result["floor"]
    prov = result["provenance"]
    where = prov.get("gpu") or prov.get("cpu") or prov["device"]
    print(f"\nglmvit bench: {s['workload'] or 'random-mm ' + str(s['bucket_config'])} · {w['requests']} requests, "
          f"{w['items']} items, {w['tokens']} tokens · {s['config']} config, {s['dtype']}, attention "
          f"{s['attn_backend']} · {where}")
    print(f"budgets {s['budgets']} (max_items {s['max_items']}, max_frames {s['max_frames']}) · floor: matmul "
          f"{fl['matmul_tflops']:.3g} TFLOP/s, copy {fl['copy_gbps']:.3g} GB/s, weights "
          f"{fl['weight_bytes'] / 2**20:.1f} MiB → {fl['mean_ms']:.3g} ms/request")
    head = f"{'mode':<15}{'reqs':>5}{'mean':>9}{'median':>9}{'std':>8}{'P99':>9}{'items/s':>10}{'tok/s':>11}" \
           f"{'TFLOP/s':>9}{'×floor':>8}"
    print("\n" + head + "\n" + "-" * len(head))
    for label, r in result["modes"].items():
        print(f"{label:<15}{r['requests']:>5}{r['mean_ms']:>9.3f}{r['median_ms']:>9.3f}{r['std_ms']:>8.3f}"
              f"{r['p99_ms']:>9.3f}{r['items_per_s']:>10.1f}{r['tokens_per_s']:>11.0f}{r['achieved_tflops']:>9.3g}"
              f"{r['vs_floor_median']:>8.1f}")
    print("(times in ms per request; ×floor = median of time / floor per request)")
    labels = list(result["ratios"])
    if labels:
        print(f"\nmedian ratio row / column (over the first {result['ratios_requests']} requests; > 1: row is slower)")
        print(f"{'':<15}" + "".join(f"{b:>15}" for b in labels))
        for a in labels:
            print(f"{a:<15}" + "".join(f"{result['ratios'][a][b]:>15.2f}" for b in labels))
    for label, r in result["modes"].items():
        if "capture" in r:
            cap = r["capture"]
            mem = sum(c.get("graph_bytes", 0) for c in cap.values())
            print(f"\n{label}: {len(cap)} budgets prepared in {r['capture_s']:.2f} s, graph pools "
                  f"{mem / 2**20:.1f} MiB; padding {r['runner']['padding_fraction']:.1%}, "
                  f"{r['runner']['replays']} replays, {r['runner']['fallback_items']} eager items")
    if result["accuracy"]:
        print("\naccuracy on request 0 (vs " + next(iter(result["accuracy"].values()))["reference"] + "):")
        for label, a in result["accuracy"].items():
            print(f"  {label:<15} max |Δ| {a['max_abs_diff']:.3g}  mean |Δ| {a['mean_abs_diff']:.3g}  "
                  f"min cosine {a['min_cosine']:.6f}")
    for label, why in result["skipped"].items():
        print(f"{label}: {why}")


# ---------------------------------------------------------------------------------------------------------------
# The latency table (for glmvit.budget.load_latency_table)
# ---------------------------------------------------------------------------------------------------------------
def latency_table(args, argv) -> dict:
    """Median eager and graph ms of one full batch of each budget (one square-ish image of m²·budget patches)."""
    from .graphs import EncoderGraphRunner

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    budgets = parse_budgets(args.budgets) if args.budgets else None
    if not budgets or len(budgets) < 2:
        raise SystemExit("--latency-table needs --budgets with at least two budgets, e.g. 64,128,256,512")
    config, model = _build(args, device, dtype)
    budget_config = BudgetConfig(budgets, max_items=1, max_frames=max(1, args.max_frames or 1))
    backend = "cuda" if device.type == "cuda" else "emulate"
    runner = EncoderGraphRunner(model, budget_config, backend=backend, progress=not args.quiet)
    with torch.inference_mode():
        runner.capture()
        gen = torch.Generator(device=device).manual_seed(args.seed)
        rows = []
        for budget in tqdm(budget_config.token_budgets, desc="latency table", unit="budget", file=sys.stderr,
                           disable=args.quiet):
            grid = np.array([square_grid(budget, config.spatial_merge_size)])
            pixels = torch.randn(int(grid.prod()), config.patch_dim, device=device, dtype=dtype, generator=gen)

            def timed(fn):
                for _ in range(args.warmup):
                    fn()
                out = []
                for _ in range(args.latency_runs):
                    _sync(device)
                    t0 = time.perf_counter()
                    fn()
                    _sync(device)
                    out.append((time.perf_counter() - t0) * 1e3)
                return out

            eager = timed(lambda: model(pixels, grid))
            graph = timed(lambda: runner.run(pixels, grid)) if budget in runner.graphs else None
            rows.append({"tokens": budget, "grid": grid[0].tolist(), "eager_ms": float(np.median(eager)),
                         "graph_ms": float(np.median(graph)) if graph else None,
                         "eager_p99_ms": float(np.percentile(eager, 99)),
                         "graph_p99_ms": float(np.percentile(graph, 99)) if graph else None,
                         "flops": encoder_flops(config, grid)})
    return {
        "benchmark": "glmvit.bench.latency_table",
        "provenance": {**provenance(device, argv), "graph_backend": backend,
                       "graph": "CUDA graphs" if backend == "cuda" else "emulated (no CUDA graphs)",
                       "runs": args.latency_runs, "warmup": args.warmup, "statistic": "median"},
        "dtype": str(dtype).replace("torch.", ""),
        "config": "glm41v" if args.config == "full" else "tiny",
        "attn_backend": model.attention_backend(),
        "budgets": [r for r in rows if r["graph_ms"] is not None],
        "capture": {str(k): v for k, v in runner.stats.capture.items()},
        "failed": {str(k): v for k, v in runner.stats.failed.items()},
    }


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m glmvit bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload (vLLM random-mm)")
    w.add_argument("--workload", choices=sorted(WORKLOADS),
                   help="a fixed preset: " + "; ".join(f"{k}: {v[1]} × {list(v[0])[0]}" for k, v in WORKLOADS.items()))
    w.add_argument("--bucket-config", default="{(224, 224, 1): 1.0}",
                   help="{(height, width, frames): probability, ...} (ignored with --workload)")
    w.add_argument("--items-per-request", type=int, default=1)
    w.add_argument("--range-ratio", type=float, default=0.0, help="items per request uniform in n·[1−r, 1+r]")
    w.add_argument("--num-requests", type=int, default=100)
    w.add_argument("--seed", type=int, default=42)
    m = p.add_argument_group("what runs")
    m.add_argument("--modes", default="transformers,eager,graph", help="comma list of transformers, eager, graph, "
                   "compile (graph is reported as graph-emulated off CUDA; compile is skipped off CUDA)")
    m.add_argument("--transformers-requests", type=int, default=None,
                   help="time only the first N requests in transformers mode (it is slow)")
    m.add_argument("--budgets", default=None, help="graph token budgets, e.g. 64,128,256 (default: powers of two "
                   "from 64 up to the largest request)")
    m.add_argument("--max-items", type=int, default=None,
                   help="items per graph batch (default: the most any request of the workload has)")
    m.add_argument("--max-frames", type=int, default=None,
                   help="temporal patches (attention segments) per graph batch (default: the most any request has; "
                        "every segment slot is a row of the flash-attention grid, so unused slots cost time)")
    m.add_argument("--attn-backend", default=None, help="varlen, flash_attn, sdpa_masked (default: the device's)")
    m.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    m.add_argument("--config", choices=["full", "tiny"], default=None, help="default full on CUDA, tiny on CPU")
    m.add_argument("--weights", default=None, help="a checkpoint (default: random weights)")
    m.add_argument("--device", default="cuda" if cuda else "cpu")
    m.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first (CPU runs; on a "
                   "busy machine 1 is the least noisy)")
    m.add_argument("--warmup", type=int, default=5, help="untimed requests per mode first (default 5)")
    m.add_argument("--matmul-size", type=int, default=None, help="n of the floor's n³ matmul (8192 CUDA, 512 CPU)")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every number, with provenance, to this JSON file")
    o.add_argument("--latency-table", metavar="PATH", help="instead: time eager and graph for one full batch of "
                   "each --budgets entry and write glmvit.budget.load_latency_table's JSON")
    o.add_argument("--latency-runs", type=int, default=20, help="timed runs per budget for --latency-table")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    args.dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    args.config = args.config or ("full" if device.type == "cuda" else "tiny")
    for name in ("num_requests", "items_per_request", "max_items", "max_frames", "latency_runs"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be ≥ 1")
    if args.warmup < 0:
        parser.error("--warmup must be ≥ 0")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be ≥ 1")
    try:
        parse_bucket_config(args.bucket_config)
        parse_modes(args.modes, device)
        if args.budgets:
            parse_budgets(args.budgets)
    except ValueError as err:
        parser.error(str(err))
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv)
    finally:
        torch.set_num_threads(threads)  # main() is also called from notebooks and tests: leave no global change


def _run(args, argv) -> int:
    if args.latency_table:
        table = latency_table(args, argv)
        print(f"\n{'tokens':>7} {'grid':>14} {'eager ms':>10} {'graph ms':>10}")
        for r in table["budgets"]:
            print(f"{r['tokens']:>7} {str(r['grid']):>14} {r['eager_ms']:>10.3f} {r['graph_ms']:>10.3f}")
        _write(args.latency_table, table)
        return 0
    result = run_benchmark(args, argv)
    print_report(result)
    if args.json:
        _write(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
