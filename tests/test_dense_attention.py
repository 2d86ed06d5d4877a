"""The ``dense`` attention backend on uniform batch shapes (CPU, fp32): one SDPA over (rows // L, heads, L, d)
views equals the per-segment loop and transformers' tower, keeps every item to itself (NaN and Inf included), and
refuses every shape that is not uniform.

Tolerances: against ``segments`` the same fp32 SDPA runs on the same (L, d) operands, batched instead of one call
each, so a kernel may block the sums differently: 1e-6, the bound tests/test_static.py puts between a padded static
forward and the eager one. Against transformers: 1e-5, the bound tests/test_model.py puts on every backend.
"""
import numpy as np
import pytest
import torch

import glmvit.model as model_module
from glmvit.attention import attend, attend_qkv, check_backend, dense_attention, prepare_attention, resolve
from glmvit.metadata import BatchShape, build_metadata
from glmvit.oracle import flatten_video_grids
from glmvit.rotary import apply_rotary
from glmvit.workloads import random_batch

L = 16  # a 4×4-patch frame of the tiny config
UNIFORM = [[1, 4, 4], [2, 4, 4], [1, 2, 8], [1, 8, 2]]  # every frame 16 rows: five segments
NON_FINITE = ("nan", "inf")


def uniform_batch(grids, seed, spare_blocks=2, fill=0.0, tiny_config=None):
    """Pixels, grids, a uniform padded buffer with ``spare_blocks`` whole padding blocks and its metadata."""
    pixels, grid = random_batch(grids, tiny_config, seed=seed)
    rows = pixels.shape[0] + spare_blocks * L
    meta = build_metadata(grid, 2, BatchShape(rows, len(grids) + 4, L, uniform=True)).to("cpu")
    buf = torch.full((rows, tiny_config.patch_dim), fill)
    buf[: pixels.shape[0]] = pixels
    return pixels, grid, buf, meta


def test_dense_equals_the_per_segment_loop_and_transformers(tiny_hf, tiny_model, tiny_config):
    pixels, grid, buf, meta = uniform_batch(UNIFORM, 30, tiny_config=tiny_config)
    tokens = pixels.shape[0] // 4
    with torch.no_grad():
        dense = tiny_model.forward_static(buf, meta, attention="dense")
        loop = tiny_model.forward_static(buf, meta, attention="segments")
        expected = tiny_hf(pixels, flatten_video_grids(grid)).pooler_output
    torch.testing.assert_close(dense, loop, atol=1e-6, rtol=0)
    torch.testing.assert_close(dense[:tokens], expected, atol=1e-5, rtol=0)
    assert torch.all(dense[tokens:] == 0)


