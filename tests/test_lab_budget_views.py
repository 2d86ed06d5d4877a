"""The set-up, tables and plot helpers notebooks 05 and 05b read through glmvit.lab.budget_views."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from glmvit.costmodel import LatencyTable
from glmvit.geometry import ItemSpec
from glmvit.lab import budget_views as bv
from glmvit.packing import Batch, BudgetConfig, Plan, plan_batches, plan_workload


def test_load_recorded_redraws_the_benchmarked_requests():
    rec = bv.load_recorded(verbose=False)
    assert set(rec.tables) == set(bv.MODES) and all(rec.tables[m].mode == m for m in bv.MODES)
    assert len(rec.requests) == rec.mixed.settings.num_requests
    assert rec.totals == [sum(s.tokens for s in r) for r in rec.requests]


def test_first_fit_decreasing_and_its_best_fit_pick():
    items = [ItemSpec(16, s) for s in (2, 7, 5, 1, 9, 2)]
    cfg = BudgetConfig((48,), max_items=3, max_segments=14)
    assert sorted(map(sorted, bv.first_fit_decreasing(items, cfg))) == [[0, 1, 5], [2, 4], [3]]
    items = [ItemSpec(t, 1) for t in (25, 20, 17, 3)]
    cfg = BudgetConfig((40,), max_items=4, max_segments=8)
    first = bv.first_fit_decreasing(items, cfg)  # 25 | 20 + 17: the 3 fits both, first fit takes the first
    best = bv.first_fit_decreasing(items, cfg, pick=lambda fits: max(fits, key=lambda b: b[1]))  # 37 is fuller
    assert first == [[0, 3], [1, 2]] and best == [[0], [1, 2, 3]]


def test_plan_violations_names_each_broken_rule():
    cfg = BudgetConfig((64, 128), max_items=2, max_segments=2)
    good = plan_batches([ItemSpec(40, 1), ItemSpec(50, 1)], cfg)
    assert bv.plan_violations(2, good, cfg) == []
    bad = Plan((Batch((0, 1, 2), 100, 3, 128), Batch((0,), 40, 1, 128)))
    wrong = bv.plan_violations(4, bad, cfg)
    assert len(wrong) == 4 and "placed" in wrong[0] and "3 items" in wrong[1] and "3 segments" in wrong[2]
    assert "40 tokens in budget 128, not 64" in wrong[3]


def test_pack_table_returns_each_workload_and_packer(capsys):
    cfg = BudgetConfig((64, 128), max_items=2, max_segments=4)
    reqs = [[ItemSpec(64, 1)], [ItemSpec(32, 1), ItemSpec(32, 1)]]
    stats = bv.pack_table({"w": reqs}, cfg)
    assert set(stats) == {("w", "vllm"), ("w", "ffd")} and stats["w", "ffd"].replays == 2
    assert "64×2" in capsys.readouterr().out


def test_packer_counts_and_its_plot():
    reqs = [[ItemSpec(64, 1)] * 3] * 4
    counts = bv.packer_counts(reqs, [1, 3])
    assert counts["vllm"][0][0] == counts["ffd"][0][0] == 12  # one item a batch
    assert counts["ffd"][0][1] == 4
    assert len(bv.plot_packer_counts(counts, [1, 3], 4).axes) == 2


def test_worst_padding_and_replay_ratio():
    assert bv.worst_padding((64, 128), 64, 128) == pytest.approx(63 / 128)
    table = LatencyTable(tokens=(64, 256), graph_ms=(2.0, 5.0), eager_ms=(3.0, 6.0))
    r = bv.replay_vs_eager(table, (64, 256), np.array([64, 256]))
    assert r == pytest.approx([table.graph_time(64, 16 * 64**2) / table.eager_time(64, 16 * 64**2),
                               table.graph_time(256, 16 * 256**2) / table.eager_time(256, 16 * 256**2)])


def test_table_fit_is_zero_error_on_what_it_predicts():
    rec = bv.load_recorded(verbose=False)
    fit = bv.table_fit(rec.tables["graph"], rec.sweeps["graph"])
    assert len(fit["names"]) == len(fit["g_err"]) > 10
    assert np.allclose(fit["g_err"], fit["pred_g"] / fit["meas_g"] - 1)


def test_pool_points_and_held_out(capsys):
    from glmvit import VisionConfig

    points = bv.pool_points(VisionConfig.glm41v())
    assert points and all(p.static_estimated == p.static_recorded for p in points)
    held = bv.held_out_pools(points)
    assert held and all([x[0] for x in r] == sorted(x[0] for x in r) for r in held.values())


def test_seed_rows_predicted_reads_both_workloads():
    from glmvit.lab.seed import load_seed

    rec = bv.load_recorded(verbose=False)
    rows = bv.seed_rows_predicted(rec.tables, load_seed())
    assert set(rows) == {(w, m) for w in ("img1x224", "video8x224") for m in ("eager", *bv.MODES)}
    assert (rows["img1x224", "graph"].tokens, rows["img1x224", "graph"].budget) == (64, 128)
    assert rows["img1x224", "graph-compiled"].pr_ms is None and rows["img1x224", "graph"].pr_ms


def test_recommend_rows_and_per_request_predictions():
    rec = bv.load_recorded(verbose=False)
    reqs = rec.requests[:40]
    rows = bv.recommend_rows(reqs, {"graph": rec.tables["graph"]}, ks=(1, 3))
    assert set(rows) == {("graph", 1), ("graph", 3)} and len(rows["graph", 1]["budgets"]) <= 1
    plans = plan_workload(reqs, BudgetConfig(rows["graph", 3]["budgets"], 4, 4))
    assert bv.predicted_per_request(plans, rec.tables["graph"], route=False).mean() == pytest.approx(
        rows["graph", 3]["ms"])
