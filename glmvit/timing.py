"""One way to time things: wall-clock per call between device synchronisations, and one summary format (with the
median's 95 % interval), taken on a quiet host (:func:`quiet_host`)."""
from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device | str, runs: int, warmup: int = 0,
               on_device: bool = False) -> list[float]:
    """Milliseconds of each of ``runs`` calls after ``warmup`` untimed ones.

    Default: wall time per call between two synchronisations (what a caller waiting for the result sees, host
    work included). ``on_device=True`` on CUDA: back-to-back calls bracketed by CUDA events (the GPU's time only,
    launch gaps included, host work overlapped) — for kernels and for the floor's matmul and copy.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    if on_device and device.type == "cuda":
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
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def summarise(ms: Sequence[float]) -> dict[str, Any]:
    """mean, median, std, P99, min and max of a list of milliseconds, and the median's 95 % interval
    (:func:`median_ci95`, a [low, high] pair): keys end in ``_ms``."""
    a = np.asarray(ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("nothing to summarise: no timings")
    lo, hi = median_ci95(a)
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "std_ms": float(a.std()),
            "p99_ms": float(np.percentile(a, 99)), "min_ms": float(a.min()), "max_ms": float(a.max()),
            "median_ci95_ms": [lo, hi]}


Z95 = 1.959963984540054  # the normal quantile of a two-sided 95 % interval


def median_ci95(ms: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """A distribution-free 95 % interval of the median of ``ms``: the order statistics at ranks
    n/2 ∓ 1.96·√n/2 (the normal approximation of the binomial), clamped to the sample. Any distribution, no
    resampling; up to ten values it reaches the sample's largest (up to seven, its whole range)."""
    a = np.sort(np.asarray(ms, dtype=np.float64))
    n = a.size
    if n == 0:
        raise ValueError("nothing to summarise: no timings")
    half = Z95 * np.sqrt(n) / 2
    lo, hi = int(np.floor(n / 2 - half)), int(np.ceil(n / 2 + half))
    return float(a[max(lo, 0)]), float(a[min(hi, n - 1)])


def relative_halfwidth(ms: Sequence[float] | np.ndarray) -> float:
    """Half the width of :func:`median_ci95` over the median: 0.02 means the median is known to ±2 %."""
    lo, hi = median_ci95(ms)
    return (hi - lo) / 2 / float(np.median(np.asarray(ms, dtype=np.float64)))


@contextmanager
def quiet_host() -> Iterator[None]:
    """Timed loops run here: Python's cycle collector off (collected once first, so no pause lands inside a
    request), and this thread pinned to one CPU it may already run on (no migration mid-request; a no-op where the
    kernel does not honour affinity). Both are restored on exit."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    pinned = None
    if hasattr(os, "sched_getaffinity"):
        try:
            pinned = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {min(pinned)})
        except OSError:
            pinned = None
    try:
        yield
    finally:
        if pinned is not None:
            os.sched_setaffinity(0, pinned)
        if enabled:
            gc.enable()


def launch_us(device: torch.device | str, launches: int = 2000) -> float | None:
    """The host's cost of one kernel launch here and now, in µs: ``launches`` tiny in-place adds queued back to
    back (the GPU finishes each long before the next is queued, so the host is what is timed). None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(launches):
        x.add_(1)
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize(device)
    return elapsed / launches * 1e6
