"""Notebook 00's CPU helpers in glmvit.lab.tour: the map's names, ulps, the operator counts and the records' views."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import torch
from PIL import Image

from glmvit import VisionConfig, records
from glmvit.lab import tour
from glmvit.lab.seed import load_seed
from glmvit.processing import SAMPLE_DATA, process_images


def test_every_name_on_the_map_exists_and_a_missing_one_is_named():
    assert tour.missing_entry_points() == []
    assert tour.missing_entry_points({"glmvit.packing": ["BudgetConfig", "no_such_name"]}) == [
        "glmvit.packing.no_such_name"]


def test_ulps_counts_float32_steps_at_the_largest_magnitude():
    expected = torch.tensor([1.0, -2.0])
    got = expected + torch.tensor([0.0, 3 * 2 * torch.finfo(torch.float32).eps])
    assert abs(tour.ulps(got, expected) - 3.0) < 1e-3 and tour.ulps(expected, expected) == 0


def test_work_ops_leaves_out_views_and_top_level_ops_counts_calls():
    assert tour.work_ops({"aten::view": 5, "aten::mm": 2, "aten::add": 1}) == 3
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    counts = tour.top_level_ops(lambda: (a @ b).view(9).add(1))
    assert counts.get("aten::view") == 1 and tour.work_ops(counts) >= 2


def test_an_aten_to_that_returns_its_input_is_not_counted_as_work():
    x = torch.randn(4)
    counts = tour.top_level_ops(lambda: (x.to(torch.float32), x.to(torch.float64)))  # a no-op, then a real copy
    assert counts == {tour.NOOP_TO: 1, "aten::to": 1} and tour.work_ops(counts) == 1


def test_count_ops_is_linear_in_depth():
    inputs = process_images(SAMPLE_DATA / "images" / "astronaut.jpg", max_pixels=2 * 112 * 112)
    c = [tour.count_ops(VisionConfig.tiny(), d, inputs.pixel_values, inputs.grid_thw) for d in (1, 2, 3)]
    assert c[2] - c[1] == c[1] - c[0] > 0


def test_plots_return_their_figures():
    photo = Image.new("RGB", (56, 56))
    assert len(tour.plot_patch_grid(photo, photo.resize((28, 28))).axes) == 2
    from glmvit import records

    bench = {n: records.load(SAMPLE_DATA / "bench" / f"{n}.json", records.BenchRecord)
             for n in ("img1x224", "img8x448")}
    assert len(tour.plot_bench_modes(bench, ["eager", "graph"]).axes) == 2


def test_pr_vs_glmvit_sets_the_seed_beside_the_recorded_runs(capsys):
    out = tour.pr_vs_glmvit(load_seed(), SAMPLE_DATA / "bench")
    assert set(out["glmvit"]) == {"img1x224", "video8x224"} and len(out["pr"]) == 2
    assert all(set(m) == {"eager", "graph", "graph-compiled"} for m in out["glmvit"].values())
    printed = capsys.readouterr().out
    gpu = records.load(SAMPLE_DATA / "bench" / "seed_img1x224.json", records.BenchRecord).provenance.gpu
    assert gpu and "PR 40576, 1× RTX 4090" in printed
    assert f"glmvit, {gpu.removeprefix('NVIDIA ')}, the PR's budgets" in printed
