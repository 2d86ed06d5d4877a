"""The ``dense`` attention and uniform graphs on CUDA in bf16 (GLM-4.1V's 12 heads × 128): accuracy against the
same attention in fp32, no host sync, real CUDA graphs that replay what the eager static forward computes, and a
uniform batch routed to its uniform graph, within tests/test_gpu.py's per-item bound of the eager forward. Marked
``gpu``: skipped without CUDA (tests/conftest.py). Run: ``pytest -m gpu tests/test_dense_gpu.py``.

Bound: bf16 attention errs against fp32 by its own rounding. ``segments`` (per-segment SDPA, the CPU-verified
reference) gives that error E on the same bf16 inputs; ``dense`` must stay within 2E plus one bf16 ulp at the
output's scale. A dense view that mixed two segments' rows would err by the output's whole scale.
"""
import pytest
import torch
from test_gpu import assert_per_item

from glmvit import VisionConfig
from glmvit.attention import attend_qkv, dense_attention
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import BatchShape, build_metadata
from glmvit.packing import BudgetConfig
from glmvit.random_weights import random_encoder
from glmvit.rotary import apply_rotary

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
HEADS, D, L = 12, 128, 256


def qkv_batch(real, blocks, seed=0):
    """qkv (rows, 3·heads·d) bf16, cos, sin (rows, d) fp32 and uniform metadata: ``real`` segments of L rows in
    ``blocks`` whole blocks (the rest padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = blocks * L
    qkv = torch.randn(rows, 3 * HEADS * D, generator=g).to(CUDA, torch.bfloat16)
    angles = torch.rand(rows, D // 2, generator=g) * 20
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(CUDA) for f in (torch.cos, torch.sin))
    meta = build_metadata([[real, 16, 16]], 2, BatchShape(rows, real + 2, L, uniform=True)).to(CUDA)
    return qkv, cos, sin, meta


def error_bound(dense, ref_bf16, truth):
    e = (ref_bf16.float() - truth).abs().max().item()
    return (dense.float() - truth).abs().max().item(), 2 * e + truth.abs().max().item() * 2**-8


@pytest.mark.parametrize("rotated", [False, True])
def test_dense_on_cuda_is_as_accurate_as_the_per_segment_loop(rotated):
    qkv, cos, sin, meta = qkv_batch(real=4, blocks=6, seed=1)
    real = 4 * L
    if rotated:  # q and k rotated already, as the fused rotary qkv GEMM leaves them
        q, k, v = qkv.view(-1, 3, HEADS, D).unbind(1)
        qkv = torch.cat([apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v], 1).reshape(qkv.shape)
    with torch.inference_mode():
        dense = attend_qkv(qkv, cos, sin, meta, "dense", HEADS, rotated=rotated)
        loop = attend_qkv(qkv, cos, sin, meta, "segments", HEADS, rotated=rotated)
        truth = attend_qkv(qkv.float(), cos, sin, meta, "segments", HEADS, rotated=rotated)
    err, bound = error_bound(dense[:real], loop[:real], truth[:real])
    assert err <= bound, f"dense errs {err:.3g} against fp32, more than {bound:.3g}"


def test_dense_on_cuda_makes_no_host_sync_and_replays_in_a_graph():
    qkv, cos, sin, meta = qkv_batch(real=3, blocks=4, seed=2)
    run = lambda: dense_attention(qkv, cos, sin, meta.cu_seqlens, HEADS, L)  # noqa: E731
    with torch.inference_mode():
        eager = run()  # warm-up: the rotation kernel's compilation, SDPA's plan
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out[: 3 * L], eager[: 3 * L])


@pytest.fixture(scope="module")
def full():
    model = random_encoder(VisionConfig.glm41v(), CUDA, torch.bfloat16)
    yield model
    del model
    torch.cuda.empty_cache()


def test_a_uniform_batch_replays_in_its_uniform_graph_as_the_eager_static_forward(full):
    runner = EncoderGraphRunner(full, BudgetConfig((64, 256), 4, 16), mode="cuda", check_pointers=True,
                                uniform_lengths=(L,)).capture()
    assert set(runner.uniform_graphs) == {(64, L), (256, L)} and not runner.uniform_failed
    grids = [[1, 16, 16]] * 4  # four 224² images: 1024 rows, budget 256
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(4 * L, 1176, generator=gen).to(CUDA, torch.bfloat16)
    grid = torch.tensor(grids)
    outs = runner.run(pixels, grid)
    assert runner.stats.uniform_replays == runner.stats.replays == 1
    cb = runner.uniform_graphs[256, L]
    with torch.inference_mode():
        static = full.forward_static(cb.pixels, cb.meta, attention="dense", captured=True)  # no graph
    assert torch.equal(torch.cat(outs), static)
    assert_per_item(full, outs, pixels, grid)  # within 3× what eager bf16 errs on each item, against fp32
    mixed = [[1, 16, 16], [1, 8, 8]]
    pixels = torch.randn(L + 64, 1176, generator=gen).to(CUDA, torch.bfloat16)
    runner.run(pixels, torch.tensor(mixed))
    assert runner.stats.uniform_replays == 1 and runner.stats.replays == 2  # mixed: the ordinary graph
