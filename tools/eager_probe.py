"""Why does one eager forward's time swing between records? A diagnostic for the eager baseline every ratio divides by.

The same eager forward of one 224² image (full GLM-4.1V tower, bf16) was timed at medians of 16 and 28 ms minutes
apart in one record process, with the host's cost of one kernel launch measured beside each at 10 µs. This probe
times that forward in alternating blocks under five conditions, in one process:

- ``quiet``: as ``bench`` times it (:func:`glmvit.timing.quiet_host`: collector off, the CPU left to the scheduler);
- ``free``: as ``quiet`` with the collector on;
- ``pinned_quietest``: as ``quiet``, the thread pinned all block long to the CPU that runs a short loop fastest at
  its start (:func:`quietest_cpu`);
- ``pinned0``: as ``quiet``, the thread pinned to the first CPU it may use, all block long;
- ``after_sleep``: as ``quiet``, each request after a 20 ms sleep (a GPU and CPU left idle between requests).

Per request it records the wall time (synchronised), the host's share of it (until the forward returns, before the
wait), the thread's CPU time and involuntary context switches, the CPU it ended on, the host's speed just after
(a fixed pure-Python loop's ms on that CPU), the ms of host work that touches memory as the forward's Python does
(:func:`host_ms`: the request's metadata built 20 times and a 20,000-entry dict filled; no GPU in it), the thread's
minor page faults, the host's steal time and the GPU's SM clock (``torch.cuda.clock_rate``, where pynvml answers);
per block, the launch cost (:func:`glmvit.timing.launch_us`).
It prints medians per condition and per CPU, and the correlation of wall time with the host work and the SM clock,
so that a swing shows its cause: a CPU (per-CPU medians apart), the GPU's clock (correlated), the host as a whole
(the host work, which runs no GPU code, slows with the forward), or page faults.

    python tools/eager_probe.py --device cuda --blocks 8 --requests 40 --json /tmp/eager_probe.json
    python tools/eager_probe.py --device cpu --config tiny --blocks 2 --requests 3     # a dry run of the code
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from contextlib import nullcontext
from typing import Any, Sequence

import numpy as np
import torch

from glmvit.cli.common import vision_config
from glmvit.random_weights import random_encoder
from glmvit.timing import launch_us, quiet_host, sync
from glmvit.workloads import random_batch

CONDITIONS = ("quiet", "free", "pinned_quietest", "pinned0", "after_sleep")


def spin_ms(iterations: int = 20_000) -> float:
    """A fixed pure-Python loop, in ms: how fast this CPU runs this thread now."""
    start = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    return (time.perf_counter() - start) * 1e3


def quietest_cpu(cpus: Sequence[int], rounds: int = 3, iterations: int = 20_000) -> int:
    """The CPU of ``cpus`` on which a short pure-Python loop (``iterations`` additions) runs fastest now: the median
    of ``rounds`` loops per CPU, taken round-robin (so a burst of load on one CPU does not land on one CPU's loops
    only), ties to the later CPU.

    The ``pinned_quietest`` condition's choice (what :func:`glmvit.timing.quiet_host` once did before every timed
    loop). The thread's own CPUs are restored before it returns."""
    cpus = sorted(cpus)
    if len(cpus) == 1:
        return cpus[0]
    loops: dict[int, list[float]] = {cpu: [] for cpu in cpus}
    allowed = os.sched_getaffinity(0)
    try:
        for _ in range(rounds):
            for cpu in cpus:
                os.sched_setaffinity(0, {cpu})
                loops[cpu].append(spin_ms(iterations))
    finally:
        os.sched_setaffinity(0, allowed)
    return min(reversed(cpus), key=lambda cpu: float(np.median(loops[cpu])))


def host_ms(grid) -> float:
    """Host work with no GPU in it, in ms: ``grid``'s metadata built 20 times (the forward's own host code) and a
    20,000-entry dict of tuples filled (allocation and pointer chasing). When it slows in step with the forward, the
    host's CPU is what changed speed, not the GPU, the driver or the launch path."""
    from glmvit.metadata import build_metadata

    start = time.perf_counter()
    for _ in range(20):
        build_metadata(grid)
    table = {}
    for i in range(20_000):
        table[i] = (i, str(i))
    return (time.perf_counter() - start) * 1e3


def current_cpu() -> int:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat); -1 where Linux does not say."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def sm_clock(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - pynvml missing or refusing: no clock, the rest still measured
        return None


