"""The launch tables in glmvit.kernels against the sweep recorded on the H200 (data/bench/tune_h200.json, from
tools/tune_kernels.py): each choice within 10% of the fastest configuration measured for that layout, and the
decision to keep cuBLAS for every matmul backed by the split-K sweep."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from glmvit.kernels.attention_table import config_for

SWEEP = json.loads((Path(__file__).parents[1] / "data" / "bench" / "tune_h200.json").read_text())


def key(config) -> str:  # as tools/tune_kernels.py's attn_key
    return (f"{config.block_m}x{config.block_n}w{config.num_warps}s{config.num_stages}"
            + (f"k{config.split_k}" if config.split_k > 1 else "") + ("r" if config.prerotate else ""))


@pytest.mark.parametrize("layout", sorted(SWEEP["attention"]))
def test_attention_config_within_10_percent_of_the_best_measured(layout):
    entry = SWEEP["attention"][layout]
    chosen = entry["configs"][key(config_for(entry["rows"]))]
    assert isinstance(chosen, float) and chosen <= 1.10 * entry["best_us"], (layout, chosen, entry["best"])


def test_cublas_stays_for_every_matmul_the_split_k_kernel_does_not_beat_by_10_percent():
    """glmvit keeps cuBLAS for all matmuls: the split-K kernel never wins by a margin worth a second code path."""
    for row in SWEEP["gemm"]:
        assert row["best_us"] >= 0.9 * row["cublas_us"], row
        best = row["configs"][row["best"]]
        # randn inputs: outputs ~ N(0, K), |y| ≲ 5√K; two bf16 roundings of such values differ by ≤ 2⁻⁷·5√K
        assert best["max_abs_err"] <= 2**-7 * 5 * math.sqrt(row["k"])  # the kernel is correct, only slower
