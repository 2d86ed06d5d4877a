"""FlashAttention-4's attention over packed segments (the ``fa4`` attention backend), through its CuTe DSL package
(``flash-attn-4``, the ``fa4`` extra: ``flash_attn.cute``; CUDA on Hopper or newer, fp16/bf16).

Spec: the ``triton`` backend's (``glmvit.kernels.triton_attention``): for every head and every real row r of
segment s, out[r] = softmax(q̃_r · K̃_sᵀ / √d) · V_s with q̃, k̃ rotated in float32 and rounded to the input dtype.

Two launches per layer, as the ``cudnn`` backend's: ``rotate_qk_triton`` writes q̃, k̃ of every head into a
(rows, 2·heads·d) scratch, then FlashAttention-4's varlen forward (``flash_attn_varlen_func``; on Hopper its SM90
kernel, the FlashAttention-3 design written in CUTLASS's CuTe DSL) reads q̃, k̃ there and v straight out of the qkv
projection, segments given by ``cu_seqlens`` on the device and the longest a batch shape allows (``max_seqlen``,
static): each query attends to its own segment's keys only, so no key or value of one item is read for another (a
NaN in one cannot reach the next). Unused slots repeat the last offset (empty segments); rows outside every segment
(padding) are not written. No host read and no plan: the kernel is compiled on its first call for a shape class
(dtype, head size, a few host choices from ``max_seqlen``) and cached, so the runner's warm-up before capture
compiles it and a CUDA graph then records the launch alone.

Why it exists beside ``cudnn``: on packed rows cuDNN's ragged (THD) kernel is far slower than its own dense kernel
on the same rows, FlashAttention-4's ragged kernel within about a tenth of its dense one (``tools/attention_sweep.py``:
its ``fa4_varlen`` and ``fa4_dense`` paths beside ``cudnn`` and ``sdpa_cudnn_dense``; on an H100 in
``data/sweeps/attention_sweep_h100.json``). Which batches take it is the launch table's decision
(``glmvit.kernels.fa4_table``), from that H100 sweep.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
from functools import cache, lru_cache

import torch

MIN_CAPABILITY = (9, 0)  # its Hopper (SM90) and Blackwell kernels; older GPUs run FlashAttention-2's design elsewhere


def submodule_installed(package: str, name: str) -> bool:
    """Whether ``package.name`` is installed, looked up in ``package``'s folders without importing ``package``:
    ``find_spec`` of a dotted name runs the package's ``__init__`` first, and FlashAttention-2's loads its CUDA
    extension there, which raises where it was built for another torch."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return False
    found = importlib.machinery.PathFinder.find_spec(f"{package}.{name}", list(spec.submodule_search_locations))
    return found is not None


def installed() -> bool:
    """Whether FlashAttention-4's CuTe DSL package is installed here (it is optional: the ``fa4`` extra). Its module
    is ``flash_attn.cute`` in a ``flash_attn`` namespace that FlashAttention-2 also uses, so the submodule is what is
    looked up (:func:`submodule_installed`)."""
    return submodule_installed("flash_attn", "cute")


def loads() -> bool:
    """Whether FlashAttention-4 is installed here and its package imports (asked once per process). Where the
    ``auto`` backend exists (the ``cudnn`` backend's conditions: Hopper or newer, fp16/bf16, head_dim 64 or 128)
    this is the whole of whether ``fa4`` runs. torch.compile takes the answer as a constant."""
    return _loads()


# What torch.compiler.assume_constant_result(loads) sets (as on glmvit.kernels.fused_gemm_table.measured_gpu): a
# plain function, so that Dynamo calls it rather than tracing the import inside (it traces through a cache wrapper).
loads._dynamo_marked_constant = True  # type: ignore[attr-defined]


@cache
def _loads() -> bool:
    if not installed():
        return False
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - a package that cannot load its compiler is one that does not run
        return False
    return True


def head_dim_ok(head_dim: int) -> bool:
    """The head sizes its SM90 forward takes: 8 to 256, a multiple of 8 (16-byte rows in fp16/bf16)."""
    return 8 <= head_dim <= 256 and head_dim % 8 == 0


@lru_cache(maxsize=8)
def unavailable_reason(device_index: int, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why the ``fa4`` backend cannot run on CUDA device ``device_index`` for ``dtype`` (None: it can)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return f"FlashAttention-4 takes fp16/bf16, not {dtype}"
    if head_dim is not None and not head_dim_ok(head_dim):
        return f"FlashAttention-4 takes a head_dim of 8 to 256 in steps of 8, not {head_dim}"
    if not installed():
        return "FlashAttention-4 is not installed (pip install 'glmvit[fa4]')"
    if torch.cuda.get_device_capability(device_index) < MIN_CAPABILITY:
        return "FlashAttention-4 needs a Hopper (sm_90) or newer GPU"
    try:  # a package that cannot load its compiler makes this backend unavailable, not every model broken
        import flash_attn.cute  # noqa: F401
    except Exception as err:  # noqa: BLE001 - whatever its native libraries raise, one line
        return f"FlashAttention-4 does not load: {type(err).__name__}: {str(err).strip()[:120]}"
    return None


def fa4_varlen_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor,
                         num_heads: int, max_seqlen: int, rotated: bool = False) -> torch.Tensor:
    """Rotary + attention from the packed qkv projection (rows, 3·heads·d) on CUDA; returns (rows, heads·d), its
    padding rows unwritten. ``rotated``: q and k of ``qkv`` are rotated already (the fused rotary qkv GEMM) and read
    where they are; ``max_seqlen`` bounds every segment (the batch shape's, the same at every replay)."""
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("fa4 attention reads qkv, cos and sin as dense rows: pass contiguous tensors")
    from flash_attn.cute import flash_attn_varlen_func

    rows, width = qkv.shape
    hd = width // 3
    if rows == 0:
        return qkv.new_empty((0, hd))
    with torch.cuda.device(qkv.device):  # its launches and its stream are the current device's: make it qkv's
        if rotated:
            q, k = qkv[:, :hd], qkv[:, hd : 2 * hd]
        else:
            from .triton_attention import rotate_qk_triton

            qk = rotate_qk_triton(qkv, cos, sin, cu_seqlens, num_heads)
            q, k = qk[:, :hd], qk[:, hd:]
        q, k, v = (x.view(rows, num_heads, hd // num_heads) for x in (q, k, qkv[:, 2 * hd :]))
        cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                     max_seqlen_k=max_seqlen, causal=False)
    out = out[0] if isinstance(out, tuple) else out  # (out, lse) where a version returns both
    return out.reshape(rows, hd)
