"""Triton kernel: the MLP's first half, silu(x · Wgᵀ) · (x · Wuᵀ), in one matmul whose epilogue is the SwiGLU.
The model runs it (``glmvit.model.SwiGLU``) on sm_90+ CUDA in fp16/bf16 from ``fused_gemm_table.SWIGLU_MIN_ROWS``
rows on, in place of cuBLAS's ``gate_up_proj`` then a separate SwiGLU kernel; timed against that path by
``tools/swiglu_ab.py``.

Spec: ``swiglu_linear_triton(x, weight, config)`` with x (M, K) and ``weight`` (2·H, K) holding gate and up rows
(each row one output column) as ``glmvit.gate_up`` lays them out: a ``packed`` configuration reads the weight packed in
tiles of its ``block_n`` (each tile's block_n gate rows, then its block_n up rows: ``pack_gate_up``), which is how the
model stores the blocks' MLP weight (``glmvit.gate_up.fuse_gate_up``, tiles of ``fused_gemm_table.PACK_TILE``); any
other configuration reads it stacked plainly (gate rows 0 … H−1, then up rows H … 2H−1: a tile of the whole width,
how the model stores an MLP whose width is not a multiple of PACK_TILE). Written for the plain layout,
out[m, j] = silu(g) · u with g = Σₖ x[m, k]·W[j, k], u = Σₖ x[m, k]·W[H + j, k]; out is (M, H) in x's dtype, in plain
column order for either layout. Both tensors contiguous, same dtype, same device; M = 0 gives an empty output.

Why: the unfused path writes the (M, 2H) gate_up product and a second kernel reads it back and writes (M, H): at
8×448² rows (8192 × 8192 bf16) that round trip is a DRAM-bound kernel of its own. Here each program computes the
gate tile AND the matching up tile (two float32 accumulators fed by the same x tile) and stores only their SwiGLU:
half the bytes written, the second kernel gone — worth it only if the matmul stays as fast as cuBLAS's.

How (Triton's matmul tutorials, shaped for Hopper): one program per BLOCK_M × BLOCK_N output tile, programs ordered
in groups of GROUP_M row tiles (a group's programs share x rows and W columns in L2), or with ``persistent=True``
one program per multiprocessor walking the tiles of that order pid, pid + grid, … (tutorial 09's grid); a K loop of
BLOCK_K steps, software-pipelined ``num_stages`` deep. ``tma=True`` loads x, Wg and Wu tiles and stores the output
tile through host-built tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``: one TMA copy per
tile on Hopper, zero-filled past the tensors' edges; rows must be a multiple of 16 bytes, so K and H a multiple of 8
in bf16); the gate and up descriptors are views of the two halves, so a gate tile never reads up rows. ``tma=False``
loads through masked pointers (any shape). The descriptors hold the tensors' addresses by value, so a CUDA graph
that captures a launch keeps them, as it keeps the tensors. Shared memory per stage: one x tile and TWO weight
tiles, (BLOCK_M + 2·BLOCK_N)·BLOCK_K elements (the TMA store's output tile reuses them after the loop; a persistent
program keeps its own).

Numerics (matters for adoption): both accumulators are float32, silu is computed in float32 on the float32 gate
(g / (1 + e⁻ᵍ), torch's formula) and multiplied by the float32 up, and the product is rounded ONCE, to the output
dtype. The model's unfused bf16 path rounds three times: g and u to bf16 when cuBLAS writes gate_up, silu(g) to bf16
(eager ``F.silu`` on a bf16 tensor), and the product to bf16; under torch.compile inductor computes silu(g)·u in
float32 from the rounded g and u, so two roundings. So this kernel's output is closer to the float32 SwiGLU than
either path (every element within one bf16 rounding of it, which the unfused paths are not: a rounded negative gate
moves silu by up to |g| times its own relative error), and differs from both by about the roundings it skips
(within 2⁻⁶·max|out| in tests/test_triton_swiglu_gemm.py): adopting it changes the model's bf16 output bitwise
(recorded results and their error bands must be re-read), not its float32 contract.
``packed=True`` reads the weight re-laid by :func:`pack_gate_up` (each tile's BLOCK_N gate rows, then its BLOCK_N up
rows): one (2·BLOCK_N) × BLOCK_K TMA tile and ONE dot per K step into a BLOCK_M × 2·BLOCK_N accumulator, split into
gate and up in the epilogue (the reshape/permute/split of tutorial 09's epilogue subtiling). Same products, same K
order; on Hopper half the warp-group MMAs, each twice as wide, so the x tile is read from shared memory once per K
step instead of twice. The model stores the weight packed, so it runs these with no repacking per call
(``fused_gemm_table.swiglu_config``); ``tools/swiglu_ab.py`` times both layouts (the packing done once, outside the
timing).
Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (fp32), both load paths and both grids included.

The norm (an option the model does not run): with ``norm_weight``, x is the block's residual stream and the RMSNorm
before the MLP runs inside a packed configuration, RMSNorm(x)·Wᵀ = diag(1/rms(x))·(x ⊙ g)·Wᵀ: each x tile is scaled
by g on its way into the dot and rounded once to x's dtype (the norm apart rounds x·r, then ·g), each row's sum of
squares is gathered as its K tiles pass (``norm_mode`` 1: reduced per tile; 2: accumulated elementwise, reduced once
after the loop), and 1/rms = rsqrt(mean + eps) scales the accumulator's rows before the SwiGLU. No normed copy of x
is written, but x reaches the dot from registers rather than straight from shared memory, and on the H100 that cost
the GEMM more than the norm's own kernel takes (``tools/norm_swiglu_ab.py``, ``data/sweeps/norm_swiglu_ab_h100.json``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..gate_up import pack_gate_up as pack_gate_up  # the layout's own module; re-exported for tests and tools
from .launch_checks import check_launch, check_tma_operands
from .tile_order import grouped_tile

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton before 3.4 has no host-side tensor descriptors: only ``tma=False`` configs run
    TensorDescriptor = None


@dataclass(frozen=True)
class SwigluConfig:
    """One launch configuration: a BLOCK_M × BLOCK_N output tile (so BLOCK_N gate and BLOCK_N up columns), K steps
    of BLOCK_K, ``num_stages`` deep, GROUP_M row tiles per group, TMA or pointer loads (module docstring). ``name``
    spells it for tables, e.g. ``128x128x64w8s3t`` (``t`` TMA, ``p`` pointers; ``-persistent`` for a persistent
    grid)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    tma: bool = True
    persistent: bool = False  # one program per multiprocessor walking the tiles (tutorial 09) instead of one per tile
    # A persistent program's tile loop and K loop pipelined as one (``tl.range(..., flatten=True)``, tutorial 09's
    # FLATTEN): the next tile's first loads are issued while this tile's epilogue runs
    flatten: bool = False
    # The weight packed by :func:`pack_gate_up` (BLOCK_N gate rows, then the matching BLOCK_N up rows, block after
    # block): one (2·BLOCK_N)-wide tile per K step, so one dot of BLOCK_M × 2·BLOCK_N instead of two of BLOCK_N (a
    # Hopper wgmma reads its x tile from shared memory once for 256 columns, not twice for 128). TMA only.
    packed: bool = False

    def __post_init__(self) -> None:
        check_launch(self, ("block_m", "block_n", "block_k"), ("num_warps", "num_stages", "group_m"))
        if self.flatten and not self.persistent:
            raise ValueError(f"{self.name}: flatten pipelines a persistent program's tile loop; set persistent=True")
        if self.packed and not self.tma:
            raise ValueError(f"{self.name}: the packed weight is read through TMA only; set tma=True")

    @property
    def name(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
                f"{'t' if self.tma else 'p'}{'-persistent' if self.persistent else ''}"
                f"{'-flat' if self.flatten else ''}{'-packed' if self.packed else ''}")

    def shared_bytes(self, element_size: int = 2) -> int:
        """The pipeline's shared memory: ``num_stages`` × (x tile + gate tile + up tile). The compiler adds its
        barriers, and stages the TMA store's output tile in these buffers once the loop is done (a persistent
        program, whose next tile's loads may be in flight, in a buffer of its own)."""
        return self.num_stages * (self.block_m + 2 * self.block_n) * self.block_k * element_size


