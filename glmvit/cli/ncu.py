"""``python -m glmvit ncu``: what holds each kernel of a graph replay where it is, from Nsight Compute's counters.

``glmvit kernels`` says how long each kernel takes against its roofline; this says why. The command runs itself
under ``ncu`` (Nsight Compute, in the CUDA toolkit) once per layout: the child builds the encoder at random weights
(bf16, triton attention, compiled in regions: the default graph-compiled path), captures the layout's budget,
stages the layout's inputs with one ``runner.replay``, replays the graph three times more, and profiles the next
replay of the graph alone (between ``cudaProfilerStart`` and ``cudaProfilerStop``, so nothing of the compile, the
capture or the staging is counted). Each kernel node of the graph is then one row of counters, and
:func:`limiter` names what the counters point to:

- ``dram``: DRAM throughput ≥ 60 % of peak; ``tensor``: the tensor pipe busy ≥ 60 % of the time; ``issue``: the
  SMs issuing an instruction in ≥ 60 % of cycles; the busiest of them where two are over the line. 60 % is the line
  Nsight Compute's Speed Of Light rule draws for compute and memory throughput (below it "typically latency
  issues"), applied here to the three units these kernels can saturate;
- ``parallelism``: none of these, and fewer thread blocks than SMs, so some SMs have nothing to run and each of
  the others holds one block;
- ``latency``: none of these with enough blocks; the warps wait, and the stall reasons say on what;
- ``unknown``: ncu could not read a counter these rules need (``n/a``).

Launches of one kernel at one launch shape (name, grid, block, registers, waves) are summarised as one group.

Under ncu every kernel runs alone, once per counter pass, with the caches flushed before each pass, at the GPU's own
clocks (``--clock-control none``): its durations are not the replay's (``glmvit kernels`` records those), but the
fractions of peak are each kernel's own. CUDA and ncu only::

    python -m glmvit ncu --json data/bench/ncu.json
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Any

import torch
from tqdm.auto import tqdm

from ..profiling import categorise
from ..provenance import collect
from ..records import NcuProfile, make
from .common import Parser, check_writable, output_path, vision_config, write_record

LAYOUTS = {"1x224": [[1, 16, 16]], "8x448": [[1, 32, 32]] * 8}
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis")
HIGH = 60.0  # % of peak: Nsight Compute's Speed Of Light line between "throughput-bound" and "latency issues"
METRICS = {  # our name: Nsight Compute's raw metric (``--page raw``)
    "duration_us": "gpu__time_duration.sum",  # in the unit of the CSV's units row, converted
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "issue_pct": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "grid": "launch__grid_size",
    "block": "launch__block_size",
    "registers": "launch__registers_per_thread",
    "waves": "launch__waves_per_multiprocessor",
}
LAUNCH_SHAPE = ("grid", "block", "registers", "waves")  # one compiled kernel at one launch: equal in a group
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}  # ncu's time units
SMS = "device__attribute_multiprocessor_count"
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")  # warps stalled per issued instruction
NOT_STALLS = ("selected", "not_selected")  # issuing, or eligible while another warp issued: not waiting


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() not in ("", "n/a") else float("nan")


def parse_raw_csv(text: str) -> list[dict[str, Any]]:
    """Nsight Compute's ``--csv --page raw`` output: one dict per kernel with :data:`METRICS`, the SM count,
    every stall reason (warps stalled per issued instruction) and the kernel's name, in launch order."""
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("==")]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    if len(table) < 3:  # a header, a row of units, then one row per kernel
        raise ValueError("ncu wrote no kernel rows: was a kernel launched between cudaProfilerStart and Stop?")
    header, units, rows = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(header)}
    missing = [m for m in (*METRICS.values(), SMS, "Kernel Name") if m not in col]
    if missing:
        raise ValueError(f"ncu's CSV lacks {missing}: collect the sections {', '.join(SECTIONS)}")
    unit = units[col[METRICS["duration_us"]]]
    if unit not in TO_US:
        raise ValueError(f"ncu's CSV gives {METRICS['duration_us']} in {unit!r}, not one of {sorted(TO_US)}")
    stalls = {name[len(STALL[0]):-len(STALL[1])]: i for name, i in col.items()
              if name.startswith(STALL[0]) and name.endswith(STALL[1])}
    kernels = []
    for row in rows:
        kernel: dict[str, Any] = {"name": row[col["Kernel Name"]], "sms": int(_number(row[col[SMS]]))}
        kernel.update({ours: _number(row[col[theirs]]) for ours, theirs in METRICS.items()})
        if math.isnan(kernel["duration_us"]):
            raise ValueError(f"ncu gave kernel {kernel['name']!r} no duration: its counters cannot be weighted")
        kernel["duration_us"] *= TO_US[unit]
        kernel["stalls"] = {reason: _number(row[i]) for reason, i in stalls.items() if reason not in NOT_STALLS}
        kernels.append(kernel)
    return kernels


