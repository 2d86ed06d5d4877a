"""Pure-torch position-table interpolation with the exact arithmetic of ``F.grid_sample`` (CPU/GPU fallback).

For every token: normalised coordinate x = ((w + 0.5) / W) · 2 − 1 (as transformers computes it), unnormalised
to the table as ix = ((x + 1) · G − 1) / 2 (align_corners=False; rounded once, as an fma), then a 4×4 Keys-cubic
(a = −0.75) gather with every tap clamped to the border — the same steps, in the same order, as ATen's grid sampler.
"""
from __future__ import annotations

import torch

CUBIC_A = -0.75


def _conv1(x: torch.Tensor) -> torch.Tensor:  # |x| <= 1
    return ((CUBIC_A + 2) * x - (CUBIC_A + 3)) * x * x + 1


def _conv2(x: torch.Tensor) -> torch.Tensor:  # 1 < |x| < 2
    return ((CUBIC_A * x - 5 * CUBIC_A) * x + 8 * CUBIC_A) * x - 4 * CUBIC_A


def cubic_weights(t: torch.Tensor) -> list[torch.Tensor]:
    """The four Keys-kernel weights of taps floor(s)−1 … floor(s)+2 for fractional offset t."""
    return [_conv2(t + 1.0), _conv1(t), _conv1(1.0 - t), _conv2(2.0 - t)]


def source_coords(idx: torch.Tensor, target: torch.Tensor, grid: int) -> torch.Tensor:
    """Unnormalised float32 source coordinate in the G-wide table for patch index idx of a target-wide grid.

    (x + 1)·G − 1 is rounded once, as the fused multiply-add ATen's kernels compile to: the float64 product and
    difference are exact, so rounding them to float32 equals fma(x + 1, G, −1). Rounding twice moves the coordinate
    by one float32 ulp now and then (≈ 2e-6 at 20), which a steep table turns into output errors near 1e-5.
    """
    normalised = ((idx.float() + 0.5) / target.float()) * 2 - 1
    return ((normalised + 1).double() * grid - 1).float() / 2


def interpolate_pos_embed_torch(table, h_idx, w_idx, target_h, target_w, mode: str = "bicubic") -> torch.Tensor:
    """Reference implementation of :func:`glmvit.kernels.interpolate_pos_embed` (inputs already validated)."""
    grid = int(round(table.shape[0] ** 0.5))
    t = table.float()
    iy = source_coords(h_idx, target_h, grid)
    ix = source_coords(w_idx, target_w, grid)

    def row(y: torch.Tensor) -> torch.Tensor:
        return y.clamp(0, grid - 1).long() * grid

    if mode == "bilinear":  # border padding clips the coordinate first, then 2×2 taps
        iy, ix = iy.clamp(0, grid - 1), ix.clamp(0, grid - 1)
        y0, x0 = iy.floor(), ix.floor()
        ty, tx = (iy - y0)[:, None], (ix - x0)[:, None]
        r0, r1, c0, c1 = row(y0), row(y0 + 1), x0.long(), (x0 + 1).clamp(max=grid - 1).long()
        top = t[r0 + c0] * (1 - tx) + t[r0 + c1] * tx
        bottom = t[r1 + c0] * (1 - tx) + t[r1 + c1] * tx
        return (top * (1 - ty) + bottom * ty).to(table.dtype)

    y0, x0 = iy.floor(), ix.floor()
    wy = cubic_weights(iy - y0)
    wx = cubic_weights(ix - x0)
    cols = [(x0 + (j - 1)).clamp(0, grid - 1).long() for j in range(4)]
    out = torch.zeros(y0.shape[0], t.shape[1], dtype=t.dtype, device=t.device)
    for i in range(4):
        r = row(y0 + (i - 1))
        acc = t[r + cols[0]] * wx[0][:, None]
        for j in range(1, 4):
            acc = acc + t[r + cols[j]] * wx[j][:, None]
        out = out + acc * wy[i][:, None]
    return out.to(table.dtype)


def vllm_bilinear(table: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """vLLM's bilinear resampling of a (G·G, D) position table to an h × w grid: (h·w, D) rows in raster order.

    The arithmetic of ``fast_pos_embed_interpolate`` in ``vllm/model_executor/models/qwen3_vl.py`` (vllm-project/vllm
    at 4f5768c74b6f; in the PR's fork grYe99/vllm at 311c7e6b534e the same steps as ``pos_embed_interpolate_native``
    and its Triton twin): **corner-aligned** coordinates ``linspace(0, G − 1, n)`` (the first and last patch sit on
    the table's edge cells), taps ``floor`` and ``min(floor + 1, G − 1)``, float32 weights w11 = dh·dw, w10 = dh − w11,
    w01 = dw − w11, w00 = 1 − dh − w01, rounded to the table's dtype; the four products are summed in that dtype.
    vLLM then reorders the rows into spatial-merge blocks and repeats them t times; this keeps raster order.
    """
    grid = int(round(table.shape[0] ** 0.5))
    ys = torch.linspace(0, grid - 1, h, dtype=torch.float32, device=table.device)
    xs = torch.linspace(0, grid - 1, w, dtype=torch.float32, device=table.device)
    y0, x0 = ys.long(), xs.long()
    y1, x1 = (y0 + 1).clamp(max=grid - 1), (x0 + 1).clamp(max=grid - 1)
    dh, dw = torch.meshgrid(ys - y0, xs - x0, indexing="ij")
    w11 = dh * dw
    w10, w01 = dh - w11, dw - w11
    w00 = 1 - dh - w01
    top, bottom = (y0 * grid)[:, None], (y1 * grid)[:, None]
    index = torch.stack([top + x0, top + x1, bottom + x0, bottom + x1]).reshape(4, -1)
    weights = torch.stack([w00, w01, w10, w11]).reshape(4, -1, 1).to(table.dtype)
    return (table[index] * weights).sum(0)
