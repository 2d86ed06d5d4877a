"""Are the gaps inside a graph replay real? A diagnostic for the kernels record's ``gaps_us_per_call``.

``python -m glmvit kernels`` splits a replay's device time into busy time and gaps by subtracting two measurements
taken apart: the graph replayed back to back between CUDA events (no profiler), and the sum of its kernels'
durations under ``torch.profiler`` (a few replays, later). At eight 448² images, compiled, that leaves about 2 ms
per replay of "gaps" — 5–6 µs per kernel boundary where the uncompiled graph shows about 1.3. Either the GPU
really waits between kernels, or the two measurements ran at different clocks (a long run of back-to-back GEMMs
under the power cap against a few profiled replays). This probe tells them apart, in one process, per layout:

1. ``timed``: the captured graph replayed back to back, each replay between CUDA events, the SM clock and the
   board's power read on the host while the GPU works (``torch.cuda.clock_rate`` / ``power_draw``, where pynvml
   answers);
2. ``profiled`` (last: no timing after a profiler attaches): a few replays under ``torch.profiler``; from the
   kernels' own timestamps, each replay's span (first kernel's start to last kernel's end), its busy time, and the
   idle time between consecutive kernels inside it, with the largest idle intervals and the kernels around them.

Real gaps: ``profiled`` span − busy is large. A clock effect: the span is close to the busy time, and ``timed``
replays run longer than the span at a lower SM clock. CUDA only (exit 2 elsewhere)::

    python tools/gap_probe.py --layouts 8x448,1x224 --replays 60 --json /tmp/gap_probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
from statistics import median
from typing import Any, Callable

import numpy as np
import torch

LAYOUTS = {"1x224": [[1, 16, 16]], "4x224": [[1, 16, 16]] * 4, "8x448": [[1, 32, 32]] * 8}
PROFILED_REPLAYS = 3
LARGEST = 8  # idle intervals listed per layout


def _read(fn: Callable[[], float]) -> float | None:
    try:
        return float(fn())
    except Exception:  # noqa: BLE001 - pynvml missing or refusing: no reading, the rest still measured
        return None


def timed(replay: Callable[[], Any], replays: int) -> dict[str, Any]:
    """Back-to-back replays, each between CUDA events; clock and power read on the host after each is enqueued."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    clocks, power = [], []
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    for start, end in zip(starts, ends, strict=True):
        start.record()
        replay()
        end.record()
        clocks.append(_read(torch.cuda.clock_rate))
        power.append(_read(lambda: torch.cuda.power_draw() / 1e3))
    torch.cuda.synchronize()
    return {"device_ms": [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], "sm_mhz": clocks,
            "power_w": power}


def idle_intervals(replay: list[tuple[float, float, str]]) -> list[dict[str, Any]]:
    """Idle time between consecutive kernels of one replay (none where they overlap), in µs, with their names."""
    out, last_end, last_name = [], replay[0][1], replay[0][2]
    for start, end, name in replay[1:]:
        if start > last_end:
            out.append({"us": start - last_end, "before": last_name[:80], "after": name[:80]})
        if end >= last_end:
            last_end, last_name = end, name
    return out


def summarise_replays(replays: list[list[tuple[float, float, str]]]) -> dict[str, Any]:
    """Span, busy time and idle time per replay (µs; each replay's kernels sorted by start), and the largest idle
    intervals over all of them."""
    spans = [max(end for _, end, _ in r) - r[0][0] for r in replays]
    busy = [sum(end - start for start, end, _ in r) for r in replays]
    idles = [idle_intervals(r) for r in replays]
    largest = sorted((i for per in idles for i in per), key=lambda i: -i["us"])[:LARGEST]
    return {"kernels_per_replay": len(replays[0]), "span_us": spans, "busy_us": busy,
            "idle_us": [sum(i["us"] for i in per) for per in idles], "largest_idle": largest}


