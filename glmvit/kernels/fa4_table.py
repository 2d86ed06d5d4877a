"""The ``auto`` attention backend's choice where FlashAttention-4 runs (the ``fa4`` extra,
``glmvit.kernels.fa4_attention.loads``): FlashAttention-4's ragged kernel from ``FA4_MIN_ROWS`` packed rows on,
otherwise the choice of ``glmvit.kernels.attention_table`` without it (cuDNN's ragged kernel from ``CUDNN_MIN_ROWS``,
glmvit's Triton kernel below).

A module of its own, imported only where FlashAttention-4 loads: a machine without the extra never runs this rule,
so what it measures does not depend on it. The rule is held to the ``fa4`` rows of the attention sweep that timed them
(``data/sweeps/attention_sweep_h100.json``, ``tools/attention_sweep.py``: the ``fa4`` backend, its rotation launch
included) by ``tests/test_kernel_tables.py``.
"""
from __future__ import annotations

# FlashAttention-4's kernel from this many packed rows on (None: ``auto`` never runs it; ``--attn-backend fa4`` does).
# The H100's sweep (data/sweeps/attention_sweep_h100.json, the one that has timed fa4) has it fastest on every layout
# from cuDNN's threshold on: 142 against cuDNN's 154 µs at eight 1024-row segments, 311 against 362 at one 5329-row
# image, 137 against 158 on the mixed 6080-row batch. Below, it loses to Triton on one 256-row segment (11.4 against
# 8.8) and on sixteen (52.3 against 48.9) but wins on two 1024-row ones (41.0 against 50.1), so a rows threshold
# lower than cuDNN's would trade one for the other; at cuDNN's, ``auto`` with FlashAttention-4 is never slower than
# without it on a swept layout (tests/test_kernel_tables.py holds it to that).
FA4_MIN_ROWS: int | None = 5120


def fa4_attention_for(rows: int) -> str:
    """``fa4``, ``cudnn`` or ``triton``: the kernel ``auto`` runs for a batch of ``rows`` packed rows where
    FlashAttention-4 runs."""
    from .attention_table import attention_for

    if FA4_MIN_ROWS is not None and rows >= FA4_MIN_ROWS:
        return "fa4"
    return attention_for(rows, fa4=False)
