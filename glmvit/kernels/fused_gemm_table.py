"""The fused GEMMs' launch table: which batches run a matmul with its neighbour in the epilogue, and with which
configuration. Two, each chosen from its A/B on Hopper, which times the configurations it is given and never reads
this table (the choice depends on the A/B, not the other way round):

- the MLP's gate_up matmul with silu(gate)·up in its epilogue (``glmvit.kernels.triton_swiglu_gemm``) instead of
  cuBLAS's matmul, then a separate SwiGLU kernel: ``tools/swiglu_ab.py``, ``data/sweeps/swiglu_ab_h200.json`` (the
  threshold) and ``swiglu_ab_h100.json`` (the packed layout, both layouts timed side by side);
- the attention's qkv matmul with q and k rotated in its epilogue (``glmvit.kernels.triton_qkv_rope_gemm``)
  instead of cuBLAS's matmul, then the attention's own rotation: ``tools/qkv_rope_ab.py``,
  ``data/sweeps/qkv_rope_ab_h100.json`` (two heads a tile, the threshold) and ``qkv_rope_ab_h200.json`` (one head a
  tile: it lost at every row count).

CUDA, fp16/bf16 only: on the CPU, and in float32, the model keeps transformers' arithmetic. Hopper (sm_9x) only
(:func:`measured_gpu`): the kernels are tuned for Hopper (TMA descriptors, its 227 KiB of shared memory a block) and
were measured on the H200 and the H100; another GPU keeps the unfused path (Ada has no TMA, and the consumer
Blackwell GPUs, sm_12x, give a block 99 KiB: less than the 144-160 KiB these configurations stage). Each rule is
one row threshold rather than a choice per row range, so that a forward compiled with symbolic sizes guards on one
comparison; the configuration is chosen inside the op, from the batch's real rows and (SwiGLU) the layout of the
model's weight.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .triton_qkv_rope_gemm import QkvRopeConfig
    from .triton_swiglu_gemm import SwigluConfig

# The fused SwiGLU GEMM from this many rows on (None: never). data/sweeps/swiglu_ab_h200.json: at 256, 1024 and 8192
# rows its best configuration beat the compiled unfused path (cuBLAS's matmul, then Inductor's SwiGLU kernel) by
# 17 %, 8 % and 5 %, and at 256 rows it ran as fast as the matmul alone: the epilogue costs nothing there. Nothing
# was measured below 256 rows, so smaller batches keep the unfused path.
SWIGLU_MIN_ROWS: int | None = 256
# Below this many rows the small-tile configuration, from it on the persistent one: the faster of the two at each
# row count of the A/B (256: 11.1 against 19.1 µs; 1024: 44.2 against 40.1 µs).
SWIGLU_PERSISTENT_MIN_ROWS = 1024
# The rows of one tile of the packed gate_up layout (glmvit.gate_up: a tile's PACK_TILE gate rows, then its PACK_TILE
# up rows), which the blocks' MLP stores when its width is a multiple of it (4096 is). It must equal the BLOCK_N of
# every packed configuration below: the packed kernel reads one tile of 2·BLOCK_N weight rows per K step, so a weight
# packed in other tiles would pair the wrong gate and up rows. 128: the N tile of the configurations the A/B chose for
# the plain layout, so the packed twins keep their output tiles (one Hopper wgmma of 2·128 = 256 columns, its widest).
PACK_TILE = 128
# The fused SwiGLU GEMM's configurations, as SwigluConfig's arguments (built on first use: the kernel module imports
# Triton), below SWIGLU_PERSISTENT_MIN_ROWS (SMALL) and from it on (PERSISTENT). PLAIN: for a weight stacked
# [gate; up] (the two-dot kernel), chosen by the A/B above. PACKED: for a weight packed in tiles of PACK_TILE (one dot
# of twice the width per K step), the plain choices' packed twins, which the model runs (its blocks store the packed
# layout): faster at every row count of data/sweeps/swiglu_ab_h100.json (256 rows 11.0 against 11.2 µs, 1024 39.3
# against 42.0, 8192 335.2 against 347.6, 16384 666.8 against 699.1; cuBLAS's plain matmul alone 321.8 at 8192).
SWIGLU_PLAIN_SMALL: dict[str, Any] = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4)
SWIGLU_PLAIN_PERSISTENT: dict[str, Any] = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3,
                                               persistent=True)
SWIGLU_PACKED_SMALL: dict[str, Any] = dict(block_m=64, block_n=PACK_TILE, block_k=64, num_warps=4, num_stages=4,
                                           packed=True)
SWIGLU_PACKED_PERSISTENT: dict[str, Any] = dict(block_m=128, block_n=PACK_TILE, block_k=64, num_warps=8,
                                                num_stages=3, persistent=True, packed=True)
# The fused rotary qkv GEMM from this many rows on (None: never): the smallest row count of its A/Bs from which it
# wins at every one. On an H100 the configuration below took, against the faster unfused path (cuBLAS's matmul, then
# the rotation launch): 128.6 against 131.5 µs at 5332 rows (one 1022² image), 149.6 against 157.6 at 6144, 193.8
# against 208.5 at 8192 and 385.0 against 419.8 at 16384 (data/sweeps/qkv_rope_ab_rows_h100.json,
# qkv_rope_ab_h100.json); it lost from 4096 rows down (103.5 against 99.2; at 256 rows 18.5 against 10.7: a fixed
# cost small grids do not hide). The graphs' budgets are powers of two, so of them it runs from 8192 on.
QKV_ROPE_MIN_ROWS: int | None = 5332
# Its configuration, as QkvRopeConfig's arguments: the fastest of the A/B's at every row count from the threshold on.
# Two heads a tile (one wgmma of N = 2·128 = 256 per K step, the x tile read once for both heads), a persistent grid,
# and only the first halves of the cos and sin tables loaded (equal_halves: rotary_cos_sin repeats its angles).
QKV_ROPE: dict[str, Any] = dict(block_m=128, block_k=64, num_warps=8, num_stages=3, one_dot=True, persistent=True,
                                heads_per_tile=2, equal_halves=True)


# The GPU generation the fused GEMMs run on (compute capability major): Hopper, where they were tuned and measured.
MEASURED_MAJOR = 9


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    """CUDA device ``device_index``'s compute capability, asked of the driver once per device."""
    return torch.cuda.get_device_capability(device_index)