# What tools/swiglu_ab.py times. Shared memory in bf16 (H100/H200 allow 227 KiB a block): 128x128x64 is 48 KiB a
# stage, so 3 stages (144 KiB) or 4 (192 KiB); 128x64x64 32 KiB, 64x128x64 40 KiB and 64x64x64 24 KiB a stage, 4
# stages (checked by compiling for sm_90: tools/swiglu_ab.py --compile-only). The smaller tiles are for few rows:
# 256 rows by H = 4096 are 64 tiles of 128x128 for 132 multiprocessors, 256 of 64x64. The pointer twin of the first
# shows what TMA buys; its persistent twin (144 KiB + its own 32 KiB output tile) what tutorial 09's grid does, and
# the flattened twins (3 and 4 stages: 176 and 224 KiB) what overlapping a tile's epilogue with the next tile's loads
# does: on the H100 they were slower than the persistent grid at 1024-16384 rows (8192: 384.6 and 388.4 against
# 340.1 µs, data/sweeps/swiglu_ab_h100.json), so the launch table (fused_gemm_table) keeps the persistent one. The
# packed twins read pack_gate_up's weight: the same tiles and shared memory, one dot of twice the width per K step.
SWEEP_CONFIGS = (
    SwigluConfig(128, 128, 64, 8, 3),
    SwigluConfig(128, 128, 64, 8, 4),
    SwigluConfig(128, 64, 64, 4, 4),
    SwigluConfig(128, 64, 64, 8, 4),
    SwigluConfig(64, 128, 64, 4, 4),
    SwigluConfig(64, 64, 64, 4, 4),
    SwigluConfig(128, 128, 64, 8, 3, tma=False),
    SwigluConfig(128, 128, 64, 8, 3, persistent=True),
    SwigluConfig(128, 128, 64, 8, 3, persistent=True, flatten=True),
    SwigluConfig(128, 128, 64, 8, 4, persistent=True, flatten=True),
    SwigluConfig(64, 128, 64, 4, 4, packed=True),
    SwigluConfig(128, 128, 64, 8, 3, packed=True),
    SwigluConfig(128, 128, 64, 8, 3, persistent=True, packed=True),
    SwigluConfig(128, 128, 64, 8, 4, persistent=True, packed=True),
)


