"""Triton kernel: the attention's qkv projection, x · Wᵀ, whose epilogue rotates q and k (2D rotary, NeoX half-split)
and leaves v as the matmul gives it, in place of cuBLAS's ``qkv`` then the separate rotation launch
``rotate_qk_triton``; timed by ``tools/qkv_rope_ab.py``; the model runs it where ``fused_gemm_table`` says (from
``QKV_ROPE_MIN_ROWS`` rows, in ``QKV_ROPE``'s configuration).

Spec: ``qkv_rope_linear_triton(x, weight, cos, sin, num_heads, config)`` with x (M, K), ``weight`` (3·heads·d, K)
(output columns [q: heads × d | k: heads × d | v: heads × d], each weight row one output column) and cos, sin
(M, d) float32 (``glmvit.rotary.rotary_cos_sin``'s tables, the same for every head): with y = x · Wᵀ exact and
y₁, y₂ the two halves of one head's d columns (first d/2, last d/2), the q and k columns of every head are

    out₁ = y₁·cos₁ − y₂·sin₁,   out₂ = y₂·cos₂ + y₁·sin₂      (cos₁ = cos[:, :d/2], cos₂ = cos[:, d/2:], sin alike)

— ``glmvit.rotary.apply_rotary`` on (x·Wᵀ)'s q and k, which does not assume the tables' halves equal, so neither
does this, unless a configuration says ``equal_halves`` — and the v columns are y. out is (M, 3·heads·d) in x's
dtype; x, weight same dtype and device, all four contiguous; d even, a power of two, at least 32 (the tile's halves
are d/2 wide: tl.arange and the MMA's N ≥ 16); M = 0 gives an empty output.

Why: the unfused path writes the (M, 3·heads·d) projection, then a second launch reads q and k back, rotates them
and writes them again into a (M, 2·heads·d) scratch: at 8192 rows (8 × 448² images) 48 MiB read and 48 MiB written,
~30 µs a layer on the H200, 0.7 ms per 24-layer forward, a DRAM round trip the fused epilogue does not make (the
cos/sin tables, 8 MiB at 8192 rows, are re-read per q or k head tile, from L2). Worth it only if the matmul stays as
fast as cuBLAS's.

How (``glmvit.kernels.triton_swiglu_gemm``'s GEMM, Triton's matmul tutorials shaped for Hopper): one program per
BLOCK_M × d output tile — one whole head of q, k or v, so the rotation's two halves are in the same program — in
groups of GROUP_M row tiles (a group's programs share x rows and W columns in L2), or with ``persistent=True`` one
program per multiprocessor walking the tiles of that order; a K loop of BLOCK_K steps, ``num_stages`` deep. Two
float32 accumulators fed by the same x tile, one per half of the head (acc₁ over columns [h·d, h·d + d/2), acc₂ over
[h·d + d/2, (h+1)·d)), as the SwiGLU GEMM's gate and up; ``one_dot=True`` instead computes the head in one
accumulator of width d (one MMA of N = d, as cuBLAS would) and splits it in registers (reshape, permute, split),
then joins the rotated halves back for one store: which compiles to less work on sm_90 is the A/B's to say.
``tma=True`` loads x and W tiles and stores the output through host-built tensor descriptors
(``triton.tools.tensor_descriptor.TensorDescriptor``: one TMA copy per tile on Hopper, zero-filled past the edges;
rows must be a multiple of 16 bytes, so K a multiple of 8 in bf16); ``tma=False`` loads through masked pointers.
cos and sin are loaded through pointers in the epilogue (float32, the tile's rows). The descriptors hold the tensors'
addresses by value, so a CUDA graph that captures a launch keeps them, as it keeps the tensors. Shared memory per
stage: one x tile and the head's d weight rows, (BLOCK_M + d)·BLOCK_K elements.

Numerics (matters for adoption): the accumulators are float32, the rotation is computed in float32 from them and
the result is rounded ONCE to the output dtype. The model's unfused bf16 path rounds q and k twice: cuBLAS rounds
x·Wᵀ to bf16, then ``rotate_qk_triton`` rotates the rounded values in float32 and rounds again. So this kernel's q̃,
k̃ are within one bf16 rounding of the float32 rotation of the float32 product; the unfused path's are within about
two (the first rounding, 2⁻⁹ relative per element, moves each rotated element by up to 2⁻⁹·(|y₁| + |y₂|)); v is one
rounding in both. Adopting it changes the model's bf16 output bitwise (recorded results and their error bands must
be re-read), not its float32 contract.

What a downstream attention must then do: treat q and k as prerotated. The output holds q̃ and k̃ in the q and k
columns of a qkv-shaped (M, 3·heads·d) tensor, so the attention must not rotate again: the model's ``Attention.heads``
passes ``rotated=True`` to ``glmvit.attention.attend_qkv`` after this GEMM, and every backend then reads q̃, k̃ where
they are (no ``rotate_qk_triton`` launch).
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (fp32), both load paths, both grids and ``one_dot`` included.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch_checks import check_launch, check_tma_operands
from .tile_order import grouped_tile

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4 has no host-side tensor descriptors: only ``tma=False`` configs run
    TensorDescriptor = None


@dataclass(frozen=True)
class QkvRopeConfig:
    """One launch configuration: a BLOCK_M × d output tile (one head of q, k or v; d comes from the weight), K steps
    of BLOCK_K, ``num_stages`` deep, GROUP_M row tiles per group, TMA or pointer loads, two accumulators or one
    (module docstring). ``name`` spells it for tables, e.g. ``128xdx64w8s4t`` (``t`` TMA, ``p`` pointers;
    ``-1dot`` for one accumulator, ``-persistent`` for a persistent grid)."""

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 8
    tma: bool = True
    persistent: bool = False  # one program per multiprocessor walking the tiles (tutorial 09) instead of one per tile
    one_dot: bool = False  # one accumulator of width d split in registers, instead of one per half
    # Heads a tile (1 or 2): with 2, one accumulator of width 2·d (``one_dot`` only), one MMA of N = 2·d per K step
    # (as the SwiGLU GEMM's packed tile: a Hopper wgmma reads its x tile once for 256 columns), and the tile's cos
    # and sin rows loaded once for both heads
    heads_per_tile: int = 1
    # The tables' two halves are equal (``glmvit.rotary.rotary_cos_sin`` repeats its angles: [h | w | h | w]), so the
    # epilogue loads cos₁ and sin₁ only and uses them for both halves: half the table bytes a tile. A contract on
    # the caller's tables, which the kernel cannot check (tables with unequal halves give ``first-half-tables``'s
    # answer: tests/test_triton_qkv_rope_gemm.py)
    equal_halves: bool = False

    def __post_init__(self) -> None:
        check_launch(self, ("block_m", "block_k"), ("num_warps", "num_stages", "group_m"))
        if self.heads_per_tile not in (1, 2) or (self.heads_per_tile == 2 and not self.one_dot):
            raise ValueError(f"{self.name}: heads_per_tile is 1, or 2 with one_dot=True (one accumulator for both)")

    @property
    def name(self) -> str:
        return (f"{self.block_m}xdx{self.block_k}w{self.num_warps}s{self.num_stages}{'t' if self.tma else 'p'}"
                f"{'-1dot' if self.one_dot else ''}{'-persistent' if self.persistent else ''}"
                f"{'-2h' if self.heads_per_tile == 2 else ''}{'-eq' if self.equal_halves else ''}")

    def shared_bytes(self, head_dim: int = 128, element_size: int = 2) -> int:
        """The pipeline's shared memory: ``num_stages`` × (x tile + the head's d weight rows). The compiler adds
        its barriers, and stages the epilogue (the TMA store's output tile, layout conversions) in these buffers
        once the loop is done (a persistent program, whose next tile's loads may be in flight, in its own)."""
        return self.num_stages * (self.block_m + self.heads_per_tile * head_dim) * self.block_k * element_size


# What tools/qkv_rope_ab.py times. Shared memory in bf16 at d = 128 (H100/H200 allow 227 KiB a block): a 128-row
# tile with BLOCK_K 64 is 32 KiB a stage, so 3 or 4 stages (96, 128 KiB); BLOCK_K 128 is 64 KiB, 3 stages
# (192 KiB); a 64-row tile 24 KiB, 4 stages (checked by compiling for sm_90: tools/qkv_rope_ab.py --compile-only).
# The 64-row tile is for few rows: 256 rows are 2 × 36 = 72 tiles of 128 rows for 132 multiprocessors, 144 of 64.
# The pointer twin of the first shows what TMA buys, its persistent twin what tutorial 09's grid does, its one-dot
# twin whether one MMA of N = d beats two of d/2.
SWEEP_CONFIGS = (
    QkvRopeConfig(128, 64, 8, 4),
    QkvRopeConfig(128, 64, 8, 3),
    QkvRopeConfig(128, 64, 4, 4),
    QkvRopeConfig(128, 128, 8, 3),
    QkvRopeConfig(64, 64, 4, 4),
    QkvRopeConfig(128, 64, 8, 4, one_dot=True),
    QkvRopeConfig(128, 64, 8, 4, tma=False),
    QkvRopeConfig(128, 64, 8, 4, persistent=True),
    QkvRopeConfig(128, 64, 8, 4, one_dot=True, persistent=True),
    QkvRopeConfig(128, 64, 8, 3, one_dot=True, heads_per_tile=2),
    QkvRopeConfig(128, 64, 8, 3, one_dot=True, persistent=True, heads_per_tile=2),
    QkvRopeConfig(64, 64, 4, 4, one_dot=True, heads_per_tile=2),
    QkvRopeConfig(128, 64, 8, 2, one_dot=True, persistent=True, heads_per_tile=2),
    QkvRopeConfig(128, 64, 8, 3, one_dot=True, heads_per_tile=2, equal_halves=True),
    QkvRopeConfig(128, 64, 8, 3, one_dot=True, persistent=True, heads_per_tile=2, equal_halves=True),
    QkvRopeConfig(128, 64, 8, 4, one_dot=True, persistent=True, equal_halves=True),
)


@triton.jit
def _qkv_rope_gemm_kernel(x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, x_desc, w_desc, y_desc, M, K,
                          HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, TMA: tl.constexpr, ONE_DOT: tl.constexpr,
                          PERSISTENT: tl.constexpr = False, HPT: tl.constexpr = 1, EQ: tl.constexpr = False):
    if PERSISTENT:  # a grid of at most one program per multiprocessor, each walking tiles pid, pid + grid, …
        tiles = tl.cdiv(M, BLOCK_M) * (3 * HEADS // HPT)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0)):
            _qkv_rope_tile(tile, x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, x_desc, w_desc, y_desc, M, K,
                           HEADS, HALF, BLOCK_M, BLOCK_K, GROUP_M, TMA, ONE_DOT, HPT, EQ)
    else:
        _qkv_rope_tile(tl.program_id(0), x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, x_desc, w_desc, y_desc, M, K,
                       HEADS, HALF, BLOCK_M, BLOCK_K, GROUP_M, TMA, ONE_DOT, HPT, EQ)


@triton.jit
def _qkv_rope_tile(pid, x_ptr, w_ptr, y_ptr, cos_ptr, sin_ptr, x_desc, w_desc, y_desc, M, K,
                   HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, TMA: tl.constexpr, ONE_DOT: tl.constexpr, HPT: tl.constexpr,
                   EQ: tl.constexpr):
    """Output tile number ``pid`` of the grouped order: rows of one row tile, the d columns of HPT heads."""
    D: tl.constexpr = 2 * HALF
    N: tl.constexpr = 3 * HEADS * D
    W: tl.constexpr = HPT * D  # the tile's columns
    # Grouped order (tutorial 03): GROUP_M row tiles walk the column tiles together, so their W tiles stay in L2.
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), 3 * HEADS // HPT, GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * W

    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    ks = tl.arange(0, BLOCK_K)
    halves = tl.arange(0, HALF)
    # q and k heads are rotated, v heads are not: a runtime branch on the tile's column, uniform over the program
    # (no divergence), rather than the same formula with cos = 1, sin = 0, which would still load the two float32
    # (BLOCK_M, d) tables — four times the bf16 output tile's bytes — and do the six flops per element for nothing.
    rotate = col0 < 2 * HEADS * D
    if ONE_DOT:  # one accumulator over the tile's heads' columns, split into their halves in registers
        acc = tl.zeros([BLOCK_M, W], tl.float32)
        for k in range(0, K, BLOCK_K):
            if TMA:  # one copy per tile; rows and K past a tensor's edge read as zeros
                x = x_desc.load([row0, k])
                w = w_desc.load([col0, k])
            else:
                kk = k + ks
                x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :],
                            mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
                cols = col0 + tl.arange(0, W)
                w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + kk[None, :], mask=kk[None, :] < K, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc)
        if rotate and HPT == 1:
            a1, a2 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            o1, o2 = _rotate_halves(a1, a2, rows, row_ok, cos_ptr, sin_ptr, HALF, EQ)
            out = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_M, D)).to(y_ptr.dtype.element_ty)
        elif rotate:  # (row, head, half, j) → each head's halves, rotated with the same rows of cos and sin
            a1, a2 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, HPT, 2, HALF)), (0, 1, 3, 2)))
            o1, o2 = _rotate_halves_heads(a1, a2, rows, row_ok, cos_ptr, sin_ptr, HALF, EQ)
            out = tl.reshape(tl.permute(tl.join(o1, o2), (0, 1, 3, 2)), (BLOCK_M, W)).to(y_ptr.dtype.element_ty)
        else:
            out = acc.to(y_ptr.dtype.element_ty)  # the one rounding
        if TMA:  # clipped at the tensor's edge
            y_desc.store([row0, col0], out)
        else:
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + col0 + tl.arange(0, W)[None, :], out,
                     mask=row_ok[:, None])
    else:  # two accumulators, one per half of the head, fed by the same x tile
        a1 = tl.zeros([BLOCK_M, HALF], tl.float32)
        a2 = tl.zeros([BLOCK_M, HALF], tl.float32)
        for k in range(0, K, BLOCK_K):
            if TMA:
                x = x_desc.load([row0, k])
                w1 = w_desc.load([col0, k])
                w2 = w_desc.load([col0 + HALF, k])
            else:
                kk = k + ks
                x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :],
                            mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
                w_off = (col0 + halves).to(tl.int64)[:, None] * K + kk[None, :]
                w1 = tl.load(w_ptr + w_off, mask=kk[None, :] < K, other=0.0)
                w2 = tl.load(w_ptr + w_off + HALF * K, mask=kk[None, :] < K, other=0.0)
            a1 = tl.dot(x, tl.trans(w1), a1)
            a2 = tl.dot(x, tl.trans(w2), a2)
        if rotate:
            o1, o2 = _rotate_halves(a1, a2, rows, row_ok, cos_ptr, sin_ptr, HALF, EQ)
        else:
            o1 = a1
            o2 = a2
        o1 = o1.to(y_ptr.dtype.element_ty)  # the one rounding
        o2 = o2.to(y_ptr.dtype.element_ty)
        if TMA:
            y_desc.store([row0, col0], o1)
            y_desc.store([row0, col0 + HALF], o2)
        else:
            dst = y_ptr + rows.to(tl.int64)[:, None] * N + col0 + halves[None, :]
            tl.store(dst, o1, mask=row_ok[:, None])
            tl.store(dst + HALF, o2, mask=row_ok[:, None])