def measured_gpu(device: torch.device) -> bool:
    """Whether CUDA ``device`` is a Hopper GPU (sm_9x), where the fused GEMMs may run (cached per device).
    torch.compile takes the answer as a constant rather than tracing the query."""
    index = torch.cuda.current_device() if device.index is None else device.index
    return _capability(index)[0] == MEASURED_MAJOR


# What torch.compiler.assume_constant_result(measured_gpu) sets, set here without importing torch._dynamo, which
# the HTTP client's imports of the model do not load (tests/test_kernel_tables.py checks the two agree).
measured_gpu._dynamo_marked_constant = True  # type: ignore[attr-defined]


def swiglu_fused(rows: int, device: torch.device) -> bool:
    """Whether a batch of ``rows`` rows on CUDA ``device`` runs the MLP's fused SwiGLU GEMM (in fp16/bf16)."""
    return SWIGLU_MIN_ROWS is not None and rows >= SWIGLU_MIN_ROWS and measured_gpu(device)


def qkv_rope_fused(rows: int, device: torch.device) -> bool:
    """Whether a batch of ``rows`` rows on CUDA ``device`` runs the attention's fused rotary qkv GEMM (in
    fp16/bf16)."""
    return QKV_ROPE_MIN_ROWS is not None and rows >= QKV_ROPE_MIN_ROWS and measured_gpu(device)


def swiglu_config(rows: int, packed: bool) -> SwigluConfig:
    """The fused SwiGLU GEMM's configuration for a batch of ``rows`` rows, for a weight packed in tiles of
    ``PACK_TILE`` (``packed``; ``glmvit.gate_up.is_packed`` says which the model's is) or stacked [gate; up]:
    64×128 tiles with 4 warps below ``SWIGLU_PERSISTENT_MIN_ROWS`` (more tiles for the multiprocessors when rows are
    few), else 128×128 tiles in a persistent grid (tutorial 09's: one program per multiprocessor walking the tiles).
    Built once per layout: the op asks on every call."""
    small, persistent = _swiglu_configs(packed)
    return small if rows < SWIGLU_PERSISTENT_MIN_ROWS else persistent


@functools.cache
def _swiglu_configs(packed: bool) -> tuple[SwigluConfig, SwigluConfig]:
    from .triton_swiglu_gemm import SwigluConfig  # the kernel module imports Triton: on first use only

    if packed:
        return SwigluConfig(**SWIGLU_PACKED_SMALL), SwigluConfig(**SWIGLU_PACKED_PERSISTENT)
    return SwigluConfig(**SWIGLU_PLAIN_SMALL), SwigluConfig(**SWIGLU_PLAIN_PERSISTENT)


def qkv_rope_config(rows: int) -> QkvRopeConfig:
    """The fused rotary qkv GEMM's configuration for a batch of ``rows`` rows: ``QKV_ROPE`` at every row count
    (built once: the op asks on every call). Its ``equal_halves`` is a contract on the tables, which the model
    keeps: they come from ``glmvit.rotary.rotary_cos_sin``."""
    return _qkv_rope_config()


@functools.cache
def _qkv_rope_config() -> QkvRopeConfig:
    from .triton_qkv_rope_gemm import QkvRopeConfig  # the kernel module imports Triton: on first use only

    return QkvRopeConfig(**QKV_ROPE)
