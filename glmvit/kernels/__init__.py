"""glmvit's Triton kernels. Here: position-table interpolation, one call for a whole packed batch, Triton on CUDA,
exact torch fallback elsewhere. Beside it: ``triton_attention`` (varlen attention with the rotary inside, the
``triton`` attention backend) and ``triton_gemm`` (a split-K matmul, measured against cuBLAS by
``tools/tune_kernels.py`` and not used by the model). Each runs on a CPU under ``TRITON_INTERPRET=1`` (fp32)."""
from __future__ import annotations

import torch

from .reference import interpolate_pos_embed_torch

__all__ = ["interpolate_pos_embed", "interpolate_pos_embed_torch", "triton_available", "uses_triton"]

MODES = ("bicubic", "bilinear")


def triton_available() -> bool:
    """True when the Triton kernel module imports (Triton installed)."""
    try:
        from . import triton_bicubic  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when the Triton kernel was decorated for the CPU interpreter (TRITON_INTERPRET=1 before its import)."""
    from .triton_bicubic import INTERPRETED

    return INTERPRETED


def uses_triton(table: torch.Tensor) -> bool:
    """Whether :func:`interpolate_pos_embed` launches the Triton kernel for this table."""
    if not triton_available():
        return False
    if table.is_cuda:
        return not interpreting()
    return interpreting() and table.device.type == "cpu" and table.dtype == torch.float32


def _validate(table, h_idx, w_idx, target_h, target_w, mode, check_values):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not table.is_floating_point():
        raise ValueError(f"table must be a floating-point tensor, got {table.dtype}")
    if table.ndim != 2:
        raise ValueError(f"table must be [G*G, D], got shape {tuple(table.shape)}")
    grid = int(round(table.shape[0] ** 0.5))
    if grid * grid != table.shape[0] or grid == 0:
        raise ValueError(f"table has {table.shape[0]} rows, which is not a square G*G")
    n = h_idx.shape[0] if h_idx.ndim == 1 else -1
    for name, t in (("h_idx", h_idx), ("w_idx", w_idx), ("target_h", target_h), ("target_w", target_w)):
        if t.ndim != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be 1-D of the same length as h_idx ({n}), got shape {tuple(t.shape)}")
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != table.device:
            raise ValueError(f"{name} is on {t.device} but the table is on {table.device}")
    if check_values and n > 0:
        if bool((target_h <= 0).any()) or bool((target_w <= 0).any()):
            raise ValueError("target_h and target_w must be positive")
        bad = (h_idx < 0) | (h_idx >= target_h) | (w_idx < 0) | (w_idx >= target_w)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"token {i}: index ({int(h_idx[i])}, {int(w_idx[i])}) outside its target "
                f"{int(target_h[i])}×{int(target_w[i])}"
            )


def interpolate_pos_embed(
    table: torch.Tensor,
    h_idx: torch.Tensor,
    w_idx: torch.Tensor,
    target_h: torch.Tensor,
    target_w: torch.Tensor,
    mode: str = "bicubic",
    check_values: bool = True,
) -> torch.Tensor:
    """Resample the G×G position table at each token's patch position; returns [N, D] in the table's dtype.

    ``mode="bicubic"`` equals ``F.grid_sample(mode="bicubic", align_corners=False, padding_mode="border")``
    on the table viewed as a G×G image, sampled at the centre of patch (h_idx, w_idx) of a target_h × target_w
    grid. ``check_values=False`` skips the value checks that read the device (what a CUDA graph needs).
    """
    _validate(table, h_idx, w_idx, target_h, target_w, mode, check_values)
    if uses_triton(table):
        from .triton_bicubic import interpolate_pos_embed_triton

        return interpolate_pos_embed_triton(table, h_idx, w_idx, target_h, target_w, mode)
    return interpolate_pos_embed_torch(table, h_idx, w_idx, target_h, target_w, mode)
