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

Plans are built on the first call for a shape (seconds: heuristics and kernel selection) and cached per process, so
the runner's warm-up before capture builds them; a capture then records only the kernels. Each thread gets its own
cuDNN handle (a handle is not safe to share between threads), bound to the current torch stream at every call.
"""
from __future__ import annotations

import importlib.util
import math
import threading
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
    import cudnn

    if cudnn.backend_version() < MIN_BACKEND:
        return f"cuDNN {cudnn.backend_version_string()} is older than 9.1 (ragged attention)"
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


def check_rows(rows: int, num_heads: int, head_dim: int) -> None:
    """Refuse a batch whose element offsets would not fit the int32 ragged offsets (one line naming the rows)."""
    if rows * 3 * num_heads * head_dim >= 2**31:
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

        qk_row, v_row = 2 * h * d, 3 * h * d
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


_plans: dict[_Key, _Plan] = {}
_plans_lock = threading.Lock()
_local = threading.local()


def _handle() -> Any:
    """This thread's cuDNN handle, bound to the current torch stream (a capture records onto that stream)."""
    import cudnn

    handles = _local.__dict__.setdefault("handles", {})
    device = torch.cuda.current_device()
    if device not in handles:
        handles[device] = cudnn.create_handle()
    cudnn.set_stream(handle=handles[device], stream=torch.cuda.current_stream().cuda_stream)
    return handles[device]


def _plan(key: _Key, handle: Any) -> _Plan:
    with _plans_lock:
        plan = _plans.get(key)
        if plan is None:
            plan = _plans[key] = _Plan(key, handle)
        return plan


def cudnn_varlen_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                           ragged: torch.Tensor, num_heads: int, max_seqlen: int) -> torch.Tensor:
    """Attention output (rows, heads·d) from the packed qkv projection (rows, 3·heads·d): the module docstring.

    ``ragged``: :func:`ragged_offsets` of ``cu_seqlens``; ``max_seqlen``: the batch shape's static bound on a
    segment's rows (a longer segment is cut short by cuDNN: the caller's shape guarantees none is).
    """
    from .triton_attention import rotate_qk_triton

    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    out = torch.empty((rows, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return out
    check_rows(rows, num_heads, head_dim)
    slots = cu_seqlens.shape[0] - 1
    handle = _handle()
    plan = _plan(_Key(qkv.device.index or 0, qkv.dtype, slots, max_seqlen, num_heads, head_dim), handle)
    qk = rotate_qk_triton(qkv, cos, sin, cu_seqlens, num_heads)
    hd = num_heads * head_dim
    pack = {plan.q: qk, plan.k: qk[:, hd:], plan.v: qkv[:, 2 * hd:], plan.o: out,
            plan.lengths: ragged[0], plan.qk_offset: ragged[1], plan.v_offset: ragged[2], plan.o_offset: ragged[3]}
    workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=qkv.device)
    plan.graph.execute(pack, workspace, handle=handle)
    return out
