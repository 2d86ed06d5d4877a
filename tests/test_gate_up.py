"""glmvit.gate_up: the MLP's gate and up projections as one weight packed in tiles (CPU, fp32): the layout helpers,
on weights really re-laid (tiles smaller than the width)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmvit.gate_up import (
    fuse_gate_up,
    gate_up_rows,
    gate_up_tile,
    is_packed,
    pack_gate_up,
    swiglu,
    unpack_gate_up,
)
from glmvit.kernels.fused_gemm_table import PACK_TILE


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


@pytest.mark.parametrize("tile", [16, PACK_TILE])
def test_swiglu_of_a_packed_projection_is_exactly_the_plain_ones(tile):
    """The same elementwise ops on the same values, wherever the columns sit: equal in every bit. (On the CPU, as
    long as each tile's columns are contiguous runs of a vector's width or more: tiles of one column are strided
    reads, which take the scalar loop, whose exp may round differently from the vectorised one.)"""
    gen = torch.Generator().manual_seed(2)
    plain = torch.randn(9, 2 * 256, generator=gen)
    packed = pack_gate_up(plain.T.contiguous(), tile).T  # the columns an x @ packed_W.T puts out
    assert torch.equal(swiglu(packed, tile), swiglu(plain, 256))
    assert not torch.equal(swiglu(packed, 256), swiglu(plain, 256))  # read as plain, the halves are wrong


def test_fuse_gate_up_refuses_a_tile_that_does_not_divide_the_width():
    with pytest.raises(ValueError, match="tile 96 does not divide hidden 256"):
        fuse_gate_up(torch.nn.Module(), 8, 256, 96)
