"""Attention over packed segments, behind one interface: ``attend(q, k, v, meta, backend)``.

q, k, v are (rows, heads, head_dim); segments come from the metadata. Padded rows lie outside every segment
(``glmvit.metadata``): what a backend leaves in them is never read by a real row. Backends:

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA). Graph-safe: reads cu_seqlens from the device,
  max_seqlen is the static worst case of the batch shape. Padded rows of its output are left as they were.
- ``flash_attn``: FlashAttention-2's ``flash_attn_varlen_func`` when the package is installed (CUDA). Graph-safe.
- ``fa4``: FlashAttention-4's varlen kernel (``glmvit.kernels.fa4_attention``; the ``fa4`` extra, Hopper or newer,
  fp16/bf16): q and k rotated by the ``cudnn`` backend's Triton launch, then one ragged forward over every segment
  with ``cu_seqlens`` read on the device. Graph-safe once its first call compiled the kernel (the runner's warm-up).
- ``sdpa_masked``: one SDPA call with a block-diagonal mask built on the device from segment ids (a padded row
  attends only to itself). Shape-static and graph-safe on any device; O(rows²) memory: the graph-safe reference.
- ``triton``: glmvit's own Triton kernel (``glmvit.kernels.triton_attention``): reads q, k, v straight out of the
  qkv projection and applies the rotary inside, one program per (block of 64 or 128 rows, head), so short segments
  still fill the GPU. Graph-safe; in fp16/bf16 (head_dim 32, 64, 128 or 256: ``TRITON_HEAD_DIMS``) the CUDA
  default without the cuDNN frontend and ``auto``'s choice for small batches with it; on the CPU in fp32 under
  ``TRITON_INTERPRET=1``.
- ``cudnn``: cuDNN's fused attention through the cuDNN frontend (``glmvit.kernels.cudnn_attention``; the ``cuda``
  extra, Hopper or newer, fp16/bf16): q and k rotated once by glmvit's Triton rotation launch, then one ragged
  (THD) SDPA over every segment, its offsets computed once per forward (:func:`prepare_attention`). Graph-safe.
- ``dense``: only on a *uniform* batch shape (``glmvit.metadata.BatchShape.uniform``: every real segment exactly
  ``max_seqlen`` = L rows, packed from row 0, rows a multiple of L), where the rows are ``rows // L`` whole segments:
  q and k rotated (on CUDA in fp16/bf16 by the ``cudnn`` backend's Triton rotation launch, elsewhere by
  ``apply_rotary``), then one SDPA over (rows // L, heads, L, d) views of the packed rows, no copies; on CUDA in
  fp16/bf16 under ``sdpa_kernel`` preferring cuDNN, then FlashAttention, then memory-efficient attention (no
  padding mask, no ragged offsets: the fastest kernel where it applies). Each real segment is one batch entry of
  its own and the padding rows form whole entries after them, so no real row reads a padded or another item's row;
  what padded entries compute (from rows the rotation launch leaves unset) stays in them. Graph-safe. A model's
  forward cannot take it (most batches are not uniform): ``EncoderGraphRunner(uniform_lengths=...)`` captures
  uniform shapes and runs it there.
- ``auto`` (the CUDA default where ``cudnn`` runs): ``dense`` on a uniform shape; otherwise ``cudnn`` for a batch
  of at least ``glmvit.kernels.attention_table.CUDNN_MIN_ROWS`` packed rows, ``triton`` below (:func:`resolve`):
  cuDNN's fixed cost per segment slot loses on small batches, its kernel wins on long segments. Where
  FlashAttention-4 runs, ``glmvit.kernels.fa4_table`` decides which batches take ``fa4`` instead. One choice per
  batch shape, so a captured budget always runs the same kernel.
- ``segments``: one SDPA call per segment, reading cu_seqlens from the tensor (a host read: a sync on CUDA, so
  eager only there). No (rows)² mask, O(rows) memory: the CPU default.

Items cannot reach each other, NaN and Inf included: the varlen kernels, ``dense`` and ``segments`` never combine
rows of two segments, and ``sdpa_masked`` keeps non-finite keys and values out of its one big call (see
``_sdpa_masked``).
"""
from __future__ import annotations

