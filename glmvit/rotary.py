"""2D rotary position ids in merge-block order, and the rotary angles the attention uses.

A frame of h × w patches is emitted block by block: each 2×2 merge block's four patches are consecutive,
so the downsample conv can merge rows (4k, 4k+1, 4k+2, 4k+3). The ids below follow that order.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch


@lru_cache(maxsize=4096)
def rot_pos_ids(h: int, w: int, merge: int = 2) -> np.ndarray:
    """Return the (h·w, 2) int32 array of [row, column] patch ids of one frame, in merge-block order.

    The array is cached per (h, w, merge) and read-only: copy it before writing.
    """
    if h <= 0 or w <= 0 or h % merge or w % merge:
        raise ValueError(f"grid {h}×{w} must be positive and divisible by the merge size {merge}")
    rows, cols = np.meshgrid(np.arange(h, dtype=np.int32), np.arange(w, dtype=np.int32), indexing="ij")

    def block_order(a: np.ndarray) -> np.ndarray:
        return a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)

    ids = np.stack([block_order(rows), block_order(cols)], axis=1)
    ids.flags.writeable = False
    return ids


def inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """The head_dim/4 inverse frequencies of one axis (32 for head_dim 128), exactly as transformers builds them."""
    dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rotary_cos_sin(h_idx: torch.Tensor, w_idx: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (N, head_dim), float32, laid out per head as [h | w | h | w] frequencies."""
    angle = torch.cat([h_idx.float()[:, None] * freqs, w_idx.float()[:, None] * freqs], dim=-1)
    angle = torch.cat([angle, angle], dim=-1)
    return angle.cos(), angle.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, heads, head_dim) in float32 (NeoX half-split style) and cast back to x's dtype."""
    xf = x.float()
    out = xf * cos[:, None, :] + rotate_half(xf) * sin[:, None, :]
    return out.to(x.dtype)
