"""GPU tests: fp32 parity with transformers on CUDA, forward_static in bf16 for every graph-safe attention backend,
no host syncs, item isolation (a NaN/Inf/overflowing item changes no other item, bitwise), padding outside every
attention segment, and EncoderGraphRunner with real CUDA graphs (capture, bitwise replay, ownership, NaN-poisoned
padding, a small item in a large graph, images + videos, 2,000 random replays, capture out of memory). Every test
is marked ``gpu`` and is skipped without CUDA (tests/conftest.py). Run: ``pytest -m gpu tests/test_gpu.py``.

Runner tests use the full GLM-4.1V tower in bfloat16 with random weights (``glmvit.random_weights.random_encoder``);
oracle comparisons that need exactness run in float32 with the ``sdpa_masked`` backend
(the flash kernels take bf16 only).
"""
import collections
import copy
import dataclasses
import functools
import gc
import threading

import numpy as np
import pytest
import torch

import glmvit.model as model_module
from glmvit import VisionConfig
from glmvit.attention import available_backends
from glmvit.costmodel import LatencyTable
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import BatchShape, build_metadata
from glmvit.oracle import encoder_like, flatten_video_grids, hf_vision_model
from glmvit.packing import BudgetConfig
from glmvit.random_weights import random_encoder

pytestmark = pytest.mark.gpu

