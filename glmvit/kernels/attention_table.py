"""The attention kernel's launch table: which :class:`~glmvit.kernels.triton_attention.AttnConfig` a batch of so
many packed rows runs, chosen from the sweep recorded on the H200 (``data/bench/tune_h200.json``, made by
``tools/tune_kernels.py``; ``tests/test_kernel_tables.py`` checks every choice within 10 % of the best one
configuration can do on the layouts of that many rows). A module of its own because the sweep times the
configurations it is given and never reads this table: the choice depends on the sweep, not the other way round, so
changing it leaves the sweep's record current.

Up to 256 rows (one 224² image) the prerotated path with 3 pipelining stages: its own rotation launch is cheap
there, and the loop over plain keys is shorter than one that rotates them. From 257 to 1024 rows the keys are
rotated in the loop, 64-row blocks with 4 warps and one stage: four 224² images gain from the prerotated path but
sixteen 112² images lose more (in 64-row segments the rotation launch costs more than the shorter loop saves),
and a table keyed by rows cannot tell the two apart. Above 1024 rows the prerotated path again: at eight 448²
images it took a quarter off the best in-loop kernel, at one 1036² image a third.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .triton_attention import AttnConfig

if TYPE_CHECKING:  # no entry holds one (data/sweeps/tma_ab_h200.json: slower on every layout); adopting one imports it
    from .triton_attention_tma import TmaConfig

# The ``auto`` attention backend's one choice: cuDNN's ragged kernel from this many packed rows on, glmvit's Triton
# kernel below. Measured per attention call in ``data/sweeps/attention_sweep_h200.json`` (``tools/attention_sweep.py``,
# rotation included on both): cuDNN wins on long segments (eight 448² images, one 1022² image, a mixed batch of
# 6080 rows) and loses below (one, four or sixteen 224² images, two 448² images: its fixed cost per segment slot).
# Between the largest layout it loses (4096 rows) and the smallest it wins (5332), at the middle. Where
# FlashAttention-4 runs (the ``fa4`` extra), ``glmvit.kernels.fa4_table`` decides instead.
CUDNN_MIN_ROWS = 5120

PREROTATED = AttnConfig(64, 64, 4, 3, prerotate=True)
# An entry may also be a TmaConfig: the same rotation launch, then the Hopper-shaped kernel of
# ``glmvit.kernels.triton_attention_tma`` (chosen where ``tools/tma_ab.py`` measured it faster).
CONFIGS: tuple[tuple[int | None, AttnConfig | TmaConfig], ...] = (
    (256, PREROTATED), (1024, AttnConfig(64, 64, 4, 1)), (None, PREROTATED))


def attention_for(rows: int, fa4: bool | None = None) -> str:
    """``fa4``, ``cudnn`` or ``triton``: the kernel the ``auto`` backend runs for a batch of ``rows`` packed rows.
    ``fa4``: whether FlashAttention-4 runs here (None: ``glmvit.kernels.fa4_attention.loads``); where it does,
    ``glmvit.kernels.fa4_table`` decides, else cuDNN's ragged kernel from ``CUDNN_MIN_ROWS`` rows, Triton below."""
    if fa4 is None:
        from .fa4_attention import loads

        fa4 = loads()
    if fa4:
        from .fa4_table import fa4_attention_for

        return fa4_attention_for(rows)
    return "cudnn" if rows >= CUDNN_MIN_ROWS else "triton"


def config_for(rows: int) -> AttnConfig | TmaConfig:
    """The launch configuration for a batch of ``rows`` packed rows (``CONFIGS``)."""
    return next(config for limit, config in CONFIGS if limit is None or rows <= limit)
