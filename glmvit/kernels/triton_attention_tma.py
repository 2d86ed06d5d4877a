"""Triton kernel: the prerotated varlen attention shaped for Hopper (tensor-memory-accelerator loads, a software
pipelined or warp-specialised key loop), beside ``glmvit.kernels.triton_attention``'s readable one. Timed by
``tools/attention_sweep.py`` and ``tools/tma_ab.py``; the model runs it for the row counts where the launch table
(``glmvit.kernels.attention_table.CONFIGS``) names a :class:`TmaConfig`.

Spec: the same as ``triton_attention``'s ``prerotate=True`` path. Given the packed qkv projection (rows, 3·heads·d)
and the scratch of rotated q̃, k̃ that ``rotate_qk_triton`` writes (rows, 2·heads·d), for every head and every real
row r of segment s, out[r] = softmax(q̃_r · K̃_sᵀ / √d) · V_s, where K̃_s, V_s hold only the rows of segment s
(``cu_seqlens[s] ≤ row < cu_seqlens[s + 1]``). Rows from ``cu_seqlens[-1]`` on (padding) are left as they were.

Work list: one program per (row block of one segment, head). A segment of n rows has ⌈n / BLOCK_M⌉ row blocks, all
inside it (the last one may run past its end: those rows are computed and not stored). Each program finds its
segment and block from ``cu_seqlens`` alone (per-segment block counts and their running sums, one masked
slots × slots sum), so the grid is static: ⌈rows / BLOCK_M⌉ + segment slots programs per head, an upper bound of
Σ ⌈nₛ / BLOCK_M⌉; the programs past the real blocks return at once (warp-specialised: load one q tile and stop).
Chosen over the readable kernel's loop over the segments a row block straddles: every program then runs exactly one
key loop, the shape of the tutorial kernel that the compiler pipelines and warp-specialises, and no program does
two segments' work while its neighbours do one.
The price is one partial row block per segment instead of per straddle (at most a block's worth of wasted rows per
segment; none where segments are multiples of BLOCK_M, e.g. 1024-row images at 64 or 128).

Loads. ``descriptors`` picks how tiles are read: ``host`` (``triton.tools.tensor_descriptor.TensorDescriptor``,
built on the host at each call from the tensors' pointers, so a CUDA graph captures it by value: graph-safe while
the pointers are the graph's static buffers), ``device`` (``tl.make_tensor_descriptor`` in the kernel; needs a
global-memory scratch for the descriptors, so this module registers a torch allocator with ``triton.set_allocator``
on first use; the tutorial's route for warp specialisation on Hopper, where host descriptors fail to compile), or
``pointer`` (plain ``tl.load``; the same index arithmetic with a TMA's semantics: rows past the tensor's end read
as zero, rows inside it read as they are, whichever segment they belong to). q̃ and k̃ tiles come from the scratch
at column (head, heads + head)·d, v tiles from qkv at column (2·heads + head)·d.

Keys of a segment: its whole key blocks first, unmasked (no masks, no selects: the loop the compiler pipelines),
then the partial last block once. That tail block is loaded whole, so its rows past the segment's end are another
segment's (or padding) rows, possibly NaN or Inf: their scores are replaced (``tl.where``, a select, not arithmetic)
by −inf, giving p = 0, AND their v rows are replaced by zeros, because p·v with p = 0 is NaN for a NaN v. So nothing
of one segment reaches another, as in the readable kernel.

Warp specialisation (``warp_specialize=True``) needs a kernel the compiler's Hopper specialiser can split (checked by
compiling for sm_90 with Triton 3.6 and 3.9): one loop and nothing around it, so that variant masks every key block
in its single loop instead of only a tail step after it (the specialiser fails on a step after the loop and leaves
the loop whole with a tail ``if``), gives a spare program an empty key range instead of returning early, and the
work list avoids ``tl.cumsum`` (the specialiser cannot place a scan's body) in every variant.

Softmax: the online one (running max and sum per row), exp2 with log2 e and 1/√d folded into one scale, float32
statistics and accumulator, the accumulator carried through the dot (``tl.dot(p, v, acc)``), p rounded to v's dtype
before it. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (fp32), all three load paths included.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch_checks import check_launch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4 has no host-side tensor descriptors: only ``device``/``pointer`` configs run
    TensorDescriptor = None

DESCRIPTORS = ("host", "device", "pointer")


@dataclass(frozen=True)
class TmaConfig:
    """One launch configuration: BLOCK_M query rows per program, BLOCK_N keys per step, ``num_stages`` for the key
    loop's software pipeline, ``warp_specialize`` for its producer/consumer split, and the load path (module
    docstring). ``name`` spells it for tables, e.g. ``128x128w8s2h`` or ``128x128w8s2d-ws``."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    descriptors: str = "host"
    warp_specialize: bool = False

    def __post_init__(self) -> None:
        if self.descriptors not in DESCRIPTORS:
            raise ValueError(f"descriptors={self.descriptors!r}: choose one of {DESCRIPTORS}")
        check_launch(self, ("block_m", "block_n"), ("num_warps", "num_stages"))

    @property
    def name(self) -> str:
        ws = "-ws" if self.warp_specialize else ""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}{self.descriptors[0]}{ws}"