import importlib.util
from contextlib import nullcontext
from dataclasses import replace
from functools import lru_cache
from itertools import pairwise
from typing import ContextManager

import torch
import torch.nn.functional as F

from .rotary import apply_rotary

BACKENDS = ("auto", "varlen", "flash_attn", "fa4", "triton", "cudnn", "dense", "sdpa_masked", "segments")
GRAPH_SAFE = ("auto", "varlen", "flash_attn", "fa4", "triton", "cudnn", "dense", "sdpa_masked")
UNIFORM_ONLY = ("dense",)  # runs only on uniform batch shapes: never a model's backend, never offered by the device


def _has_varlen() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def _has_flash_attn2() -> bool:
    """FlashAttention-2's package (its ``flash_attn_interface``), not merely a ``flash_attn`` namespace:
    FlashAttention-4 installs ``flash_attn.cute`` into one without FlashAttention-2's functions. Looked up without
    importing ``flash_attn`` (``glmvit.kernels.fa4_attention.submodule_installed``)."""
    from .kernels.fa4_attention import submodule_installed

    return submodule_installed("flash_attn", "flash_attn_interface")


HALF = (torch.float16, torch.bfloat16)


def available_backends(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                       head_dim: int | None = None) -> list[str]:
    """Backends that can run on ``device`` for ``dtype`` (and ``head_dim``, when given) here, the default first.

    CUDA: ``auto`` and ``cudnn`` where cuDNN runs, glmvit's ``triton`` kernel, ``fa4`` where FlashAttention-4 runs,
    then the other library varlen kernels (all fp16/bf16 only), then ``sdpa_masked``
    (graph-safe in any dtype). Elsewhere there is no graph to capture, so the per-segment loop comes first
    (``triton`` is offered there only in fp32 under the interpreter).
    """
    return list(_available(torch.device(device).type, dtype, head_dim))


@lru_cache(maxsize=64)
def _available(device_type: str, dtype: torch.dtype, head_dim: int | None) -> tuple[str, ...]:
    """What :func:`available_backends` returns, computed once per process (module lookups are not free: the eager
    forward asks on every call)."""
    triton_ok = triton_attention_runs(device_type, dtype, head_dim)
    if device_type != "cuda":
        return ("segments", "sdpa_masked") + (("triton",) if triton_ok else ())
    names = ["sdpa_masked", "segments"]
    if torch.cuda.is_available() and dtype in HALF:
        if _has_flash_attn2():
            names.insert(0, "flash_attn")
        if _has_varlen():
            names.insert(0, "varlen")
        if triton_ok:
            if fa4_attention_runs(torch.cuda.current_device(), dtype, head_dim):
                names.insert(0, "fa4")  # rotates q and k with the Triton launch
            names.insert(0, "triton")
            if cudnn_attention_runs(torch.cuda.current_device(), dtype, head_dim):
                names[:0] = ["auto", "cudnn"]
    return tuple(names)


