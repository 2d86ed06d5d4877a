"""vllm_bilinear: vLLM's corner-aligned bilinear resampling of the position table (CPU, float32 and bf16)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glmvit.kernels.reference import vllm_bilinear


def interpolate(table: torch.Tensor, h: int, w: int, align_corners: bool) -> torch.Tensor:
    """torch's bilinear resize of the (G, G, D) table to h × w, as (h·w, D) rows in raster order."""
    g = int(round(table.shape[0] ** 0.5))
    image = table.view(g, g, -1).permute(2, 0, 1)[None]
    out = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=align_corners)
    return out[0].permute(1, 2, 0).reshape(h * w, -1)


def test_hand_computed_cases():
    # A linear table v(r, c) = 2r + c is reproduced exactly at the corner-aligned points r, c ∈ {0, 0.5, 1}.
    linear = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    expected = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 2.5, 3.0])[:, None]
    assert torch.equal(vllm_bilinear(linear, 3, 3), expected)
    # A bump at the centre of a 3 × 3 table, sampled at 0, 0.5, 1, 1.5, 2: the floor/ceil taps weigh it 1, ½, ¼.
    bump = torch.zeros(9, 1)
    bump[4] = 1
    got = vllm_bilinear(bump, 5, 5).view(5, 5)
    row = torch.tensor([0.0, 0.5, 1.0, 0.5, 0.0])
    assert torch.equal(got, row[:, None] * row[None, :])
    # The edge patches land on the table's edge cells: a 2 × 2 target takes the four corners.
    assert vllm_bilinear(bump, 2, 2).abs().max() == 0


@pytest.mark.parametrize("h, w", [(1, 1), (2, 30), (16, 16), (24, 24), (40, 6), (74, 38)])
def test_agrees_with_align_corners_true(h, w):
    # Both sample at i·(G − 1)/(n − 1) with taps floor and floor + 1 (clamped): the same points and weights in exact
    # arithmetic. They round apart: linspace and ATen's scale · i may differ by one ulp of a coordinate below 24
    # (2⁻¹⁹), which moves the result by at most that times the slope (≤ 2 max|v| per axis, two axes); vLLM's
    # w00 = 1 − dh − w01 against (1 − dh)(1 − dw), and the sums, by a few float32 ulps (2⁻²³) of max|v|.
    table = torch.randn(24 * 24, 8, generator=torch.Generator().manual_seed(0))
    got, ref = vllm_bilinear(table, h, w), interpolate(table, h, w, align_corners=True)
    bound = (2 * 2 * 2**-19 + 8 * 2**-23) * table.abs().max().item()
    torch.testing.assert_close(got, ref, atol=bound, rtol=0)


def test_differs_from_half_pixel_bilinear():
    # align_corners=False samples patch centres ((i + 0.5)·G/n − 0.5): the same only where n = G (the table itself).
    table = torch.randn(24 * 24, 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(vllm_bilinear(table, 24, 24), table)
    torch.testing.assert_close(interpolate(table, 24, 24, align_corners=False), table, atol=1e-6, rtol=0)
    for h, w in [(16, 16), (32, 32), (40, 6)]:
        gap = (vllm_bilinear(table, h, w) - interpolate(table, h, w, align_corners=False)).abs().max()
        assert gap > 0.1 * table.abs().max()


def test_bf16_table_rounds_in_its_dtype():
    table = torch.randn(24 * 24, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    got, exact = vllm_bilinear(table, 16, 32), vllm_bilinear(table.float(), 16, 32)
    assert got.dtype == torch.bfloat16 and got.shape == (16 * 32, 16)
    # four bf16-rounded weights and products, one rounded sum: a few bf16 ulps (2⁻⁸ relative) of the table's scale
    assert (got.float() - exact).abs().max() <= 4 * 2**-8 * table.float().abs().max()
