"""Triton kernel: varlen attention over packed segments, reading q, k, v straight out of the qkv projection and
rotating q and k on the fly, one launch for a whole batch (two with split keys).

Spec (``glmvit.attention``'s ``segments`` backend after ``glmvit.rotary.apply_rotary``): for every head and every
row r of segment s = segment_ids[r], out[r] = softmax(q̃_r · K̃_sᵀ / √d) · V_s, where q̃, k̃ are q, k rotated in
float32 and rounded to the input dtype, and K̃_s, V_s hold only the rows of segment s.

Work list: one program per (block of BLOCK_M packed rows, head, key split); the grid depends only on the batch's
static shape, so a CUDA graph captures it. With ``split_k = 1`` a program walks all of its rows' keys and writes the
output. A short segment (a 224² image: 256 rows, 4 row blocks × 12 heads = 48 programs for 132 SMs) leaves most of
the GPU idle, so ``split_k = S`` splits each segment's key blocks over S programs, flash-decoding style: program s
takes key blocks s, s + S, …, writes its unnormalised output and its rows' running max and sum, and a second launch
combines the S partials of each row (out = Σ 2^(mₛ−M)·accₛ / Σ 2^(mₛ−M)·lₛ, M = max mₛ; a split with no key block
of a row's segment has mₛ = −∞ and adds nothing).

A row block may straddle segments (they are packed back to back): the program then loops over those segments,
each against its own keys only, and stores only its rows of that segment, so no key or value of one segment is
ever loaded for another (a NaN in one item cannot reach the next). Blocks past the real rows (padding,
``cu_seqlens[-1]`` on) return at once and leave their rows as they were, like the varlen kernels.

Two launch shapes. Rotating where the keys are loaded (above) needs no second launch, but every key block is
rotated once per row block: in a long segment (a 448² image: 1024 rows) many times over, and that rotation —
float32 arithmetic on loaded registers, and cos/sin tables as large as the keys — is what the inner loop waits on.
``prerotate=True`` first rotates q and k of every head once, in their own launch, into a (rows, 2·heads·d)
scratch, and the attention then streams plain bf16 keys, which the compiler can pipeline (``num_stages`` > 1).
Both compute the same rounded q̃, k̃. Which is faster depends on the segments and the rows (the second launch costs
a few µs; many short segments save less than that), so ``glmvit.kernels.attention_table`` picks per batch size,
from a measured sweep.

Rotary: q and k are loaded as two halves x₁ = x[:, :d/2], x₂ = x[:, d/2:] (NeoX half-split), and rotated as
(x₁·cos − x₂·sin, x₂·cos + x₁·sin) with the first d/2 columns of the cos/sin tables (the tables repeat themselves:
``rotary_cos_sin`` concatenates the angles twice), so QKᵀ = q̃₁·k̃₁ᵀ + q̃₂·k̃₂ᵀ: two dots of width d/2.
The softmax is the online one of FlashAttention (running max and sum per row, exp2 with log2 e folded into the
scale), accumulated in float32. Under ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (fp32 only).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from .triton_attention_tma import TmaConfig


@dataclass(frozen=True)
class AttnConfig:
    """A launch configuration: BLOCK_M query rows per program, BLOCK_N keys per step of the inner loop."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    rotate_k: bool = True  # False: skip the keys' rotation (timing experiments only: not a correct attention)
    split_k: int = 1  # programs that share one row block's keys (module docstring); 1: no combine launch
    prerotate: bool = False  # rotate q and k once in a first launch, then attend without rotating (module docstring)


ROTATE_ROWS = 32  # rows per program of the prerotated path's rotation launch (256 rows, 12 heads: 96 programs)


@triton.jit
def _rotate(x_ptr, rows, ok, cos_ptr, sin_ptr, ROW_STRIDE, HALF: tl.constexpr, ROTATE: tl.constexpr = True):
    """Load rows × d of one head as two halves and rotate them in float32; returns both halves in x's dtype.
    ``ROTATE=False`` only loads (what the rotation costs, for tuning; not a correct attention)."""
    cols = tl.arange(0, HALF)
    ptr = x_ptr + rows.to(tl.int64)[:, None] * ROW_STRIDE + cols[None, :]
    if not ROTATE:
        return tl.load(ptr, mask=ok[:, None], other=0.0), tl.load(ptr + HALF, mask=ok[:, None], other=0.0)
    x1 = tl.load(ptr, mask=ok[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF, mask=ok[:, None], other=0.0).to(tl.float32)
    trig = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]  # cos/sin are (rows, d) float32
    c = tl.load(cos_ptr + trig, mask=ok[:, None], other=0.0)
    s = tl.load(sin_ptr + trig, mask=ok[:, None], other=0.0)
    dtype = x_ptr.dtype.element_ty
    return (x1 * c - x2 * s).to(dtype), (x2 * c + x1 * s).to(dtype)


