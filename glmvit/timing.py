"""How glmvit times things, and the two summaries it records.

Timing: wall-clock ms per call between device synchronisations (:func:`time_calls`, which can also bracket calls
with CUDA events for the GPU's time alone; :func:`time_until_steady` for calls that vary little; :func:`time_passes`
for a request: passes until the median is known to ±:data:`PRECISION`; :func:`time_to_precision` for one call,
runs until its median is known to a given precision), on a quiet host (:func:`quiet_host`).
Summaries: :func:`summarise` for a timed loop (keys ``*_ms``, with the median's 95 % interval,
:func:`median_ci95`), and :func:`distribution` for what a server observes (queue delays, batch sizes, latencies),
which may be empty."""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

# How a request is timed (bench's defaults; latency's eager forwards too, so that one forward timed by both agrees by
# method): WARMUP untimed calls, then passes over the requests while the median's 95 % interval is wider than
# ±PRECISION, at most MAX_PASSES passes.
WARMUP = 5
PRECISION = 0.02
MAX_PASSES = 3
# A pass after the first ends once the median is known to ±precision, checked every CHECK_EVERY calls between two
# calls (outside every clock): one check sorts the times so far, ~20 µs for 150 of them, so ≤ 0.2 ms over a pass
CHECK_EVERY = 10


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
    _warm(fn, device, warmup)
    if on_device and device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    return _wall_ms(fn, device, runs)


def time_until_steady(fn: Callable[[], Any], device: torch.device | str, max_runs: int, warmup: int = 0,
                      min_runs: int = 3, spread: float = 0.02) -> list[float]:
    """:func:`time_calls` (wall ms per call between synchronisations), stopping early: once ``min_runs`` runs are
    in and every run so far lies within ``spread`` of their median, (max − min) ≤ spread · median; at most
    ``max_runs`` runs. A GPU-bound call (a replay, a large eager forward) stops at ``min_runs``; a noisy one runs on."""
    if not 1 <= min_runs <= max_runs:
        raise ValueError(f"need 1 <= min_runs <= max_runs, got {min_runs} and {max_runs}")
    device = torch.device(device)
    _warm(fn, device, warmup)

    def steady(times: list[float]) -> bool:
        return len(times) >= min_runs and max(times) - min(times) <= spread * float(np.median(times))

    return _wall_ms(fn, device, max_runs, steady)


