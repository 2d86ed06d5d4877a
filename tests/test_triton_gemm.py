"""The split-K matmul (glmvit.kernels.triton_gemm) against x @ Wᵀ, on the CPU through the Triton interpreter (fp32,
a fresh process: the interpreter is chosen at import). Two launches in a row must agree bitwise: the last program of
each tile resets its counter, so a graph replay starts clean. fp32 tolerance: sums of ≤ 128 products of N(0, 1)
values reordered by the split: a few float32 ulps of values up to ~50, far below 1e-4."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_interpreted

CASES = [(70, 100, 90, (16, 16, 16, 3)), (33, 64, 40, (16, 32, 16, 1)), (16, 48, 16, (16, 16, 16, 4)),
         (40, 128, 48, (16, 16, 32, 4))]


def _interpreter_child() -> None:
    from glmvit.kernels.triton_gemm import _COUNTERS, SplitK, splitk_linear_triton

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    results = []
    for m, k, n, (bm, bn, bk, split) in CASES:
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        first, second = (splitk_linear_triton(x, w, SplitK(bm, bn, bk, split)) for _ in range(2))
        results.append({"err": (first - x @ w.T).abs().max().item(), "same": bool(torch.equal(first, second)),
                        "counters_zero": int(_COUNTERS[x.device].abs().sum()) == 0})
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_triton_gemm")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_k_matches_matmul_and_resets_its_counters(interpreted, case):
    result = interpreted[case]
    assert result["err"] <= 1e-4 and result["same"] and result["counters_zero"]
