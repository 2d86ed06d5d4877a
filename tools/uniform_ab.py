"""Do uniform graphs pay? ``EncoderGraphRunner`` with and without ``uniform_lengths`` on the same layouts, side by side.

A uniform graph (``glmvit.graphs``: a budget captured again for batches whose segments all have one length) runs the
``dense`` attention, one SDPA call over (segments, heads, L, d) views, where the default graph runs the ragged
kernels. This A/B captures both runners in one process, per mode (``graph``, and ``graph-compiled`` on CUDA), and
for each layout times ``runner.run`` (CUDA events on CUDA, the host clock elsewhere; median of ``--runs``), counts
the uniform replays, and compares every item's output between the two runners (max |Δ|; bf16 rounding differs
between the two attention kernels, so they agree to bf16 noise, not bitwise).

    python tools/uniform_ab.py --json /tmp/uniform_ab.json                       # on the H200: full tower, bf16
    python tools/uniform_ab.py --config tiny --modes graph --runs 2 --layouts "1x224"   # a dry run of the code on CPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from glmvit.cli.common import vision_config  # noqa: E402 - the repository's own package, by path
from glmvit.graphs import EncoderGraphRunner  # noqa: E402
from glmvit.packing import BudgetConfig  # noqa: E402
from glmvit.random_weights import random_encoder  # noqa: E402

# name -> grids: equal segments (the cases a uniform graph takes) and one image that fills a ladder budget exactly
LAYOUTS: dict[str, list[list[int]]] = {
    "1x224": [[1, 16, 16]],
    "4x224": [[1, 16, 16]] * 4,
    "clip8x224": [[4, 16, 16]],
    "16clips8x224": [[4, 16, 16]] * 16,
    "2x448": [[1, 32, 32]] * 2,
    "8x448": [[1, 32, 32]] * 8,
    "1x896": [[1, 64, 64]],
    "1x1036": [[1, 74, 74]],
}


def time_run(runner: EncoderGraphRunner, pixels: torch.Tensor, grid: torch.Tensor, runs: int) -> float:
    """Median ms of ``runner.run`` over ``runs`` calls after 3 untimed ones."""
    cuda = pixels.is_cuda
    for _ in range(3):
        runner.run(pixels, grid, check_finite=False)
    ms = []
    for _ in range(runs):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.run(pixels, grid, check_finite=False)
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            runner.run(pixels, grid, check_finite=False)
            ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def segment_lengths(layouts: dict[str, list[list[int]]]) -> tuple[int, ...]:
    """Every segment length (rows per frame-pair: h·w) the layouts hold: the uniform lengths to capture."""
    return tuple(sorted({h * w for grids in layouts.values() for _, h, w in grids}))


def ab(model: torch.nn.Module, layouts: dict[str, list[list[int]]], modes: list[str], runs: int) -> dict[str, Any]:
    """Per mode and layout: plain and uniform ms, uniform replays of replays, and the outputs' max |Δ|."""
    device = next(model.parameters()).device
    run_mode = "cuda" if device.type == "cuda" else "emulate"
    budgets = BudgetConfig.serving()
    out: dict[str, Any] = {}
    for mode in modes:
        compiled = mode == "graph-compiled"
        plain = EncoderGraphRunner(model, budgets, mode=run_mode, torch_compile=compiled).capture()
        uniform = EncoderGraphRunner(model, budgets, mode=run_mode, torch_compile=compiled,
                                     uniform_lengths=segment_lengths(layouts)).capture()
        for name, grids in layouts.items():
            rows = sum(t * h * w for t, h, w in grids)
            gen = torch.Generator(device=device).manual_seed(0)
            pixels = torch.randn(rows, model.config.patch_dim, device=device, dtype=model.dtype, generator=gen)
            grid = torch.tensor(grids)
            uniform.stats.reset()
            a, b = time_run(plain, pixels, grid, runs), time_run(uniform, pixels, grid, runs)
            worst = max((x.float() - y.float()).abs().max().item()
                        for x, y in zip(plain.run(pixels, grid), uniform.run(pixels, grid), strict=True))
            out[f"{mode} {name}"] = {"mode": mode, "layout": name, "grids": grids, "plain_ms": a, "uniform_ms": b,
                                     "uniform_replays": uniform.stats.uniform_replays,
                                     "replays": uniform.stats.replays, "max_abs_diff": worst}
            print(f"{mode:15s} {name:13s} plain {a:8.3f} ms  uniform {b:8.3f} ms  ({uniform.stats.uniform_replays} "
                  f"uniform replays of {uniform.stats.replays})  max |Δ| {worst:.3g}", flush=True)
        del plain, uniform
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="full", choices=("full", "tiny"))
    parser.add_argument("--modes", default=None, help="comma list of graph, graph-compiled (default: both on CUDA, "
                                                      "graph elsewhere)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    unknown = [n for n in args.layouts.split(",") if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layout(s) {unknown}: choose from {', '.join(LAYOUTS)}")
    modes = args.modes.split(",") if args.modes else (["graph", "graph-compiled"] if device.type == "cuda"
                                                      else ["graph"])
    if any(m not in ("graph", "graph-compiled") for m in modes):
        parser.error(f"--modes takes graph and graph-compiled, got {args.modes!r}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_encoder(vision_config(args.config), device, dtype, 0)
    layouts = {n: LAYOUTS[n] for n in args.layouts.split(",")}
    results = ab(model, layouts, modes, args.runs)
    if args.json:
        from glmvit.provenance import collect

        Path(args.json).write_text(json.dumps({"provenance": collect(device, " ".join(["python", *sys.argv])),
                                               "settings": {"config": args.config, "runs": args.runs,
                                                            "modes": modes, "dtype": str(dtype)},
                                               "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
