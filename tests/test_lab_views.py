"""The notebooks' CPU helpers for notebooks 06, 07, 09, 10b and 11: comparisons, record readers, tables and figures
moved out of the cells. Each test holds a case the helper must get right and one it must refuse or tell apart."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from glmvit.lab import capture_replay as cr  # noqa: E402
from glmvit.lab.staging import serve  # noqa: E402


def test_fp32_close_allows_rounding_and_refuses_a_wrong_value():
    ref = torch.tensor([1.0, -2.0, 50.0])
    assert cr.fp32_close(ref + 1e-4, ref)  # 2e-6 of the scale
    assert not cr.fp32_close(ref + torch.tensor([0.0, 0.0, 0.01]), ref)  # 2e-4 of the scale


def test_eager_items_runs_each_item_alone():
    class Echo:  # a "model" that returns its rows' first column and the grid it was given
        def __call__(self, rows, grid):
            return torch.cat([rows[:, :1], grid.float().repeat(rows.shape[0], 1)], 1)

    pixels = torch.arange(12.0).reshape(6, 2)
    out = cr.eager_items(Echo(), pixels, [[1, 2, 2], [1, 1, 2]])
    assert [o.shape[0] for o in out] == [4, 2]
    assert out[1][:, 0].tolist() == [8.0, 10.0] and out[1][0, 1:].tolist() == [1.0, 1.0, 2.0]


def test_refusals_names_the_runners_that_raised():
    class Ok:
        def run(self, *args):
            return []

    class Refuses:
        def run(self, *args):
            raise ValueError("NaN in item(s) [1]")

    assert cr.refusals({"ok": Ok(), "no": Refuses()}, None, None) == {"ok": None, "no": "NaN in item(s) [1]"}


def test_staging_figure_has_a_panel_per_case_and_the_lines_follow_the_record():
    batches = [np.full(4, k) for k in (1, 2, 3)]
    fig = cr.plot_staging(serve, batches, [(1, False), (2, True)])
    assert len(fig.axes) == 2 and "[3, 3, 3]" in fig.axes[0].get_title() and "[1, 2, 3]" in fig.axes[1].get_title()
    case = {"host_ms": 1.0, "items_correct": [True]}
    staged = {"plans": {"two": [{"items": [0], "budget": 64}]}, "three_with_events": case,
              "three_without_events": {**case, "first_batch_is_the_signature": True}, "two_with_two_buffers": case,
              "two_with_one_buffer": case}
    lines = cr.staging_lines(staged)
    assert lines[0] == "two-batch request: items [0] → budget 64" and len(lines) == 5
    assert "batch 1 saw batch 3's metadata: True" in lines[2] and "saw" not in lines[1]


def test_bf16_ulp_and_the_item_bound():
    assert cr.bf16_ulp(1.0) == 2**-7 and cr.bf16_ulp(3.0) == 2**-6 and cr.bf16_ulp(0.5) == 2**-8
    assert cr.item_bound({"eager_vs_fp32": 0.01, "scale": 1.0}) == pytest.approx(0.03 + 2**-7)


def test_graph_launch_finds_the_one_launch_and_refuses_two():
    lane = {"host": [[0.0, 5.0, "cudaMemcpyAsync"], [10.0, 20.0, "cudaGraphLaunch_v10000"]], "gpu": []}
    assert cr.graph_launch(lane) == (10.0, 20.0, "cudaGraphLaunch_v10000")
    with pytest.raises(ValueError, match="found 2"):
        cr.graph_launch({"host": lane["host"] + [[40.0, 1.0, "cudaGraphLaunch"]]})


def test_tower_timeline_figure_titles_carry_the_unprofiled_times():
    lane = {"host": [[0.0, 5.0, "cudaLaunchKernel"], [10.0, 20.0, "cudaGraphLaunch"]], "gpu": [[12.0, 30.0, "k"]]}
    times = {"eager": {"wall_ms_median": 2.5}, "run": {"wall_ms_median": 0.75}}
    fig = cr.plot_tower_timeline({"eager": lane, "run": lane}, times)
    titles = [ax.get_title() for ax in fig.axes]
    assert "2.50 ms per call" in titles[0] and "0.75 ms per call" in titles[1] and "2 host calls" in titles[1]


def test_tower_timeline_labels_the_launch_as_profiled_beside_its_unprofiled_time():
    lane = {"host": [[10.0, 1142.0, "cudaGraphLaunch"]], "gpu": [[12.0, 30.0, "k"]]}
    times = {"eager": {"wall_ms_median": 2.5}, "run": {"wall_ms_median": 0.75}, "graph_launch_host_us_median": 5.1}
    fig = cr.plot_tower_timeline({"eager": lane, "run": lane}, times)
    labels = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert labels and all(t == "cudaGraphLaunch: 1142 µs under the profiler, 5 µs without" for t in labels)


def test_load_gif_reads_frames_and_rate(tmp_path):
    from PIL import Image

    from glmvit.lab.frame_oracle import load_gif

    pictures = [Image.new("RGB", (6, 4), (40 * k, 0, 0)) for k in range(4)]
    path = tmp_path / "c.gif"
    pictures[0].save(path, save_all=True, append_images=pictures[1:], duration=250, loop=0)
    frames, fps = load_gif(path)
    assert frames.shape == (4, 4, 6, 3) and fps == 4.0


def test_block_mask_is_block_diagonal_and_padding_attends_nothing():
    from glmvit.lab.frame_oracle import block_mask

    mask = block_mask([0, 2, 5, 5])
    assert mask.shape == (5, 5) and mask[:2, :2].all() and mask[2:, 2:].all() and not mask[:2, 2:].any()
    assert mask.sum() == 2 * 2 + 3 * 3


def test_graph_capacity_slots_bytes_and_grids():
    from glmvit import VisionConfig
    from glmvit.lab.frame_oracle import graph_capacity
    from glmvit.metadata import BatchShape

    full = VisionConfig.glm41v()
    four, sixteen = graph_capacity(full, 1024, 4), graph_capacity(full, 1024, 16)
    assert (four["slots"], sixteen["slots"], graph_capacity(full, 64, 1000)["slots"]) == (4, 16, 64)
    assert sixteen["meta_bytes"] - four["meta_bytes"] == 48  # 12 more int32 (cu_seqlens slots, 16-byte aligned)
    assert four["meta_bytes"] == BatchShape(4096, 4, 4096).packed_size(4) * 4
    assert sixteen["fa2_programs"] == 4 * four["fa2_programs"] == 4 * 32 * 4 * full.num_heads
    assert sixteen["triton_programs"] == four["triton_programs"]  # no slot term


def test_frame_figures_have_their_panels():
    import torch

    from glmvit.lab.frame_oracle import plot_frame_pairs, plot_sampled_frames, plot_slot_limits

    frames = np.zeros((7, 8, 8, 3), np.uint8)
    fig = plot_sampled_frames(frames, {"a": [0, 2], "b": [2]})
    assert len(fig.axes) == 10 and fig.axes[2].get_title() == "2: a b" and fig.axes[1].get_title() == "1: "
    fig = plot_frame_pairs(frames, [0, 1, 2, 3], torch.zeros(2 * 4, 1176), [2, 2, 2], patch=1)
    assert len(fig.axes) == 8 and fig.axes[5].get_title() == "frame 3"
    assert len(plot_slot_limits([4, 16]).axes[0].lines) == 2


def test_patches_and_the_assignment_figure():
    from glmvit.lab import data_parallel as dp
    from glmvit.parallel import balance_items, round_robin_items
    from glmvit.workloads import make_item

    assert dp.patches(make_item(224, 224, 8)) == 4 * 16 * 16 and dp.patches(make_item(448, 448)) == 32 * 32
    sizes = [5, 1, 4]
    fig = dp.plot_assignments(sizes, {"rr": round_robin_items(sizes, 2), "lpt": balance_items(sizes, 2)})
    assert [ax.get_title() for ax in fig.axes] == ["rr: imbalance 1.80", "lpt: imbalance 1.00"]


def test_mean_imbalance_one_item_cannot_balance_and_lpt_never_loses():
    from glmvit.lab.data_parallel import mean_imbalance

    table = mean_imbalance({(224, 224, 1): 0.5, (448, 448, 1): 0.5}, worlds=(2,), counts=(1, 4), requests=20)
    assert table[2, 1] == (2.0, 2.0) and table[2, 4][1] <= table[2, 4][0]


def test_shares_plan_each_rank_and_preset_views_sum_them():
    from glmvit.costmodel import ladder_split
    from glmvit.lab import data_parallel as dp
    from glmvit.packing import BudgetConfig, default_ladder
    from glmvit.recorded import recorded_table
    from glmvit.workloads import make_item

    latency = recorded_table("graph-compiled")
    ladder = BudgetConfig.resolve(default_ladder(4096, split=ladder_split(latency)))
    items = [make_item(448, 448), make_item(224, 224, 8), make_item(224, 224)]
    assignment, ranks = dp.shares(items, 2, ladder, latency)
    assert sorted(i for r in ranks for i in r["items"]) == [0, 1, 2]
    assert tuple(r["patches"] for r in ranks) == assignment.loads
    assert all(r["tokens"] * 4 == r["patches"] and r["tokens"] + r["padding"] == sum(r["budgets"]) for r in ranks)
    views = dp.preset_views([items, items[:1]], ladder, latency, worlds=(1, 2))
    assert views[1]["patches"] == 2304 + 1024 and views[2]["patches"] == 1280 + 1024
    assert views[2]["ms"] < views[1]["ms"] and 0 <= views[2]["padding"] < 1
    assert len(dp.plot_shares(ranks).axes) == 2


def test_check_cost_lines_and_hash_shares():
    from glmvit.lab.data_parallel import check_cost_lines, hash_shares

    costs = {"med": {"glmvit": 12.0, "gather-only": 10.0}, "gap": 2.0, "check_phase": 1.5, "requests": 5,
             "hash_ms": 1.0, "hash_rate": 2e9, "inputs_ms": 0.25, "exchanges": [(8, 0.1)], "parts": 1.35}
    ranks_out = [{"pixel_bytes": 2**21, "gather_only_wrong_items": [1]}, {"glmvit_raised": "different requests"}]
    lines = check_cost_lines(costs, ranks_out)
    assert "the checks cost 2.0 ms" in lines[0] and "2.0 MiB" in lines[1] and "[1]" in lines[2]
    shares = hash_shares(1e9, {"w": 2.0}, {"w": 3 * 2**20 + 1})
    assert shares["w"]["pieces"] == 4 and shares["w"]["hash_ms"] == pytest.approx((3 * 2**20 + 1) / 1e6)
    assert shares["w"]["threads"] == 16  # ⌈3.15 ms / 0.2 ms⌉


def test_poison_segments_passes_segment_attention_and_catches_a_leak():
    from glmvit.lab import attention_kernel as ak

    qkv, cos, sin, meta = ak.attention_case([(1, 2, 4), (2, 2, 2)], heads=2, head_dim=8)
    assert qkv.shape == (meta.shape.rows, 3 * 2 * 8) and cos.shape[0] == meta.shape.rows
    assert ak.unfused_reference(qkv, cos, sin, meta, 2).shape == (meta.shape.rows, 2 * 8)

    def per_segment(qkv, c, s, segment_ids, cu_seqlens, heads):  # plain attention within each segment, no rotary
        q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
        out = torch.zeros_like(q)
        bounds = cu_seqlens.tolist()
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            out[a:b] = torch.einsum("qhk,khd->qhd", torch.softmax(torch.einsum("qhd,khd->qhk", q[a:b], k[a:b]), -1),
                                    v[a:b])
        return out.reshape(qkv.shape[0], -1)

    assert ak.poison_segments(per_segment, qkv, cos, sin, meta, 2) == 3 * 3  # q, k, v of 3 segments

    def leaky(q, c, s, segment_ids, cu_seqlens, heads):  # every row attends every row: a NaN crosses segments
        out = per_segment(q, c, s, segment_ids, cu_seqlens, heads)
        return out + 0 * q[:, : out.shape[1]].sum()

    with pytest.raises(AssertionError, match="left them"):
        ak.poison_segments(leaky, qkv, cos, sin, meta, 2)


def test_work_list_finds_the_straddling_blocks():
    from glmvit.lab.attention_kernel import plot_work_list

    assert plot_work_list([196, 120], 64)[1] == [3]
    assert plot_work_list([64, 64], 64)[1] == [] and plot_work_list([10, 10, 10], 32)[1] == [0]


def _tune():
    from types import SimpleNamespace

    def entry(rows, configs, best_in_loop, best_prerotated, rotation):
        return {"rows": rows, "configs": configs, "best_in_loop": best_in_loop, "best_prerotated": best_prerotated,
                "rotation_launch_us": rotation, "best_us": min(v for v in configs.values() if isinstance(v, float))}

    return SimpleNamespace(attention={
        "a": entry(256, {"64x64w4s1": 10.0, "64x64w4s1r": 8.0, "64x64w4s1k2": 12.0, "32x64w4s1": "failed"},
                   "64x64w4s1", "64x64w4s1r", 2.0),
        "b": entry(256, {"64x64w4s1": 20.0, "64x64w4s1r": 30.0, "64x64w4s1k2": 25.0, "32x64w4s1": 40.0},
                   "64x64w4s1", "64x64w4s1r", 2.0)})


def test_rotation_rows_and_best_by_variant_read_the_sweep():
    from types import SimpleNamespace

    from glmvit.lab import attention_kernel as ak

    tune = _tune()
    rows = ak.rotation_rows(tune, lambda r: SimpleNamespace(prerotate=True))
    assert rows["a"]["gain"] == pytest.approx(0.2) and rows["a"]["saves"] == pytest.approx(4.0)
    assert rows["b"]["gain"] == pytest.approx(-0.5) and rows["b"]["table_prerotates"]
    assert len(ak.plot_paths(rows).axes[0].patches) == 4
    best = ak.best_by_variant(tune, {"split": lambda k: k.endswith("k2"), "any": lambda k: True})
    assert best["a"] == {"split": 12.0, "any": 8.0}  # the failed configuration is skipped


def test_sweep_grid_attn_key_and_table_fit():
    from glmvit.kernels.triton_attention import AttnConfig
    from glmvit.lab import attention_kernel as ak

    tune = _tune()
    grid = ak.sweep_grid(tune.attention["a"], [32, 64], [64], "w4s1")
    assert np.isnan(grid[0, 0]) and grid[1, 0] == 10.0
    assert ak.attn_key(AttnConfig(64, 64, 4, 1)) == "64x64w4s1"
    assert ak.attn_key(AttnConfig(64, 32, 8, 3, split_k=2, prerotate=True)) == "64x32w8s3k2r"
    fit = ak.table_fit(tune, lambda rows: AttnConfig(64, 64, 4, 1))  # the in-loop entry: 1.25× on "a"
    assert fit[256]["layouts"] == ["a", "b"] and fit[256]["chosen"] == pytest.approx(1.25)
    assert fit[256]["least"] == pytest.approx(1.25)  # "r" is 1.5× on "b"; k2 1.5× on "a"; the failed one is not timed
    assert len(ak.plot_sweep_slices(tune, [("a", [32, 64], [64], "w4s1", "x")]).axes) == 1


def test_submit_all_reports_each_refusal_by_name():
    from glmvit.lab.serving import submit_all
    from glmvit.scheduler import QueueFull

    class Scheduler:
        def __init__(self):
            self.n = 0

        def submit(self, pixels, grid):
            self.n += 1
            if self.n > 1:
                raise QueueFull("the queue is full")
            return "future"

    outcomes, futures = submit_all(Scheduler(), [(None, None)] * 2)
    assert outcomes == ["admitted", "QueueFull: the queue is full"] and futures == ["future"]


def test_own_items_tells_own_outputs_from_others():
    from glmvit.lab.serving import own_items

    a, b = torch.ones(2, 3), torch.full((2, 3), 5.0)
    check = own_items([[a.clone()], [b + 1e-3]], [[a], [b]])
    assert check["same_count"] and check["bitwise"] == 1 and check["items"] == 2
    assert check["own_gap"] == pytest.approx(2e-4, rel=1e-2) and check["other_gap"] == pytest.approx(4 / 5)
    assert own_items([[b], [a]], [[a], [b]])["own_gap"] == pytest.approx(4.0)  # swapped: |5 − 1| / 1
    assert not own_items([[a], []], [[a], [b]])["same_count"]


def test_one_vs_many_skips_budgets_without_many_small():
    from types import SimpleNamespace as NS

    from glmvit.lab.serving import one_vs_many

    def budget(tokens, names):
        return NS(tokens=tokens, layouts=[NS(name=n, graph_ms=float(k + 1)) for k, n in enumerate(names)])

    sweep = NS(budgets=[budget(64, ["one-small", "full"]),
                        budget(128, ["one-small", "many-small", "full", "full-many"])])
    assert one_vs_many(sweep) == {128: {"one-small": 1.0, "many-small": 2.0, "full": 3.0, "full-many": 4.0,
                                        "ratio": 0.5}}


def test_rate_of_and_the_serve_lines():
    from types import SimpleNamespace as NS

    from glmvit.lab.serving import rate_of, serve_lines

    assert rate_of({"request_rate": "inf"}) == float("inf") and rate_of({"request_rate": "2.5"}) == 2.5
    run = {"mode": "eager", "requests_per_s": 3.0, "items_per_s": 6.0, "vs_floor": None,
           "tte_ms": {"median": 10.0, "p99": 20.0}, "queue_ms": {"median": 1.0, "p99": 2.0},
           "server": {"items_per_batch": 2.0, "padding_fraction": 0.1, "utilisation": 0.5}}
    record = NS(settings={"workload": "w", "requests": 4, "request_rates": ["inf", "2"], "modes": ["eager"],
                          "batching": {"max_wait_ms": 0.0}}, workload={"items": 8},
                runs=[{**run, "request_rate": "inf"}, {**run, "request_rate": "2"}])
    lines = serve_lines(record)
    assert len(lines) == 3 and "workload w: 4 requests, 8 items" in lines[0]
    assert "2.0:" in lines[1] and "inf:" in lines[2] and "(- of floor)" in lines[1] and "busy 50%" in lines[2]


def test_serving_figures():
    from glmvit.lab.serving import plot_latency_sweep, plot_phases, plot_rates, plot_wait

    fig = plot_wait({0.0: [1.0, 2.0], 0.001: [2.0, 3.0]}, [10.0, 100.0], 300.0, 200.0)
    assert len(fig.axes[0].lines) == 4  # two waits, two markers
    runs = {"a": {"time_split_ms": {"read": 1.0, "encode": 2.0}}, "b": {"time_split_ms": {"read": 3.0, "encode": 1.0}}}
    assert len(plot_phases(runs).axes[0].patches) == 4
    run = {"items_per_s": 5.0, "tte_ms": {"median": 1.0, "p99": 2.0}, "queue_ms": {"median": 0.5}}
    assert plot_latency_sweep([run, {**run, "saturation_share": 0.2}], 9.0, "t").axes[0].get_title() == "t"
    assert len(plot_rates({"eager": 3.0}, {"eager": 4.0}, 10.0).axes[0].patches) == 2


def test_read_answer_returns_tensors_and_item_metadata():
    import json

    from safetensors.torch import save

    from glmvit.lab.serving import read_answer

    body = save({"item_0": torch.ones(2, 3), "item_1": torch.zeros(1, 3)},
                metadata={"item_0": json.dumps({"source": "a.jpg"}), "item_1": json.dumps({"source": "b.gif"})})
    tensors, items = read_answer(body)
    assert [i["source"] for i in items] == ["a.jpg", "b.gif"] and tensors["item_0"].shape == (2, 3)
