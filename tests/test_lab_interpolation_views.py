"""glmvit.lab.interpolation's notebook helpers: the patch indices, the grid_sample oracle, the Keys kernel and the
tolerance, the sin-cos table, the bilinear judgement and the views of the recorded results."""
from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
import torch

from glmvit.env import RECORDED
from glmvit.lab import interpolation as lab

matplotlib.use("Agg")


def test_patch_indices_pack_targets_in_raster_order():
    h_idx, w_idx, th, tw = lab.patch_indices([(2, 3), (1, 2)])
    assert h_idx.tolist() == [0, 0, 0, 1, 1, 1, 0, 0] and w_idx.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert th.tolist() == [2] * 6 + [1] * 2 and tw.tolist() == [3] * 6 + [2] * 2 and h_idx.dtype == torch.int32


def test_oracle_returns_the_table_on_its_own_grid_and_a_constant_anywhere():
    table = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lab.grid_sample_oracle(table, *lab.patch_indices([(4, 4)])), table, atol=1e-5, rtol=0)
    flat = torch.full((16, 2), 3.0)
    torch.testing.assert_close(lab.grid_sample_oracle(flat, *lab.patch_indices([(7, 2)])), torch.full((14, 2), 3.0))


def test_keys_kernel_interpolates_and_its_slope_is_its_derivative():
    assert lab.keys(0.0) == 1 and lab.keys(1.0) == 0 and lab.keys(2.5) == 0
    u = np.linspace(-1.9, 1.9, 77)
    numeric = (lab.keys(u + 1e-6) - lab.keys(u - 1e-6)) / 2e-6
    np.testing.assert_allclose(lab.keys_slope(u), numeric, atol=1e-5)


def test_tolerance_is_the_documented_bound():
    bound = lab.bicubic_tolerance(24, 2.0)
    assert bound["spread"] == pytest.approx(1.375, abs=1e-3) and bound["slope"] == pytest.approx(3.0, abs=1e-3)
    assert bound["coord_ulp"] == 2.0**-19
    expected = 2 * 2.0**-19 * bound["slope"] * bound["spread"] * 2 + 16 * 2**-23 * bound["spread"] ** 2 * 2
    assert bound["tol"] == pytest.approx(expected)


def test_sincos_table_and_the_bilinear_judgement():
    table = lab.sincos_table(6, 8)
    assert table.shape == (36, 8) and torch.allclose(table[:, 0] ** 2 + table[:, 2] ** 2, torch.ones(36))  # sin, cos
    with pytest.raises(ValueError, match="multiple of 4"):
        lab.sincos_table(6, 6)
    grids = {"own": (6, 6), "thin": (10, 2)}
    judged = lab.judge_bilinear(table, grids)
    assert judged["own"]["vllm"] < 1e-5 < judged["thin"]["vllm"] and 0 <= judged["thin"]["above"] <= 1
    text = lab.judged_table(judged, grids)
    assert len(text.splitlines()) == 3 and "10 × 2" in text


def test_record_views_follow_the_records():
    in_graph = json.loads((RECORDED / "02_interp_in_graph.json").read_text())
    kernels = json.loads((RECORDED / "02_interp_kernels.json").read_text())
    lines = lab.in_graph_lines(in_graph, kernels)
    assert len(lines) == 2 * len(in_graph["results"])
    assert f"{in_graph['results'][0]['triton']['in_graph_us']:8.1f}" in lines[0]
    with pytest.raises(ValueError, match="different cases"):
        lab.in_graph_lines(in_graph, {"results": kernels["results"][::-1]})
    fig = lab.plot_in_graph(in_graph)
    assert len(fig.axes[0].patches) == 4 * len(in_graph["results"])


def test_plots_and_truncation():
    fig = lab.plot_resampled({"a": torch.zeros(4, 4, 2), "b": torch.zeros(2, 6, 2)})
    assert [ax.get_title() for ax in fig.axes] == ["a", "b"]
    assert len(lab.plot_kernel(lab.keys, "k").axes[0].lines) == 2  # the kernel and the zero line
    x = torch.tensor([1.0 + 2**-8 + 2**-10])  # between two bf16 values, nearer the upper one
    assert lab.truncate_to_bf16(x).item() == 1.0 and x.bfloat16().item() == 1.0 + 2**-7
    with pytest.raises(ValueError, match="float32"):
        lab.truncate_to_bf16(x.double())