BF16_ULPS = 2
BF16_BACKENDS = [b for b in available_backends("cuda", torch.bfloat16) if b != "segments"]
RUNNER_CONFIG = BudgetConfig((64, 256, 1024), max_items=4, max_segments=32)
CUDA = torch.device("cuda")


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x|: 2^(floor(log2|x|) − 7) (8 significant bits); tiny for x = 0."""
    mag = x.float().abs().clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def assert_within_bf16_ulps(a: torch.Tensor, b: torch.Tensor, ulps: int = BF16_ULPS) -> None:
    """Elementwise |a − b| ≤ ulps · max(ulp(b), ulp(max |b|) · 2^-8), with ulp(x) = 2^(floor(log2|x|) − 7).

    ``b`` is the reference. The floor (ulps of the tensor's largest magnitude, scaled by 2^-8) keeps values near
    zero, whose own ulp is tiny, from demanding more precision than the tensor's scale carries. Both must be
    finite and of the same shape. The failure message gives the worst error in ulps and how many elements fail.
    """
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    a, b = a.float(), b.float()
    assert torch.isfinite(a).all() and torch.isfinite(b).all(), "non-finite values"
    if b.numel() == 0:
        return
    unit = torch.maximum(bf16_ulp(b), bf16_ulp(b.abs().max()) * 2.0**-8)
    err = (a - b).abs()
    bad = err > ulps * unit
    if bad.any():
        worst = (err / unit).max().item()
        raise AssertionError(
            f"{int(bad.sum())} of {b.numel()} elements differ by more than {ulps} bf16 ulps "
            f"(worst {worst:.1f} ulps, max |a − b| = {err.max().item():.3g}, max |b| = {b.abs().max().item():.3g})"
        )


def random_pixels(grids, dtype, seed=0, device=CUDA) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel rows for ``grids`` (drawn in fp32 on the CPU, then cast) and the grid tensor."""
    grid = torch.as_tensor(np.asarray(grids), dtype=torch.long).reshape(-1, 3)
    rows = int(grid.prod(dim=1).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 1176, generator=gen).to(device, dtype), grid


def padded(pixels, grid, tokens, segments, fill=0.0, merge=2):
    """A static batch of ``tokens`` output tokens (rows = 4·tokens), metadata on the device, padding = fill."""
    rows = tokens * merge * merge
    meta = build_metadata(grid, merge, BatchShape(rows, segments, rows)).to(pixels.device)
    buf = torch.full((rows, pixels.shape[1]), fill, dtype=pixels.dtype, device=pixels.device)
    buf[: pixels.shape[0]] = pixels
    return buf, meta


def per_item(model, pixels, grid):
    """model.forward on each item alone (the eager reference)."""
    outs, start = [], 0
    for t, h, w in grid.tolist():
        rows = t * h * w
        outs.append(model(pixels[start : start + rows], torch.tensor([[t, h, w]])))
        start += rows
    return outs


_FP32_TWINS: dict[int, torch.nn.Module] = {}


def fp32_twin(model):
    """The same tower with its bf16 weights held in fp32 (exactly): what the bf16 arithmetic approximates."""
    if id(model) not in _FP32_TWINS:
        _FP32_TWINS.clear()
        _FP32_TWINS[id(model)] = copy.deepcopy(model).float()
    return _FP32_TWINS[id(model)]


def assert_per_item(model, outs, pixels, grid) -> None:
    """Every runner result against model.forward on that item alone, within what bf16 itself errs on that item.

    Both are bf16 evaluations of one function; the runner's batch has other GEMM row counts (so cuBLAS picks other
    kernels) and rounds differently. Let E = max |eager − fp32| for the item, its rounding error against the same
    arithmetic in fp32 (the bf16 weights held exactly in fp32). If the runner is at most twice as wrong as eager
    (|runner − fp32| ≤ 2E), the triangle inequality gives |runner − eager| ≤ 3E; one ulp at the output's scale is
    added for E = 0. A bound measured on the item itself, not a count of ulps one run happened to meet; a batch that
    mixes rows of other items errs by the output's whole scale, far beyond it."""
    with torch.inference_mode():
        expected = per_item(model, pixels, grid)
        exact = per_item(fp32_twin(model), pixels.float(), grid)
    assert len(outs) == len(expected)
    for out, ref, truth in zip(outs, expected, exact, strict=True):
        assert out.shape == ref.shape and torch.isfinite(out).all()
        e = (ref.float() - truth).abs().max().item()
        bound = 3 * e + bf16_ulp(ref.abs().max()).item()
        err = (out.float() - ref.float()).abs().max().item()
        assert err <= bound, f"runner vs eager {err:.3g} > 3 × eager's own bf16 error {e:.3g} + 1 ulp"


def poisoned(pixels, grids, item, kind):
    """A copy of ``pixels`` with one item poisoned: one NaN or +Inf pixel, or one patch row of 3e38 (finite in bf16,
    so it passes the host check, and it overflows to Inf inside the tower)."""
    out = pixels.clone()
    rows = np.cumsum([0] + [t * h * w for t, h, w in grids])
    row = int(rows[item] + rows[item + 1]) // 2
    if kind == "huge":
        out[row] = 3e38
    else:
        out[row, 7] = float(kind)
    return out


def other_tokens(total, grids, item):
    """Boolean mask over ``total`` output tokens: everything but item ``item``'s tokens (padding included)."""
    tokens = np.cumsum([0] + [t * h * w // 4 for t, h, w in grids])
    keep = torch.ones(total, dtype=torch.bool, device=CUDA)
    keep[int(tokens[item]) : int(tokens[item + 1])] = False
    return keep


def free_cuda():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# fixtures
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full():
    """The full GLM-4.1V tower, bf16, random weights, on CUDA (default attention backend)."""
    model = random_encoder(VisionConfig.glm41v(), CUDA, torch.bfloat16)
    yield model
    del model
    free_cuda()


@pytest.fixture(scope="module")
def runner(full):
    return EncoderGraphRunner(full, RUNNER_CONFIG, mode="cuda", check_pointers=True, progress=False).capture()


@pytest.fixture
def exact_fp32():
    """No TF32 anywhere (transformers' Conv3d / Conv2d go through cuDNN, which allows TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def backend(full, request):
    """Set the full model's attention backend for one test, then restore it."""
    saved = full.attn_backend
    full.attn_backend = request.param
    yield request.param
    full.attn_backend = saved


# ---------------------------------------------------------------------------------------------------------------
# fp32 parity with transformers on CUDA
# ---------------------------------------------------------------------------------------------------------------
TINY_GRIDS = [[1, 4, 6], [2, 6, 4], [1, 8, 4]]


@pytest.mark.usefixtures("exact_fp32")
def test_tiny_fp32_forward_and_static_equal_transformers():
    config = VisionConfig.tiny()
    hf = hf_vision_model(config, seed=0).cuda()
    model = encoder_like(hf, config, attn_backend="sdpa_masked").cuda()
    pixels, grid = random_pixels(TINY_GRIDS, torch.float32, seed=1)
    tokens = pixels.shape[0] // 4
    with torch.no_grad():
        expected = hf(pixels, flatten_video_grids(grid).cuda()).pooler_output
        eager = model(pixels, grid)
        static = model.forward_static(*padded(pixels, grid, tokens + 13, segments=8))
    torch.testing.assert_close(eager, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(static[:tokens], expected, atol=1e-5, rtol=0)
    assert torch.all(static[tokens:] == 0)


@pytest.mark.usefixtures("exact_fp32")
def test_full_fp32_one_image_equals_transformers():
    """The full tower in fp32 on one 224² image (grid [1, 16, 16]): relative error ≤ 1e-4 vs transformers."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    config = VisionConfig.glm41v()
    model = random_encoder(config, CUDA, torch.float32, seed=1)
    model.attn_backend = "sdpa_masked"
    hf_config = Glm4vVisionConfig(**config.to_hf_dict())
    hf_config._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = Glm4vVisionModel(hf_config).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    hf.cuda()  # buffers too (inv_freq)
    assert all(b.is_cuda for b in hf.buffers()) and all(p.is_cuda for p in hf.parameters())
    pixels, grid = random_pixels([[1, 16, 16]], torch.float32, seed=2)
    with torch.no_grad():
        expected = hf(pixels, grid.cuda()).pooler_output
        got = model(pixels, grid)
    assert got.shape == expected.shape == (64, config.out_hidden_size)
    rel = ((got - expected).norm() / expected.norm()).item()
    del model, hf
    free_cuda()
    assert rel <= 1e-4, f"relative error {rel:.3g}"


# ---------------------------------------------------------------------------------------------------------------
# forward_static in bf16, every graph-safe backend
# ---------------------------------------------------------------------------------------------------------------
BF16_GRIDS = [[1, 16, 16], [1, 12, 20], [2, 8, 8]]  # 64 + 60 + 32 = 156 tokens, padded to 256


@pytest.mark.parametrize("backend", BF16_BACKENDS, indirect=True)
def test_static_padded_equals_forward_bf16(full, backend):
    pixels, grid = random_pixels(BF16_GRIDS, torch.bfloat16, seed=3)
    tokens = pixels.shape[0] // 4
    with torch.inference_mode():
        eager = full(pixels, grid)
        static = full.forward_static(*padded(pixels, grid, 256, segments=32))
    assert_within_bf16_ulps(static[:tokens], eager)
    assert torch.all(static[tokens:] == 0)


@pytest.mark.parametrize("backend", BF16_BACKENDS, indirect=True)
def test_nan_padding_leaves_real_tokens_bitwise_unchanged(full, backend):
    pixels, grid = random_pixels(BF16_GRIDS, torch.bfloat16, seed=4)
    tokens = pixels.shape[0] // 4
    with torch.inference_mode():
        clean = full.forward_static(*padded(pixels, grid, 256, segments=32))
        poisoned = full.forward_static(*padded(pixels, grid, 256, segments=32, fill=float("nan")))
    assert torch.equal(clean, poisoned)
    assert torch.isfinite(poisoned).all() and torch.all(poisoned[tokens:] == 0)


@pytest.mark.parametrize("backend", BF16_BACKENDS, indirect=True)
def test_forward_static_makes_no_host_sync(full, backend):
    pixels, grid = random_pixels(BF16_GRIDS, torch.bfloat16, seed=5)
    buf, meta = padded(pixels, grid, 256, segments=32)
    with torch.inference_mode():
        full.forward_static(buf, meta)  # warm-up: kernel compilation and autotuning happen here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = full.forward_static(buf, meta)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BF16_BACKENDS, indirect=True)
def test_a_poisoned_item_leaves_every_other_item_bitwise_unchanged(full, backend):
    """NaN, +Inf or an overflowing row in one item: every other item (and the zero padding) is bitwise what the
    same batch gives with that item clean (same shapes, same kernels; only the poisoned item's values differ)."""
    pixels, grid = random_pixels(BF16_GRIDS, torch.bfloat16, seed=18)
    with torch.inference_mode():
        clean = full.forward_static(*padded(pixels, grid, 256, segments=32))
        for kind in ("nan", "inf", "huge"):
            for item in range(len(BF16_GRIDS)):
                out = full.forward_static(*padded(poisoned(pixels, BF16_GRIDS, item, kind), grid, 256, segments=32))
                keep = other_tokens(256, BF16_GRIDS, item)
                assert torch.equal(out[keep], clean[keep]), f"{kind} in item {item} changed another item ({backend})"


@pytest.mark.parametrize("backend", BF16_BACKENDS, indirect=True)
def test_nothing_left_in_padded_attention_rows_reaches_a_real_row(full, backend, monkeypatch):
    """The varlen kernels leave the padded rows of their output unwritten (padding lies outside every segment):
    fill them with NaN after every attention and the output must stay bitwise the same."""
    pixels, grid = random_pixels(BF16_GRIDS, torch.bfloat16, seed=19)
    buf, meta = padded(pixels, grid, 256, segments=32)
    assert meta.cu_seqlens[-1].item() == pixels.shape[0]  # no segment reaches into the padding
    real_attend = model_module.attend_qkv

    def leaves_nan(qkv, cos, sin, meta, backend, heads, **kwargs):
        pad = meta.token_valid.repeat_interleave(4) == 0
        return real_attend(qkv, cos, sin, meta, backend, heads, **kwargs).masked_fill(pad[:, None], float("nan"))

    with torch.inference_mode():
        clean = full.forward_static(buf, meta)
        monkeypatch.setattr(model_module, "attend_qkv", leaves_nan)
        dirty = full.forward_static(buf, meta)
    assert torch.equal(dirty, clean)
    assert torch.isfinite(dirty).all() and torch.all(dirty[pixels.shape[0] // 4 :] == 0)


# ---------------------------------------------------------------------------------------------------------------
# EncoderGraphRunner with CUDA graphs
# ---------------------------------------------------------------------------------------------------------------
def test_every_budget_is_captured(runner):
    assert set(runner.captures) == set(RUNNER_CONFIG.token_budgets) and not runner.failed
    for budget, info in runner.captures.items():
        assert runner.graphs[budget].graph is not None
        assert info.segments == min(RUNNER_CONFIG.max_segments, budget) and info.rows == 4 * budget
        assert info.seconds > 0 and info.buffer_bytes > 0


def test_replay_equals_eager_static_bitwise_and_forward_per_item(runner, full):
    pixels, grid = random_pixels([[1, 16, 16], [1, 8, 12]], torch.bfloat16, seed=6)  # 64 + 24 tokens → budget 256
    outs = runner.run(pixels, grid)
    bg = runner.graphs[256]
    with torch.inference_mode():
        # same static buffers, same batch, no graph (the captured path's kernels: model.project_residual)
        eager_static = full.forward_static(bg.pixels, bg.meta, captured=True)
        torch.testing.assert_close(bg.output, eager_static, atol=0, rtol=0)
    assert torch.equal(torch.cat(outs), bg.output[: sum(o.shape[0] for o in outs)])
    assert_per_item(full, outs, pixels, grid)


def test_small_large_small_keeps_earlier_results(runner, full):
    small = random_pixels([[1, 8, 8]], torch.bfloat16, seed=7)  # budget 64
    large = random_pixels([[1, 32, 32], [2, 16, 16], [1, 16, 24]], torch.bfloat16, seed=8)  # 256 + 128 + 96 → 1024
    first = runner.run(*small)
    kept = [t.clone() for t in first]
    middle = runner.run(*large)
    again = runner.run(*small)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=False))
    assert all(torch.equal(a, b) for a, b in zip(again, kept, strict=False))  # same batch, same graph: bitwise
    assert_per_item(full, middle, *large)


def test_nan_poisoned_padding_in_the_graph(runner):
    """run() leaves padded rows as they are (embed masks them): NaN there changes no real token."""
    pixels, grid = random_pixels([[1, 12, 16]], torch.bfloat16, seed=9)  # 48 tokens → budget 64, 16 padded
    (out,) = runner.run(pixels, grid)
    bg = runner.graphs[64]
    rows = pixels.shape[0]
    with torch.inference_mode():  # the static buffers were made in inference mode
        bg.pixels[rows:] = float("nan")
        bg.graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(bg.pixels[rows:]).all()
    assert torch.equal(bg.output[:48], out)
    assert torch.all(bg.output[48:] == 0) and torch.isfinite(bg.output).all()
    again = runner.run(pixels, grid)[0]  # the next batch replays with the NaN rows still there
    assert torch.equal(again, out)
    with torch.inference_mode():
        bg.pixels[rows:] = 0


def test_poisoned_item_through_the_graph(runner):
    """run() refuses NaN pixels naming the item; with the check skipped the replay keeps every other item bitwise."""
    grids = [[1, 16, 16], [1, 8, 12], [2, 8, 8]]  # 64 + 24 + 32 tokens: one batch in the 256 graph
    pixels, grid = random_pixels(grids, torch.bfloat16, seed=20)
    clean = runner.run(pixels, grid)
    with pytest.raises(ValueError, match=r"item\(s\) \[1\] hold NaN or Inf"):
        runner.run(poisoned(pixels, grids, 1, "nan"), grid)
    for kind in ("nan", "inf", "huge"):
        outs = runner.run(poisoned(pixels, grids, 1, kind), grid, check_finite=False)
        assert torch.equal(outs[0], clean[0]) and torch.equal(outs[2], clean[2]), kind


def test_runner_on_cuda_refuses_a_backend_that_is_not_graph_safe(full, monkeypatch):
    monkeypatch.setattr(full, "attn_backend", "segments")
    with pytest.raises(ValueError, match="not graph-safe"):
        EncoderGraphRunner(full, RUNNER_CONFIG, mode="cuda", progress=False)


def test_a_small_item_in_a_large_graph(full):
    """One 112² image (16 tokens) replayed in a 1024-token graph: the 1,008 padded tokens lie outside every
    attention segment, so the replay equals the eager static forward bitwise. (What it costs is measured, not
    asserted: the layout sweep of `python -m glmvit latency` records it.)"""
    run = EncoderGraphRunner(full, BudgetConfig((1024,), 4, 32), mode="cuda", progress=False).capture()
    try:
        bg = run.graphs[1024]
        small = random_pixels([[1, 8, 8]], torch.bfloat16, seed=22)
        (out,) = run.run(*small)
        with torch.inference_mode():
            eager_static = full.forward_static(bg.pixels, bg.meta, captured=True)
        assert torch.equal(bg.output, eager_static) and torch.all(bg.output[16:] == 0)
        assert torch.equal(out, bg.output[:16])
        assert_per_item(full, [out], *small)
    finally:
        del run
        free_cuda()


def test_mixed_images_and_videos_equal_per_item_eager(runner, full):
    grids = [[1, 16, 16], [4, 8, 8], [1, 10, 14], [2, 12, 12]]  # 64 + 64 + 35 + 72 tokens, 8 temporal patches
    pixels, grid = random_pixels(grids, torch.bfloat16, seed=10)
    replays = runner.stats.replays
    outs = runner.run(pixels, grid)
    assert runner.stats.replays > replays
    assert_per_item(full, outs, pixels, grid)


def test_video_clips_through_the_runner(runner, full):
    """An 8-frame 224² clip (grid [4, 16, 16], 256 tokens) alone, then two clips in one batch."""
    for grids, seed in (([[4, 16, 16]], 11), ([[4, 16, 16], [2, 16, 16]], 12)):
        pixels, grid = random_pixels(grids, torch.bfloat16, seed=seed)
        fallbacks = runner.stats.fallback_items
        outs = runner.run(pixels, grid)
        assert runner.stats.fallback_items == fallbacks
        assert [tuple(o.shape) for o in outs] == [(t * h * w // 4, 4096) for t, h, w in grids]
        assert_per_item(full, outs, pixels, grid)


def test_two_thousand_random_batches(runner, full):
    """2,000 replays of random image/video mixes: no memory growth after the first 50 but the layout cache's own
    (its gather indices, bounded), 20 sampled checks."""
    rng = np.random.default_rng(13)
    sampled = set(rng.choice(np.arange(50, 2000), size=20, replace=False).tolist())
    fp32_twin(full)  # the sampled checks' fp32 reference, made before the memory baseline (3.6 GB, made once)
    base = None
    peak_after_warmup = 0
    fallbacks = runner.stats.fallback_items
    for i in range(2000):
        grids = []
        for _ in range(int(rng.integers(1, 5))):
            if rng.random() < 0.7:
                grids.append([1, *(2 * rng.integers(4, 9, size=2)).tolist()])  # images of 8..16 × 8..16 patches
            else:
                grids.append([int(rng.integers(2, 5)), *(2 * rng.integers(4, 7, size=2)).tolist()])  # small clips
        grid = torch.tensor(grids)
        pixels = torch.randn(int(grid.prod(dim=1).sum()), 1176, device=CUDA, dtype=torch.bfloat16)
        outs = runner.run(pixels, grid)
        assert len(outs) == len(grids)
        if i in sampled:
            assert_per_item(full, outs, pixels, grid)
        del outs, pixels
        if i == 49:
            torch.cuda.synchronize()
            base = uncached_bytes(runner)
        elif i > 49:
            peak_after_warmup = max(peak_after_warmup, uncached_bytes(runner))
    torch.cuda.synchronize()
    assert runner.stats.fallback_items == fallbacks
    assert uncached_bytes(runner) <= base, (uncached_bytes(runner), base)
    assert peak_after_warmup <= base, (peak_after_warmup, base)


def uncached_bytes(runner):
    """Allocated device memory less the layout cache's gather indices (bounded by LAYOUT_CACHE_SIZE layouts, in
    512-byte allocator blocks): what must not grow from batch to batch."""
    index = sum(-(-s.row_index.numel() * s.row_index.element_size() // 512) * 512
                for steps in runner._layouts.values() for s in steps if s.row_index is not None)
    return torch.cuda.memory_allocated() - index


def test_run_itself_makes_no_host_sync_but_its_one_named_wait(runner):
    """runner.run under sync-debug "error": no implicit synchronisation anywhere in run() — pixels from the host or
    the device, a replayed batch and an eager one (1,296 tokens fit no budget), the finite check on or off. The one
    wait it keeps is explicit, an event's synchronize() before reading the finite check's row sums (after every batch
    is launched); torch's sync-debug mode flags implicit syncs (a .item(), a blocking copy), not that."""
    grids = [[1, 16, 16], [2, 8, 8], [1, 72, 72]]
    gpu_pixels, grid = random_pixels(grids, torch.bfloat16, seed=40)
    host_pixels = gpu_pixels.float().cpu()
    runner.run(host_pixels, grid)  # plan and warm the layout outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for pixels in (gpu_pixels, host_pixels):
            for check in (True, False):
                outs = runner.run(pixels, grid, check_finite=check)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert [tuple(o.shape) for o in outs] == [(64, 4096), (32, 4096), (1296, 4096)]


def test_a_routed_runner_runs_eagerly_what_its_table_says_is_faster(full):
    """A table that says every replay costs more than eager: every batch runs eagerly, the outputs are right, and
    the stats hold the table's predictions beside the GPU time measured with CUDA events."""
    table = dataclasses.replace(LatencyTable((64, 1024), (50.0, 50.0), (1.0, 1.0)), mode="graph")
    routed = EncoderGraphRunner(full, RUNNER_CONFIG, mode="cuda", latency_table=table, progress=False).capture()
    try:
        grids = [[1, 16, 16], [1, 8, 12]]
        pixels, grid = random_pixels(grids, torch.bfloat16, seed=41)
        assert [(s.replay, s.budget is not None) for s in routed.plan(grid)] == [(False, True)]
        assert_per_item(full, routed.run(pixels, grid), pixels, grid)
        stats = routed.settle_stats()
        assert (stats.replays, stats.eager_batches, stats.routed_eager, stats.timed_batches) == (0, 1, 1, 1)
        assert stats.predicted_ms == 1.0 and stats.measured_ms > 0
    finally:
        del routed
        free_cuda()


def test_regional_compile_runs_no_device_to_device_copy_per_block(full, monkeypatch):
    """Inductor fuses a matmul with the residual add after it into an addmm, which on CUDA copies its 2-D input
    first (two copies per block); ``model.residual_add`` keeps the add pointwise, so a compiled replay runs fewer
    copy kernels than the tower has blocks. The adds apart (``RESIDUAL_IN_MATMUL`` off), so that residual_add is
    what the replay runs even where nvmath-python would put them in the matmuls' epilogue."""
    from glmvit.profiling import profile_kernels

    monkeypatch.setattr(model_module, "RESIDUAL_IN_MATMUL", False)
    torch._dynamo.reset()  # no compiled block of an earlier test with the flag on
    compiled = EncoderGraphRunner(full, BudgetConfig((64,), max_items=1, max_segments=1), mode="cuda",
                                  torch_compile=True, progress=False).capture()
    try:
        pixels, grid = random_pixels([[1, 16, 16]], torch.bfloat16, seed=43)
        replay = functools.partial(compiled.replay, 64, pixels, grid)
        with torch.inference_mode():
            prof = profile_kernels(replay, calls=3, top=1000)
        copies = sum(k["launches_per_call"] for k in prof["top"] if k["category"] == "copy")
        assert copies < full.config.depth, prof["by_category_us"]
    finally:
        del compiled
        free_cuda()


def test_one_cuda_runner_shared_by_threads(runner):
    """Four threads share the runner: each request's outputs equal, bitwise, what it gives alone (same batches,
    same graphs), so no request sees another's static buffers."""
    rng = np.random.default_rng(42)
    requests = []
    for i in range(24):
        grids = [[1, *(2 * rng.integers(4, 9, size=2)).tolist()] for _ in range(int(rng.integers(1, 4)))]
        requests.append(random_pixels(grids, torch.bfloat16, seed=100 + i))
    alone = [[o.clone() for o in runner.run(*r)] for r in requests]
    got: dict[int, list[torch.Tensor]] = {}

    def worker(k: int) -> None:
        for i in range(k, len(requests), 4):
            got[i] = [o.clone() for o in runner.run(*requests[i])]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert [i for i in range(len(requests)) if not all(torch.equal(a, b) for a, b in zip(got[i], alone[i],
                                                                                        strict=True))] == []


# ---------------------------------------------------------------------------------------------------------------
# capture out of memory
# ---------------------------------------------------------------------------------------------------------------
def _limit_memory(headroom: int) -> None:
    """Let the caching allocator reserve at most what it holds now plus ``headroom`` bytes."""
    free_cuda()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + headroom) / total))


def test_capture_out_of_memory_skips_the_budget_and_falls_back(full):
    """65,536 tokens cannot be captured within 2 GiB of headroom (its static buffers alone take 1.15 GB, its
    activations far more); 64 and 256 can. A batch above 256 tokens then runs eagerly."""
    config = BudgetConfig((64, 256, 65536), max_items=4, max_segments=32)
    try:
        _limit_memory(2 * 2**30)
        small = EncoderGraphRunner(full, config, mode="cuda", progress=False).capture()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    try:
        assert set(small.failed) == {65536}, small.failed
        message = small.failed[65536]
        assert "out of memory" in message and "65536" in message and "unknown amount" not in message
        assert any(unit in message for unit in ("KiB", "MiB", "GiB")), message
        assert set(small.captures) == {64, 256} and set(small.graphs) == {64, 256}
        big = random_pixels([[1, 32, 40]], torch.bfloat16, seed=14)  # 320 tokens: no captured graph holds it
        assert_per_item(full, small.run(*big), *big)
        assert small.stats.fallback_items == 1 and small.stats.eager_batches == 1 and small.stats.replays == 0
        tiny = random_pixels([[1, 8, 8]], torch.bfloat16, seed=15)  # 16 tokens: the 64 graph
        assert_per_item(full, small.run(*tiny), *tiny)
        assert small.stats.replays == 1
    finally:
        del small
        free_cuda()


def test_out_of_memory_in_the_middle_of_capture(full, monkeypatch):
    """Run out of memory inside torch.cuda.graph (after kernels were recorded) on the first, largest budget: that
    budget is skipped, the next one is captured into a fresh pool, the stream is restored, replays are right."""
    original = full.forward_static
    headroom = 2 * 2**30

    def forward_static(pixels, meta, **kwargs):
        out = original(pixels, meta, **kwargs)
        if torch.cuda.is_current_stream_capturing() and meta.shape.rows == 4 * 256:
            torch.empty(2 * headroom, dtype=torch.uint8, device=CUDA)  # more than the allocator may reserve
        return out

    monkeypatch.setattr(full, "forward_static", forward_static)
    config = BudgetConfig((64, 256), max_items=4, max_segments=32)
    try:
        _limit_memory(headroom)
        run = EncoderGraphRunner(full, config, mode="cuda", progress=False).capture()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    monkeypatch.undo()
    try:
        assert set(run.failed) == {256} and "out of memory" in run.failed[256]
        assert set(run.graphs) == {64}
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert not torch.cuda.is_current_stream_capturing()
        fits = random_pixels([[1, 8, 12]], torch.bfloat16, seed=16)  # 24 tokens: the 64 graph
        assert_per_item(full, run.run(*fits), *fits)
        assert run.stats.replays == 1 and run.stats.fallback_items == 0
        over = random_pixels([[1, 16, 24]], torch.bfloat16, seed=17)  # 96 tokens: the 256 budget failed → eager
        assert_per_item(full, run.run(*over), *over)
        assert run.stats.replays == 1 and run.stats.fallback_items == 1
    finally:
        del run
        free_cuda()


# ---------------------------------------------------------------------------------------------------------------
# the launch tables' Hopper candidates, forced on for every row count
# ---------------------------------------------------------------------------------------------------------------
def count_calls(monkeypatch, *targets) -> collections.Counter:
    """Wrap each (module, function name) so that calls through the module's attribute are counted by name."""
    ran: collections.Counter = collections.Counter()
    for module, name in targets:
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            ran[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return ran


@pytest.mark.parametrize("attn", ["triton", "cudnn"])
def test_the_tables_candidates_keep_the_encoder_contract(full, monkeypatch, attn):
    """The Hopper candidates forced on for every row count — the attention of ``triton_attention_tma`` (the
    ``triton`` backend's table), the SwiGLU GEMM and the rotary qkv GEMM (``fused_gemm_table``: q and k reach the
    attention rotated) — through a captured runner: replays equal the same batch eagerly, bitwise; a poisoned item
    leaves the others bitwise unchanged; and each item is as close to the default kernels' answer as bf16 allows:
    |candidate − default| ≤ 3E + 1 ulp with E = |default − fp32| on that item (``assert_per_item``'s bound: the
    candidates round differently, one rounding where the default path rounds two or three times, never by more
    than the default path's own error twice over)."""
    from glmvit.kernels import (
        attention_table,
        fused_gemm_table,
        triton_attention_tma,
        triton_qkv_rope_gemm,
        triton_swiglu_gemm,
    )
    from glmvit.kernels.triton_attention_tma import TmaConfig

    if attn not in available_backends("cuda", torch.bfloat16):
        pytest.skip(f"the {attn} backend does not run here")

    grids = [[1, 32, 32], [2, 16, 16], [1, 16, 24]]  # 256 + 128 + 96 tokens: the 1024 budget, three segments' kinds
    pixels, grid = random_pixels(grids, torch.bfloat16, seed=31)
    with torch.inference_mode():
        exact = per_item(fp32_twin(full), pixels.float(), grid)
    saved = full.attn_backend
    full.attn_backend = attn
    try:
        with monkeypatch.context() as off:  # the default kernels: cuBLAS and the table's attention, nothing fused
            off.setattr(fused_gemm_table, "SWIGLU_MIN_ROWS", None)
            off.setattr(fused_gemm_table, "QKV_ROPE_MIN_ROWS", None)
            with torch.inference_mode():
                default = per_item(full, pixels, grid)
        monkeypatch.setattr(attention_table, "CONFIGS", ((None, TmaConfig(128, 64, 8, 3)),))
        monkeypatch.setattr(fused_gemm_table, "SWIGLU_MIN_ROWS", 0)
        monkeypatch.setattr(fused_gemm_table, "QKV_ROPE_MIN_ROWS", 0)
        ran = count_calls(monkeypatch, (triton_swiglu_gemm, "swiglu_linear_triton"),
                          (triton_qkv_rope_gemm, "qkv_rope_linear_triton"),
                          (triton_attention_tma, "attend_prerotated_tma"))
        run = EncoderGraphRunner(full, BudgetConfig((1024,), max_items=4, max_segments=32), mode="cuda",
                                 progress=False).capture()
        outs = run.run(pixels, grid)
        # the candidates ran (in the warm-up and the capture): the bound below is theirs, not the default kernels'
        assert ran["swiglu_linear_triton"] and ran["qkv_rope_linear_triton"]
        assert bool(ran["attend_prerotated_tma"]) == (attn == "triton"), dict(ran)
        bg = run.graphs[1024]
        with torch.inference_mode():
            torch.testing.assert_close(bg.output, full.forward_static(bg.pixels, bg.meta, captured=True), atol=0,
                                       rtol=0)
        for out, ref, truth in zip(outs, default, exact, strict=True):
            e = (ref.float() - truth).abs().max().item()
            err = (out.float() - ref.float()).abs().max().item()
            assert err <= 3 * e + bf16_ulp(ref.abs().max()).item(), f"candidates vs default {err:.3g}, E = {e:.3g}"
        clean = torch.cat(outs)
        for item in range(len(grids)):
            dirty = torch.cat(run.run(poisoned(pixels, grids, item, "nan"), grid, check_finite=False))
            keep = other_tokens(dirty.shape[0], grids, item)
            assert torch.equal(dirty[keep], clean[keep]), f"NaN in item {item} reached another item"
    finally:
        full.attn_backend = saved
        free_cuda()