def time_passes(call: Callable[[int], Any], n: int, device: torch.device | str, precision: float = PRECISION,
                max_passes: int = MAX_PASSES, warmup: int = 0, pass_budget_s: float | None = None, min_calls: int = 1,
                after: Callable[[int, Any], None] | None = None,
                progress: Callable[[int, range], Iterable[int]] | None = None) -> tuple[list[float], list[float], int]:
    """Wall ms of each ``call(j)`` between synchronisations, and this thread's CPU ms in it (wall − CPU: waiting for
    the device, or not scheduled): ``warmup`` untimed calls first (j cycling over 0 … n−1), then a pass of j = 0 …
    n−1, and another while fewer than ``max_passes`` ran and the median's 95 % interval (:func:`median_ci95`) is
    wider than ±``precision``. The first pass times every call once; a later one stops as soon as the interval is
    within ±``precision`` (checked every :data:`CHECK_EVERY` of its calls, outside the clock), so the last pass may
    be partial: the wall ms stay in call order, the i-th of them is call ``i % n``. ``pass_budget_s``: a pass also
    ends once it has taken that long and the timing holds ``min_calls`` calls (a slow call's cost bounded, a fast
    one still gets its n). ``after(j, result)`` runs once a call's clock has stopped (to keep an output outside the
    timing); ``progress(pass, range)`` wraps each pass's range (a progress bar). Returns (wall ms, CPU ms, passes
    begun). Call it on a quiet host (:func:`quiet_host`)."""
    if n < 1 or max_passes < 1 or min_calls < 1:
        raise ValueError(f"need n, max_passes and min_calls >= 1, got {n}, {max_passes} and {min_calls}")
    device = torch.device(device)
    for i in range(warmup):
        call(i % n)
    sync(device)
    ms: list[float] = []
    cpu: list[float] = []
    passes = 0
    while passes == 0 or (passes < max_passes and relative_halfwidth(ms) > precision):
        passes += 1
        started = time.perf_counter()
        for j in progress(passes, range(n)) if progress is not None else range(n):
            c0, t0 = time.thread_time(), time.perf_counter()
            out = call(j)
            sync(device)
            t1 = time.perf_counter()
            ms.append((t1 - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
            if after is not None:
                after(j, out)
            if pass_budget_s is not None and len(ms) >= min_calls and t1 - started >= pass_budget_s:
                break
            if passes > 1 and (j + 1) % CHECK_EVERY == 0 and relative_halfwidth(ms) <= precision:
                break
    return ms, cpu, passes


def time_to_precision(fn: Callable[[], Any], device: torch.device | str, min_runs: int, max_runs: int,
                      precision: float, warmup: int = 0, on_device: bool = False,
                      step: int = CHECK_EVERY) -> list[float]:
    """:func:`time_calls` (``on_device`` as there) in rounds: ``warmup`` untimed calls and ``min_runs`` timed ones,
    then ``step`` more at a time while the median's 95 % interval (:func:`relative_halfwidth`) is wider than
    ±``precision``, at most ``max_runs`` in all. Calls within a round run back to back (CUDA events: no host wait
    between them); the interval is checked between rounds only."""
    if not 1 <= min_runs <= max_runs or step < 1:
        raise ValueError(f"need 1 <= min_runs <= max_runs and step >= 1, got {min_runs}, {max_runs} and {step}")
    ms = time_calls(fn, device, min_runs, warmup, on_device)
    while len(ms) < max_runs and relative_halfwidth(ms) > precision:
        ms += time_calls(fn, device, min(step, max_runs - len(ms)), 0, on_device)
    return ms


def _warm(fn: Callable[[], Any], device: torch.device, warmup: int) -> None:
    for _ in range(warmup):
        fn()
    sync(device)


def _wall_ms(fn: Callable[[], Any], device: torch.device, max_runs: int,
             stop: Callable[[list[float]], bool] | None = None) -> list[float]:
    """Wall ms of each call between synchronisations: ``max_runs`` calls, or fewer once ``stop(times)`` holds."""
    times: list[float] = []
    while len(times) < max_runs:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if stop is not None and stop(times):
            break
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


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, P99, min and max of ``values``; each None when there are none (a server that saw nothing)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "median": None, "p99": None, "min": None, "max": None}
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99)),
            "min": float(a.min()), "max": float(a.max())}


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
    request), restored on exit. Which CPU runs the thread is left to the kernel's scheduler: on
    the H200 machine (a 16-CPU KVM guest whose CPUs swing in speed within seconds, no steal time
    reported), pinning the thread to the CPU that ran a short loop fastest made one 224² image's eager forward slower
    than leaving it free (``data/sweeps/eager_probe_h200.json``, two rounds of 30-forward blocks alternating in one
    process, the collector off: medians 20.7 ms pinned to the fastest CPU, 16.7 ms to the first, 14.0 ms unpinned)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
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


STEADY_SHARE = (0.1, 0.9)  # the answers a steady rate counts: those between these quantiles of the answer times


def steady_rate(answers: Iterable[tuple[float, int]]) -> float | None:
    """Items per second of a run's successful ``answers`` (each: the time it came, s; its items) between the 10th and
    the 90th percentile of their times (:data:`STEADY_SHARE`): the items answered after the answer at the 10th
    percentile, up to the one at the 90th, over the time between those two. At rate inf every request is sent at
    once, so the whole run's rate also holds the pipeline's fill (nothing is answered until the first requests are
    read, decoded and encoded) and its drain (the last, smaller batches); this is the rate the server holds once
    full. None for fewer than 10 answers or a zero span."""
    done = sorted(answers)
    if len(done) < 10:
        return None
    lo, hi = (int(q * len(done)) for q in STEADY_SHARE)
    span = done[hi - 1][0] - done[lo][0]
    return sum(n for _, n in done[lo + 1 : hi]) / span if span > 0 else None
