"""A prototype for the attention sweep: cuDNN's ragged attention with each segment's *queries* cut into chunks.

The ``cudnn`` backend hands cuDNN one batch entry per segment slot, each as long as the budget's rows allow
(``max_seqlen``): the kernel's grid is slots × heads × ⌈max_seqlen / tile⌉, almost all of it empty at eight 448²
images (66 slots of up to 8192 rows for 8 real segments of 1024). Attention splits freely over queries — a query
row needs only its own segment's keys — so here every segment's rows are cut into chunks of at most ``chunk``
queries, each chunk a batch entry of its own whose keys and values are its whole segment: the grid becomes
(rows / chunk + slots) × heads × ⌈chunk / tile⌉, nearly all of it real work, like the Triton kernel's work list.

:func:`chunk_table` computes the entries on the device from ``cu_seqlens`` (static sizes: graph-safe);
:func:`cudnn_chunked_attention` runs q and k through glmvit's rotation launch, then one cuDNN SDPA with separate
query and key/value lengths and ragged offsets. Keys of one segment are never read for another (each entry's
key/value window is its own segment), so isolation holds as in the ``cudnn`` backend. CUDA with the cuDNN frontend.

:func:`rotate_qk_rows` is the second half of the prototype: the rotation launch with one program per block of rows
for every head, so each row's cos/sin are loaded once rather than once per head (the library's launch, one program
per row block and head, reads the float32 tables twelve times over at twelve heads). Same arithmetic, same output.

A prototype mirrors the library code it would replace (the cuDNN graph of ``glmvit.kernels.cudnn_attention``, the
rotation launch of ``glmvit.kernels.triton_attention``) so that the library and its records stay as measured until
the sweep decides; adopted, it replaces them there and leaves this file.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

TABLE_ROWS = ("q_len", "kv_len", "q_offset", "k_offset", "v_offset", "o_offset")


def max_chunks(rows: int, slots: int, chunk: int) -> int:
    """Batch entries a budget of ``rows`` rows and ``slots`` segment slots needs at most: Σ ⌈Lₛ / chunk⌉ ≤
    rows / chunk + slots."""
    return rows // chunk + slots


def chunk_table(cu_seqlens: torch.Tensor, chunk: int, rows: int, num_heads: int, head_dim: int) -> torch.Tensor:
    """int32 (6, entries + 1), rows as ``TABLE_ROWS``: per entry its query rows (≤ ``chunk``), its segment's rows,
    and the element offsets of its first query in the q̃/k̃ scratch (2·heads·d per row), of its segment's first key
    there, of that key's value in qkv (3·heads·d per row) and of its first output row (heads·d per row). Entries
    past the last chunk have no rows; the last column holds the real rows' end, as ``ragged_offsets``' does. Device
    ops on static sizes only."""
    cu = cu_seqlens.to(torch.int64)
    slots = cu.shape[0] - 1
    entries = max_chunks(rows, slots, chunk)
    lengths = cu[1:] - cu[:-1]
    per = (lengths + chunk - 1) // chunk  # chunks of each segment (0 for an empty slot)
    ends = torch.cumsum(per, 0)
    j = torch.arange(entries, device=cu.device)
    seg = torch.searchsorted(ends, j, right=True).clamp(max=slots - 1)
    valid = j < ends[-1]
    q_start = cu[seg] + (j - (ends[seg] - per[seg])) * chunk
    q_len = torch.where(valid, torch.minimum(cu[seg + 1] - q_start, torch.full_like(q_start, chunk)), 0)
    kv_len = torch.where(valid, lengths[seg], 0)
    q_start, kv_start = torch.where(valid, q_start, 0), torch.where(valid, cu[seg], 0)
    width = num_heads * head_dim
    table = torch.stack([q_len, kv_len, q_start * 2 * width, kv_start * 2 * width, kv_start * 3 * width,
                         q_start * width])
    end = cu[-1:]  # the (entries + 1)-th offsets cuDNN's ragged tensors take: the real rows' end, as ragged_offsets
    last = torch.stack([end * 0, end * 0, end * 2 * width, end * 2 * width, end * 3 * width, end * width])
    return torch.cat([table, last], 1).to(torch.int32)


ROTATE_BLOCK = 16  # rows per program of :func:`rotate_qk_rows` (8192 rows: 512 programs)


@triton.jit(do_not_specialize=["last_slot"])
def _rotate_rows_kernel(qkv_ptr, cos_ptr, sin_ptr, cu_seqlens_ptr, qk_ptr, last_slot,
                        HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    """q̃ and k̃ of every head for BLOCK real rows: cos/sin loaded once, then each head's q and k rotated."""
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
    for column in tl.static_range(0, 2 * HEADS * D, D):  # q heads, then k heads: the first 2·heads·d of a qkv row
        src = qkv_ptr + rows[:, None] * (3 * HEADS * D) + column + cols
        dst = qk_ptr + rows[:, None] * (2 * HEADS * D) + column + cols
        x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst, (x1 * c - x2 * s).to(qk_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, (x2 * c + x1 * s).to(qk_ptr.dtype.element_ty), mask=ok)