def steal_ticks() -> int:
    """The host's steal time so far (``/proc/stat``'s eighth cpu field, in clock ticks); -1 where Linux does not say."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, ValueError, IndexError):
        return -1


def block(condition: str, forward, device: torch.device, requests: int, cpus: set[int], grid) -> list[dict[str, Any]]:
    """``requests`` timed forwards under ``condition`` (each followed by :func:`host_ms` of ``grid``); the thread's
    CPUs restored after."""
    rows = []
    context = nullcontext() if condition == "free" else quiet_host()
    try:
        if condition == "pinned0":
            os.sched_setaffinity(0, {min(cpus)})
        elif condition == "pinned_quietest":
            os.sched_setaffinity(0, {quietest_cpu(sorted(cpus), rounds=1, iterations=10_000)})
        with context:
            launch = launch_us(device)
            for _ in range(requests):
                if condition == "after_sleep":
                    time.sleep(0.02)
                sync(device)
                usage0 = resource.getrusage(resource.RUSAGE_THREAD)
                steal0 = steal_ticks()
                c0, t0 = time.thread_time(), time.perf_counter()
                forward()
                t_issue = time.perf_counter()
                sync(device)
                t1 = time.perf_counter()
                usage1 = resource.getrusage(resource.RUSAGE_THREAD)
                rows.append({"condition": condition, "wall_ms": (t1 - t0) * 1e3, "issue_ms": (t_issue - t0) * 1e3,
                             "cpu_ms": (time.thread_time() - c0) * 1e3, "cpu": current_cpu(),
                             "preempted": usage1.ru_nivcsw - usage0.ru_nivcsw,
                             "minor_faults": usage1.ru_minflt - usage0.ru_minflt, "host_ms": host_ms(grid),
                             "steal_ticks": steal_ticks() - steal0, "spin_ms": spin_ms(5_000),
                             "sm_mhz": sm_clock(device), "launch_us": launch})
    finally:
        os.sched_setaffinity(0, cpus)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    wall = np.array([r["wall_ms"] for r in rows])
    out: dict[str, Any] = {"by_condition": {}, "by_cpu": {}}
    for c in CONDITIONS:
        w = [r["wall_ms"] for r in rows if r["condition"] == c]
        if w:
            launches = [r["launch_us"] for r in rows if r["condition"] == c and r["launch_us"] is not None]
            sel = [r for r in rows if r["condition"] == c]
            out["by_condition"][c] = {"median_ms": float(np.median(w)), "min_ms": float(np.min(w)),
                                      "issue_median_ms": float(np.median([r["issue_ms"] for r in sel])),
                                      "spin_median_ms": float(np.median([r["spin_ms"] for r in sel])),
                                      "host_median_ms": float(np.median([r["host_ms"] for r in sel])),
                                      "minor_faults": int(sum(r["minor_faults"] for r in sel)),
                                      "preempted": int(sum(r["preempted"] for r in sel)),
                                      "steal_ticks": int(sum(r["steal_ticks"] for r in sel)),
                                      "p90_ms": float(np.percentile(w, 90)), "requests": len(w),
                                      "launch_us_median": float(np.median(launches)) if launches else None}
    for cpu in sorted({r["cpu"] for r in rows}):
        w = [r["wall_ms"] for r in rows if r["cpu"] == cpu]
        out["by_cpu"][str(cpu)] = {"median_ms": float(np.median(w)), "requests": len(w)}
    spin = np.array([r["spin_ms"] for r in rows])
    if spin.std() > 0:
        out["corr_wall_spin"] = float(np.corrcoef(wall, spin)[0, 1])  # near 1: the host's speed is the swing
        out["corr_wall_issue"] = float(np.corrcoef(wall, [r["issue_ms"] for r in rows])[0, 1])
    host = np.array([r["host_ms"] for r in rows])
    if host.std() > 0 and wall.std() > 0:
        out["corr_wall_host"] = float(np.corrcoef(wall, host)[0, 1])  # well above 0: the host's CPU is the swing
    clocks = np.array([r["sm_mhz"] if r["sm_mhz"] is not None else np.nan for r in rows], dtype=float)
    if np.isfinite(clocks).all() and clocks.std() > 0:
        out["corr_wall_sm_clock"] = float(np.corrcoef(wall, clocks)[0, 1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="full", choices=("full", "tiny"))
    parser.add_argument("--blocks", type=int, default=8, help="rounds of the five conditions")
    parser.add_argument("--requests", type=int, default=40, help="forwards per block")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = vision_config(args.config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_encoder(config, device, dtype)
    pixels, grid = random_batch([[1, 16, 16]], config, seed=0)
    pixels = pixels.to(device, dtype)
    cpus = set(os.sched_getaffinity(0))
    rows: list[dict[str, Any]] = []
    with torch.inference_mode():
        for _ in range(5):
            model(pixels, grid)
        for _ in range(args.blocks):
            for condition in CONDITIONS:
                rows += block(condition, lambda: model(pixels, grid), device, args.requests, cpus, grid)
    from glmvit.provenance import collect

    result = {"provenance": collect(device, " ".join(["python", *sys.argv])), "summary": summary(rows), "rows": rows,
              "settings": {"device": str(device), "config": args.config, "blocks": args.blocks,
                           "requests": args.requests, "cpus": sorted(cpus)}}
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
