"""cuDNN's fused attention over packed segments (the ``cudnn`` attention backend), through the cuDNN frontend's
Python graph API (``nvidia-cudnn-frontend``, the ``cuda`` extra; CUDA on Hopper or newer, fp16/bf16).

Spec: the ``triton`` backend's (``glmvit.kernels.triton_attention``): for every head and every real row r of
segment s, out[r] = softmax(q̃_r · K̃_sᵀ / √d) · V_s with q̃, k̃ rotated in float32 and rounded to the input dtype.

Two launches per layer: ``rotate_qk_triton`` writes q̃, k̃ of every head into a (rows, 2·heads·d) scratch, then one
cuDNN SDPA reads q̃, k̃ there and v straight out of the qkv projection, as *ragged* (THD) tensors: segment b's rows
start at ``ragged_offset[b]`` elements and hold ``seq_len[b]`` rows, and cuDNN's padding mask keeps every query to
its own segment's keys, so no key or value of one segment is read for another (a NaN in one item cannot reach the
next). The graph's dims are static — segment slots (``cu_seqlens`` has slots + 1 entries) and the longest segment
a batch shape allows (``BatchShape.max_seqlen``) — and the lengths and offsets are device tensors
(:func:`ragged_offsets`, computed once per forward), so one plan serves every batch of a shape and a CUDA graph
replays it. Rows outside every segment (padding) are left as they were.

Plans are built on the first call for a shape (heuristics and kernel selection) and cached per thread, as handles are
(cuDNN promises neither thread-safe): the runner's warm-up before capture builds them in the capturing thread, and a
capture then records only the kernels. A plan's segment bound is rounded up to a power of two, so the exact shapes of
eager batches share a few plans; each thread keeps its ``PLANS_PER_THREAD`` most recent. Every call runs on
``qkv``'s device and that device's current stream.
"""
from __future__ import annotations

import importlib.util
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

MIN_BACKEND = 90100  # cuDNN 9.1: ragged offsets on packed (THD) q, k, v with a padding mask, on Hopper
MIN_CAPABILITY = (9, 0)
HEAD_DIMS = (64, 128)  # what cuDNN's fused attention kernels take on Hopper, of the dims glmvit's towers use


def frontend_installed() -> bool:
    """Whether the cuDNN frontend's Python package imports here (it is optional: the ``cuda`` extra)."""
    return importlib.util.find_spec("cudnn") is not None


