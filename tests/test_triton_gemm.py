"""The split-K matmul (glmvit.kernels.triton_gemm) against x @ Wᵀ, on the CPU through the Triton interpreter (fp32,
a fresh process: the interpreter is chosen at import). Two launches in a row must agree bitwise: the last program of
each tile resets its counter, so a graph replay starts clean. fp32 tolerance: sums of ≤ 128 products of N(0, 1)
values reordered by the split: a few float32 ulps of values up to ~50, far below 1e-4.

The counters are graph-safe: growing them never frees a buffer a graph may have captured (checked on the CPU by
the buffer's lifetime, on a GPU by replaying a graph after the buffer grew and its old memory could be reused)."""
from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from conftest import run_interpreted

CASES = [(70, 100, 90, (16, 16, 16, 3)), (33, 64, 40, (16, 32, 16, 1)), (16, 48, 16, (16, 16, 16, 4)),
         (40, 128, 48, (16, 16, 32, 4))]


def _interpreter_child() -> None:
    from glmvit.kernels.triton_gemm import SplitK, splitk_linear_triton, tile_counters

    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    results = []
    for tma in (False, True):
        for m, k, n, (bm, bn, bk, split) in CASES:
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            first, second = (splitk_linear_triton(x, w, SplitK(bm, bn, bk, split, tma=tma)) for _ in range(2))
            results.append({"err": (first - x @ w.T).abs().max().item(), "same": bool(torch.equal(first, second)),
                            "counters_zero": int(tile_counters(x.device).abs().sum()) == 0})
    try:  # K = 30 fp32 values: rows of 120 bytes, which a descriptor cannot step
        splitk_linear_triton(torch.ones(8, 30), torch.ones(8, 30), SplitK(16, 16, 16, 1, tma=True))
        refused = ""
    except ValueError as err:
        refused = str(err)
    print(json.dumps({"cases": results, "refused": refused}))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_triton_gemm")


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_k_matches_matmul_and_resets_its_counters(interpreted, case, tma):
    """Pointer loads and descriptor loads: the same result, edges (M, N, K not multiples of the tile) included."""
    result = interpreted["cases"][case + tma * len(CASES)]
    assert result["err"] <= 1e-4 and result["same"] and result["counters_zero"]


def test_tma_refuses_rows_a_descriptor_cannot_step(interpreted):
    assert interpreted["refused"] == "TMA needs rows of a multiple of 16 bytes: K = 30 in torch.float32 is 120"


def test_growing_the_counters_keeps_the_old_buffer_alive():
    """A graph captured with the first buffer still points at it: a larger launch must not free it."""
    pytest.importorskip("triton")
    from glmvit.kernels import triton_gemm

    device = torch.device("cpu")
    first = triton_gemm._counters(device, 8)
    alive = weakref.ref(first)
    grown = triton_gemm._counters(device, first.numel() + 1)
    del first
    gc.collect()
    assert alive() is not None and grown.numel() > alive().numel()
    assert triton_gemm.tile_counters(device) is grown and int(grown.abs().sum()) == 0
    assert triton_gemm._counters(device, 8) is grown  # smaller launches keep using the larger buffer


@pytest.mark.gpu
def test_a_captured_launch_survives_the_counters_growing():
    """Capture a split-K launch, grow the counters with a larger eager launch, let the allocator hand out memory of
    the first buffer's size, and replay: the graph's output must be the eager one, bitwise (the sum's order is
    fixed), and the new tensors untouched. Had the first buffer been freed, a new tensor would take its block and
    the replay's atomics would write into it (and, from its non-zero values, never write the output)."""
    from glmvit.kernels.triton_gemm import SplitK, splitk_linear_triton, tile_counters

    gen = torch.Generator(device="cuda").manual_seed(0)
    cfg = SplitK(64, 64, 64, 4)
    x = torch.randn(256, 1536, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1536, 1536, device="cuda", dtype=torch.bfloat16, generator=gen)
    expected = splitk_linear_triton(x, w, cfg)  # before the capture: the counters exist
    before = tile_counters("cuda")
    size = before.numel()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = splitk_linear_triton(x, w, cfg)
    big_x = torch.randn(64 * (size // 64 + 1), 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    big_w = torch.randn(64 * 64, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    splitk_linear_triton(big_x, big_w, SplitK(64, 64, 64, 1))  # more tiles than the buffer holds: it grows
    assert tile_counters("cuda").numel() > size
    del before
    fills = [torch.full((size,), 7, dtype=torch.int32, device="cuda") for _ in range(8)]
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected)
    assert all(bool((f == 7).all()) for f in fills)


def test_no_counters_are_made_inside_a_capture(monkeypatch):
    """The guard, without a GPU: a capture is simulated by the one query the guard makes; nothing is allocated."""
    pytest.importorskip("triton")
    from glmvit.kernels import triton_gemm

    device = torch.device("cuda", 0)
    before = triton_gemm._COUNTERS.get(device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="launch this shape once before capturing"):
        triton_gemm._counters(device, 2**40)
    assert triton_gemm._COUNTERS.get(device) is before


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_gpu_bf16_split_k_on_an_encoder_shape_replays_in_a_graph(tma):
    """The block's proj at 256 rows, 4 splits, bf16: within two bf16 roundings of cuBLAS (randn inputs: |y| ≲ 5√K,
    each rounding ≤ 2⁻⁸ of it), and a captured launch replays to the same bits."""
    from glmvit.kernels.triton_gemm import SplitK, splitk_linear_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 1536, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1536, 1536, device="cuda", dtype=torch.bfloat16, generator=gen)
    cfg = SplitK(64, 64, 128, 4, tma=tma)
    eager = splitk_linear_triton(x, w, cfg)
    assert (eager.float() - torch.nn.functional.linear(x, w).float()).abs().max().item() <= 2**-7 * 5 * 1536**0.5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = splitk_linear_triton(x, w, cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)