def cudnn_attention_runs(device_index: int, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether the ``cudnn`` backend runs on CUDA device ``device_index`` for ``dtype`` (it rotates q and k with
    glmvit's Triton launch, so the caller has checked Triton already)."""
    from .kernels.cudnn_attention import unavailable_reason

    return unavailable_reason(device_index, dtype, head_dim) is None


def fa4_attention_runs(device_index: int, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether the ``fa4`` backend runs on CUDA device ``device_index`` for ``dtype`` (it rotates q and k with
    glmvit's Triton launch, so the caller has checked Triton already)."""
    from .kernels.fa4_attention import unavailable_reason

    return unavailable_reason(device_index, dtype, head_dim) is None


TRITON_HEAD_DIMS = (32, 64, 128, 256)  # on a GPU: half a head is one tl.dot operand, ≥ 16 wide and a power of two


def triton_attention_runs(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether the Triton kernel runs here: on CUDA in fp16/bf16 with a head_dim of ``TRITON_HEAD_DIMS`` (None: not
    checked), on the CPU in fp32 under the interpreter."""
    from .kernels import interpreting, triton_available

    if not triton_available():
        return False
    if torch.device(device).type == "cuda":
        return dtype in HALF and not interpreting() and (head_dim is None or head_dim in TRITON_HEAD_DIMS)
    return torch.device(device).type == "cpu" and dtype == torch.float32 and interpreting()


def default_backend(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                    head_dim: int | None = None) -> str:
    return available_backends(device, dtype, head_dim)[0]


def check_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                  head_dim: int | None = None) -> str:
    """Return ``name`` if it can run on ``device`` for ``dtype``; otherwise raise a ValueError saying what can."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name in UNIFORM_ONLY:
        raise ValueError(f"attention backend {name!r} runs only on uniform batch shapes, not every batch; "
                         "EncoderGraphRunner(uniform_lengths=...) runs it on the graphs it captures for them")
    ok = available_backends(device, dtype, head_dim)
    if name not in ok:
        raise ValueError(
            f"attention backend {name!r} is not available on {torch.device(device)} for {dtype}; available: {ok}"
        )
    return name


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA on (rows, heads, d) tensors (viewed as the (1, heads, rows, d) it takes); returns (rows, heads, d)."""
    q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)[0].transpose(0, 1)


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal attention in one SDPA call; a non-finite key or value reaches only its own segment.

    SDPA applies the mask additively (NaN + -inf is NaN, and a zero weight times NaN is NaN), so a head's key and
    value of a row holding NaN/Inf are zeroed first, which leaves every finite input bitwise as it is. The segments
    that held one are then set to NaN in that head, as a per-segment attention leaves them. All static shapes.
    """
    mask = (segment_ids[:, None] == segment_ids[None, :])[None, None]
    bad = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (rows, heads)
    k, v = (x.masked_fill(bad[..., None], 0) for x in (k, v))
    out = _sdpa(q, k, v, mask)
    # Segment ids are < rows (each real segment has ≥ 1 row, each padded row an id of its own): a rows-long tally.
    hits = torch.zeros(bad.shape, dtype=torch.float32, device=bad.device).index_add_(0, segment_ids, bad.float())
    return out.masked_fill(hits.index_select(0, segment_ids)[..., None] > 0, float("nan"))


def _dense_kernels(x: torch.Tensor) -> ContextManager[None]:
    """The SDPA kernels the ``dense`` backend allows for ``x``: on CUDA in fp16/bf16 cuDNN first, then
    FlashAttention, then memory-efficient attention (never the math kernel's materialised scores); elsewhere SDPA's
    own choice."""
    if not (x.is_cuda and x.dtype in HALF):
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel(order, set_priority=True)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Attention within each whole block of ``seqlen`` rows of (rows, heads, d) q, k, v (rows a multiple of it; any
    row stride): one SDPA call over their (rows // seqlen, heads, seqlen, d) views. Returns (rows, heads, d)."""
    rows, heads, d = q.shape
    n = rows // seqlen
    q4, k4, v4 = (x.view(n, seqlen, heads, d).transpose(1, 2) for x in (q, k, v))
    with _dense_kernels(q):
        out = F.scaled_dot_product_attention(q4, k4, v4)
    return out.transpose(1, 2).reshape(rows, heads, d)


def _check_uniform(meta) -> None:
    if not meta.shape.uniform:
        raise ValueError(f"attention backend 'dense' needs a uniform batch shape, got {meta.shape}")


@torch.library.custom_op("glmvit::dense_attention", mutates_args=())
def dense_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                    num_heads: int, seqlen: int, rotated: bool = False) -> torch.Tensor:
    """The ``dense`` backend from the packed qkv projection (rows, 3·heads·d), rows a multiple of ``seqlen``, as one
    opaque op (torch.compile traces around it; a CUDA graph captures it); returns (rows, heads·d).

    On CUDA in fp16/bf16 q and k are rotated by the ``cudnn`` backend's Triton launch into a (rows, 2·heads·d)
    scratch (rows from ``cu_seqlens[-1]`` on, the padding, left unset: only padded blocks read them); elsewhere by
    ``apply_rotary``. ``rotated``: q and k of ``qkv`` are rotated already and read where they are."""
    rows, width = qkv.shape
    hd = width // 3
    if rows == 0:
        return qkv.new_empty((0, hd))
    launch = not rotated and qkv.is_cuda and triton_attention_runs(qkv.device, qkv.dtype, hd // num_heads)
    if launch:
        from .kernels.triton_attention import rotate_qk_triton

        qk = rotate_qk_triton(qkv, cos, sin, cu_seqlens, num_heads)
        q, k = qk[:, :hd], qk[:, hd:]
    else:
        q, k = qkv[:, :hd], qkv[:, hd : 2 * hd]
    q, k, v = (x.view(rows, num_heads, -1) for x in (q, k, qkv[:, 2 * hd :]))
    if not (rotated or launch):
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return _dense(q, k, v, seqlen).reshape(rows, hd)


@dense_attention.register_fake
def _(qkv, cos, sin, cu_seqlens, num_heads, seqlen, rotated=False):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3))


def _per_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """One SDPA call per non-empty segment; rows outside every segment (padding) stay zero."""
    out = torch.zeros_like(q)
    cu = cu_seqlens.tolist()  # from the tensor, never a host copy: the runner refreshes only the device buffer
    for start, end in pairwise(cu):
        if end > start:
            out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end])
    return out


@torch.library.custom_op("glmvit::rope_varlen_attention", mutates_args=())
def rope_varlen_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segment_ids: torch.Tensor,
                          cu_seqlens: torch.Tensor, num_heads: int, rotated: bool = False) -> torch.Tensor:
    """The ``triton`` backend as one opaque op (torch.compile traces around it; a CUDA graph captures it)."""
    from .kernels.triton_attention import rope_varlen_attention_triton

    return rope_varlen_attention_triton(qkv, cos, sin, segment_ids, cu_seqlens, num_heads, rotated=rotated)


@rope_varlen_attention.register_fake
def _(qkv, cos, sin, segment_ids, cu_seqlens, num_heads, rotated=False):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3))


