"""The attention kernel's launch table: which :class:`~glmvit.kernels.triton_attention.AttnConfig` a batch of so
many packed rows runs, chosen from the sweep recorded on the H200 (``data/bench/tune_h200.json``, made by
``tools/tune_kernels.py``; ``tests/test_kernel_tables.py`` checks every choice within 10 % of the best measured on
each layout). A module of its own because the sweep times the configurations it is given and never reads this
table: the choice depends on the sweep, not the other way round, so changing it leaves the sweep's record current.

Up to 1024 rows (budgets ≤ 256 tokens: segments of at most 256 rows) the keys are rotated in the loop, 64-row
blocks with 4 warps and one stage: the most programs, and no second launch. Above, the prerotated path with
3 pipelining stages: at eight 448² images it took 23 % off the best in-loop kernel, at one 1036² image 35 %.
"""
from __future__ import annotations

from .triton_attention import AttnConfig

CONFIGS = ((1024, AttnConfig(64, 64, 4, 1)), (None, AttnConfig(64, 64, 4, 3, prerotate=True)))


def config_for(rows: int) -> AttnConfig:
    """The launch configuration for a batch of ``rows`` packed rows (``CONFIGS``)."""
    return next(config for limit, config in CONFIGS if limit is None or rows <= limit)
