"""Host time of ``EncoderGraphRunner.run``: what one call costs the CPU before its one wait, per request.

For each workload (one 224² image, eight 224² images: grids [1, 16, 16]) it builds a runner over a budget config
sized for that workload as ``python -m glmvit bench`` sizes it (:meth:`BudgetConfig.for_requests`), warms it, then
calls ``run`` ``--calls`` times per repeat and reports per call, median over ``--repeats``:

- ``host_us``: ``runner.stats.host_s`` per call, the runner's own host time up to its last launch (planning,
  metadata staging, copies, launches, the per-item views): the README's "before its one wait";
- ``run_us``: the whole ``run`` call's wall time (with the finite check's read of the row sums).

``--profile`` adds cProfile's top functions by cumulative time over one more repeat.

On CPU (the default, and all that runs without a GPU) the runner emulates (``GraphMode.EMULATE``) with
``forward_static`` replaced by a no-op that returns a preallocated zero output of the budget's shape, so the
forward costs nothing and what is left is the host path; the tiny config keeps the real patch geometry (1176-wide
pixel rows, merge 2). Unlike on CUDA, the pixel copies, row sums and output clones then run synchronously on the
CPU and count in the host time (cProfile lists them apart: ``copy_``, ``sum``, ``clone``, ``index_select``);
``--narrow`` shrinks them by giving the tiny config 2×2 patches (24-wide pixel rows, the same grids and tokens), so
what remains is the Python and dispatch work that a CUDA host pays too, the copies being asynchronous launches there.

``--device cuda`` measures the real thing: the runner captures CUDA graphs (``--compile``: graph-compiled) and
``run`` replays them; nothing is stubbed, and ``host_us`` is then the launch-side host time the GPU record quotes.
Off CUDA that mode cannot run. ``--config glm41v`` uses the full tower's widths (CUDA only in practice).

    python tools/host_path.py                        # CPU, tiny config, 1 and 8 images
    python tools/host_path.py --profile --top 10     # with cProfile's top 10 (cumulative)
    python tools/host_path.py --narrow               # 24-wide pixel rows: the CPU's copies nearly free
    python tools/host_path.py --device cuda --config glm41v --compile --json /tmp/host.json
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import time
from typing import Any

import numpy as np
import torch

from glmvit.config import VisionConfig
from glmvit.geometry import item_spec
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import EncoderMetadata
from glmvit.model import GlmVisionEncoder
from glmvit.modes import GraphMode
from glmvit.packing import BudgetConfig
from glmvit.random_weights import randomize_

WORKLOADS = {"1x224": [[1, 16, 16]], "8x224": [[1, 16, 16]] * 8}


def build_runner(model: GlmVisionEncoder, grids: list[list[int]], compiled: bool) -> EncoderGraphRunner:
    """A captured runner for ``grids`` on the model's device; off CUDA, emulated with a no-op forward."""
    specs = [item_spec(*g, merge=model.config.spatial_merge_size) for g in grids]
    budgets = BudgetConfig.for_requests([specs])
    mode = GraphMode.for_device(model.device)
    runner = EncoderGraphRunner(model, budgets, mode=mode, torch_compile=compiled and mode is GraphMode.CUDA)
    if mode is GraphMode.EMULATE:
        outputs = {b: torch.zeros(b, model.config.out_hidden_size, dtype=model.dtype) for b in budgets.token_budgets}
        merge_area = model.config.merge_area

        def no_forward(pixels: torch.Tensor, meta: EncoderMetadata) -> torch.Tensor:
            return outputs[meta.shape.rows // merge_area]

        runner.forward_static = no_forward
    return runner.capture()


def measure(runner: EncoderGraphRunner, pixels: torch.Tensor, grids: np.ndarray, calls: int,
            repeats: int) -> dict[str, float]:
    """Median over ``repeats`` of the per-call host time (stats.host_s) and wall time of ``calls`` runs."""
    sync = torch.cuda.synchronize if pixels.device.type == "cuda" else (lambda: None)
    for _ in range(max(10, calls // 10)):  # warm: plans cached, staging filled, allocator settled
        runner.run(pixels, grids)
    sync()
    host, wall = [], []
    for _ in range(repeats):
        runner.stats.reset()
        start = time.perf_counter()
        for _ in range(calls):
            runner.run(pixels, grids)
        wall.append((time.perf_counter() - start) / calls * 1e6)
        host.append(runner.stats.host_s / calls * 1e6)
        sync()
    return {"host_us": statistics.median(host), "run_us": statistics.median(wall),
            "host_us_min": min(host), "run_us_min": min(wall)}


def profile(runner: EncoderGraphRunner, pixels: torch.Tensor, grids: np.ndarray, calls: int, top: int) -> str:
    """cProfile's ``top`` functions by cumulative time over ``calls`` runs."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        runner.run(pixels, grids)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (emulated runner, no-op forward) or cuda (real graphs)")
    p.add_argument("--config", default="tiny", choices=("tiny", "glm41v"))
    p.add_argument("--narrow", action="store_true", help="tiny config with 2×2 patches: 24-wide pixel rows")
    p.add_argument("--compile", action="store_true", help="CUDA: capture graph-compiled (torch.compile first)")
    p.add_argument("--workloads", default="1x224,8x224", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--calls", type=int, default=2000, help="run() calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile", action="store_true", help="print cProfile's top functions (cumulative)")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    torch.manual_seed(0)
    config = VisionConfig.tiny() if args.config == "tiny" else VisionConfig.glm41v()
    if args.narrow:
        config = dataclasses.replace(config, patch_size=2, image_size=2 * config.pos_grid)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = randomize_(GlmVisionEncoder(config)).to(device, dtype).eval()
    results: dict[str, Any] = {"device": str(device), "config": args.config, "narrow": args.narrow,
                               "compiled": args.compile,
                               "calls": args.calls, "repeats": args.repeats, "workloads": {}}
    for name in args.workloads.split(","):
        grids = np.array(WORKLOADS[name], dtype=np.int64)
        rows = int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum())
        pixels = torch.randn(rows, config.patch_dim, generator=torch.Generator().manual_seed(0)).to(device, dtype)
        runner = build_runner(model, WORKLOADS[name], args.compile)
        found = measure(runner, pixels, grids, args.calls, args.repeats)
        results["workloads"][name] = found
        print(f"{name}: host {found['host_us']:.1f} µs/run (min {found['host_us_min']:.1f}), "
              f"run() {found['run_us']:.1f} µs (min {found['run_us_min']:.1f}); budgets "
              f"{runner.budgets.token_budgets}")
        if args.profile:
            text = profile(runner, pixels, grids, args.calls, args.top)
            results["workloads"][name]["profile"] = text
            print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
