"""Where a forward's GPU time goes: kernels by category from ``torch.profiler``, single ops timed inside a CUDA
graph, and each op's roofline (the time its FLOPs or its bytes need at the rates measured on the same GPU)."""
from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from typing import Any, Callable

import torch

from .config import VisionConfig

# Ordered: the first pattern that matches a kernel's name names its category. Inductor names a fused kernel after
# the ops it fused, so its rotary-before-varlen kernel (…_varlen_attn_…_cos_mul_neg_sin…) counts as attention.
CATEGORIES = (
    ("attention", r"rope_varlen|rope_rotate|combine_splits|flash|fmha|attn|attention"),  # with its launches
    ("gemm", r"gemm|nvjet|cutlass|xmma|matmul|triton_tem|_mm_|splitk|cublas|sm90_|wgmma"),
    ("fused elementwise", r"triton_(poi|per|red)"),
    ("interpolation", r"interp"),
    ("fill", r"fill|zero"),
    ("copy", r"copy|memcpy|memset|cat_|catarray"),
)
OTHER = "elementwise / norm / other"


def categorise(name: str) -> str:
    """The category of a CUDA kernel by its name (see ``CATEGORIES``); everything else is ``OTHER``."""
    low = name.lower()
    for category, pattern in CATEGORIES:
        if re.search(pattern, low):
            return category
    return OTHER


def traced_spans(fn: Callable[[], Any], warmup: int = 0, label: str | None = None) -> list[dict[str, Any]]:
    """The complete events (``ph`` "X", with ``ts`` and ``dur`` in µs) of one call of ``fn`` under
    ``torch.profiler`` (CPU and CUDA activity), as its Chrome trace lists them: host ops, CUDA API calls, kernels,
    copies. ``warmup`` untimed calls first; ``label`` wraps the call in a ``record_function`` of that name."""
    import json
    import tempfile
    from contextlib import nullcontext
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(label) if label else nullcontext():
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def profile_kernels(fn: Callable[[], Any], calls: int = 20, top: int = 12) -> dict[str, Any]:
    """Run ``fn`` ``calls`` times under ``torch.profiler`` (CUDA activity) and sum its kernels per call.

    Returns kernels and GPU µs per call, µs per category, and the ``top`` kernels by time (name, category, launches
    and µs per call). GPU µs is the sum of kernel durations: gaps between kernels are not in it. ``idle_us_per_call``
    is the time between the first kernel's start and the last one's end in which no kernel ran (the union of the
    kernels' intervals taken from that span), per call: the boundaries inside ``fn`` and between calls, read from the
    kernels' own timestamps, so at the clock they ran at.
    """
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us: dict[str, float] = defaultdict(float)
    launches: Counter[str] = Counter()
    intervals = []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us[event.name] += event.time_range.elapsed_us()
        launches[event.name] += 1
        intervals.append((event.time_range.start, event.time_range.end))
    by_category: dict[str, float] = defaultdict(float)
    for name, t in us.items():
        by_category[categorise(name)] += t / calls
    ranked = sorted(us, key=lambda n: -us[n])[:top]
    return {
        "calls": calls,
        "kernels_per_call": sum(launches.values()) / calls,
        "gpu_us_per_call": sum(us.values()) / calls,
        "idle_us_per_call": idle_us(intervals) / calls,
        "by_category_us": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top": [{"name": n[:120], "category": categorise(n), "launches_per_call": launches[n] / calls,
                 "us_per_call": us[n] / calls} for n in ranked],
    }


def idle_us(intervals: list[tuple[float, float]]) -> float:
    """µs between the earliest start and the latest end of ``intervals`` (start, end) covered by none of them."""
    idle, last_end = 0.0, None
    for start, end in sorted(intervals):
        if last_end is not None and start > last_end:
            idle += start - last_end
        last_end = end if last_end is None else max(last_end, end)
    return idle


def graph_time_us(fn: Callable[[], Any], repeats: int = 20, runs: int = 10) -> float:
    """µs per call of ``fn`` on the GPU: ``repeats`` calls captured in one CUDA graph, replayed ``runs`` times
    between CUDA events (median). No launch gaps and no host work: the kernels' own time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / repeats)
    return statistics.median(times)


def roofline_us(flops: float, nbytes: float, tflops: float, gbps: float) -> float:
    """The least time an op can take: its FLOPs at the matmul rate or its bytes at the copy bandwidth, the larger.

    ``gbps`` is :func:`glmvit.floor.measure_copy_bandwidth`'s (bytes read + written per second), so bytes moved
    once each way count once.
    """
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e6


def encoder_gemms(config: VisionConfig, rows: int) -> list[tuple[str, int, int, int, int]]:
    """Every matmul of one forward over ``rows`` patch rows: (name, M, K, N, how many), as the model runs them."""
    c = config
    tokens = rows // c.merge_area
    h, f, i = c.hidden_size, c.out_hidden_size, c.intermediate_size
    return [
        ("patch_embed", rows, c.patch_dim, h, 1),
        ("qkv", rows, h, 3 * h, c.depth),
        ("proj", rows, h, h, c.depth),
        ("gate_up", rows, h, 2 * f, c.depth),
        ("down", rows, f, h, c.depth),
        ("downsample", tokens, c.merge_area * h, f, 1),
        ("merger.proj", tokens, f, f, 1),
        ("merger.gate_up", tokens, f, 2 * i, 1),
        ("merger.down", tokens, i, f, 1),
    ]