def limiter(kernel: dict[str, Any]) -> str:
    """What a kernel's counters point to (module docstring): dram, tensor, issue (the busiest of those at or over
    :data:`HIGH`), parallelism or latency; ``unknown`` where ncu could not read a counter the rule needs."""
    units = {"dram": kernel["dram_pct"], "tensor": kernel["tensor_pct"], "issue": kernel["issue_pct"]}
    if any(not _known(v) for v in (*units.values(), kernel["grid"], kernel["sms"])):
        return "unknown"
    busiest = max(units, key=lambda name: units[name])
    if units[busiest] >= HIGH:
        return busiest
    return "parallelism" if kernel["grid"] < kernel["sms"] else "latency"


def _known(value: Any) -> bool:
    """A counter ncu measured: not n/a (NaN when parsed, null once written to JSON)."""
    return value is not None and not math.isnan(value)


def top_stalls(stalls: dict[str, float], count: int = 2) -> list[str]:
    """The ``count`` reasons most warps wait on, most first."""
    return sorted(stalls, key=lambda reason: -stalls[reason])[:count]


def summarise_kernels(kernels: list[dict[str, Any]]) -> dict[str, Any]:
    """Launches of one kernel at one launch shape grouped (same name, grid, block, registers and waves: µs summed,
    counters weighted by time, the limiter taken on the group's counters), and GPU µs by category (as ``glmvit
    kernels`` names them) and by limiter. One cuBLAS kernel serving the qkv and the down projection is two groups:
    two grids."""
    by_launch: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for kernel in kernels:
        shape = tuple(kernel[m] if _known(kernel[m]) else None for m in LAUNCH_SHAPE)  # NaN != NaN splits groups
        by_launch[(kernel["name"],) + shape].append(kernel)
    groups = []
    for (name, *_), same in by_launch.items():
        total = sum(k["duration_us"] for k in same)
        group: dict[str, Any] = {"name": name, "category": categorise(name), "launches": len(same), "us": total,
                                 **{m: same[0][m] for m in LAUNCH_SHAPE}}  # the launches' own values, not a mean
        for metric in METRICS:
            if metric not in ("duration_us", *LAUNCH_SHAPE):
                group[metric] = sum(k[metric] * k["duration_us"] for k in same) / total
        group["sms"] = same[0]["sms"]
        stalls = {r: sum(k["stalls"][r] * k["duration_us"] for k in same) / total for r in same[0]["stalls"]}
        group["stalls"] = {r: stalls[r] for r in top_stalls(stalls, 4)}
        group["limiter"] = limiter(group)
        groups.append(group)
    groups.sort(key=lambda g: -g["us"])
    by_category: dict[str, float] = defaultdict(float)
    by_limiter: dict[str, float] = defaultdict(float)
    for group in groups:
        by_category[group["category"]] += group["us"]
        by_limiter[group["limiter"]] += group["us"]
    return {"kernels": len(kernels), "gpu_us": sum(k["duration_us"] for k in kernels), "groups": groups,
            "by_category_us": dict(by_category), "by_limiter_us": dict(by_limiter)}


