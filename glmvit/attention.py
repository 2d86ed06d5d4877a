"""Attention over packed segments, behind one interface: ``attend(q, k, v, meta, backend)``.

q, k, v are (rows, heads, head_dim); segments come from the metadata. Backends:

- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA). Graph-safe: reads cu_seqlens from the device,
  max_seqlen is the static worst case of the batch shape.
- ``flash_attn``: FlashAttention's ``flash_attn_varlen_func`` when the package is installed (CUDA). Graph-safe.
- ``sdpa_masked``: one SDPA call with a block-diagonal mask built on the device from segment ids. Shape-static
  and graph-safe on any device; O(rows²) memory, so it is the CPU and reference path.
- ``segments``: a Python loop over segments (reads cu_seqlens on the host). Eager reference only.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

BACKENDS = ("varlen", "flash_attn", "sdpa_masked", "segments")
GRAPH_SAFE = ("varlen", "flash_attn", "sdpa_masked")


def _has_varlen() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


HALF = (torch.float16, torch.bfloat16)


def available_backends(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Backends that can run on ``device`` for ``dtype`` here (the flash kernels take fp16/bf16 only)."""
    names = ["sdpa_masked", "segments"]
    if torch.device(device).type == "cuda" and torch.cuda.is_available() and dtype in HALF:
        if importlib.util.find_spec("flash_attn") is not None:
            names.insert(0, "flash_attn")
        if _has_varlen():
            names.insert(0, "varlen")
    return names


def default_backend(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    return available_backends(device, dtype)[0]


def check_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Return ``name`` if it can run on ``device`` for ``dtype``; otherwise raise a ValueError saying what can."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    ok = available_backends(device, dtype)
    if name not in ok:
        raise ValueError(
            f"attention backend {name!r} is not available on {torch.device(device)} for {dtype}; available: {ok}"
        )
    return name


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, backend: str) -> torch.Tensor:
    """Non-causal attention within each segment; returns (rows, heads, head_dim)."""
    scale = q.shape[-1] ** -0.5
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        m = meta.max_seqlen
        return varlen_attn(q, k, v, meta.cu_seqlens, meta.cu_seqlens, m, m)  # non-causal by default
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        m = meta.max_seqlen
        return flash_attn_varlen_func(q, k, v, meta.cu_seqlens, meta.cu_seqlens, m, m, causal=False)
    if backend == "sdpa_masked":
        seg = meta.segment_ids
        mask = (seg[:, None] == seg[None, :])[None, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
        )
        return out[0].transpose(0, 1)
    if backend == "segments":
        cu = meta.host.packed[: meta.shape.segments + 2].tolist()
        out = torch.zeros_like(q)
        for start, end in zip(cu[:-1], cu[1:], strict=False):
            if end <= start or start >= meta.host.num_rows:
                continue
            qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))
            weights = torch.softmax((qs @ ks.transpose(-1, -2)) * scale, dim=-1, dtype=torch.float32).to(q.dtype)
            out[start:end] = (weights @ vs).transpose(0, 1)
        return out
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