@lru_cache(maxsize=8)
def unavailable_reason(device_index: int, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why the ``cudnn`` backend cannot run on CUDA device ``device_index`` for ``dtype`` (None: it can)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN attention takes fp16/bf16, not {dtype}"
    if head_dim is not None and head_dim not in HEAD_DIMS:
        return f"cuDNN attention takes head_dim {HEAD_DIMS}, not {head_dim}"
    if not frontend_installed():
        return "the cuDNN frontend is not installed (pip install 'glmvit[cuda]')"
    if torch.cuda.get_device_capability(device_index) < MIN_CAPABILITY:
        return "cuDNN's ragged attention needs a Hopper (sm_90) or newer GPU"
    try:  # a frontend that cannot load its cuDNN library makes this backend unavailable, not every model broken
        import cudnn

        version, name = cudnn.backend_version(), cudnn.backend_version_string()
    except (ImportError, OSError, RuntimeError) as err:
        return f"the cuDNN frontend does not load: {type(err).__name__}: {str(err).strip()[:120]}"
    if version < MIN_BACKEND:
        return f"cuDNN {name} is older than 9.1 (ragged attention)"
    return None


def ragged_offsets(cu_seqlens: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """int32 (4, slots + 1) from ``cu_seqlens`` (slots + 1 entries): segment lengths (the last entry 0, unused),
    then each segment's first element in the q̃/k̃ scratch (2·heads·d per row), in qkv (3·heads·d) and in the output
    (heads·d). Device ops only: graph-safe. Values stay below 2³¹ while rows · 3·heads·d does (checked by the caller
    with :func:`check_rows`)."""
    cu = cu_seqlens.to(torch.int32)
    width = num_heads * head_dim
    lengths = torch.zeros_like(cu)
    lengths[:-1] = cu[1:] - cu[:-1]
    return torch.stack([lengths, cu * (2 * width), cu * (3 * width), cu * width])


def fits_int32(rows: int, qkv_width: int) -> bool:
    """Whether every element offset of a (rows, qkv_width) projection fits cuDNN's int32 ragged offsets."""
    return rows * qkv_width < 2**31


def check_rows(rows: int, num_heads: int, head_dim: int) -> None:
    """Refuse a batch whose element offsets would not fit the int32 ragged offsets (one line naming the rows)."""
    if not fits_int32(rows, 3 * num_heads * head_dim):
        raise ValueError(f"{rows:,} rows of {3 * num_heads * head_dim} qkv elements exceed cuDNN's int32 ragged "
                         f"offsets; split the batch")


@dataclass(frozen=True)
class _Key:
    device: int
    dtype: torch.dtype
    slots: int
    max_seqlen: int
    num_heads: int
    head_dim: int
    qk_row_heads: int = 2  # q̃, k̃ rows hold 2·heads·d (the rotation's scratch) or 3·heads·d (qkv, rotated already)


class _Plan:
    """One built cuDNN graph and its tensor handles, for one :class:`_Key`."""

    def __init__(self, key: _Key, handle: Any):
        import cudnn

        io = cudnn.data_type.BFLOAT16 if key.dtype == torch.bfloat16 else cudnn.data_type.HALF
        b, h, s, d = key.slots, key.num_heads, key.max_seqlen, key.head_dim
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def tensor(name: str, dim: list[int], stride: list[int], dtype: Any = io) -> Any:
            return g.tensor(name=name, dim=dim, stride=stride, data_type=dtype)

        def index(name: str, n: int) -> Any:
            return tensor(name, [n, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT32)

        qk_row, v_row = key.qk_row_heads * h * d, 3 * h * d
        self.q = tensor("q", [b, h, s, d], [s * qk_row, d, qk_row, 1])
        self.k = tensor("k", [b, h, s, d], [s * qk_row, d, qk_row, 1])
        self.v = tensor("v", [b, h, s, d], [s * v_row, d, v_row, 1])
        self.lengths, self.qk_offset = index("seq_len", b), index("qk_offset", b + 1)
        self.v_offset, self.o_offset = index("v_offset", b + 1), index("o_offset", b + 1)
        for t, offset in ((self.q, self.qk_offset), (self.k, self.qk_offset), (self.v, self.v_offset)):
            t.set_ragged_offset(offset)
        self.o, _ = g.sdpa(name="attention", q=self.q, k=self.k, v=self.v, is_inference=True,
                           attn_scale=1.0 / math.sqrt(d), use_padding_mask=True,
                           seq_len_q=self.lengths, seq_len_kv=self.lengths)
        self.o.set_output(True).set_dim([b, h, s, d]).set_stride([s * h * d, d, h * d, 1])
        self.o.set_ragged_offset(self.o_offset)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace_bytes = int(g.get_workspace_size())


PLANS_PER_THREAD = 32
_local = threading.local()


def _handle(device: torch.device) -> Any:
    """This thread's cuDNN handle for ``device``, bound to that device's current stream (a capture records there)."""
    import cudnn

    handles = _local.__dict__.setdefault("handles", {})
    if device.index not in handles:
        handles[device.index] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device.index], stream=torch.cuda.current_stream(device).cuda_stream)
    return handles[device.index]


def _plan(key: _Key, handle: Any) -> _Plan:
    """This thread's plan for ``key``, built on a miss; the least recently used beyond ``PLANS_PER_THREAD`` dropped."""
    plans: OrderedDict[_Key, _Plan] = _local.__dict__.setdefault("plans", OrderedDict())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _Plan(key, handle)
        if len(plans) > PLANS_PER_THREAD:
            plans.popitem(last=False)
    plans.move_to_end(key)
    return plan


def plan_bound(max_seqlen: int) -> int:
    """The segment bound a plan is built for: ``max_seqlen`` rounded up to a power of two (at least 256)."""
    return max(256, 1 << (max(max_seqlen, 1) - 1).bit_length())


def cudnn_varlen_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                           ragged: torch.Tensor, num_heads: int, max_seqlen: int,
                           rotated: bool = False) -> torch.Tensor:
    """Attention output (rows, heads·d) from the packed qkv projection (rows, 3·heads·d): the module docstring.

    ``ragged``: :func:`ragged_offsets` of ``cu_seqlens``; ``max_seqlen``: the batch shape's static bound on a
    segment's rows (a longer segment is cut short by cuDNN: the caller's shape guarantees none is). ``rotated``: q
    and k in ``qkv`` are rotated already (the fused rotary qkv GEMM): no rotation launch, cuDNN reads q̃, k̃ from
    qkv's own columns (a plan of row stride 3·heads·d for them, offsets ``ragged[2]``).
    """
    from .triton_attention import rotate_qk_triton

    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    out = torch.empty((rows, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return out
    check_rows(rows, num_heads, head_dim)
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cudnn attention reads qkv, cos and sin as dense rows: pass contiguous tensors")
    slots = cu_seqlens.shape[0] - 1
    with torch.cuda.device(qkv.device):
        handle = _handle(qkv.device)
        key = _Key(qkv.device.index or 0, qkv.dtype, slots, plan_bound(max_seqlen), num_heads, head_dim,
                   3 if rotated else 2)
        plan = _plan(key, handle)
        qk = qkv if rotated else rotate_qk_triton(qkv, cos, sin, cu_seqlens, num_heads)
        hd = num_heads * head_dim
        pack = {plan.q: qk, plan.k: qk[:, hd:], plan.v: qkv[:, 2 * hd:], plan.o: out, plan.lengths: ragged[0],
                plan.qk_offset: ragged[2] if rotated else ragged[1], plan.v_offset: ragged[2],
                plan.o_offset: ragged[3]}
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=qkv.device)
        plan.graph.execute(pack, workspace, handle=handle)
    return out
