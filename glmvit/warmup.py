"""Warming the eager route: one forward per kernel class before the first served batch needs it.

An eager forward (``GlmVisionEncoder.forward``: a batch no captured budget holds, or one the latency table routes
eager) picks its kernels by its row count: the attention kernel and its launch configuration
(``glmvit.attention.resolve``, ``glmvit.kernels.attention_table``), whether and how the MLP's and the qkv's fused GEMMs
run (``glmvit.kernels.fused_gemm_table``). A Triton kernel compiles the first time a configuration launches, and
again for each specialisation of its integer arguments: Triton specialises an integer on whether it is divisible by
:data:`SPECIALISE` (16), and the row count is one such argument. A graph runner compiled what its budgets' captures
launched; an eager batch whose class no capture launched compiles on the engine's thread, with every queued request
behind it (``tools/first_call_probe.py`` times a first call against the second). cuDNN's attention handle and plans
are the calling thread's own (``glmvit.kernels.cudnn_attention``), so the warm-up runs in the thread that serves. It
covers Triton's compiles, not every cuDNN plan: a plan is keyed by the batch's segment slots and its longest segment
(rounded up to a power of two), and each warm-up forward is one segment, so a served batch with a new key still builds
its plan once in that thread (on the H100, 117 ms for a first call whose second took 42, against 1,194 ms unwarmed:
``data/sweeps/first_call_h100_warm.json``).

:func:`eager_classes` lists one row count per class, read off those tables (the decision stays where it is made);
:func:`warm_eager` runs one zero-pixel forward per class through an :class:`~glmvit.encoder.Encoder`'s model and
attention backend. :class:`~glmvit.scheduler.BatchScheduler` calls it in its worker thread before the first batch.
Off CUDA it does nothing: the CPU path compiles nothing per shape.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from .attention import resolve
from .config import VisionConfig
from .gate_up import gate_up_tile, is_packed
from .kernels.fused_gemm_table import qkv_rope_config, qkv_rope_fused, swiglu_config, swiglu_fused
from .model import GlmVisionEncoder, half_on_cuda

SPECIALISE = 16  # Triton's divisibility specialisation of integer arguments (triton.runtime.jit: ``x % 16 == 0``)
SCAN_ROWS = 16_384  # classes are looked for up to this many rows (or the largest budget's, when larger): every
#                     threshold of the tables lies below it (tests/test_warmup.py), so a longer batch repeats a class
#                     found already, up to cuDNN's int32 offsets (~466K rows, Triton's prerotated class again)


@dataclass(frozen=True)
class WarmUp:
    """What :func:`warm_eager` ran: the row count of each class's forward, and the wall seconds of all of them."""

    rows: tuple[int, ...]
    seconds: float


def kernel_class(rows: int, attention: str, config: VisionConfig, device: torch.device,
                 dtype: torch.dtype) -> Hashable:
    """What decides which kernels (and which of their compiled specialisations) an eager forward of ``rows`` packed
    rows launches, with attention backend ``attention`` (the encoder's, ``auto`` included) on ``device`` in
    ``dtype``: two row counts of one class launch the same compiled kernels."""
    qkv_width = 3 * config.hidden_size
    backend = resolve(attention, rows, qkv_width)
    launch = None
    if backend == "triton":
        from .kernels.attention_table import config_for  # imports Triton: reached only where it runs

        launch = config_for(rows)
    half = half_on_cuda(device, dtype)
    mlp = config.out_hidden_size  # the blocks' MLP width: its weight is packed in tiles of gate_up_tile(mlp)
    swiglu = swiglu_config(rows, is_packed(gate_up_tile(mlp), mlp)) if half and swiglu_fused(rows, device) else None
    qkv = qkv_rope_config(rows) if half and qkv_rope_fused(rows, device) else None
    return backend, launch, swiglu, qkv, rows % SPECIALISE == 0


def eager_classes(attention: str, config: VisionConfig, device: torch.device, dtype: torch.dtype,
                  max_rows: int = SCAN_ROWS) -> tuple[int, ...]:
    """The smallest row count of each :func:`kernel_class` among the batches an encoder can be given (a multiple of
    the merge area m²), up to ``max(max_rows, SCAN_ROWS)`` rows, ascending."""
    step = config.merge_area
    found: dict[Hashable, int] = {}
    for rows in range(step, max(max_rows, SCAN_ROWS) + 1, step):
        found.setdefault(kernel_class(rows, attention, config, device, dtype), rows)
    return tuple(sorted(found.values()))


@torch.inference_mode()
def warm_eager(model: GlmVisionEncoder, attention: str, max_rows: int = SCAN_ROWS,
               stop: Callable[[], bool] = lambda: False) -> WarmUp:
    """Run one eager forward of ``model`` with backend ``attention`` per class of :func:`eager_classes` (zero pixels,
    one frame of 2 × rows/2 patches), in the calling thread, and wait for them. Off CUDA: nothing (no rows).
    ``stop`` is asked before each forward: once it says True the rest are skipped (the result names those that
    ran)."""
    if model.device.type != "cuda":
        return WarmUp((), 0.0)
    config = model.config
    rows_of = eager_classes(attention, config, model.device, model.dtype, max_rows)
    start = time.perf_counter()
    ran: list[int] = []
    for rows in rows_of:
        if stop():
            break
        ran.append(rows)
        pixels = torch.zeros(rows, config.patch_dim, dtype=model.dtype, device=model.device)
        model.forward(pixels, [[1, config.spatial_merge_size, rows // config.spatial_merge_size]],
                      check_finite=False, attention=attention)
    torch.cuda.synchronize(model.device)
    return WarmUp(tuple(ran), time.perf_counter() - start)