def rotate_qk_rows(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                   num_heads: int) -> torch.Tensor:
    """What ``glmvit.kernels.triton_attention.rotate_qk_triton`` returns, one program per row block for all heads."""
    rows, width = qkv.shape
    head_dim = width // (3 * num_heads)
    qk = torch.empty((rows, 2 * num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    _rotate_rows_kernel[(triton.cdiv(rows, ROTATE_BLOCK),)](
        qkv, cos, sin, cu_seqlens, qk, cu_seqlens.shape[0] - 1, HEADS=num_heads, HALF=head_dim // 2,
        BLOCK=ROTATE_BLOCK)
    return qk


class ChunkedPlan:
    """One cuDNN graph for ``entries`` chunks of at most ``chunk`` queries against segments of at most
    ``max_seqlen`` keys, bf16/fp16, ``num_heads`` heads of ``head_dim``."""

    def __init__(self, entries: int, chunk: int, max_seqlen: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, handle: Any):
        import cudnn

        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        b, h, d, sq, skv = entries, num_heads, head_dim, chunk, max_seqlen
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)

        def tensor(name: str, dim: list[int], stride: list[int], dtype: Any = io) -> Any:
            return g.tensor(name=name, dim=dim, stride=stride, data_type=dtype)

        def index(name: str, n: int) -> Any:
            return tensor(name, [n, 1, 1, 1], [1, 1, 1, 1], cudnn.data_type.INT32)

        qk_row, v_row = 2 * h * d, 3 * h * d
        self.q = tensor("q", [b, h, sq, d], [sq * qk_row, d, qk_row, 1])
        self.k = tensor("k", [b, h, skv, d], [skv * qk_row, d, qk_row, 1])
        self.v = tensor("v", [b, h, skv, d], [skv * v_row, d, v_row, 1])
        self.q_len, self.kv_len = index("seq_len_q", b), index("seq_len_kv", b)
        self.offsets = [index(name, b + 1) for name in TABLE_ROWS[2:]]
        for t, offset in zip((self.q, self.k, self.v), self.offsets[:3], strict=True):
            t.set_ragged_offset(offset)
        self.o, _ = g.sdpa(name="attention", q=self.q, k=self.k, v=self.v, is_inference=True,
                           attn_scale=1.0 / math.sqrt(d), use_padding_mask=True,
                           seq_len_q=self.q_len, seq_len_kv=self.kv_len)
        self.o.set_output(True).set_dim([b, h, sq, d]).set_stride([sq * h * d, d, h * d, 1])
        self.o.set_ragged_offset(self.offsets[3])
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.graph = g
        self.workspace = torch.empty(int(g.get_workspace_size()), dtype=torch.uint8, device="cuda")


def cudnn_chunked_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                            table: torch.Tensor, plan: ChunkedPlan, handle: Any, num_heads: int,
                            one_pass: bool = True) -> torch.Tensor:
    """Attention output (rows, heads·d) from the packed qkv projection, as the ``cudnn`` backend computes it;
    ``table`` from :func:`chunk_table`, ``plan`` built for its entries (rows outside every segment left as they
    were); ``one_pass``: rotate with :func:`rotate_qk_rows`, else with the library's launch."""
    import cudnn

    from glmvit.kernels.triton_attention import rotate_qk_triton

    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(qkv.device).cuda_stream)  # a capture's stream
    rows, width = qkv.shape
    hd = width // 3
    out = torch.empty((rows, hd), dtype=qkv.dtype, device=qkv.device)
    qk = (rotate_qk_rows if one_pass else rotate_qk_triton)(qkv, cos, sin, cu_seqlens, num_heads)
    pack = {plan.q: qk, plan.k: qk[:, hd:], plan.v: qkv[:, 2 * hd:], plan.o: out, plan.q_len: table[0, :-1],
            plan.kv_len: table[1, :-1]}
    pack.update(dict(zip(plan.offsets, table[2:], strict=True)))
    plan.graph.execute(pack, plan.workspace, handle=handle)
    return out
