"""An eager forward's first call of a batch shape against its second: what a new shape costs the engine's path.

A served batch the latency table routes eager runs ``GlmVisionEncoder.forward``. Its kernels are chosen by rows
(``glmvit.kernels.attention_table``, ``glmvit.kernels.fused_gemm_table``), and a Triton kernel compiles (or loads
from its disk cache) the first time each configuration and specialisation launches. A graph runner compiled its own
kernels at capture; the eager route's are compiled when a batch first needs them, on the engine's thread, with every
request queued behind it. This probe times, in one fresh process, each grid's forward twice (synchronised wall ms):
the first call minus the second is what that shape's first batch costs the engine.

    python tools/first_call_probe.py --grids "8x32x32+1x16x16;4x16x16;1x16x20" --json /tmp/first_call.json
    python tools/first_call_probe.py --device cpu --config tiny --grids "1x4x4;2x4x6"   # a dry run of the code
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from glmvit.config import VisionConfig  # noqa: E402
from glmvit.random_weights import random_encoder  # noqa: E402
from glmvit.workloads import random_batch  # noqa: E402


def parse_grids(text: str) -> list[list[list[int]]]:
    """``"8x32x32+1x16x16;4x16x16"``: batches split by ``;``, items by ``+``, each item ``TxHxW``; ValueError in one
    line naming the bad item."""
    batches = []
    for batch in text.split(";"):
        items = []
        for item in batch.split("+"):
            parts = item.strip().split("x")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"grid item {item.strip()!r} is not TxHxW with positive integers")
            items.append([int(p) for p in parts])
        batches.append(items)
    return batches


def first_and_second_ms(model: torch.nn.Module, config: VisionConfig, grids: list[list[int]],
                        device: torch.device) -> tuple[float, float]:
    """Wall ms of the first and the second eager forward of ``grids`` (each synchronised)."""
    pixels, grid = random_batch(grids, config, seed=0)
    pixels = pixels.to(device, next(model.parameters()).dtype)
    times = []
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            model(pixels, grid)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times[0], times[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="full", choices=("full", "tiny"))
    parser.add_argument("--grids", default="8x32x32+1x16x16;4x16x16;1x16x20", help="batches: ';' between, '+' in")
    parser.add_argument("--json", default=None, help="write every number, with provenance, here")
    args = parser.parse_args(argv)
    try:
        batches = parse_grids(args.grids)
    except ValueError as err:
        parser.error(str(err))
    device = torch.device(args.device)
    config = VisionConfig.glm41v() if args.config == "full" else VisionConfig.tiny()
    model = random_encoder(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = []
    for grids in batches:
        first, second = first_and_second_ms(model, config, grids, device)
        rows.append({"grids": grids, "first_ms": first, "second_ms": second})
        print(f"{'+'.join('x'.join(map(str, g)) for g in grids):<24} first {first:9.1f} ms   second {second:8.1f} ms")
    if args.json:
        from glmvit.provenance import collect

        with open(args.json, "w") as f:
            json.dump({"provenance": collect(device, " ".join(["python", *sys.argv])), "batches": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