# What the sweep and the A/B time: the tutorial's Hopper shapes (128×128 with 8 warps, 128×64 with 4; 128×64 with 8
# is what the readable kernel measured best), pipelined 2 or 3 deep, and the pointer path at the readable kernel's
# best shape: the work list without TMA, to tell the two gains apart. The warp-specialised variants are left out: on
# the H200, Triton 3.6 failed to build both (128x64w4s3d-ws, 128x128w4s2d-ws) at launch ("PassManager::run failed",
# data/sweeps/tma_ab_h200.json); the interpreter tests keep their arithmetic checked.
SWEEP_CONFIGS = (
    TmaConfig(128, 64, 8, 3, "pointer"),
    TmaConfig(128, 64, 8, 3),
    TmaConfig(128, 64, 4, 3),
    TmaConfig(128, 128, 8, 2),
    TmaConfig(128, 128, 8, 3),
)


@triton.jit
def _tile(src, row, col, ROWS, STRIDE: tl.constexpr, R: tl.constexpr, C: tl.constexpr, DESC: tl.constexpr,
          BOUNDED: tl.constexpr):
    """The (R, C) tile at (row, col) of a (ROWS, STRIDE) row-major tensor: through the descriptor ``src`` or, with
    DESC False, from the pointer ``src`` as a TMA reads it (``BOUNDED``: rows past ROWS are zero; otherwise the
    caller knows every row is inside the tensor)."""
    if DESC:
        return src.load([row, col])
    else:
        rows = row + tl.arange(0, R)
        ptr = src + rows.to(tl.int64)[:, None] * STRIDE + col + tl.arange(0, C)[None, :]
        if BOUNDED:
            return tl.load(ptr, mask=(rows < ROWS)[:, None], other=0.0)
        else:
            return tl.load(ptr)