@triton.jit
def _rotate_halves(a1, a2, rows, row_ok, cos_ptr, sin_ptr, HALF: tl.constexpr, EQ: tl.constexpr = False):
    """(a₁·cos₁ − a₂·sin₁, a₂·cos₂ + a₁·sin₂) in float32 for the tile's rows; cos/sin are (M, d) float32. ``EQ``:
    cos₂ = cos₁ and sin₂ = sin₁ (QkvRopeConfig.equal_halves), not loaded."""
    trig = rows.to(tl.int64)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + trig, mask=row_ok[:, None], other=0.0)
    s1 = tl.load(sin_ptr + trig, mask=row_ok[:, None], other=0.0)
    if EQ:
        return a1 * c1 - a2 * s1, a2 * c1 + a1 * s1
    c2 = tl.load(cos_ptr + trig + HALF, mask=row_ok[:, None], other=0.0)
    s2 = tl.load(sin_ptr + trig + HALF, mask=row_ok[:, None], other=0.0)
    return a1 * c1 - a2 * s1, a2 * c2 + a1 * s2


@triton.jit
def _rotate_halves_heads(a1, a2, rows, row_ok, cos_ptr, sin_ptr, HALF: tl.constexpr, EQ: tl.constexpr):
    """:func:`_rotate_halves` for (BLOCK_M, heads, d/2) halves: every head of a row takes the row's cos and sin."""
    trig = rows.to(tl.int64)[:, None] * (2 * HALF) + tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + trig, mask=row_ok[:, None], other=0.0)[:, None, :]
    s1 = tl.load(sin_ptr + trig, mask=row_ok[:, None], other=0.0)[:, None, :]
    if EQ:
        return a1 * c1 - a2 * s1, a2 * c1 + a1 * s1
    c2 = tl.load(cos_ptr + trig + HALF, mask=row_ok[:, None], other=0.0)[:, None, :]
    s2 = tl.load(sin_ptr + trig + HALF, mask=row_ok[:, None], other=0.0)[:, None, :]
    return a1 * c1 - a2 * s1, a2 * c2 + a1 * s2


