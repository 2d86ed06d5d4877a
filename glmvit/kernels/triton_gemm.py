"""Triton kernel: y = x · Wᵀ for skinny x (a few hundred rows), split along K so the GPU fills up.

Why: a (256 × 1536) · (1536 × 1536)ᵀ matmul cut into 64 × 64 output tiles is 96 tiles for 132 multiprocessors,
each walking all of K. Splitting K into S slices gives S times as many programs, each S times shorter.

How: one kernel, like CUTLASS's serial split-K (``kSplitKSerial``, a per-tile semaphore the last slice resets), but
no program waits its turn (CUTLASS's slice k waits for the semaphore to read k, then adds its part into the output).
Program (tile, s) multiplies its K slice into a float32 partial and stores it in a workspace; then it bumps the
tile's counter (one atomic, release/acquire at GPU scope,
after a barrier so every thread's stores are in). The program that finds the counter at S − 1 arrives last: it sums
the S partials in slice order (deterministic), writes the output in x's dtype and puts the counter back to 0, so
the next launch (the next graph replay) starts clean. One kernel, no memset, no second pass; the grid depends only
on the shapes, so a CUDA graph captures it, and the counters it captured are never freed (:func:`_counters`). Under
``TRITON_INTERPRET=1`` it runs on CPU tensors (fp32).

``SplitK(tma=True)`` loads the tiles through host-built tensor descriptors instead of computed pointers: on Hopper,
one TMA instruction per tile and no address arithmetic in the warps (what notebook 10 says the pointer kernel
lacks). The descriptors hold the tensors' addresses, so a captured launch keeps them, as it keeps the counters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class SplitK:
    """One launch configuration: output tile BLOCK_M × BLOCK_N, K step BLOCK_K, SPLIT slices of K."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    split: int = 4
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False  # load x and W tiles through tensor descriptors (TMA on Hopper) instead of pointers


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, y_ptr, partial_ptr, counter_ptr, M, N, K, k_per_split, x_desc, w_desc,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   TMA: tl.constexpr = False):
    tile = tl.program_id(0)
    part = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = part * k_per_split
    for k in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        if TMA:  # one descriptor load per tile; rows, columns and K past the tensor's edge read as zeros
            x = x_desc.load([(tile // tiles_n) * BLOCK_M, k])
            w = w_desc.load([(tile % tiles_n) * BLOCK_N, k])
        else:
            kk = k + ks
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + kk[None, :],
                        mask=(cols[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    out_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if SPLIT == 1:
        tl.store(y_ptr + out_offsets, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile_elems = BLOCK_M * BLOCK_N
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        slot = partial_ptr + (tile.to(tl.int64) * SPLIT) * tile_elems + local
        tl.store(slot + part * tile_elems, acc)
        tl.debug_barrier()  # every thread's partial is stored before the one release below
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT):  # fixed order: the same sum on every launch
                total += tl.load(slot + s * tile_elems, cache_modifier=".cg")
            tl.store(y_ptr + out_offsets, total.to(y_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


COUNTER_SLOTS = 4096  # the smallest counter buffer (16 KiB); a launch with more tiles grows it

_COUNTERS: dict[torch.device, torch.Tensor] = {}  # what launches on each device use now
_RETIRED: list[torch.Tensor] = []  # buffers grown out of, kept alive: graphs captured earlier still use them


def tile_counters(device: torch.device | str) -> torch.Tensor | None:
    """The per-tile arrival counters that launches on ``device`` use now (int32, zero between launches), or None
    before the first launch there. For inspection: a launch that starts from non-zero counters is wrong."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # tensors name their GPU: "cuda" is the current one
        device = torch.device("cuda", torch.cuda.current_device())
    return _COUNTERS.get(device)


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters, zero between launches (the last program of a tile resets its own). One buffer per
    device; launches on one device must not overlap (one stream), as in the runner.

    Graph-safe: a captured launch keeps the buffer's address, so a buffer is never freed — when a launch needs more
    tiles, a larger one takes over and the old one is retired, still alive, for the graphs that captured it. A new
    buffer cannot be made during a capture (its zero-fill would run only at replay): launch once before capturing.
    """
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K counters for {tiles:,} tiles on {device} do not exist yet and cannot be "
                               "made inside a CUDA graph capture: launch this shape once before capturing")
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(tiles, COUNTER_SLOTS), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def splitk_linear_triton(x: torch.Tensor, weight: torch.Tensor, config: SplitK) -> torch.Tensor:
    """x (M, K) · weight (N, K)ᵀ → (M, N) in x's dtype, float32 accumulation; both contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, config.split), config.block_k) * config.block_k
    partial = torch.empty(tiles * config.split * config.block_m * config.block_n if config.split > 1 else 1,
                          dtype=torch.float32, device=x.device)
    x_desc: object = x
    w_desc: object = weight  # not read without TMA
    if config.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        if (k * x.element_size()) % 16:
            raise ValueError(f"TMA needs rows of a multiple of 16 bytes: K = {k} in {x.dtype} is "
                             f"{k * x.element_size()}")
        x_desc = TensorDescriptor.from_tensor(x, [config.block_m, config.block_k])
        w_desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k])
    _splitk_kernel[(tiles, config.split)](
        x, weight, y, partial, _counters(x.device, tiles), m, n, k, k_per_split, x_desc, w_desc,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=config.split,
        TMA=config.tma, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