def test_attend_dense_views_whole_blocks_and_rotated_qkv_is_read_as_it_is():
    g = torch.Generator().manual_seed(31)
    rows, heads, d = 5 * L, 3, 8
    meta = build_metadata([[3, 4, 4]], 2, BatchShape(rows, 4, L, uniform=True)).to("cpu")
    q, k, v = torch.randn(3, rows, heads, d, generator=g).unbind(0)
    dense = attend(q, k, v, meta, "dense")
    loop = attend(q, k, v, meta, "segments")
    torch.testing.assert_close(dense[: 3 * L], loop[: 3 * L], atol=1e-6, rtol=0)
    blocks = [attend(q[i : i + L], k[i : i + L], v[i : i + L], build_metadata([[1, 4, 4]], 2).to("cpu"), "segments")
              for i in range(0, rows, L)]
    torch.testing.assert_close(dense, torch.cat(blocks), atol=1e-6, rtol=0)  # padding: blocks of their own too
    # The qkv entry point: rotating here, or reading q and k rotated already, gives the same attention.
    qkv = torch.randn(rows, 3 * heads * d, generator=g)
    angles = torch.rand(rows, d // 2, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q, k, v = qkv.view(rows, 3, heads, d).unbind(1)
    pre = torch.cat([apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v], 1).reshape(rows, -1)
    here = attend_qkv(qkv, cos, sin, meta, "dense", heads)
    loop = attend_qkv(qkv, cos, sin, meta, "segments", heads)
    torch.testing.assert_close(here[: 3 * L], loop[: 3 * L], atol=1e-6, rtol=0)  # the loop leaves padding zero
    assert torch.equal(dense_attention(pre, cos, sin, meta.cu_seqlens, heads, L, rotated=True), here)


@pytest.mark.parametrize("kind", NON_FINITE)
def test_a_non_finite_item_reaches_no_other_item(tiny_model, tiny_config, kind):
    pixels, grid, buf, meta = uniform_batch(UNIFORM, 32, tiny_config=tiny_config)
    with torch.no_grad():
        clean = tiny_model.forward_static(buf, meta, attention="dense")
        rows = np.cumsum([0] + [t * h * w for t, h, w in UNIFORM])
        for item in range(len(UNIFORM)):
            dirty = buf.clone()
            dirty[(rows[item] + rows[item + 1]) // 2, 3] = float(kind)
            out = tiny_model.forward_static(dirty, meta, attention="dense")
            keep = torch.ones(out.shape[0], dtype=torch.bool)
            keep[rows[item] // 4 : rows[item + 1] // 4] = False
            assert torch.equal(out[keep], clean[keep]), f"{kind} in item {item} changed another item's output"
            assert not torch.isfinite(out[~keep]).all(), f"{kind} in item {item} was laundered into numbers"


def test_nothing_in_the_padding_blocks_reaches_a_real_row(tiny_model, tiny_config, monkeypatch):
    """Padded pixel rows hold NaN, and after every attention the padded rows hold NaN too (what the rotation
    launch leaves unset on a GPU feeds the padding blocks): the real tokens do not move."""
    _, _, clean_buf, meta = uniform_batch(UNIFORM, 33, tiny_config=tiny_config)
    pixels, _, buf, _ = uniform_batch(UNIFORM, 33, fill=float("nan"), tiny_config=tiny_config)
    real_attend = model_module.attend_qkv
    padded = meta.token_valid.repeat_interleave(4) == 0

    def leaves_nan(qkv, cos, sin, meta, backend, heads):
        return real_attend(qkv, cos, sin, meta, backend, heads).masked_fill(padded[:, None], float("nan"))

    with torch.no_grad():
        clean = tiny_model.forward_static(clean_buf, meta, attention="dense")
        monkeypatch.setattr(model_module, "attend_qkv", leaves_nan)
        dirty = tiny_model.forward_static(buf, meta, attention="dense")
    assert torch.equal(dirty, clean) and torch.isfinite(dirty).all()


def test_dense_refuses_a_shape_that_is_not_uniform(tiny_model, tiny_config):
    pixels, grid = random_batch([[1, 4, 4]], tiny_config, seed=34)
    meta = build_metadata(grid, 2).to("cpu")
    with pytest.raises(ValueError, match=r"^attention backend 'dense' needs a uniform batch shape, got BatchShape"):
        tiny_model.forward_static(pixels, meta, attention="dense")
    q = torch.zeros(16, 2, 8)
    with pytest.raises(ValueError, match=r"^attention backend 'dense' needs a uniform batch shape"):
        attend(q, q, q, meta, "dense")


def test_dense_is_no_model_backend_and_auto_picks_it_on_uniform_shapes(tiny_model, tiny_config):
    with pytest.raises(ValueError, match=r"^attention backend 'dense' runs only on uniform batch shapes[^\n]*$"):
        check_backend("dense", "cpu", torch.float32)
    tiny_model.attn_backend = "dense"
    try:
        with pytest.raises(ValueError, match=r"runs only on uniform batch shapes"):
            tiny_model(*random_batch([[1, 4, 4]], tiny_config))
    finally:
        tiny_model.attn_backend = None
    assert resolve("auto", 64, 384, uniform=True) == "dense"
    assert resolve("auto", 64, 384) == "triton" and resolve("auto", 8192, 384) == "cudnn"  # today's choice
    assert resolve("triton", 64, 384, uniform=True) == "triton"  # a backend named is the backend run
    meta = build_metadata([[1, 4, 4]], 2, BatchShape(8192, 4, L, uniform=True)).to("cpu")
    assert prepare_attention(meta, "auto", 12, 128) is meta  # no ragged offsets for the dense path
    assert prepare_attention(build_metadata([[1, 4, 4]], 2, BatchShape(8192, 4, 8192)).to("cpu"), "auto", 12,
                             128).ragged is not None
