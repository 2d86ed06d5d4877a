"""glmvit.gate_up: the MLP's gate and up projections as one weight packed in tiles (CPU, fp32). The tiny config's
MLP (64 wide) is one tile, the plain [gate; up]; PACKED widens the blocks' MLP to 256 = two tiles of 128, the layout
the real tower (4096 = 32 tiles) stores, so every hook, loader and initialiser is checked on a weight that is
really re-laid."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from glmvit import GlmVisionEncoder, VisionConfig
from glmvit.gate_up import (
    fuse_gate_up,
    gate_up_rows,
    gate_up_tile,
    is_packed,
    pack_gate_up,
    swiglu,
    unpack_gate_up,
    writable_state,
)
from glmvit.kernels.fused_gemm_table import PACK_TILE
from glmvit.oracle import encoder_like, flatten_video_grids, hf_vision_model
from glmvit.random_weights import random_encoder
from glmvit.workloads import random_batch

PACKED = dataclasses.replace(VisionConfig.tiny(), out_hidden_size=2 * PACK_TILE)


@pytest.fixture(scope="module")
def packed_hf():
    return hf_vision_model(PACKED, seed=1)


@pytest.fixture(scope="module")
def packed_model(packed_hf):
    return encoder_like(packed_hf, PACKED)


def rows(n, k=3):
    """A (n, k) weight whose row i is all i: where each row went is readable off column 0."""
    return torch.arange(float(n))[:, None].expand(n, k).contiguous()


def test_tiles_of_the_blocks_and_the_real_tower():
    assert PACK_TILE == 128 and gate_up_tile(4096) == 128 and gate_up_tile(256) == 128
    assert gate_up_tile(64) == 64 and gate_up_tile(200) == 200  # not a multiple: one tile, the plain layout
    assert is_packed(128, 4096) and not is_packed(64, 64) and not is_packed(128, 128)
    with pytest.raises(ValueError, match="tiles of 64"):
        is_packed(64, 256)  # packed, but in tiles no configuration reads


def test_pack_then_unpack_is_the_identity_and_a_wrong_tile_is_not():
    weight = torch.randn(2 * 384, 5, generator=torch.Generator().manual_seed(0))
    for tile in (1, 128, 384):
        assert torch.equal(unpack_gate_up(pack_gate_up(weight, tile), tile), weight), tile
        assert torch.equal(pack_gate_up(unpack_gate_up(weight, tile), tile), weight), tile
    assert not torch.equal(unpack_gate_up(pack_gate_up(weight, 128), 64), weight)
    assert not torch.equal(unpack_gate_up(pack_gate_up(weight, 128), 384), weight)
    assert torch.equal(pack_gate_up(weight, 384), weight)  # one tile: the plain layout
    assert unpack_gate_up(weight, 384).data_ptr() == weight.data_ptr()  # ...and unpacking it moves nothing
    with pytest.raises(ValueError, match=r"weight \(6, 3\) does not stack gate and up halves of a multiple of tile=2"):
        unpack_gate_up(rows(6), 2)


def test_packed_rows_are_each_tiles_gate_then_its_up():
    packed = pack_gate_up(rows(8), 2)  # gate rows 0-3, up rows 4-7
    assert packed[:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    gate, up = gate_up_rows(packed, 2)
    assert gate.shape == up.shape == (2, 2, 3) and gate.data_ptr() == packed.data_ptr()
    assert gate.reshape(4, 3)[:, 0].tolist() == [0, 1, 2, 3] and up.reshape(4, 3)[:, 0].tolist() == [4, 5, 6, 7]


def test_swiglu_of_one_tile_is_bitwise_the_chunk_form():
    gate_up = torch.randn(7, 2, 2 * 48, generator=torch.Generator().manual_seed(1))
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(swiglu(gate_up, 48), F.silu(gate) * up)


@pytest.mark.parametrize("tile", [64, PACK_TILE])
def test_swiglu_of_a_packed_projection_is_exactly_the_plain_ones(tile):
    """The same elementwise ops on the same values, wherever the columns sit: equal in every bit. (On the CPU, as
    long as each tile's columns are contiguous runs at least as long as one step of torch's vectorised loop, two
    vectors: 32 floats under AVX-512, 16 under AVX2. A shorter run ends in the scalar loop, whose exp may round
    differently from the vectorised one: 16-column tiles differ in the last bit on an AVX-512 CPU.)"""
    gen = torch.Generator().manual_seed(2)
    plain = torch.randn(9, 2 * 256, generator=gen)
    packed = pack_gate_up(plain.T.contiguous(), tile).T  # the columns an x @ packed_W.T puts out
    assert torch.equal(swiglu(packed, tile), swiglu(plain, 256))
    assert not torch.equal(swiglu(packed, 256), swiglu(plain, 256))  # read as plain, the halves are wrong


def test_fuse_gate_up_refuses_a_tile_that_does_not_divide_the_width():
    with pytest.raises(ValueError, match="tile 96 does not divide hidden 256"):
        fuse_gate_up(torch.nn.Module(), 8, 256, 96)


def test_the_blocks_store_the_packed_layout_and_the_merger_the_plain(packed_model, packed_hf):
    theirs = packed_hf.state_dict()
    for i, block in enumerate(packed_model.blocks):
        plain = torch.cat([theirs[f"blocks.{i}.mlp.gate_proj.weight"], theirs[f"blocks.{i}.mlp.up_proj.weight"]])
        assert block.mlp.gate_up_tile == PACK_TILE
        assert torch.equal(block.mlp.gate_up_proj.weight, pack_gate_up(plain, PACK_TILE))
        assert not torch.equal(block.mlp.gate_up_proj.weight, plain)
    merger = packed_model.merger
    assert merger.gate_up_tile == PACKED.intermediate_size
    assert torch.equal(merger.gate_up_proj.weight, torch.cat([theirs["merger.gate_proj.weight"],
                                                              theirs["merger.up_proj.weight"]]))


def test_packed_state_dict_is_transformers_key_for_key_and_value_for_value(packed_model, packed_hf, tmp_path):
    """Unpacked on save: the same keys in the same order and the same values; saved to safetensors, it loads into
    transformers' tower and into a fresh encoder, which saves the same state again (an exact round trip)."""
    from safetensors.torch import load_file, save_file

    ours, theirs = packed_model.state_dict(), packed_hf.state_dict()
    assert sorted(ours) == sorted(theirs)
    for prefix in ("blocks.0.mlp.", "blocks.1.mlp.", "merger."):  # within a module, transformers' order
        assert [k for k in ours if k.startswith(prefix)] == [k for k in theirs if k.startswith(prefix)]
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    save_file(ours, str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    hf = hf_vision_model(PACKED, seed=5)
    hf.load_state_dict(loaded, strict=True)
    again = GlmVisionEncoder(PACKED)
    again.load_state_dict(loaded, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.values(), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), packed_model.parameters(), strict=True))