def profiled(replay: Callable[[], Any], replays: int) -> dict[str, Any]:
    """``replays`` replays, each in a profiler session of its own (so no replay's kernels need telling apart)."""
    from torch.profiler import ProfilerActivity, profile

    per_replay, clocks = [], []
    for _ in range(replays):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay()
            clocks.append(_read(torch.cuda.clock_rate))  # read while the replay runs, as timed() does
            torch.cuda.synchronize()
        per_replay.append(sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                                 if e.device_type == torch.autograd.DeviceType.CUDA))
    return {**summarise_replays(per_replay), "sm_mhz": clocks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layouts", default="8x448,1x224", help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--replays", type=int, default=60, help="timed replays per layout")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--json", default=None, help="write every number, with provenance, here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gap_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    names = args.layouts.split(",")
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout {unknown[0]!r}; choose from {', '.join(LAYOUTS)}")

    from glmvit.config import VisionConfig
    from glmvit.encoder import build_encoder
    from glmvit.geometry import ItemSpec, grid_specs
    from glmvit.graphs import EncoderGraphRunner
    from glmvit.modes import RunMode
    from glmvit.packing import BudgetConfig
    from glmvit.random_weights import random_encoder
    from glmvit.uniform import planned_uniform_lengths
    from glmvit.workloads import random_batch

    config = VisionConfig.glm41v()
    model = random_encoder(config, "cuda", torch.bfloat16)
    tokens = {n: ItemSpec.total(grid_specs(LAYOUTS[n], config.spatial_merge_size)).tokens for n in names}
    items = max(len(LAYOUTS[n]) for n in names)
    budgets = BudgetConfig(tuple(sorted(set(tokens.values()))), min(items, min(tokens.values())), max(items, 8))
    # the graphs bench replays each layout in: a uniform one where its rule captures one for that layout alone
    attention = None if args.attention == "auto" else args.attention
    lengths = sorted({length for n in names for length in planned_uniform_lengths(
        ((h * w, t) for t, h, w in LAYOUTS[n]), "cuda", "bfloat16", attention)})
    runner = build_encoder(model, RunMode.GRAPH_COMPILED, budgets, attention=args.attention,
                           uniform_lengths=tuple(lengths))
    assert isinstance(runner, EncoderGraphRunner)  # on CUDA: real graphs
    graphs: dict[str, Callable[[], Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    with torch.inference_mode():
        for n in names:
            pixels, grid = random_batch(LAYOUTS[n], config, seed=1)
            dense = runner.uniform_graph(tokens[n], np.asarray(grid))  # the runner's own rule, as skeleton_bound asks
            runner.replay(tokens[n], pixels.to("cuda", model.dtype), grid, uniform=dense is not None)  # stages it there
            graph = (dense or runner.graphs[tokens[n]]).graph
            assert graph is not None
            graphs[n] = graph.replay
            results[n] = {"graph": "ragged" if dense is None else f"uniform {dense.shape.max_seqlen}-row segments"}
        for n in names:  # every timing before the first profiler attaches
            results[n]["timed"] = timed(graphs[n], args.replays)
        for n in names:
            results[n]["profiled"] = profiled(graphs[n], PROFILED_REPLAYS)
    for n, r in results.items():
        t, p = r["timed"], r["profiled"]
        clocks = [c for c in t["sm_mhz"] if c is not None]
        pclocks = [c for c in p["sm_mhz"] if c is not None]
        print(f"{n} ({r['graph']}): timed {median(t['device_ms']):.3f} ms per replay (median of "
              f"{len(t['device_ms'])}), SM clock "
              f"{min(clocks, default=float('nan')):.0f}–{max(clocks, default=float('nan')):.0f} MHz; profiled span "
              f"{median(p['span_us']) / 1e3:.3f} ms = busy {median(p['busy_us']) / 1e3:.3f} + idle "
              f"{median(p['idle_us']) / 1e3:.3f} ms over {p['kernels_per_replay']} kernels (medians of "
              f"{len(p['span_us'])}), profiled at {min(pclocks, default=float('nan')):.0f}–"
              f"{max(pclocks, default=float('nan')):.0f} MHz")
        for gap in p["largest_idle"][:3]:
            print(f"    idle {gap['us']:.1f} µs between {gap['before']} and {gap['after']}")
    if args.json:
        from glmvit.provenance import collect

        with open(args.json, "w") as f:
            json.dump({"provenance": collect("cuda"), "layouts": results, "attention": args.attention}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
