"""The ``auto`` attention backend's choice where FlashAttention-4 runs (the ``fa4`` extra,
``glmvit.kernels.fa4_attention.loads``): FlashAttention-4's ragged kernel from ``FA4_MIN_ROWS`` packed rows on,
otherwise the choice of ``glmvit.kernels.attention_table`` without it (cuDNN's ragged kernel from ``CUDNN_MIN_ROWS``,
glmvit's Triton kernel below).

A module of its own, imported only where FlashAttention-4 loads: a machine without the extra never runs this rule,
so what it measures does not depend on it. The rule is held to the ``fa4`` rows of the H200 attention sweep
(``data/sweeps/attention_sweep_h200.json``, ``tools/attention_sweep.py``: the ``fa4`` backend, its rotation launch
included) by ``tests/test_kernel_tables.py``, as ``CUDNN_MIN_ROWS`` is.
"""
from __future__ import annotations

# FlashAttention-4's kernel from this many packed rows on (None: ``auto`` never runs it; ``--attn-backend fa4`` does).
# None: no sweep holds a threshold yet. The H100's (data/sweeps/attention_sweep_h100.json) has fa4 fastest at two
# 1024-row segments (2048 rows) and 7 % behind Triton at sixteen 256-row ones (4096), so no rows threshold keeps
# ``auto`` within 5 % of the fastest on every layout there; the H200 sweep has not timed fa4.
FA4_MIN_ROWS: int | None = None


def fa4_attention_for(rows: int) -> str:
    """``fa4``, ``cudnn`` or ``triton``: the kernel ``auto`` runs for a batch of ``rows`` packed rows where
    FlashAttention-4 runs."""
    from .attention_table import attention_for

    if FA4_MIN_ROWS is not None and rows >= FA4_MIN_ROWS:
        return "fa4"
    return attention_for(rows, fa4=False)