@triton.jit
def _swiglu_gemm_kernel(x_ptr, w_ptr, y_ptr, x_desc, wg_desc, wu_desc, y_desc, M, H, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        TMA: tl.constexpr, PERSISTENT: tl.constexpr = False, FLATTEN: tl.constexpr = False,
                        PACKED: tl.constexpr = False, norm_ptr=None, eps=0.0, NORM: tl.constexpr = 0):
    if PERSISTENT:  # a grid of at most one program per multiprocessor, each walking tiles pid, pid + grid, …
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(H, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=FLATTEN):
            if PACKED:
                _swiglu_packed_tile(tile, y_ptr, x_desc, wg_desc, y_desc, M, H, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                    norm_ptr, eps, NORM)
            else:
                _swiglu_tile(tile, x_ptr, w_ptr, y_ptr, x_desc, wg_desc, wu_desc, y_desc, M, H, K,
                             BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA)
    elif PACKED:
        _swiglu_packed_tile(tl.program_id(0), y_ptr, x_desc, wg_desc, y_desc, M, H, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            GROUP_M, norm_ptr, eps, NORM)
    else:
        _swiglu_tile(tl.program_id(0), x_ptr, w_ptr, y_ptr, x_desc, wg_desc, wu_desc, y_desc, M, H, K,
                     BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA)


@triton.jit
def _swiglu_packed_tile(pid, y_ptr, x_desc, w_desc, y_desc, M, H, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, norm_ptr, eps, NORM: tl.constexpr):
    """Output tile ``pid`` from a packed weight (:func:`pack_gate_up`): its rows 2·BLOCK_N·pid_n … hold this tile's
    BLOCK_N gate rows, then its BLOCK_N up rows, so one accumulator of BLOCK_M × 2·BLOCK_N holds gate | up. ``NORM``:
    x is the block's residual stream and the RMSNorm before the MLP runs here (module docstring, "The norm")."""
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    row0 = pid_m * BLOCK_M
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    tile_squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = x_desc.load([row0, k])
        if NORM:  # the row's sum of squares as its K tiles pass, and the norm's weight on x's columns
            xf = x.to(tl.float32)
            if NORM == 2:  # summed across the tile once, after the loop
                tile_squares += xf * xf
            else:
                squares += tl.sum(xf * xf, axis=1)
            ks = k + tl.arange(0, BLOCK_K)
            g = tl.load(norm_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            x = (xf * g[None, :]).to(x.dtype)  # one rounding of x·g, where the norm rounds twice
        acc = tl.dot(x, tl.trans(w_desc.load([pid_n * 2 * BLOCK_N, k])), acc)
    if NORM == 2:
        squares = tl.sum(tile_squares, axis=1)
    if NORM:  # each row's 1/rms, which commutes with the matmul: a scale of the accumulator's rows
        acc = acc * tl.rsqrt(squares / K + eps)[:, None]
    # columns 0 … BLOCK_N − 1 are the gate, BLOCK_N … 2·BLOCK_N − 1 the up: split them apart (tutorial 09's subtile)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty)  # silu in float32, one rounding
    y_desc.store([row0, pid_n * BLOCK_N], out)


@triton.jit
def _swiglu_tile(pid, x_ptr, w_ptr, y_ptr, x_desc, wg_desc, wu_desc, y_desc, M, H, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 TMA: tl.constexpr):
    """Output tile number ``pid`` of the grouped order."""
    # Grouped order (tutorial 03): GROUP_M row tiles walk the column tiles together, so their W tiles stay in L2.
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(H, BLOCK_N), GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N

    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        if TMA:  # one copy per tile; rows, columns and K past a tensor's edge read as zeros
            x = x_desc.load([row0, k])
            wg = wg_desc.load([col0, k])
            wu = wu_desc.load([col0, k])
        else:
            kk = k + ks
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w_mask = (cols[:, None] < H) & (kk[None, :] < K)
            wg = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + kk[None, :], mask=w_mask, other=0.0)
            wu = tl.load(w_ptr + (cols + H).to(tl.int64)[:, None] * K + kk[None, :], mask=w_mask, other=0.0)
        gate = tl.dot(x, tl.trans(wg), gate)
        up = tl.dot(x, tl.trans(wu), up)
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(y_ptr.dtype.element_ty)  # silu in float32, one rounding
    if TMA:
        y_desc.store([row0, col0], out)  # clipped at the tensor's edge
    else:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], out,
                 mask=(rows[:, None] < M) & (cols[None, :] < H))