@triton.jit
def _softmax_step(q, k_src, v_src, key, key_end, m_i, l_i, acc, qk_scale, ROWS,
                  QK_STRIDE: tl.constexpr, V_STRIDE: tl.constexpr, k_col, v_col,
                  D: tl.constexpr, BLOCK_N: tl.constexpr, DESC: tl.constexpr, TAIL: tl.constexpr):
    """One key block at ``key``: scores, the online-softmax update, acc += p·v. ``TAIL``: the block runs past the
    segment's end (``key_end``): its foreign keys score −inf and its foreign v rows become zeros (module docstring)."""
    k = _tile(k_src, key, k_col, ROWS, QK_STRIDE, BLOCK_N, D, DESC, TAIL)
    qk = tl.dot(q, tl.trans(k))  # unscaled: the scale goes into the max and into one multiply-add per score
    if TAIL:
        inside = (key + tl.arange(0, BLOCK_N)) < key_end
        qk = tl.where(inside[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    v = _tile(v_src, key, v_col, ROWS, V_STRIDE, BLOCK_N, D, DESC, TAIL)
    if TAIL:
        v = tl.where(inside[:, None], v, 0.0)  # 0·NaN is NaN: p = 0 alone does not keep a foreign NaN out
    acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["ROWS"])
def _varlen_attention_tma_kernel(
    q_src, k_src, v_src, cu_seqlens_ptr, out_ptr, qk_scale, ROWS,
    SEGMENTS: tl.constexpr, SLOTS: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, QK_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    DESCRIPTORS: tl.constexpr,
):
    """One (row block of one segment, head) per program (module docstring). q_src, k_src: the rotated scratch
    (ROWS, QK_STRIDE = 2·HEADS·D) or qkv rotated already (QK_STRIDE = 3·HEADS·D: q̃, k̃ in the same columns),
    v_src: qkv (ROWS, 3·HEADS·D), each a host descriptor or a pointer. SEGMENTS: segment slots (``cu_seqlens`` has
    SEGMENTS + 1 entries), SLOTS: a power of two ≥ SEGMENTS."""
    V_STRIDE: tl.constexpr = 3 * HEADS * D
    DESC: tl.constexpr = DESCRIPTORS != "pointer"
    head = tl.program_id(1)
    work = tl.program_id(0)

    # The work list: segment s has ⌈nₛ / BLOCK_M⌉ row blocks; program `work` takes block `work` of their concatenation.
    slot = tl.arange(0, SLOTS)
    seg_start = tl.load(cu_seqlens_ptr + slot, mask=slot < SEGMENTS, other=0)
    seg_end = tl.load(cu_seqlens_ptr + slot + 1, mask=slot < SEGMENTS, other=0)
    blocks = (seg_end - seg_start + BLOCK_M - 1) // BLOCK_M
    # Row blocks of segments 0..s, as a (SLOTS, SLOTS) masked sum rather than tl.cumsum: the warp specialiser cannot
    # place a scan's body.
    blocks_through = tl.sum(tl.where(slot[None, :] <= slot[:, None], blocks[None, :], 0), 1)
    seg = tl.sum((blocks_through <= work).to(tl.int32), 0)  # the first segment whose blocks reach past `work`
    if WARP_SPECIALIZE:  # no branch around the loop (the specialiser takes none): a spare program gets no keys
        live = seg < SEGMENTS
        seg = tl.minimum(seg, SEGMENTS - 1)
    else:
        if seg >= SEGMENTS:
            return  # past the real row blocks: padding rows and the grid's spare programs
    this = slot == seg
    key_start = tl.sum(tl.where(this, seg_start, 0), 0)
    key_end = tl.sum(tl.where(this, seg_end, 0), 0)
    if WARP_SPECIALIZE:
        key_end = tl.where(live, key_end, key_start)
    first = key_start + (work - tl.sum(tl.where(this, blocks_through - blocks, 0), 0)) * BLOCK_M

    if DESCRIPTORS == "device":
        q_src = tl.make_tensor_descriptor(q_src, shape=[ROWS, QK_STRIDE], strides=[QK_STRIDE, 1],
                                          block_shape=[BLOCK_M, D])
        k_src = tl.make_tensor_descriptor(k_src, shape=[ROWS, QK_STRIDE], strides=[QK_STRIDE, 1],
                                          block_shape=[BLOCK_N, D])
        v_src = tl.make_tensor_descriptor(v_src, shape=[ROWS, V_STRIDE], strides=[V_STRIDE, 1],
                                          block_shape=[BLOCK_N, D])
    # Rows of the block past the segment's end are another segment's q̃ (or zeros past the tensor): each row's
    # softmax is its own, so they only make rows that are not stored.
    q = _tile(q_src, first, head * D, ROWS, QK_STRIDE, BLOCK_M, D, DESC, True)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if WARP_SPECIALIZE:  # one loop over every key block, each masked: the specialiser takes no step after it
        for block in tl.range(0, (key_end - key_start + BLOCK_N - 1) // BLOCK_N, num_stages=NUM_STAGES,
                              warp_specialize=True):
            m_i, l_i, acc = _softmax_step(q, k_src, v_src, key_start + block * BLOCK_N, key_end, m_i, l_i, acc,
                                          qk_scale, ROWS, QK_STRIDE, V_STRIDE, (HEADS + head) * D,
                                          (2 * HEADS + head) * D, D, BLOCK_N, DESC, True)
    else:
        whole = (key_end - key_start) // BLOCK_N
        for block in tl.range(0, whole, num_stages=NUM_STAGES):
            m_i, l_i, acc = _softmax_step(q, k_src, v_src, key_start + block * BLOCK_N, key_end, m_i, l_i, acc,
                                          qk_scale, ROWS, QK_STRIDE, V_STRIDE, (HEADS + head) * D,
                                          (2 * HEADS + head) * D, D, BLOCK_N, DESC, False)
        tail = key_start + whole * BLOCK_N
        if tail < key_end:
            m_i, l_i, acc = _softmax_step(q, k_src, v_src, tail, key_end, m_i, l_i, acc,
                                          qk_scale, ROWS, QK_STRIDE, V_STRIDE, (HEADS + head) * D,
                                          (2 * HEADS + head) * D, D, BLOCK_N, DESC, True)
    rows = first + tl.arange(0, BLOCK_M)
    dst = out_ptr + rows.to(tl.int64)[:, None] * (HEADS * D) + head * D + tl.arange(0, D)[None, :]
    tl.store(dst, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=(rows < key_end)[:, None])


def _scratch_for_descriptors(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory that device-side ``tl.make_tensor_descriptor`` writes its descriptors into (one launch's)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """``device`` descriptors need a Triton allocator. Triton keeps it in a context variable, so a thread that did
    not set it has none: set before every such launch (a context variable's set, nanoseconds), in the launching
    thread."""
    triton.set_allocator(_scratch_for_descriptors)


def attend_prerotated_tma(qkv: torch.Tensor, qk_scratch: torch.Tensor | None, cu_seqlens: torch.Tensor,
                          num_heads: int, config: TmaConfig | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output (rows, heads·d) from the packed qkv projection (rows, 3·heads·d) and the rotated scratch
    (rows, 2·heads·d) of ``rotate_qk_triton``; see the module docstring. ``qk_scratch=None``: q̃ and k̃ are qkv's
    own q and k columns, rotated already (the fused rotary qkv GEMM), read at row stride 3·heads·d. ``out``: written
    in place when given (its padding rows keep what they held), else a fresh uninitialised tensor. cu_seqlens:
    int32, segment slots + 1."""
    config = config or TmaConfig()
    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    if qk_scratch is not None and (qk_scratch.shape != (rows, 2 * num_heads * head_dim)
                                   or not qk_scratch.is_contiguous()):
        want = (rows, 2 * num_heads * head_dim)
        raise ValueError(f"qk_scratch {tuple(qk_scratch.shape)}: want a contiguous {want}")
    if not qkv.is_contiguous():
        raise ValueError("qkv must be contiguous: its tiles are read by row stride 3·heads·d")
    qk = qkv if qk_scratch is None else qk_scratch
    if out is None:
        out = torch.empty((rows, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return out
    srcs: tuple = (qk, qk, qkv)
    if config.descriptors == "host":
        if TensorDescriptor is None:
            raise RuntimeError("host descriptors need triton.tools.tensor_descriptor (Triton 3.4 or newer)")
        shapes = ((config.block_m, head_dim), (config.block_n, head_dim), (config.block_n, head_dim))
        srcs = tuple(TensorDescriptor.from_tensor(t, list(block)) for t, block in zip(srcs, shapes, strict=True))
    elif config.descriptors == "device" and qkv.is_cuda:
        _ensure_allocator()
    segments = cu_seqlens.shape[0] - 1
    grid = (triton.cdiv(rows, config.block_m) + segments, num_heads)
    _varlen_attention_tma_kernel[grid](
        *srcs, cu_seqlens, out, math.log2(math.e) / math.sqrt(head_dim), rows,
        SEGMENTS=segments, SLOTS=triton.next_power_of_2(max(segments, 2)), HEADS=num_heads, D=head_dim,
        QK_STRIDE=qk.shape[1],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, NUM_STAGES=config.num_stages,
        WARP_SPECIALIZE=config.warp_specialize, DESCRIPTORS=config.descriptors,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