def profile_target(layout: str) -> None:
    """The child ncu runs: one graph-compiled replay of ``layout`` between cudaProfilerStart and Stop."""
    from ..encoder import build_encoder
    from ..graphs import EncoderGraphRunner
    from ..modes import RunMode
    from ..packing import BudgetConfig
    from ..random_weights import random_encoder
    from ..workloads import random_batch

    config = vision_config("full")
    grids = LAYOUTS[layout]
    tokens = sum(t * h * w for t, h, w in grids) // config.merge_area
    model = random_encoder(config, "cuda", torch.bfloat16)
    runner = build_encoder(model, RunMode.GRAPH_COMPILED, BudgetConfig((tokens,), len(grids), len(grids)),
                           attention="triton")
    assert isinstance(runner, EncoderGraphRunner)
    pixels, grid = random_batch(grids, config, seed=1)
    graph = runner.graphs[tokens].graph
    assert graph is not None  # mode "cuda": every budget has its graph
    with torch.inference_mode():
        runner.replay(tokens, pixels.to("cuda", model.dtype), grid)  # stages this layout's inputs
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        graph.replay()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def run_ncu(ncu: str, layout: str) -> str:
    """The raw CSV of one child run under ncu (module docstring)."""
    sections = [arg for name in SECTIONS for arg in ("--section", name)]
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "raw.csv")
        command = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--target-processes",
                   "application-only", "--csv", "--page", "raw", *sections, "--log-file", log,
                   sys.executable, "-m", "glmvit", "ncu", "--target", layout]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise OSError(f"ncu on layout {layout} exited with {done.returncode}: {tail[0]}")
        with open(log) as f:
            return f.read()


def print_report(result: dict[str, Any]) -> None:
    for layout, entry in result["layouts"].items():
        limiters = ", ".join(f"{k} {v:.0f}" for k, v in sorted(entry["by_limiter_us"].items(), key=lambda t: -t[1]))
        print(f"\n{layout}: {entry['kernels']} kernels, {entry['gpu_us']:.0f} µs under ncu — by limiter (µs): "
              f"{limiters}")
        for g in entry["groups"][:10]:
            stalls = ", ".join(f"{r} {v:.1f}" for r, v in list(g["stalls"].items())[:2])
            print(f"  {g['us']:8.1f} µs {g['launches']:3d}× {g['name'][:44]:44s} {g['limiter']:>11s}: "
                  f"dram {g['dram_pct']:4.0f}%, tensor {g['tensor_pct']:4.0f}%, issue {g['issue_pct']:4.0f}%, "
                  f"grid {g['grid']:.0f}, {g['cycles_per_issue']:.1f} cycles/issue ({stalls})")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(prog="python -m glmvit ncu", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write every kernel's counters, with provenance, here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--target", metavar="LAYOUT", help=argparse.SUPPRESS)  # the child ncu runs
    args = parser.parse_args(argv)
    if args.target is not None:
        if args.target not in LAYOUTS:
            parser.error(f"unknown layout {args.target!r}; layouts: {list(LAYOUTS)}")
        profile_target(args.target)
        return 0
    layouts = [name.strip() for name in args.layouts.split(",")]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown}; layouts: {list(LAYOUTS)}")
    if not torch.cuda.is_available():
        parser.error("ncu profiles CUDA kernels: this machine has no CUDA device")
    ncu = shutil.which("ncu")
    if ncu is None:
        parser.error("ncu (Nsight Compute, in the CUDA toolkit's bin/) is not on PATH")
    if args.json:
        check_writable(args.json)
    version = subprocess.run([ncu, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    result: dict[str, Any] = {"ncu": version[0] if version else "", "sections": list(SECTIONS), "layouts": {}}
    for layout in tqdm(layouts, desc="ncu", disable=args.quiet):
        kernels = parse_raw_csv(run_ncu(ncu, layout))
        result["layouts"][layout] = {"grids": LAYOUTS[layout], **summarise_kernels(kernels)}
    print_report(result)
    if args.json:
        command = " ".join([sys.executable, "-m", "glmvit", "ncu", *argv])
        write_record(args.json, make(NcuProfile, provenance=collect(torch.device("cuda"), command), **result))
    return 0

