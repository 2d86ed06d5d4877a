"""The record readings notebooks 08 and 10 show rather than inline (glmvit.lab.bench_reading,
glmvit.lab.kernel_views): each against the recorded files or a small hand-made input whose answer is known."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import matplotlib
import numpy as np
import pytest
import torch

from glmvit import GlmVisionEncoder, VisionConfig
from glmvit.floor import flops_breakdown
from glmvit.lab import bench_reading as br
from glmvit.lab import kernel_views as kv
from glmvit.lab.seed import load_seed, seed_rows, seed_serve
from glmvit.packing import Batch
from glmvit.recorded import recorded_table
from glmvit.records import BenchRecord, KernelsProfile, LatencySweep, NcuProfile, StartupRecord, TuneSweep, load

matplotlib.use("Agg")
BENCH = Path(__file__).resolve().parents[1] / "data" / "bench"


@pytest.fixture(scope="module")
def benches():
    return br.load_benches(BENCH)


@pytest.fixture(scope="module")
def kernels():
    return load(BENCH / "kernels.json", KernelsProfile)


def by_workload(runs, name):
    return next(r for r in runs if r.settings.workload == name)


def batch(budget, tokens):
    return Batch((0,), tokens, 1, budget)


# --- notebook 08 ---------------------------------------------------------------------------------------------------

def test_load_benches_splits_the_seed_configuration_off(benches):
    runs, seed_runs, lines = benches
    assert runs and set(seed_runs) == {"img1x224", "video8x224"} and len(lines) == len(runs) + len(seed_runs)
    assert all(br.is_seed_config(r) for r in seed_runs.values()) and not any(br.is_seed_config(r) for r in runs)
    other = seed_runs["img1x224"].model_copy(deep=True)
    other.settings.max_items = 8
    assert not br.is_seed_config(other)
    assert [br.workload_name(r) for r in runs] == [r.settings.workload for r in runs]


def test_first_pass_and_latency_lines(benches):
    runs = benches[0]
    d = runs[0].modes["eager"]
    assert np.array_equal(br.first_pass(d), d.ms[: d.requests]) and len(br.first_pass(d)) == d.requests
    lines = br.latency_lines(runs)
    assert len(lines) == 1 + sum(len(r.modes) for r in runs) and lines[0].startswith("workload")
    assert br.gain(6.0, 2.0) == 3.0


def test_the_plots_draw_one_panel_or_bar_per_run_and_mode(benches):
    runs = benches[0]
    assert len(br.plot_latency(runs).axes) == len(runs)
    pairs = [("eager", "graph"), ("graph", "graph-compiled")]
    assert len(br.plot_ratios(runs, pairs).axes[0].patches) == len(runs) * len(pairs)
    assert len(br.plot_vs_floor(runs).axes[0].patches) == len(runs) * len(br.MODES)
    fig = br.plot_kinds({"a": {"gemm": (2, 5.0)}, "b": {"gemm": (1, 3.0), "attention": (1, 1.0)}})
    assert len(fig.axes[0].patches) == 2 * 2  # every kind on every row, zero-width where absent


def test_seed_tables_have_a_line_per_workload_and_source(benches):
    seed = load_seed()
    one, two = seed_rows(seed, "1× RTX 4090"), seed_rows(seed, "2× RTX 4090, encoder data-parallel")
    lines = br.seed_pr_lines(one, two, seed_serve(seed))
    assert len(lines) == len(one) + len(two) + 1 and lines[-1].startswith("serve:")
    seed_lines = br.seed_lines(one, benches[1])
    assert len(seed_lines) == 1 + 3 * len(one) and "PR 40576" in seed_lines[1]


def test_request0_fills_one_budget(benches):
    runs = benches[0]
    assert br.request0_fills_one_budget(by_workload(runs, "img1x224"))
    assert not br.request0_fills_one_budget(by_workload(runs, "mixed-img"))


def test_compile_savings_read_the_profile_of_the_kernel_the_backend_runs(kernels):
    rows = br.compile_savings(kernels, "auto")
    assert set(rows) == set(kernels.layouts)
    for layout, s in rows.items():
        p = kernels.profile[s["kernel"]][layout]
        assert s["gpu_us"][0] == p["gpu_us_per_call"] and s["kernels"][0] == p["kernels_per_call"]
        attention = p["by_category_us"].get("attention", 0.0)
        assert abs(s["gemm_us"][0] + s["rest_us"][0] + attention - p["gpu_us_per_call"]) < 1e-6 * p["gpu_us_per_call"]


def test_kernels_by_kind_counts_and_sums_per_category():
    gemm = "nvjet_sm90_tst_64x64_64x13_4x2_h_bz_TNT"
    got = br.kernels_by_kind([(gemm, 2.0), (gemm, 3.0), ("_rope_varlen_attention_kernel", 1.0)])
    assert got == {"gemm": (2, 5.0), "attention": (1, 1.0)}


def test_sweeps_mixed_and_per_request_readings(benches):
    runs = benches[0]
    tables = {m: recorded_table(m) for m in br.GRAPH_MODES}
    sweeps = {m: load(t.source, LatencySweep)
              for m, t in tables.items()}
    fig, small = br.plot_sweeps(sweeps)
    assert len(fig.axes) == 2 and set(small) == set(br.GRAPH_MODES) and all(v > 0 for v in small["graph"].values())
    mixed = by_workload(runs, "mixed-img")
    assert len(br.mixed_lines(mixed)) == 2 + len(br.ORDER) + len(br.GRAPH_MODES)
    fig, ratios = br.plot_per_request(mixed)
    assert all(len(v) == mixed.workload["requests"] for v in ratios.values())
    rows = br.size_classes(mixed, tables, (0, 256, 1024))
    assert sum(c["n"] for c in rows) == mixed.workload["requests"] and rows[0]["lo"] == 0
    assert all(0 <= c["padding"] < 1 for c in rows)
    assert len(br.request_tokens(mixed)) == mixed.workload["requests"]


def test_route_counts_classes_and_padding_by_budget():
    made = [[(batch(64, 64), True)], [(batch(128, 100), True), (batch(None, 30), False)], [(batch(128, 120), True)]]
    assert br.route_counts(made) == (3, 1)
    classes = br.request_classes(made)
    assert classes["replayed, no padding"].tolist() == [True, False, False]
    assert classes["routed to eager"].tolist() == [False, True, False]
    assert classes["replayed, padded"].tolist() == [False, False, True]
    table = SimpleNamespace(graph_time=lambda b: 0.01 * b)  # every token 0.01 ms, padded or not
    assert br.padding_by_budget(made, table) == {64: (1, 0, 0.0), 128: (2, 36, pytest.approx(0.36))}


def test_floor_parts_make_the_recorded_floor(benches):
    for r in benches[0]:
        compute, weights_ms = br.floor_parts(r)
        assert np.allclose(r.floor["per_request_ms"], np.maximum(compute, weights_ms), rtol=1e-9)


def test_diff_stats_and_textbook_attention():
    a = torch.randn(5, 8)
    assert br.diff_stats(a, a.clone()) == (0.0, 0.0, pytest.approx(1.0))
    mx, mean, cos = br.diff_stats(a + 1, a)
    assert mx == pytest.approx(1.0) and mean == pytest.approx(1.0) and cos < 1
    q, k, v = (torch.randn(2, 3, 7, 4) for _ in range(3))
    assert torch.allclose(br.textbook_sdpa(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v),
                          atol=1e-6)
    with pytest.raises(ValueError, match="attn_mask"):
        br.textbook_sdpa(q, k, v, attn_mask=torch.ones(7, 7, dtype=torch.bool))


def test_counted_flops_match_the_analytic_count_and_restore_the_backend():
    tiny = VisionConfig.tiny()
    grids = np.array([[1, 4, 4]])
    model = GlmVisionEncoder(tiny, attn_backend="sdpa_masked").eval()
    counted = br.counted_flops(model, torch.randn(16, tiny.patch_dim), grids)
    analytic = flops_breakdown(tiny, grids)
    assert counted["segments"][0] == counted["sdpa_masked"][0] == analytic["matmul"]
    assert counted["segments, textbook attention"][0] == analytic["total"]
    assert model.attn_backend == "sdpa_masked"


def test_accuracy_lines_report_the_worst_relative_difference():
    ref = [torch.full((2, 3), 4.0)]
    lines, worst = br.accuracy_lines(["a/x.jpg"], [[1, 2, 2]], ref, [ref[0] + 0.4], [ref[0]])
    assert len(lines) == 1 + 3 and lines[1].startswith("x.jpg")
    assert worst == pytest.approx(0.1)  # eager 0.4 off a reference of scale 4


# --- notebook 10 ---------------------------------------------------------------------------------------------------

def test_recorded_prints_what_it_loaded(capsys):
    record = kv.recorded(BENCH / "capture.json", StartupRecord)
    assert isinstance(record, StartupRecord) and "capture.json" in capsys.readouterr().out


def test_replay_rows_and_their_plot(kernels):
    variants, layouts = ["cudnn", "cudnn-compiled"], ["1x224", "8x448"]
    rows = kv.replay_rows(kernels.profile, variants, layouts)
    assert set(rows) == {(v, lay) for v in variants for lay in layouts}
    for (v, lay), p in rows.items():
        assert p["kernels"] == kernels.profile[v][lay]["kernels_per_call"]
        assert abs(p["gap_us"] - (p["device_us"] - p["busy_us"])) < 1e-6 * p["device_us"]
    fig = kv.plot_replay_categories(kernels.profile, variants, layouts)
    assert len(fig.axes) == len(layouts)
    assert len(kv.plot_rooflines(kernels.gemm, layouts).axes[0].patches) == sum(len(kernels.gemm[x]) for x in layouts)
    assert len(kv.plot_startup({"a-cold": 3.0, "a-warm": 1.0}).axes[0].patches) == 2


def test_split_k_ratios_pick_the_best_of_each_load():
    row = {"m": 64, "k": 128, "n": 256, "best_us": 9.0, "cublas_us": 10.0,
           "configs": {"a": {"us": 12.0}, "at": {"us": 9.0}, "b": {"us": 11.0}, "note": "not a config"}}
    ratios, tma_faster = kv.split_k_ratios(SimpleNamespace(gemm=[row]))
    assert ratios == {(64, 128, 256): 0.9} and tma_faster == 1
    row["configs"]["b"]["us"] = 8.0
    assert kv.split_k_ratios(SimpleNamespace(gemm=[row]))[1] == 0
    assert kv.split_k_ratios(load(BENCH / "tune_h200.json", TuneSweep))[0]


def test_metadata_views_start_on_16_bytes():
    assert kv.misaligned_views((64, 256), max_segments=8) == []


def test_region_costs_compare_regions_with_the_whole_model():
    top = [{"name": "Memcpy DtoD", "category": "copy", "launches_per_call": 24, "us_per_call": 48.0},
           {"name": "Memcpy HtoD", "category": "copy", "launches_per_call": 1, "us_per_call": 3.0},
           {"name": "gemm", "category": "gemm", "launches_per_call": 2, "us_per_call": 1.0}]
    regions = {"kernels_per_call": 124, "by_category_us": {"copy": 5.0}, "replay_device": {"median_ms": 1.0},
               "top": top}
    whole = {"kernels_per_call": 100, "by_category_us": {}, "replay_device": {"median_ms": 0.9},
             "top": [{"name": "Memset (Unknown)", "category": "copy", "launches_per_call": 4, "us_per_call": 3.2}]}
    got = kv.region_costs({"x": {"l": regions}, "x-model": {"l": whole}}, "x-model", ["l"], depth=24)["l"]
    assert got["extra_per_block"] == 1.0 and got["copy_us"] == (5.0, 0.0) and got["device_ms"] == (1.0, 0.9)
    assert [t["name"] for t in got["per_block_copies"]] == ["Memcpy DtoD"]
    assert got["shortest_copy_us"] == 0.8  # the whole model's memset, 3.2 µs over 4 launches; not the gemm's 0.5


def test_target_verdicts_follow_the_goals():
    easy = kv.target_verdicts(BENCH, {"img1x224": ("median_ms", 1e9), "img8x448": ("rate", 0.0)}, p99_within=1e9)
    hard = kv.target_verdicts(BENCH, {"img1x224": ("median_ms", 0.0), "img8x448": ("rate", 1.1)}, p99_within=1.0)
    assert all(v["met"] and v["steady"] for v in easy.values())
    assert not any(v["met"] or v["steady"] for v in hard.values())
    assert 0 < easy["img8x448"]["rate"] < 1 and easy["img1x224"]["x_floor"] > 1
    assert easy["img1x224"]["commit"] == load(BENCH / "img1x224.json", BenchRecord).provenance.short_commit


def test_describe_sweep_names_its_gpu_and_commit(tmp_path):
    path = tmp_path / "ab.json"
    path.write_text(json.dumps({"provenance": {"gpu": "G", "git_commit": "0123456789ab", "date_utc": "D"}}))
    assert kv.describe_sweep(path) == "ab.json: sweep (G, commit 0123456, D)"


def test_skeleton_verdicts_judge_a_target_against_the_skeleton_from_idle_and_held(tmp_path):
    def run(model, skeleton, mhz):
        return {"model": {"ms": model, "sm_mhz": mhz}, "skeleton": {"ms": skeleton, "sm_mhz": mhz}}

    workload = {"burst": run(24.0, 19.0, 1980), "sustained": run(26.0, 21.5, 1470),
                "chosen": {"attention": {"kernel": "sdpa_cudnn_dense"}}}
    path = tmp_path / "skeleton.json"
    path.write_text(json.dumps({"workloads": {"8x448": workload, "1x224": workload}}))
    verdict = kv.skeleton_verdicts(path, {"8x448": 21.0})["8x448"]
    assert verdict["reachable"] and not verdict["reachable_held"]  # 19 < 21 from idle; 21.5 > 21 held
    assert verdict["left_ms"] == 2.0 and verdict["mhz_sustained"] == (1470, 1470)
    assert verdict["attention"] == "sdpa_cudnn_dense"
    assert not kv.skeleton_verdicts(path, {"1x224": 18.0})["1x224"]["reachable"]
    assert all(verdict[k] is None for k in ("model_run", "skeleton_run", "mhz_run", "reachable_run"))  # none timed


def test_gpu_kind_names_the_sweeps_of_a_records_gpu_and_refuses_others():
    assert kv.gpu_kind("NVIDIA H100 80GB HBM3") == "h100" and kv.gpu_kind("NVIDIA H200") == "h200"
    with pytest.raises(ValueError, match="no sweeps are recorded for 'NVIDIA A100-SXM4-80GB': only for H100, H200"):
        kv.gpu_kind("NVIDIA A100-SXM4-80GB")


def test_skeleton_verdicts_judge_the_records_regime_where_it_was_timed(tmp_path):
    def run(model, skeleton, mhz):
        return {"model": {"ms": model, "sm_mhz": mhz}, "skeleton": {"ms": skeleton, "sm_mhz": mhz - 200}}

    workload = {"burst": run(2.9, 2.55, 1980), "run": run(3.0, 2.7, 1980), "sustained": run(3.1, 2.8, 1500),
                "chosen": {"attention": {"kernel": "sdpa_cudnn_dense"}}}
    path = tmp_path / "skeleton.json"
    path.write_text(json.dumps({"workloads": {"clip8x224": workload}}))
    verdict = kv.skeleton_verdicts(path, {"clip8x224": 2.6})["clip8x224"]
    assert verdict["reachable"] and not verdict["reachable_run"] and not verdict["reachable_held"]
    assert (verdict["model_run"], verdict["skeleton_run"], verdict["mhz_run"]) == (3.0, 2.7, (1980, 1780))


def test_fused_ab_takes_the_fastest_correct_fused_path(tmp_path):
    path = tmp_path / "ab.json"
    paths = {"torch": {"us": 10.0}, "compiled": {"us": 9.0}, "gate_up_only": {"us": 7.0},
             "triton@a": {"us": 5.0, "ok": False}, "triton@b": {"us": 8.0, "ok": True},
             "triton@c": {"us": 8.5, "ok": True}}
    path.write_text(json.dumps({"provenance": {"gpu": "G"}, "results": [{"rows": 256, "paths": paths}]}))
    assert kv.fused_ab(path) == [{"rows": 256, "unfused": 9.0, "fused": 8.0, "best": "triton@b", "gate_up_us": 7.0,
                                  "gpu": "G"}]


def test_ncu_lines_and_registers():
    ncu = load(BENCH / "ncu.json", NcuProfile)
    lines = kv.ncu_lines(ncu.layouts, top=2)
    assert len(lines) == sum(1 + min(2, len(e["groups"])) for e in ncu.layouts.values())
    assert lines[0].startswith(next(iter(ncu.layouts)))
    assert kv.blocks_by_registers(128, 128) == 4 and kv.blocks_by_registers(255, 128) == 2


def test_small_tower_and_compiled_code():
    tower, meta, cos, sin = kv.small_tower("cpu", torch.float32, depth=2)
    assert len(tower.blocks) == 2 and cos.shape[0] == meta.shape.rows == sin.shape[0]
    x = torch.randn(4, 3)
    out, code = kv.compiled_code(lambda t: (t * 2).sum(-1), x)
    assert torch.allclose(out, (x * 2).sum(-1)) and "def " in code


def test_kernel_delta_matches_kernels_by_name_and_orders_by_the_largest_change():
    before = {"top": [{"name": "attn_ragged", "category": "attention", "us_per_call": 150.0, "launches_per_call": 24},
                      {"name": "gemm", "category": "gemm", "us_per_call": 900.0, "launches_per_call": 96}]}
    after = {"top": [{"name": "gemm", "category": "gemm", "us_per_call": 905.0, "launches_per_call": 96},
                     {"name": "attn_dense", "category": "attention", "us_per_call": 90.0, "launches_per_call": 24},
                     {"name": "rotate", "category": "attention", "us_per_call": 20.0, "launches_per_call": 24}]}
    rows = kv.kernel_delta(before, after)
    assert [r["name"] for r in rows] == ["attn_ragged", "attn_dense", "rotate", "gemm"]
    assert rows[0]["delta_us"] == -150.0 and rows[0]["after_launches"] == 0
    assert rows[1]["delta_us"] == 90.0 and rows[-1]["delta_us"] == 5.0
    assert sum(r["delta_us"] for r in rows) == (905 + 90 + 20) - (150 + 900)


def test_compile_savings_read_auto_s_kernel_from_the_record_where_it_names_one(kernels):
    """A record made where FlashAttention-4 runs says auto ran ``fa4``: the reading takes that profile, not the kernel
    this machine's auto would choose."""
    layout = next(iter(kernels.layouts))
    moved = {**kernels.profile, "fa4": kernels.profile["triton"], "fa4-compiled": kernels.profile["triton-compiled"]}
    record = kernels.model_copy(update={"profile": moved, "auto": {layout: "fa4"}})
    rows = br.compile_savings(record, "auto")
    assert rows[layout]["kernel"] == "fa4"
    assert rows[layout]["gpu_us"][0] == moved["fa4"][layout]["gpu_us_per_call"]


