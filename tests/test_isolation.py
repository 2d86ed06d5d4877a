"""Item isolation on CPU: no item's values (NaN, Inf, huge finite) can change another item's output, for every
attention backend, eagerly and through the emulated runner; nothing in a padded row reaches a real one; NaN/Inf
pixels are reported by item; the CPU default attention never builds a (rows)² tensor."""
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import glmvit.model as model_module
from glmvit.attention import available_backends, default_backend
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import BatchShape, build_metadata, nonfinite_items
from glmvit.oracle import flatten_video_grids
from glmvit.packing import BudgetConfig
from glmvit.workloads import random_batch

CPU_BACKENDS = available_backends("cpu", torch.float32)  # segments (the default), sdpa_masked
GRIDS = [[1, 4, 6], [2, 2, 4], [1, 6, 2], [1, 2, 2]]  # an image, a 2-frame clip, two more images
HUGE = 3e38  # finite, so the host check lets it through; a patch row of it overflows to Inf inside the tower
POISONS = ["nan", "inf", "huge"]
# Batched and alone run the same fp32 math with other GEMM row counts and attention key lengths, i.e. summed in
# another order, so they need not agree bitwise. Each must be as close to transformers' output for the item alone
# as test_model requires of any batch: that bound, against the oracle, not a tolerance between the two.
ORACLE_ATOL = 1e-5


