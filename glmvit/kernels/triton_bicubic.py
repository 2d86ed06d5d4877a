"""Triton kernel: resample the G×G position table at every token's patch centre, one launch for a packed batch.

Spec (``reference.py``, which follows ATen's ``grid_sample(align_corners=False, padding_mode="border")``), per
token and per axis:

1. normalised coordinate  x = ((w + 0.5) / W) · 2 − 1      (fp32, as transformers builds the grid)
2. table coordinate       ix = ((x + 1) · G − 1) / 2       (align_corners=False; the product-difference rounded once)
3. bicubic: taps floor(ix) − 1 … floor(ix) + 2 with Keys weights (a = −0.75), every tap clamped to [0, G − 1];
   sum along each row first (Σ_j v · wx_j), then over the rows (Σ_i row_i · wy_i), all in fp32.
   bilinear: clip ix to [0, G − 1] first, then the 2×2 lerp.

One program handles BLOCK_N tokens × BLOCK_D channels. The kernel reads everything from device tensors and the
launch grid depends only on shapes, so the call can be captured in a CUDA graph. Under ``TRITON_INTERPRET=1``
(set before this module is imported) the same kernel runs on CPU tensors, in fp32 only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .reference import CUBIC_A

BLOCK_N = 4  # tokens per program
MAX_BLOCK_D = 512  # channels per program: D = 1536 → 3 channel blocks, 2048 fp32 accumulators per program


@triton.jit
def _conv1(x, A: tl.constexpr):
    """Keys kernel for |x| <= 1 (ATen's cubic_convolution1)."""
    return ((A + 2) * x - (A + 3)) * x * x + 1


@triton.jit
def _conv2(x, A: tl.constexpr):
    """Keys kernel for 1 < |x| < 2 (ATen's cubic_convolution2)."""
    return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A


@triton.jit
def _cubic_weights(t, A: tl.constexpr):
    """Weights of taps floor − 1 … floor + 2 for fractional offset t (reference.cubic_weights)."""
    return _conv2(t + 1.0, A), _conv1(t, A), _conv1(1.0 - t, A), _conv2(2.0 - t, A)


@triton.jit
def _source_coord(idx, target, G: tl.constexpr):
    """Steps 1-2 for [BLOCK_N] tokens: an IEEE round-to-nearest division like torch's, and (x + 1)·G − 1 as one
    explicit fma, as ATen's kernels compute it (whatever the compiler would contract); halving is exact."""
    normalised = tl.math.div_rn(idx.to(tl.float32) + 0.5, target.to(tl.float32)) * 2 - 1
    return tl.fma(normalised + 1, G * 1.0, -1.0) * 0.5


@triton.jit
def _clamp(i, G: tl.constexpr):
    """Border padding: an integer tap index clamped into [0, G − 1]."""
    return tl.minimum(tl.maximum(i, 0), G - 1)


@triton.jit
def _tap(table_ptr, row, col, ch, mask, G: tl.constexpr, D: tl.constexpr):
    """table[row, col, ch] as a [BLOCK_N, BLOCK_D] fp32 tile; row, col are clamped [BLOCK_N] indices.

    The load is widened to fp32 at once: the interpreter cannot compute in bf16, and we accumulate in fp32 anyway.
    """
    ptrs = table_ptr + (row * G + col)[:, None] * D + ch[None, :]
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _cubic_row(table_ptr, row, xi, wx0, wx1, wx2, wx3, ch, mask, G: tl.constexpr, D: tl.constexpr):
    """Σ_j table[row, clamp(xi − 1 + j)] · wx_j, summed left to right as ATen's cubic_interp1d does."""
    v0 = _tap(table_ptr, row, _clamp(xi - 1, G), ch, mask, G, D)
    v1 = _tap(table_ptr, row, _clamp(xi, G), ch, mask, G, D)
    v2 = _tap(table_ptr, row, _clamp(xi + 1, G), ch, mask, G, D)
    v3 = _tap(table_ptr, row, _clamp(xi + 2, G), ch, mask, G, D)
    return v0 * wx0[:, None] + v1 * wx1[:, None] + v2 * wx2[:, None] + v3 * wx3[:, None]


@triton.jit
def _interp_kernel(
    table_ptr,  # [G*G, D], contiguous
    h_ptr, w_ptr, th_ptr, tw_ptr,  # [N] int32: patch row, patch column, target height, target width
    out_ptr,  # [N, D] in the table's dtype
    N,
    G: tl.constexpr,
    D: tl.constexpr,
    BICUBIC: tl.constexpr,
    A: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = tok < N
    mask = tok_ok[:, None] & (ch < D)[None, :]

    # Per-token table coordinates; tokens past N read index 0 of a 1-wide target (in range, never stored).
    iy = _source_coord(tl.load(h_ptr + tok, mask=tok_ok, other=0), tl.load(th_ptr + tok, mask=tok_ok, other=1), G)
    ix = _source_coord(tl.load(w_ptr + tok, mask=tok_ok, other=0), tl.load(tw_ptr + tok, mask=tok_ok, other=1), G)

    if BICUBIC:
        y0 = tl.floor(iy)
        x0 = tl.floor(ix)
        wx0, wx1, wx2, wx3 = _cubic_weights(ix - x0, A)
        wy0, wy1, wy2, wy3 = _cubic_weights(iy - y0, A)
        yi = y0.to(tl.int32)
        xi = x0.to(tl.int32)
        # Row i is table row clamp(yi − 1 + i), weighted by wy_i; summed in order like ATen.
        row0 = _cubic_row(table_ptr, _clamp(yi - 1, G), xi, wx0, wx1, wx2, wx3, ch, mask, G, D)
        row1 = _cubic_row(table_ptr, _clamp(yi, G), xi, wx0, wx1, wx2, wx3, ch, mask, G, D)
        row2 = _cubic_row(table_ptr, _clamp(yi + 1, G), xi, wx0, wx1, wx2, wx3, ch, mask, G, D)
        row3 = _cubic_row(table_ptr, _clamp(yi + 2, G), xi, wx0, wx1, wx2, wx3, ch, mask, G, D)
        acc = row0 * wy0[:, None] + row1 * wy1[:, None] + row2 * wy2[:, None] + row3 * wy3[:, None]
    else:
        # Bilinear with border padding clips the coordinate itself, then lerps the 2×2 neighbours.
        iy = tl.minimum(tl.maximum(iy, 0.0), G - 1.0)
        ix = tl.minimum(tl.maximum(ix, 0.0), G - 1.0)
        y0 = tl.floor(iy)
        x0 = tl.floor(ix)
        ty = (iy - y0)[:, None]
        tx = (ix - x0)[:, None]
        yi = y0.to(tl.int32)
        xi = x0.to(tl.int32)
        y1 = _clamp(yi + 1, G)
        x1 = _clamp(xi + 1, G)
        top = _tap(table_ptr, yi, xi, ch, mask, G, D) * (1 - tx) + _tap(table_ptr, yi, x1, ch, mask, G, D) * tx
        bottom = _tap(table_ptr, y1, xi, ch, mask, G, D) * (1 - tx) + _tap(table_ptr, y1, x1, ch, mask, G, D) * tx
        acc = top * (1 - ty) + bottom * ty

    out = out_ptr + tok.to(tl.int64)[:, None] * D + ch[None, :]  # int64: N · D may pass 2**31
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# The interpreter is chosen when @triton.jit decorates, i.e. when this module is first imported.
INTERPRETED = isinstance(_interp_kernel, InterpretedFunction)


def interpolate_pos_embed_triton(table, h_idx, w_idx, target_h, target_w, mode: str = "bicubic") -> torch.Tensor:
    """Triton version of :func:`glmvit.kernels.interpolate_pos_embed` (inputs already validated): [N, D]."""
    grid = int(round(table.shape[0] ** 0.5))
    n, d = h_idx.shape[0], table.shape[1]
    out = torch.empty((n, d), dtype=table.dtype, device=table.device)
    if n == 0:
        return out
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(d))
    launch = (triton.cdiv(n, BLOCK_N), triton.cdiv(d, block_d))
    _interp_kernel[launch](
        table.contiguous(), h_idx.contiguous(), w_idx.contiguous(), target_h.contiguous(),
        target_w.contiguous(), out, n,
        G=grid, D=d, BICUBIC=mode == "bicubic", A=CUBIC_A, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
    )
    return out