def test_packed_model_matches_transformers(packed_model, packed_hf):
    pixels, grid = random_batch([[1, 4, 6], [2, 4, 4]], PACKED, seed=0)
    with torch.no_grad():
        expected = packed_hf(pixels, flatten_video_grids(grid)).pooler_output
        got = packed_model(pixels, grid)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_writable_state_shares_the_models_storage(packed_model):
    state, writable = packed_model.state_dict(), writable_state(packed_model)
    assert set(state) <= set(writable)
    for name, value in state.items():
        assert torch.equal(writable[name].reshape(value.shape), value), name
    gate = writable["blocks.0.mlp.gate_proj.weight"]
    assert gate.shape == (2, PACK_TILE, PACKED.hidden_size)
    assert gate.data_ptr() == packed_model.blocks[0].mlp.gate_up_proj.weight.data_ptr()
    assert state["blocks.0.mlp.gate_proj.weight"].data_ptr() != gate.data_ptr()  # why state_dict() cannot serve


def test_random_weights_land_in_a_packed_weight(packed_hf):
    """randomize_ draws per state-dict key and writes through writable_state: the packed encoder holds exactly the
    draw transformers' tower holds (a write into state_dict()'s unpacked copy would be lost)."""
    ours = random_encoder(PACKED, seed=1).state_dict()
    theirs = packed_hf.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_load_vision_weights_fills_a_packed_weight(packed_model, tmp_path):
    from safetensors.torch import save_file

    from glmvit import load_vision_weights

    save_file(packed_model.state_dict(), str(tmp_path / "vision.safetensors"))
    model = random_encoder(PACKED, seed=7)
    load_vision_weights(model, tmp_path / "vision.safetensors")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), packed_model.parameters(), strict=True))


@pytest.mark.parametrize("config", ["tiny", "full"])
def test_state_like_is_state_dict_without_the_copies(config):
    """Names in order, shapes and dtypes of ``state_dict()`` (non-persistent buffers left out as it leaves them out),
    as meta tensors: the packed weights' halves are never unpacked."""
    from glmvit.config import VisionConfig
    from glmvit.gate_up import state_like
    from glmvit.model import GlmVisionEncoder

    with torch.device("meta"):
        model = GlmVisionEncoder(VisionConfig.tiny() if config == "tiny" else VisionConfig()).to(torch.bfloat16)
    model.register_buffer("scratch", torch.zeros(3, device="meta"), persistent=False)
    model.blocks[0].mlp.register_buffer("kept", torch.zeros(2, device="meta"))  # a persistent one, after gate_up
    saved, like = model.state_dict(), state_like(model)
    assert list(like) == list(saved) and "scratch" not in like and "blocks.0.mlp.kept" in like
    assert all(v.device.type == "meta" for v in like.values())
    assert {k: (v.shape, v.dtype) for k, v in like.items()} == {k: (v.shape, v.dtype) for k, v in saved.items()}