def item_spans(grids, merge_area=4):
    """(row range, token range) of every item in a packed batch."""
    rows = np.cumsum([0] + [t * h * w for t, h, w in grids])
    return [((a, b), (a // merge_area, b // merge_area)) for a, b in zip(rows[:-1], rows[1:], strict=True)]


def poison(pixels, grids, item, kind):
    """A copy of ``pixels`` with item ``item`` poisoned: one NaN or +Inf pixel, or one patch row all HUGE."""
    out = pixels.clone()
    (a, b), _ = item_spans(grids)[item]
    if kind == "huge":
        out[(a + b) // 2] = HUGE
    else:
        out[(a + b) // 2, 7] = float(kind)
    return out


def others_than(n, span):
    keep = torch.ones(n, dtype=torch.bool)
    keep[span[0] : span[1]] = False
    return keep


@pytest.fixture
def backend(tiny_model, request, monkeypatch):
    monkeypatch.setattr(tiny_model, "attn_backend", request.param)
    return request.param


@pytest.mark.parametrize("backend", CPU_BACKENDS, indirect=True)
def test_a_poisoned_item_leaves_every_other_item_unchanged(tiny_model, tiny_hf, tiny_config, backend):
    pixels, grid = random_batch(GRIDS, tiny_config, seed=20)
    spans = item_spans(GRIDS)
    with torch.no_grad():
        clean = tiny_model(pixels, grid)
        for item, ((a, b), (ta, tb)) in enumerate(spans):
            alone = tiny_hf(pixels[a:b], flatten_video_grids([GRIDS[item]])).pooler_output
            torch.testing.assert_close(clean[ta:tb], alone, atol=ORACLE_ATOL, rtol=0)
        for kind in POISONS:
            for item, (_, tokens) in enumerate(spans):
                out = tiny_model(poison(pixels, GRIDS, item, kind), grid, check_finite=False)
                keep = others_than(out.shape[0], tokens)
                # Same batch, same shapes, same kernels; only the poisoned item's values differ: bitwise.
                assert torch.equal(out[keep], clean[keep]), f"{kind} in item {item} changed another item's output"
                if kind != "huge":
                    assert not torch.isfinite(out[~keep]).all(), f"{kind} in item {item} was laundered into numbers"


@pytest.mark.parametrize("backend", CPU_BACKENDS, indirect=True)
def test_emulated_runner_isolates_items(tiny_model, tiny_config, backend):
    runner = EncoderGraphRunner(tiny_model, BudgetConfig((8, 16, 32), 4, 8), mode="emulate", progress=False)
    runner.capture()
    pixels, grid = random_batch(GRIDS, tiny_config, seed=22)
    clean = runner.run(pixels, grid)
    for kind in POISONS:
        poisoned = poison(pixels, GRIDS, 1, kind)
        if kind != "huge":
            with pytest.raises(ValueError, match=r"item\(s\) \[1\] hold NaN or Inf"):
                runner.run(poisoned, grid)
        outs = runner.run(poisoned, grid, check_finite=False)
        assert all(torch.equal(outs[i], clean[i]) for i in (0, 2, 3)), kind


def test_nothing_a_kernel_leaves_in_padded_rows_reaches_a_real_row(tiny_model, tiny_config, monkeypatch):
    """The varlen kernels never write the padded rows of their output: fill them with NaN after every attention
    (what an uninitialised buffer may hold) and the real tokens must not move."""
    pixels, grid = random_batch(GRIDS, tiny_config, seed=21)
    rows = pixels.shape[0] + 4 * 9
    meta = build_metadata(grid, 2, BatchShape(rows, 8, rows)).to("cpu")
    buf = torch.zeros(rows, tiny_config.patch_dim)
    buf[: pixels.shape[0]] = pixels
    real_attend = model_module.attend_qkv

    def leaves_nan(qkv, cos, sin, meta, backend, heads):
        padded = meta.token_valid.repeat_interleave(4) == 0
        return real_attend(qkv, cos, sin, meta, backend, heads).masked_fill(padded[:, None], float("nan"))

    for backend in CPU_BACKENDS:
        monkeypatch.setattr(tiny_model, "attn_backend", backend)
        with torch.no_grad():
            clean = tiny_model.forward_static(buf, meta)
            monkeypatch.setattr(model_module, "attend_qkv", leaves_nan)
            dirty = tiny_model.forward_static(buf, meta)
            monkeypatch.setattr(model_module, "attend_qkv", real_attend)
        assert torch.equal(dirty, clean), backend
        assert torch.all(dirty[pixels.shape[0] // 4 :] == 0) and torch.isfinite(dirty).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS, indirect=True)
def test_attention_reads_the_metadata_tensor_not_the_host_copy(tiny_model, tiny_config, backend):
    """The runner refreshes only ``meta.packed`` per batch; ``meta.host`` still describes the batch it was built for."""
    shape = BatchShape(rows=96, segments=6, max_seqlen=96)
    pixels, grid = random_batch([[1, 2, 4], [2, 4, 4]], tiny_config, seed=23)
    buf = torch.zeros(shape.rows, tiny_config.patch_dim)
    buf[: pixels.shape[0]] = pixels
    fresh = build_metadata(grid, 2, shape)
    stale = build_metadata([[1, 2, 2]], 2, shape).to("cpu")
    stale.packed.copy_(torch.from_numpy(fresh.packed))
    with torch.no_grad():
        assert torch.equal(tiny_model.forward_static(buf, stale), tiny_model.forward_static(buf, fresh.to("cpu")))


def test_nonfinite_pixels_are_named_by_item(tiny_model, tiny_config):
    pixels, grid = random_batch(GRIDS, tiny_config, seed=24)
    bad = poison(poison(pixels, GRIDS, 1, "nan"), GRIDS, 3, "inf")
    bad[0] = HUGE  # item 0: finite rows whose sum overflows are suspects, then cleared value by value
    bad[2, 0] = -float("inf")  # item 0 again, as -Inf
    assert nonfinite_items(bad, np.array(GRIDS)) == [0, 1, 3]
    assert nonfinite_items(bad.bfloat16(), np.array(GRIDS)) == [0, 1, 3]
    bad[2, 0] = 0
    assert nonfinite_items(bad, np.array(GRIDS)) == [1, 3]
    with pytest.raises(ValueError, match=r"^pixel_values of item\(s\) \[1, 3\] hold NaN or Inf[^\n]*$"):
        tiny_model(bad, grid)
    with torch.no_grad():
        assert tiny_model(bad, grid, check_finite=False).shape[0] == pixels.shape[0] // 4
    assert nonfinite_items(pixels[:0], np.zeros((0, 3), np.int64)) == []


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.numel = max([self.numel, *sizes])
        return out


def test_cpu_default_attention_builds_no_rows_squared_tensor(tiny_model, tiny_config):
    """A 4-frame clip of 36×36 patches (5,184 rows): no tensor may outgrow the pixels themselves (rows · 1,176),
    let alone the (rows)² = 26.9 M-entry mask of one batch-wide attention."""
    assert default_backend("cpu", torch.float32) == "segments" == tiny_model.attention_backend()
    assert available_backends("cuda", torch.float32)[0] == "sdpa_masked"  # graph-safe where graphs are captured
    pixels, grid = random_batch([[4, 36, 36]], tiny_config, seed=25)
    watch = LargestTensor()
    with torch.no_grad(), watch:
        tiny_model(pixels, grid)
    assert watch.numel <= pixels.numel() < pixels.shape[0] ** 2, watch.numel