@torch.library.custom_op("glmvit::cudnn_varlen_attention", mutates_args=())
def cudnn_varlen_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                           ragged: torch.Tensor, num_heads: int, max_seqlen: int,
                           rotated: bool = False) -> torch.Tensor:
    """The ``cudnn`` backend as one opaque op (torch.compile traces around it; a CUDA graph captures it)."""
    from .kernels.cudnn_attention import cudnn_varlen_attention as run

    return run(qkv, cos, sin, cu_seqlens, ragged, num_heads, max_seqlen, rotated=rotated)


@cudnn_varlen_attention.register_fake
def _(qkv, cos, sin, cu_seqlens, ragged, num_heads, max_seqlen, rotated=False):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3))


@torch.library.custom_op("glmvit::fa4_varlen_attention", mutates_args=())
def fa4_varlen_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                         num_heads: int, max_seqlen: int, rotated: bool = False) -> torch.Tensor:
    """The ``fa4`` backend as one opaque op (torch.compile traces around it; a CUDA graph captures it)."""
    from .kernels.fa4_attention import fa4_varlen_attention as run

    return run(qkv, cos, sin, cu_seqlens, num_heads, max_seqlen, rotated=rotated)


@fa4_varlen_attention.register_fake
def _(qkv, cos, sin, cu_seqlens, num_heads, max_seqlen, rotated=False):
    return qkv.new_empty((qkv.shape[0], qkv.shape[1] // 3))


def resolve(backend: str, rows: int, qkv_width: int | None = None, uniform: bool = False) -> str:
    """The kernel ``backend`` runs for a batch of ``rows`` packed rows: ``auto`` becomes ``dense`` on a ``uniform``
    shape (``auto`` exists only on CUDA in fp16/bf16, where the dense SDPA runs), else ``fa4``, ``cudnn`` or
    ``triton`` (``glmvit.kernels.attention_table.attention_for``), ``triton`` where a (rows, ``qkv_width``)
    projection would overflow cuDNN's int32 offsets; every other name is itself."""
    if backend != "auto":
        return backend
    if uniform:
        return "dense"
    from .kernels.attention_table import attention_for
    from .kernels.cudnn_attention import fits_int32

    choice = attention_for(rows)
    return "triton" if choice == "cudnn" and qkv_width is not None and not fits_int32(rows, qkv_width) else choice


def prepare_attention(meta, backend: str, num_heads: int, head_dim: int):
    """The metadata a forward's attention layers read: ``meta`` itself, or for ``cudnn`` a copy holding the ragged
    offsets of its ``cu_seqlens`` (``glmvit.kernels.cudnn_attention.ragged_offsets``), computed once per forward
    on the device instead of once per layer. Graph-safe: a capture records the few ops that compute them."""
    if resolve(backend, meta.shape.rows, 3 * num_heads * head_dim, meta.shape.uniform) != "cudnn":
        return meta
    from .kernels.cudnn_attention import ragged_offsets

    return replace(meta, ragged=ragged_offsets(meta.cu_seqlens, num_heads, head_dim))


def attend_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta, backend: str,
               num_heads: int, rotated: bool = False) -> torch.Tensor:
    """Rotary + attention from the packed qkv projection (rows, 3·heads·d); returns (rows, heads·d).

    ``triton`` does it in one kernel, ``fa4`` in two (rotation, then FlashAttention-4), ``cudnn`` in two (rotation,
    then cuDNN, its offsets from :func:`prepare_attention`'s metadata or, when ``meta`` has none, computed here),
    ``dense`` in two on CUDA
    (rotation, then one SDPA; :func:`dense_attention`); the others split q, k, v,
    rotate q and k (``apply_rotary``) and ``attend``. ``rotated``: q and k of ``qkv`` are rotated already (the
    fused rotary qkv GEMM, ``glmvit.kernels.triton_qkv_rope_gemm``): every backend attends without rotating.
    """
    rows = qkv.shape[0]
    backend = resolve(backend, rows, qkv.shape[1], meta.shape.uniform)
    if backend == "dense":
        _check_uniform(meta)
        return dense_attention(qkv, cos, sin, meta.cu_seqlens, num_heads, meta.max_seqlen, rotated)
    if backend == "triton":
        return rope_varlen_attention(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, num_heads, rotated)
    if backend == "cudnn":
        ragged = getattr(meta, "ragged", None)
        if ragged is None:
            from .kernels.cudnn_attention import ragged_offsets

            ragged = ragged_offsets(meta.cu_seqlens, num_heads, qkv.shape[1] // (3 * num_heads))
        return cudnn_varlen_attention(qkv, cos, sin, meta.cu_seqlens, ragged, num_heads, meta.max_seqlen, rotated)
    if backend == "fa4":
        return fa4_varlen_attention(qkv, cos, sin, meta.cu_seqlens, num_heads, meta.max_seqlen, rotated)
    q, k, v = qkv.view(rows, 3, num_heads, -1).unbind(1)
    if not rotated:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    return attend(q, k, v, meta, backend).reshape(rows, -1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, backend: str) -> torch.Tensor:
    """Non-causal attention within each segment; returns (rows, heads, head_dim)."""
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        m = meta.max_seqlen
        out = varlen_attn(q, k, v, meta.cu_seqlens, meta.cu_seqlens, m, m)  # non-causal by default
        assert isinstance(out, torch.Tensor)  # a tuple only when asked for the log-sum-exp
        return out
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        m = meta.max_seqlen
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens, meta.cu_seqlens, m, m, causal=False)
    if backend == "dense":
        _check_uniform(meta)
        return _dense(q, k, v, meta.max_seqlen)
    if backend == "sdpa_masked":
        return _sdpa_masked(q, k, v, meta.segment_ids)
    if backend == "segments":
        return _per_segment(q, k, v, meta.cu_seqlens)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
