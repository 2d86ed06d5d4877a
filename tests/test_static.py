"""forward_static: fixed shapes, padding that cannot leak, and no host syncs."""
import numpy as np
import pytest
import torch

from glmvit.attention import available_backends
from glmvit.metadata import BatchShape, build_metadata
from glmvit.oracle import flatten_video_grids
from glmvit.testing import forbid_host_syncs
from glmvit.workloads import random_batch

BATCHES = [[[1, 4, 6]], [[1, 4, 6], [1, 8, 4]], [[2, 6, 4], [1, 2, 2]], [[3, 4, 4]]]
GRAPH_SAFE_CPU = ["sdpa_masked"]
CPU_BACKENDS = available_backends("cpu", torch.float32)  # the per-segment default, then sdpa_masked


def padded(pixels, grid, tokens, segments, merge=2, fill=0.0):
    rows = tokens * merge * merge
    meta = build_metadata(grid, merge, BatchShape(rows, segments, rows)).to("cpu")
    buf = torch.full((rows, pixels.shape[1]), fill)
    buf[: pixels.shape[0]] = pixels
    return buf, meta


@pytest.mark.parametrize("grids", BATCHES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_padded_static_equals_transformers_and_forward(tiny_hf, tiny_model, tiny_config, grids, backend):
    pixels, grid = random_batch(grids, tiny_config, seed=7)
    tokens = pixels.shape[0] // 4
    tiny_model.attn_backend = backend
    with torch.no_grad():
        expected = tiny_hf(pixels, flatten_video_grids(grid)).pooler_output
        eager = tiny_model(pixels, grid)
        buf, meta = padded(pixels, grid, tokens=tokens + 13, segments=8)
        static = tiny_model.forward_static(buf, meta)
    tiny_model.attn_backend = None
    torch.testing.assert_close(static[:tokens], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(static[:tokens], eager, atol=1e-6, rtol=0)
    assert torch.all(static[tokens:] == 0), "padded output tokens must be zero"


@pytest.mark.parametrize("grids", BATCHES)
@pytest.mark.parametrize("fill", [float("nan"), 1e30, -7.0])
def test_poisoned_padding_cannot_leak(tiny_model, tiny_config, grids, fill):
    pixels, grid = random_batch(grids, tiny_config, seed=8)
    tokens = pixels.shape[0] // 4
    with torch.no_grad():
        clean = tiny_model.forward_static(*padded(pixels, grid, tokens + 9, segments=6))
        poisoned = tiny_model.forward_static(*padded(pixels, grid, tokens + 9, segments=6, fill=fill))
    assert torch.equal(clean, poisoned)  # bitwise: same shapes, same kernels
    assert torch.isfinite(poisoned).all()


def test_attention_ignores_padding_rows(tiny_model, tiny_config):
    """Poison the padded rows *after* the input guard (q, k, v of padding): real rows must not change."""
    pixels, grid = random_batch([[1, 4, 6], [2, 2, 4]], tiny_config, seed=9)
    buf, meta = padded(pixels, grid, tokens=20, segments=4)
    real = pixels.shape[0]
    block = tiny_model.blocks[0]
    from glmvit.rotary import rotary_cos_sin

    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, tiny_model.rotary_pos_emb.inv_freq)
    x = torch.randn(buf.shape[0], tiny_config.hidden_size)
    y = x.clone()
    y[real:] = 1e4 * torch.randn_like(y[real:])
    with torch.no_grad():
        a = block(x, cos, sin, meta, "sdpa_masked")
        b = block(y, cos, sin, meta, "sdpa_masked")
    assert torch.equal(a[:real], b[:real])


def test_padding_lies_outside_every_segment(tiny_config):
    grid = np.array([[1, 4, 6], [2, 2, 2]])
    meta = build_metadata(grid, 2, BatchShape(rows=64, segments=5, max_seqlen=64))
    cu = meta.cu_seqlens
    assert cu.tolist() == [0, 24, 28, 32, 32, 32, 32, 32]  # 3 real segments, then empty slots: rows 32..63 in none
    seg = meta.packed[8 + 4 * 64 : 8 + 5 * 64]  # cu_seqlens takes 5 + 2 slots rounded up to 8
    assert seg[:32].max() == 2 and seg[32:].tolist() == list(range(3, 35))  # each padded row a block of its own


def test_metadata_rejects_batches_that_do_not_fit():
    with pytest.raises(ValueError, match="patch rows"):
        build_metadata([[1, 8, 8]], 2, BatchShape(rows=32, segments=4, max_seqlen=32))
    with pytest.raises(ValueError, match="temporal patches"):
        build_metadata([[5, 2, 2]], 2, BatchShape(rows=32, segments=4, max_seqlen=32))


@pytest.mark.parametrize("backend", GRAPH_SAFE_CPU)
def test_forward_static_makes_no_host_sync(tiny_model, tiny_config, backend):
    pixels, grid = random_batch([[1, 4, 6], [2, 2, 4]], tiny_config, seed=10)
    buf, meta = padded(pixels, grid, tokens=32, segments=6)
    tiny_model.attn_backend = backend
    try:
        with torch.no_grad(), forbid_host_syncs():
            tiny_model.forward_static(buf, meta)
        with pytest.raises(AssertionError, match="host sync"), forbid_host_syncs():
            meta.cu_seqlens.tolist()  # the guard itself works
    finally:
        tiny_model.attn_backend = None



@pytest.mark.parametrize("backend", ["segments", "sdpa_masked"])
def test_attention_given_q_and_k_rotated_does_not_rotate_them_again(backend):
    """``attend_qkv(..., rotated=True)`` on the torch backends: the attention of qkv whose q and k were rotated
    before the call equals the attention that rotates them itself (float32, the same rotation: bitwise), and it
    is not the attention of rotating twice."""
    from glmvit.attention import attend_qkv
    from glmvit.rotary import apply_rotary, inv_freq, rotary_cos_sin

    heads, head_dim, grids = 2, 16, [[1, 4, 6], [2, 2, 4]]
    meta = build_metadata(grids, 2, BatchShape(64, 4, 64)).to("cpu")
    qkv = torch.randn(64, 3 * heads * head_dim, generator=torch.Generator().manual_seed(5))
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(head_dim))
    q, k, _ = qkv.view(64, 3, heads, head_dim).unbind(1)
    rotated = qkv.clone()
    rotated[:, :2 * heads * head_dim] = torch.cat([apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)], 1).flatten(1)
    n = meta.host.num_rows
    expected = attend_qkv(qkv, cos, sin, meta, backend, heads)[:n]
    assert torch.equal(attend_qkv(rotated, cos, sin, meta, backend, heads, rotated=True)[:n], expected)
    assert not torch.allclose(attend_qkv(rotated, cos, sin, meta, backend, heads)[:n], expected, atol=1e-3)
