"""One way to time things: wall-clock per call between device synchronisations, and one summary format."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

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


def summarise(ms: Sequence[float]) -> dict[str, float]:
    """mean, median, std, P99, min and max of a list of milliseconds (keys end in ``_ms``)."""
    a = np.asarray(ms, dtype=np.float64)
    if a.size == 0:
        raise ValueError("nothing to summarise: no timings")
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "std_ms": float(a.std()),
            "p99_ms": float(np.percentile(a, 99)), "min_ms": float(a.min()), "max_ms": float(a.max())}
