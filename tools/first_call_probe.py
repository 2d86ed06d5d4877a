"""An eager forward's first call of a batch shape against its second: what a new shape costs the engine's path.

A served batch the latency table routes eager runs ``GlmVisionEncoder.forward``. Its kernels are chosen by rows
(``glmvit.kernels.attention_table``, ``glmvit.kernels.fused_gemm_table``), and a Triton kernel compiles (or loads
from its disk cache) the first time each configuration and specialisation launches. A graph runner compiled its own
kernels at capture; the eager route's are compiled when a batch first needs them, on the engine's thread, with every
request queued behind it. This probe times, in one fresh process, each grid's forward twice (synchronised wall ms):
the first call minus the second is what that shape's first batch costs the engine. Before them, one untimed forward
of ``--warmup`` (another shape) pays what only a process's first forward pays (library handles, lazy module
loading, the allocator's first blocks), so the first timed batch is not charged for it; a batch's first call still
depends on the batches timed before it, which may have compiled some of its kernels. Each row also names the Triton
kernels whose in-memory cache missed during each call (``triton.knobs.runtime.jit_cache_hook``: a compile, or a
load from Triton's disk cache) and how many cuDNN attention plans it built, so a first call's cost shows its causes.
``--warm`` first runs the engine's warm-up (``glmvit.warmup.warm_eager``: one forward per kernel class), so the rows
show what a first call costs after it.
Give each run a fresh ``TRITON_CACHE_DIR`` to time compiles rather than loads from an earlier run's disk cache.

    python tools/first_call_probe.py --grids "8x32x32+1x16x16;4x16x16;1x16x20" --json /tmp/first_call.json
    python tools/first_call_probe.py --warm --json /tmp/first_call_warm.json     # the same, after the warm-up
    python tools/first_call_probe.py --device cpu --config tiny --grids "1x4x4;2x4x6"   # a dry run of the code
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

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


class TritonMisses:
    """While entered, the ``repr`` of every Triton kernel launch that missed the in-memory cache (a compile, or a
    load from the disk cache), in order; nothing where Triton has no ``knobs.runtime.jit_cache_hook``."""

    def __init__(self) -> None:
        self.kernels: list[str] = []
        self._before: object = None

    def _hook(self, *args: object, **kwargs: object) -> bool:
        self.kernels.append(str(kwargs.get("repr", "?")))
        return False  # compile as usual

    def __enter__(self) -> "TritonMisses":
        runtime = _triton_runtime()
        if runtime is not None:
            self._before, runtime.jit_cache_hook = runtime.jit_cache_hook, self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        runtime = _triton_runtime()
        if runtime is not None:
            runtime.jit_cache_hook = self._before


def _triton_runtime() -> Any:
    """``triton.knobs.runtime`` where it has ``jit_cache_hook``, else None (no Triton, or one without the hook)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime if hasattr(knobs.runtime, "jit_cache_hook") else None


def cudnn_plans() -> int:
    """How many cuDNN attention plans this thread holds (``glmvit.kernels.cudnn_attention``: built on a miss)."""
    from glmvit.kernels import cudnn_attention

    return len(getattr(cudnn_attention._local, "plans", {}))


def first_and_second(model: torch.nn.Module, config: VisionConfig, grids: list[list[int]],
                     device: torch.device) -> list[dict]:
    """The first and the second eager forward of ``grids``: each one's wall ms (synchronised), the Triton kernels
    that missed the cache during it and the cuDNN plans it built (this thread's count before and after: a plan
    evicted meanwhile would hide one, past ``PLANS_PER_THREAD``)."""
    pixels, grid = random_batch(grids, config, seed=0)
    pixels = pixels.to(device, next(model.parameters()).dtype)
    calls = []
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        plans = cudnn_plans()
        start = time.perf_counter()
        with TritonMisses() as misses, torch.inference_mode():
            model(pixels, grid)
            if device.type == "cuda":
                torch.cuda.synchronize()
        calls.append({"ms": (time.perf_counter() - start) * 1e3, "triton_misses": misses.kernels,
                      "cudnn_plans_built": cudnn_plans() - plans})
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="full", choices=("full", "tiny"))
    parser.add_argument("--grids", default="8x32x32+1x16x16;4x16x16;1x16x20", help="batches: ';' between, '+' in")
    parser.add_argument("--warmup", default="1x4x4", help="the untimed first batch (one of another shape)")
    parser.add_argument("--warm", action="store_true", help="run glmvit.warmup.warm_eager before the timed batches")
    parser.add_argument("--json", default=None, help="write every number, with provenance, here")
    args = parser.parse_args(argv)
    try:
        batches = parse_grids(args.grids)
        warmup = parse_grids(args.warmup)
    except ValueError as err:
        parser.error(str(err))
    if len(warmup) != 1:
        parser.error(f"--warmup is one batch, not {len(warmup)}")
    device = torch.device(args.device)
    config = VisionConfig.glm41v() if args.config == "full" else VisionConfig.tiny()
    model = random_encoder(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    first_and_second(model, config, warmup[0], device)  # untimed: the process's own first-forward costs
    warmed = None
    if args.warm:
        from glmvit.warmup import warm_eager

        with TritonMisses() as misses:
            done = warm_eager(model, model.attention_backend())
        warmed = {"rows": list(done.rows), "seconds": done.seconds, "triton_misses": misses.kernels}
        print(f"warm-up: {len(done.rows)} forwards (rows {list(done.rows)}) in {done.seconds:.2f} s, "
              f"{len(misses.kernels)} Triton cache misses")
    rows = []
    for grids in batches:
        first, second = first_and_second(model, config, grids, device)
        rows.append({"grids": grids, "first_ms": first["ms"], "second_ms": second["ms"],
                     "first_triton_misses": first["triton_misses"], "second_triton_misses": second["triton_misses"],
                     "first_cudnn_plans": first["cudnn_plans_built"],
                     "second_cudnn_plans": second["cudnn_plans_built"]})
        print(f"{'+'.join('x'.join(map(str, g)) for g in grids):<24} first {first['ms']:9.1f} ms   second "
              f"{second['ms']:8.1f} ms   Triton cache misses {len(first['triton_misses'])} then "
              f"{len(second['triton_misses'])}   cuDNN plans built {first['cudnn_plans_built']} then "
              f"{second['cudnn_plans_built']}")
        for kernel in first["triton_misses"]:
            print(f"    {kernel[:150]}")
    if args.json:
        from glmvit.provenance import collect

        with open(args.json, "w") as f:
            json.dump({"provenance": collect(device, " ".join(["python", *sys.argv])), "warmup": warmup[0],
                       "warm_eager": warmed, "batches": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