@triton.jit(do_not_specialize=["last_slot"])
def _rope_rotate_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, cu_seqlens_ptr, qk_ptr, last_slot,
                           HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                           HEADS_PER_PROGRAM: tl.constexpr = 1):
    """q̃ and k̃ of HEADS_PER_PROGRAM heads for BLOCK real rows, from qkv (rows, 3·heads·d) into qk (rows, 2·heads·d):
    the prerotated path's first launch, one program per (row block, group of heads). The rows' cos/sin halves are
    loaded once for every rotation; the grid splits heads as well as rows, so that a few hundred rows still fill
    the GPU."""
    D: tl.constexpr = 2 * HALF
    num_rows = tl.load(cu_seqlens_ptr + last_slot)
    first = tl.program_id(0) * BLOCK
    if first >= num_rows:
        return
    rows = (first + tl.arange(0, BLOCK)).to(tl.int64)
    ok = (rows < num_rows)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    c = tl.load(cos_ptr + rows[:, None] * D + cols, mask=ok, other=0.0)
    s = tl.load(sin_ptr + rows[:, None] * D + cols, mask=ok, other=0.0)
    for index in range(2 * HEADS_PER_PROGRAM):  # q, then k: head h of each is column block (part·heads + h)
        part = index % 2
        head = tl.program_id(1) * HEADS_PER_PROGRAM + index // 2
        column = (part * HEADS + head) * D
        src = qkv_ptr + rows[:, None] * (3 * HEADS * D) + column + cols
        dst = qk_ptr + rows[:, None] * (2 * HEADS * D) + column + cols
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * c - x2 * s).to(qk_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, (x2 * c + x1 * s).to(qk_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _key_scores(qa, qb, k_ptr, keys, key_ok, cos_ptr, sin_ptr, qk_scale, QK_STRIDE, HALF: tl.constexpr,
                FULL: tl.constexpr, ROTATE_K: tl.constexpr, MASKED: tl.constexpr):
    """Scaled scores (BLOCK_M, BLOCK_N) of one key block. ``FULL``: qa holds whole rows of q̃ and the keys are loaded
    whole from the prerotated scratch, one dot of width d; otherwise qa, qb are q's rotated halves and the keys are
    rotated here, two dots of width d/2. ``MASKED=False`` is for blocks wholly inside the segment: no masks, no
    -inf fill (the loads the compiler pipelines best)."""
    if FULL:
        ptr = k_ptr + keys.to(tl.int64)[:, None] * QK_STRIDE + tl.arange(0, 2 * HALF)[None, :]
        if MASKED:
            k = tl.load(ptr, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(ptr)
        scores = tl.dot(qa, tl.trans(k)) * qk_scale
    else:
        k1, k2 = _rotate(k_ptr, keys, key_ok, cos_ptr, sin_ptr, QK_STRIDE, HALF, ROTATE_K)
        scores = (tl.dot(qa, tl.trans(k1)) + tl.dot(qb, tl.trans(k2))) * qk_scale
    if MASKED:
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
    return scores


@triton.jit
def _online_softmax_step(scores, m_i, l_i, acc, v_ptr, keys, key_ok, ROW_STRIDE, D: tl.constexpr,
                         MASKED: tl.constexpr):
    """FlashAttention's update of the running max m_i, sum l_i and output acc by one key block's scores and values
    (exp2: log2 e is folded into the scale). Masked values load as 0, so a key outside the segment adds nothing."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    ptr = v_ptr + keys.to(tl.int64)[:, None] * ROW_STRIDE + tl.arange(0, D)[None, :]
    if MASKED:
        v = tl.load(ptr, mask=key_ok[:, None], other=0.0)
    else:
        v = tl.load(ptr)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit(do_not_specialize=["last_slot", "ROWS"])
def _rope_varlen_attention_kernel(
    qkv_ptr, cos_ptr, sin_ptr, segment_ids_ptr, cu_seqlens_ptr, out_ptr,
    last_slot, qk_scale,
    part_ptr, stats_ptr, ROWS, qk_ptr,
    HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_STRIDE: tl.constexpr,
    ROTATE_Q: tl.constexpr = True, ROTATE_K: tl.constexpr = True, SPLIT: tl.constexpr = 1,
):
    """q and k are read from qk_ptr (row stride QK_STRIDE): qkv itself, rotated here, or the prerotated scratch;
    v always from qkv. Each segment's keys: the whole key blocks first, unmasked, then the partial last one."""
    D: tl.constexpr = 2 * HALF
    FULL: tl.constexpr = not ROTATE_Q and not ROTATE_K  # q and k already rotated: whole rows, one dot of width d
    ROW_STRIDE: tl.constexpr = 3 * HEADS * D  # qkv rows are [q heads | k heads | v heads]
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_rows = tl.load(cu_seqlens_ptr + last_slot)  # real rows; the padding after them is in no segment
    first = tl.program_id(0) * BLOCK_M
    if first >= num_rows:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    row_seg = tl.load(segment_ids_ptr + rows, mask=row_ok, other=-1)
    if FULL:
        q_ptr = qk_ptr + head * D + rows.to(tl.int64)[:, None] * QK_STRIDE + tl.arange(0, D)[None, :]
        qa = tl.load(q_ptr, mask=row_ok[:, None], other=0.0)
        qb = qa  # not read
    else:
        qa, qb = _rotate(qk_ptr + head * D, rows, row_ok, cos_ptr, sin_ptr, QK_STRIDE, HALF, ROTATE_Q)
    k_ptr = qk_ptr + (HEADS + head) * D
    v_ptr = qkv_ptr + (2 * HEADS + head) * D
    d = tl.arange(0, D)
    seg_first = tl.load(segment_ids_ptr + first)
    seg_last = tl.load(segment_ids_ptr + tl.minimum(first + BLOCK_M, num_rows) - 1)
    for seg in range(seg_first, seg_last + 1):
        key_start = tl.load(cu_seqlens_ptr + seg)
        key_end = tl.load(cu_seqlens_ptr + seg + 1)
        whole = (key_end - key_start) // BLOCK_N  # key blocks wholly inside the segment; split s takes s, s + S, …
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in range(key_start + split * BLOCK_N, key_start + whole * BLOCK_N, SPLIT * BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            key_ok = keys < key_end
            scores = _key_scores(qa, qb, k_ptr, keys, key_ok, cos_ptr, sin_ptr, qk_scale, QK_STRIDE, HALF,
                                 FULL, ROTATE_K, False)
            m_i, l_i, acc = _online_softmax_step(scores, m_i, l_i, acc, v_ptr, keys, key_ok, ROW_STRIDE, D, False)
        tail = key_start + whole * BLOCK_N
        if (tail < key_end) & (whole % SPLIT == split):  # the partial last block, masked, in the split its index has
            keys = tail + tl.arange(0, BLOCK_N)
            key_ok = keys < key_end
            scores = _key_scores(qa, qb, k_ptr, keys, key_ok, cos_ptr, sin_ptr, qk_scale, QK_STRIDE, HALF,
                                 FULL, ROTATE_K, True)
            m_i, l_i, acc = _online_softmax_step(scores, m_i, l_i, acc, v_ptr, keys, key_ok, ROW_STRIDE, D, True)
        store = row_ok & (row_seg == seg)
        if SPLIT == 1:
            dst = out_ptr + rows.to(tl.int64)[:, None] * (HEADS * D) + head * D + d[None, :]
            tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=store[:, None])
        else:  # partials, float32: [split, row, head, d] and [split, 2 (max, sum), row, head]
            part = (split.to(tl.int64) * ROWS + rows.to(tl.int64)) * HEADS + head
            tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=store[:, None])
            stat = (split.to(tl.int64) * 2 * ROWS + rows.to(tl.int64)) * HEADS + head
            tl.store(stats_ptr + stat, m_i, mask=store)
            tl.store(stats_ptr + stat + ROWS * HEADS, l_i, mask=store)


@triton.jit(do_not_specialize=["last_slot", "ROWS"])
def _combine_splits_kernel(part_ptr, stats_ptr, cu_seqlens_ptr, out_ptr, last_slot, ROWS,
                           HEADS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr):
    """out[row, head] from the SPLIT partials of each real row (module docstring); padding rows are left as they are."""
    head = tl.program_id(1)
    num_rows = tl.load(cu_seqlens_ptr + last_slot)
    first = tl.program_id(0) * BLOCK_M
    if first >= num_rows:
        return
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < num_rows
    d = tl.arange(0, D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLIT):
        m = tl.maximum(m, tl.load(stats_ptr + (s * 2 * ROWS + rows) * HEADS + head, mask=row_ok, other=0.0))
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(SPLIT):
        stat = (s * 2 * ROWS + rows) * HEADS + head
        weight = tl.exp2(tl.load(stats_ptr + stat, mask=row_ok, other=0.0) - m)
        total += weight * tl.load(stats_ptr + stat + ROWS * HEADS, mask=row_ok, other=0.0)
        part = (s * ROWS + rows) * HEADS + head
        acc += weight[:, None] * tl.load(part_ptr + part[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
    dst = out_ptr + rows[:, None] * (HEADS * D) + head * D + d[None, :]
    tl.store(dst, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def rotate_qk_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                     num_heads: int, block: int = ROTATE_ROWS, heads_per_program: int = 1,
                     num_warps: int = 4) -> torch.Tensor:
    """q̃, k̃ of every head, (rows, 2·heads·d) in qkv's dtype: the prerotated path's first launch. Rows past the real
    ones (``cu_seqlens[-1]`` on) are left uninitialised: they are in no segment, so the attention never reads them.
    ``block`` rows and ``heads_per_program`` heads a program (it must divide ``num_heads``), ``num_warps`` warps:
    what ``tools/rotate_ab.py`` times."""
    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    if num_heads % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} does not divide {num_heads} heads")
    qk = torch.empty((rows, 2 * num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_rotate_qk_kernel[(triton.cdiv(rows, block), num_heads // heads_per_program)](
        qkv, cos, sin, cu_seqlens, qk, cu_seqlens.shape[0] - 1, HEADS=num_heads, HALF=head_dim // 2, BLOCK=block,
        HEADS_PER_PROGRAM=heads_per_program, num_warps=num_warps)
    return qk


def rope_varlen_attention_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segment_ids: torch.Tensor,
                                 cu_seqlens: torch.Tensor, num_heads: int,
                                 config: AttnConfig | TmaConfig | None = None,
                                 rotated: bool = False) -> torch.Tensor:
    """Attention output (rows, heads·d) from the packed qkv projection (rows, 3·heads·d); see the module docstring.

    cos, sin: (rows, d) float32 from ``rotary_cos_sin``; segment_ids, cu_seqlens: int32 from the metadata. Rows
    outside every segment are left uninitialised. ``config=None``: the launch table's choice for the row count
    (:func:`glmvit.kernels.attention_table.config_for`); a ``TmaConfig`` runs the rotation launch, then
    ``glmvit.kernels.triton_attention_tma``'s kernel. ``rotated``: q and k in ``qkv`` are rotated already, so no
    configuration rotates (no rotation launch, no rotation in the loop): q̃ and k̃ are read from ``qkv`` itself.
    """
    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    out = torch.empty((rows, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return out
    if config is None:
        from .attention_table import config_for  # the table imports AttnConfig from here

        config = config_for(rows)
    if not isinstance(config, AttnConfig):  # a TmaConfig: the rotation launch, then the Hopper-shaped kernel
        from .triton_attention_tma import attend_prerotated_tma

        qk_tma = None if rotated else rotate_qk_triton(qkv, cos, sin, cu_seqlens, num_heads)
        return attend_prerotated_tma(qkv, qk_tma, cu_seqlens, num_heads, config, out=out)
    split = config.split_k
    if split > 1:  # every real row of every split is written (its max −∞ where a split has no keys of its segment)
        part = torch.empty((split, rows, num_heads, head_dim), dtype=torch.float32, device=qkv.device)
        stats = torch.empty((split, 2, rows, num_heads), dtype=torch.float32, device=qkv.device)
    else:
        part = stats = out  # not read
    last_slot = cu_seqlens.shape[0] - 1
    prerotated = config.prerotate or rotated  # q̃, k̃ read as they are: from the scratch, or from qkv when rotated
    qk = rotate_qk_triton(qkv, cos, sin, cu_seqlens, num_heads) if config.prerotate and not rotated else qkv
    blocks = triton.cdiv(rows, config.block_m)
    _rope_varlen_attention_kernel[(blocks, num_heads, split)](
        qkv, cos, sin, segment_ids, cu_seqlens, out,
        last_slot, math.log2(math.e) / math.sqrt(head_dim), part, stats, rows, qk,
        HEADS=num_heads, HALF=head_dim // 2, BLOCK_M=config.block_m, BLOCK_N=config.block_n, QK_STRIDE=qk.shape[1],
        ROTATE_Q=not prerotated, ROTATE_K=config.rotate_k and not prerotated, SPLIT=split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split > 1:
        _combine_splits_kernel[(blocks, num_heads)](part, stats, cu_seqlens, out, last_slot, rows,
                                                   HEADS=num_heads, D=head_dim, BLOCK_M=config.block_m, SPLIT=split)
    return out