INTERPRETER_PROGRAMS = 3  # a persistent grid on the CPU: few enough that every program walks several tiles


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def descriptors(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, head_dim: int,
                config: QkvRopeConfig) -> tuple:
    """Host tensor descriptors for x (BLOCK_M × BLOCK_K tiles), weight (w × BLOCK_K) and y (BLOCK_M × w), w the
    head's half (two accumulators) or the whole head (``one_dot``); one-line errors for what TMA cannot take."""
    if TensorDescriptor is None:
        raise RuntimeError(f"{config.name}: this Triton has no triton.tools.tensor_descriptor; use tma=False")
    check_tma_operands(config.name, (("x", x), ("weight", weight), ("out", y)))
    bm, bk = config.block_m, config.block_k
    width = config.heads_per_tile * head_dim if config.one_dot else head_dim // 2
    return (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight, [width, bk]),
            TensorDescriptor.from_tensor(y, [bm, width]))


def _check(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> int:
    """The head_dim the shapes imply, or a one-line ValueError naming what is wrong."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"qkv_rope_linear_triton needs x (M, K) and weight (3·heads·d, K): got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if num_heads < 1 or weight.shape[0] % (3 * num_heads):
        raise ValueError(f"weight {tuple(weight.shape)}: rows must be 3·heads·d for num_heads={num_heads}")
    head_dim = weight.shape[0] // (3 * num_heads)
    if head_dim < 32 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim}: must be a power of two, at least 32 (its halves are MMA tiles)")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x and weight differ: x {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}")
    for label, t in (("cos", cos), ("sin", sin)):
        if t.shape != (x.shape[0], head_dim) or t.dtype != torch.float32 or t.device != x.device:
            raise ValueError(f"{label} must be ({x.shape[0]}, {head_dim}) float32 on {x.device}: got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}")
    for label, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        if not t.is_contiguous():
            raise ValueError(f"qkv_rope_linear_triton needs contiguous tensors: {label} is not")
    return head_dim


def qkv_rope_linear_triton(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           num_heads: int, config: QkvRopeConfig | None = None) -> torch.Tensor:
    """x · Wᵀ → (M, 3·heads·d) in x's dtype with q and k of every head rotated by cos, sin (M, d) float32 and v
    as the matmul gives it (module docstring: float32 accumulation and rotation, one rounding). None:
    ``SWEEP_CONFIGS[0]``."""
    config = SWEEP_CONFIGS[0] if config is None else config
    head_dim = _check(x, weight, cos, sin, num_heads)
    if num_heads % config.heads_per_tile:
        raise ValueError(f"{config.name}: {num_heads} heads do not fill tiles of {config.heads_per_tile}")
    m, k = x.shape
    y = torch.empty((m, weight.shape[0]), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    descs: tuple = (x, weight, y)  # not read without TMA
    if config.tma:
        descs = descriptors(x, weight, y, head_dim, config)
    tiles = triton.cdiv(m, config.block_m) * 3 * num_heads // config.heads_per_tile
    if config.persistent:
        tiles = min(tiles, _multiprocessors(x.device))
    _qkv_rope_gemm_kernel[(tiles,)](
        x, weight, y, cos, sin, *descs, m, k,
        HEADS=num_heads, HALF=head_dim // 2, BLOCK_M=config.block_m, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        TMA=config.tma, ONE_DOT=config.one_dot, PERSISTENT=config.persistent, HPT=config.heads_per_tile,
        EQ=config.equal_halves,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
