"""Notebook 08's GPU measurements: what torch.compile fuses in a replay, and how busy an eager forward keeps the
GPU. Each is two results: the timings (no profiler in them) and the kernels (under torch.profiler)."""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from ..config import VisionConfig
from ..graphs import EncoderGraphRunner
from ..packing import BudgetConfig
from ..profiling import traced_spans
from ..timing import time_calls
from ..workloads import random_batch
from .shared import full_model

MODES = (("graph", False), ("graph-compiled", True))  # label, torch_compile before capture


def _four_images() -> tuple[torch.Tensor, torch.Tensor]:
    pixels, grid = random_batch([[1, 16, 16]] * 4, VisionConfig.glm41v(), seed=0)
    return pixels.to("cuda", torch.bfloat16), grid


def _runner(compiled: bool, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[EncoderGraphRunner, Any]:
    """A one-budget (256 tokens) runner of the full tower, captured, and its graph; its static buffers hold four real
    images."""
    with torch.inference_mode():
        runner = EncoderGraphRunner(full_model(), BudgetConfig((256,), max_items=4, max_segments=4),
                                    torch_compile=compiled).capture()
        runner.run(pixels, grid)
    return runner, runner.graphs[256].graph


def fusion() -> dict[str, Any]:
    """Four 224² images through a 256-token budget, uncompiled and compiled before capture: the replay's GPU time
    (CUDA events, median of 50) and the capture's duration. No profiler (:func:`fusion_kernels` profiles)."""
    pixels, grid = _four_images()
    result = {}
    for label, compiled in MODES:
        runner, graph = _runner(compiled, pixels, grid)
        with torch.inference_mode():
            ms = time_calls(graph.replay, "cuda", runs=50, warmup=5, on_device=True)
        result[label] = {"replay_ms_median": float(np.median(ms)), "capture_s": runner.captures[256].seconds}
        del runner, graph
        torch.cuda.empty_cache()
    return result


def _replay_kernels(replay: Callable[[], Any]) -> list[list[Any]]:
    """[name, µs] of every kernel of one replay, under torch.profiler."""
    return [[e["name"][:80], round(e["dur"], 2)] for e in traced_spans(replay) if e.get("cat") == "kernel"]


def fusion_kernels() -> dict[str, Any]:
    """The kernels of one replay of :func:`fusion`'s two runners, under torch.profiler."""
    pixels, grid = _four_images()
    result = {}
    for label, compiled in MODES:
        runner, graph = _runner(compiled, pixels, grid)
        with torch.inference_mode():
            result[label] = {"kernels": _replay_kernels(graph.replay)}
        del runner, graph
        torch.cuda.empty_cache()
    return result


def _one_image_forward() -> tuple[Callable[[], None], str]:
    """An eager forward of the full tower (the device's default attention) on one 224² image, and that backend."""
    model = full_model()
    pixels, grid = random_batch([[1, 16, 16]], VisionConfig.glm41v(), seed=0)
    pixels = pixels.to("cuda", torch.bfloat16)

    def forward():
        with torch.inference_mode():
            model(pixels, grid)

    return forward, model.attention_backend()


def eager_busy() -> dict[str, Any]:
    """An eager forward of one 224² image, no profiler: the wall time of a synchronised call and the host time until
    the call returns (its last launch), medians of 50."""
    forward, backend = _one_image_forward()
    wall = time_calls(forward, "cuda", runs=50, warmup=5)
    issued = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()  # returns when the host has launched the last kernel
        issued.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return {"grid": [1, 16, 16], "wall_ms_median": float(np.median(wall)), "host_ms_median": float(np.median(issued)),
            "attention": backend}


def eager_kernels() -> dict[str, Any]:
    """The same forward as :func:`eager_busy` under torch.profiler (20 calls): GPU-busy time and kernels per call."""
    from ..profiling import profile_kernels

    forward, backend = _one_image_forward()
    prof = profile_kernels(forward, calls=20)
    return {"grid": [1, 16, 16], "gpu_busy_ms": prof["gpu_us_per_call"] / 1e3,
            "kernels_per_call": prof["kernels_per_call"], "attention": backend}