INTERPRETER_PROGRAMS = 3  # a persistent grid on the CPU: few enough that every program walks several tiles


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _descriptors(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, config: SwigluConfig) -> tuple:
    """Host tensor descriptors for x, the gate half, the up half and y; one-line errors for what TMA cannot take."""
    if TensorDescriptor is None:
        raise RuntimeError(f"{config.name}: this Triton has no triton.tools.tensor_descriptor; use tma=False")
    check_tma_operands(config.name, (("x", x), ("weight", weight), ("out", y)))
    hidden = y.shape[1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if config.packed:  # one descriptor over the packed weight, 2·BLOCK_N rows a tile (in the gate's slot)
        packed = TensorDescriptor.from_tensor(weight, [2 * bn, bk])
        return TensorDescriptor.from_tensor(x, [bm, bk]), packed, packed, TensorDescriptor.from_tensor(y, [bm, bn])
    return (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight[:hidden], [bn, bk]),
            TensorDescriptor.from_tensor(weight[hidden:], [bn, bk]), TensorDescriptor.from_tensor(y, [bm, bn]))


def swiglu_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: SwigluConfig | None = None,
                         norm_weight: torch.Tensor | None = None, eps: float | None = None, norm_mode: int = 1
                         ) -> torch.Tensor:
    """silu(x · Wgᵀ) · (x · Wuᵀ) → (M, H) in x's dtype, for x (M, K) and weight (2·H, K) = [Wg; Wu] (module
    docstring: float32 accumulation and silu, one rounding). None: ``SWEEP_CONFIGS[0]``. A ``packed`` configuration
    takes the weight as :func:`pack_gate_up` lays it out for its ``block_n`` (H a multiple of ``block_n``).
    ``norm_weight`` (K,) given: x is first RMS-normalised with it and ``eps`` (``glmvit.model.RMSNorm``), inside
    the GEMM (module docstring, "The norm"); packed configurations only, ``eps`` given and ``norm_mode`` 1 or 2."""
    config = SWEEP_CONFIGS[0] if config is None else config
    if norm_weight is not None and (eps is None or norm_mode not in (1, 2)):
        raise ValueError(f"the norm inside the GEMM needs eps given and norm_mode 1 or 2: got eps={eps}, "
                         f"norm_mode={norm_mode}")
    if norm_weight is not None and not config.packed:
        raise ValueError(f"{config.name}: the RMSNorm runs inside packed configurations only")
    if norm_weight is not None and (norm_weight.shape != (x.shape[-1],) or norm_weight.dtype != x.dtype
                                    or norm_weight.device != x.device or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be contiguous ({x.shape[-1]},) {x.dtype} on {x.device}: got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] % 2:
        raise ValueError(f"swiglu_linear_triton needs x (M, K) and weight (2·H, K): got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x and weight differ: x {x.dtype} on {x.device}, weight {weight.dtype} on {weight.device}")
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("swiglu_linear_triton needs contiguous x and weight")
    m, k = x.shape
    hidden = weight.shape[0] // 2
    if config.packed and hidden % config.block_n:
        raise ValueError(f"{config.name}: a packed weight holds whole tiles of {config.block_n} rows; H = {hidden}")
    y = torch.empty((m, hidden), dtype=x.dtype, device=x.device)
    if m == 0 or hidden == 0:
        return y
    descs: tuple = (x, weight, weight, y)  # not read without TMA
    if config.tma:
        descs = _descriptors(x, weight, y, config)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(hidden, config.block_n)
    if config.persistent:
        tiles = min(tiles, _multiprocessors(x.device))
    _swiglu_gemm_kernel[(tiles,)](
        x, weight, y, *descs, m, hidden, k,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        TMA=config.tma, PERSISTENT=config.persistent, FLATTEN=config.flatten, PACKED=config.packed,
        norm_ptr=norm_weight, eps=float(eps or 0.0), NORM=0 if norm_weight is None else norm_mode,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return y
