"""The fused GEMMs' launch table: which batches run a matmul with its neighbour in the epilogue, and with which
configuration. Two, each chosen from its A/B on the H200, which times the configurations it is given and never reads
this table (the choice depends on the A/B, not the other way round):

- the MLP's gate_up matmul with silu(gate)·up in its epilogue (``glmvit.kernels.triton_swiglu_gemm``) instead of
  cuBLAS's matmul, then a separate SwiGLU kernel: ``tools/swiglu_ab.py``, ``data/sweeps/swiglu_ab_h200.json``;
- the attention's qkv matmul with q and k rotated in its epilogue (``glmvit.kernels.triton_qkv_rope_gemm``)
  instead of cuBLAS's matmul, then the attention's own rotation: ``tools/qkv_rope_ab.py``,
  ``data/sweeps/qkv_rope_ab_h200.json``.

CUDA, fp16/bf16 only: on the CPU, and in float32, the model keeps transformers' arithmetic. Each rule is one row
threshold rather than a choice per row range, so that a forward compiled with symbolic sizes guards on one
comparison; the configuration is chosen inside the op, from the batch's real rows.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .triton_qkv_rope_gemm import QkvRopeConfig
    from .triton_swiglu_gemm import SwigluConfig

# The fused SwiGLU GEMM from this many rows on (None: never).
SWIGLU_MIN_ROWS: int | None = None
# The fused rotary qkv GEMM from this many rows on (None: never).
QKV_ROPE_MIN_ROWS: int | None = None


def swiglu_fused(rows: int) -> bool:
    """Whether a batch of ``rows`` rows runs the MLP's fused SwiGLU GEMM (on CUDA, in fp16/bf16)."""
    return SWIGLU_MIN_ROWS is not None and rows >= SWIGLU_MIN_ROWS


def qkv_rope_fused(rows: int) -> bool:
    """Whether a batch of ``rows`` rows runs the attention's fused rotary qkv GEMM (on CUDA, in fp16/bf16)."""
    return QKV_ROPE_MIN_ROWS is not None and rows >= QKV_ROPE_MIN_ROWS


def swiglu_config(rows: int) -> SwigluConfig:
    """The fused SwiGLU GEMM's configuration for a batch of ``rows`` rows (one for every row count until an A/B
    shows a row range where another wins)."""
    from .triton_swiglu_gemm import SwigluConfig

    return SwigluConfig(128, 128, 64, 8, 3)


def qkv_rope_config(rows: int) -> QkvRopeConfig:
    """The fused rotary qkv GEMM's configuration for a batch of ``rows`` rows (one for every row count until an
    A/B shows a row range where another wins)."""
    from .triton_qkv_rope_gemm import QkvRopeConfig

    return QkvRopeConfig()