def test_compile_savings_read_an_older_record_by_the_rule_it_ran_not_this_machine_s(kernels, monkeypatch):
    """A record without ``auto`` predates FlashAttention-4 in ``auto``: read where fa4 loads and its table names
    every batch, it still takes the kernel cuDNN's rule chose (the record has no ``fa4`` profile)."""
    from glmvit.kernels import fa4_attention, fa4_table
    from glmvit.kernels.attention_table import attention_for

    monkeypatch.setattr(fa4_attention, "_loads", lambda: True)
    monkeypatch.setattr(fa4_table, "FA4_MIN_ROWS", 0)
    older = kernels.model_copy(update={"auto": {}})  # as records made before auto named its kernel
    assert "fa4" not in older.profile
    rows = br.compile_savings(older, "auto")
    assert {n: r["kernel"] for n, r in rows.items()} == {
        n: attention_for(sum(t * h * w for t, h, w in g), fa4=False) for n, g in older.layouts.items()}


def test_plot_kernel_delta_draws_a_bar_pair_per_kernel_the_largest_change_on_top(kernels):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from glmvit.lab import kernel_views as kv

    rows = kv.kernel_delta(kernels.profile["triton-compiled"]["8x448"], kernels.profile["cudnn-compiled"]["8x448"])
    fig = kv.plot_kernel_delta(rows, "triton-compiled", "cudnn-compiled", top=4)
    ax = fig.axes[0]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert len(ax.patches) == 8 and widths == sorted(round(r[k] / 1e3, 6) for r in rows[:4]
                                                      for k in ("before_us", "after_us"))
    assert [t.get_text() for t in ax.get_yticklabels()][-1].startswith(rows[0]["name"][:44])  # barh: last on top
    plt.close(fig)
