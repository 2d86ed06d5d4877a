"""The MLP's launch table: which batches run the gate_up matmul with its SwiGLU in the epilogue
(``glmvit.kernels.triton_swiglu_gemm``) instead of cuBLAS's matmul, then a separate SwiGLU kernel, and with which
configuration. Chosen from ``tools/swiglu_ab.py``'s A/B on the H200 (``data/sweeps/swiglu_ab_h200.json``), which
times the configurations it is given and never reads this table: the choice depends on the A/B, not the other way
round.

CUDA, fp16/bf16 only: on the CPU, and in float32, the model keeps transformers' two matmuls' arithmetic.
"""
from __future__ import annotations

from .triton_swiglu_gemm import SwigluConfig

# The fused kernel from this many rows on (None: never). One threshold rather than a choice per row range, so that a
# forward compiled with symbolic sizes guards on one comparison.
MIN_ROWS: int | None = None
# The configuration for a batch of at most so many rows (None: any larger), from MIN_ROWS on.
CONFIGS: tuple[tuple[int | None, SwigluConfig], ...] = ((None, SwigluConfig(128, 128, 64, 8, 3)),)


def fused_for(rows: int) -> bool:
    """Whether a batch of ``rows`` rows runs the fused kernel (on CUDA, in fp16/bf16)."""
    return MIN_ROWS is not None and rows >= MIN_ROWS


def config_for(rows: int) -> SwigluConfig:
    """The fused kernel's configuration for a batch of ``rows`` rows (``CONFIGS``)."""
    return next(config for limit, config in CONFIGS if limit is None or rows <= limit)
