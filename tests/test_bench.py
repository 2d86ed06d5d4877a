"""python -m glmvit bench on CPU: tiny config, emulated graph runner, JSON structure, FLOPs, bucket-config errors.

Performance is measured by the benchmark, never asserted here: only structure and arithmetic are checked.
"""
import contextlib
import json
import math
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from glmvit import VisionConfig
from glmvit.cli.bench import main, parse_modes
from glmvit.cli.latency import square_grid
from glmvit.floor import encoder_flops, floor_ms, flops_breakdown
from glmvit.geometry import grid_for
from glmvit.random_weights import random_encoder
from glmvit.recorded import load_latency_table
from glmvit.workloads import PRESETS, parse_bucket_config

ROOT = Path(__file__).resolve().parents[1]
CPU_ARGS = ["--device", "cpu", "--config", "tiny", "--num-requests", "3", "--warmup", "1", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    # images and 4-frame clips (grid [2, 8, 8]) mixed, 1-3 items per request: exercises video flattening for
    # transformers, packing for the runner, and ratios over a workload whose requests differ
    assert main([*CPU_ARGS, "--bucket-config", "{(112, 112, 1): 0.5, (112, 112, 4): 0.5}",
                 "--items-per-request", "2", "--range-ratio", "0.5", "--seed", "1", "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_json_structure(bench_json):
    r = bench_json
    for key in ("kind", "provenance", "fingerprint", "settings", "workload", "floor", "flops", "modes", "ratios",
                "accuracy"):
        assert key in r, key
    assert r["kind"] == "bench" and "glmvit.graphs" in r["fingerprint"]["modules"]
    prov = r["provenance"]
    for key in ("torch", "triton", "transformers", "git_commit", "command", "date_utc", "device", "gpu", "cpu"):
        assert key in prov, key
    assert prov["gpu"] is None and prov["device"] == "cpu"  # a CPU run says so
    assert prov["device"] == "cpu" and "bench" in prov["command"] and "--json" in prov["command"]
    assert r["settings"]["dtype"] == "float32" and r["settings"]["config"] == "tiny"
    assert r["workload"]["requests"] == len(r["workload"]["grids"]) == 3


def test_every_mode_present_and_graph_is_labelled_emulated(bench_json):
    modes = bench_json["modes"]
    assert list(modes) == ["transformers", "eager", "graph-emulated"]
    assert "graph" not in modes and bench_json["settings"]["modes"] == list(modes)
    for label, m in modes.items():
        assert m["requests"] == 3 and len(m["ms"]) == m["timed_requests"] == 3 * m["passes"]
        for key in ("mean_ms", "median_ms", "std_ms", "p99_ms", "items_per_s", "tokens_per_s", "achieved_tflops",
                    "vs_floor_median"):
            assert math.isfinite(m[key]) and m[key] >= 0, (label, key)
        assert m["min_ms"] <= m["median_ms"] <= m["max_ms"]
    g = modes["graph-emulated"]
    assert g["runner_mode"] == "emulate" and g["capture"] and g["runner"]["replays"] >= 3
    assert all(a["max_abs_diff"] < 1e-4 and a["min_cosine"] > 0.9999 for a in bench_json["accuracy"].values())


def test_floor_is_computed(bench_json):
    f = bench_json["floor"]
    assert f["matmul_tflops"] > 0 and f["copy_gbps"] > 0
    config = VisionConfig.tiny()
    assert f["parameters"] == 182_400 and f["weight_bytes"] == 4 * 182_400
    grids = bench_json["workload"]["grids"]
    for g, flops, fl in zip(grids, bench_json["flops"]["per_request"], f["per_request_ms"], strict=False):
        assert flops == encoder_flops(config, g)
        assert fl == pytest.approx(floor_ms(flops, f["weight_bytes"], f["matmul_tflops"], f["copy_gbps"]))
        assert fl >= 1e3 * f["weight_bytes"] / (f["copy_gbps"] * 1e9) * (1 - 1e-12)


def test_flops_by_hand():
    c = VisionConfig.tiny()  # depth 2, hidden 64, out_hidden (block MLP width) 64, intermediate 128, patch_dim 1176
    grids = [[1, 2, 2]]  # 4 patches, 1 token, one segment of 4
    n, t = 4, 1
    hand = (2 * n * 1176 * 64  # patch embed
            + 2 * (2 * n * 64 * 192 + 2 * n * 64 * 64 + 3 * 2 * n * 64 * 64)  # two blocks: qkv, proj, gate/up/down
            + 2 * t * 256 * 64  # downsample 2×2·64 → 64
            + 2 * t * 64 * 64 + 3 * 2 * t * 64 * 128  # merger proj, gate/up/down
            + 2 * 4 * 4 * 4 * 64)  # attention: depth · 4 · L² · hidden, L = 4
    assert encoder_flops(c, grids) == hand == 1_159_168
    # a video row is t segments of h·w: attention grows linearly in t, not quadratically
    two = flops_breakdown(c, [[2, 2, 2]])
    assert two["attention"] == 2 * flops_breakdown(c, grids)["attention"]
    assert two["matmul"] == 2 * flops_breakdown(c, grids)["matmul"]


@pytest.mark.parametrize("backend", ["segments", "sdpa_masked"])
def test_flops_against_flop_counter(backend):
    """FlopCounterMode on our eager forward agrees with the analytic matmul count exactly.

    Attention: with the ``segments`` backend attention is one SDPA call per segment; under the math SDPA kernel
    those are matmuls (aten.bmm), counted as 4·Σ L²·H, so the totals agree too. With ``sdpa_masked`` the CPU runs
    ``_scaled_dot_product_flash_attention_for_cpu``, which FlopCounterMode has no formula for, so it counts no
    attention at all (on a GPU its SDPA formulas would count the dense masked cost 4·N²·H over all N rows, not the
    useful Σ L²).
    """
    config = VisionConfig.tiny()
    model = random_encoder(config, torch.device("cpu"), torch.float32)
    model.attn_backend = backend
    grids = np.array([[2, 4, 6], [1, 8, 4]])
    pixels = torch.randn(int(grids.prod(1).sum()), config.patch_dim)
    math = torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH) if backend == "segments" \
        else contextlib.nullcontext()
    with torch.inference_mode(), math, FlopCounterMode(display=False) as counter:
        model(pixels, grids)
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    expected = flops_breakdown(config, grids)
    assert counts["aten.addmm"] + counts["aten.mm"] == expected["matmul"]
    if backend == "segments":
        assert counts["aten.bmm"] == expected["attention"]
        assert counter.get_total_flops() == expected["total"]
    else:
        assert counter.get_total_flops() == expected["matmul"]


def test_workload_presets():
    assert grid_for(224, 224, 8) == (4, 16, 16)  # the seed's video workload
    assert grid_for(448, 448, 1) == (1, 32, 32)
    assert PRESETS["img8x448"].items_per_request == 8 and PRESETS["video8x224"].bucket_config == {(224, 224, 8): 1.0}
    sizes = {len(r) for r in PRESETS["mixed-img"].requests(200)}
    assert sizes == {1, 2, 3, 4}  # 1–4 images per request, as the preset says


def test_square_grid():
    for budget in (64, 128, 256, 1536, 4096, 7):
        t, h, w = square_grid(budget)
        assert t == 1 and h * w == 4 * budget and h % 2 == 0 and w % 2 == 0 and h <= w
    assert square_grid(64) == [1, 16, 16] and square_grid(128) == [1, 16, 32]


def test_bucket_config_strings_parse():
    assert parse_bucket_config("{(224, 224, 1): 1.0}") == {(224, 224, 1): 1.0}
    assert parse_bucket_config("{(224,224,1): 3, (448, 448, 8): 1}") == {(224, 224, 1): 0.75, (448, 448, 8): 0.25}


@pytest.mark.parametrize("text, message", [
    ("{(224, 224): 1.0}", "bucket key must be (height, width, frames)"),
    ("{(224, 224, 1): }", "could not parse bucket_config"),
    ("[(224, 224, 1)]", "must be a non-empty dict"),
    ("{(224, 224, 1): -1}", "probability must be a finite number ≥ 0"),
    ("{(224, 0, 1): 1}", "must be a positive integer"),
])
def test_bad_bucket_config_is_a_clear_cli_error(text, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*CPU_ARGS, "--bucket-config", text])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_modes():
    assert parse_modes("transformers, eager,graph-emulated") == ["transformers", "eager", "graph"]
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        parse_modes("eager,fast")


@pytest.mark.gpu
def test_bench_times_transformers_compiled_as_the_peer(tmp_path, monkeypatch):
    """``--modes transformers,transformers-compiled``: the compiled peer runs, replays, and answers what transformers
    answers. fp32 on the tiny tower without TF32: inductor sums in another order, so the two differ by float32
    rounding through two blocks (about 1e-6 of outputs of size ~1); 1e-4 leaves that a hundredfold."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    path = tmp_path / "peer.json"
    assert main(["--device", "cuda", "--config", "tiny", "--dtype", "fp32", "--workload", "img1x224",
                 "--num-requests", "4", "--warmup", "3", "--quiet", "--modes", "transformers,transformers-compiled",
                 "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert list(record["modes"]) == ["transformers", "transformers-compiled"] and not record["skipped"]
    assert record["accuracy"]["transformers-compiled"]["vs_transformers"]["max_abs_diff"] < 1e-4
    assert record["ratios"]["transformers-compiled"]["transformers"] > 0


def test_json_naming_a_tables_input_is_refused_before_any_work(tmp_path, capsys):
    table = tmp_path / "t.json"
    table.write_bytes((ROOT / "data" / "bench" / "latency.json").read_bytes())
    before = table.read_bytes()
    with pytest.raises(SystemExit) as exc:
        main([*CPU_ARGS, "--modes", "eager,graph", "--tables", f"graph={table}", "--json", str(table)])
    assert exc.value.code == 2 and "is the --tables graph input" in capsys.readouterr().err
    assert table.read_bytes() == before


def test_compile_is_skipped_on_cpu(tmp_path):
    path = tmp_path / "b.json"
    assert main([*CPU_ARGS, "--workload", "img1x224", "--num-requests", "1", "--modes",
                 "eager,compile,transformers-compiled", "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    assert list(r["modes"]) == ["eager"]
    assert all("CUDA" in r["skipped"][m] for m in ("compile", "transformers-compiled"))


def test_latency_table_loads(tmp_path, monkeypatch):
    """``bench latency``'s sweep, end to end into the table that ``plan`` reads, with each call still made but its
    time taken from a known model (wall times on a loaded CI machine are noise): the fit must recover the model."""
    import glmvit.cli.latency as latency

    slope = 10.0  # ms per 1e6 segment rows² — the attention term the fit estimates by least squares

    def modelled_times(fn, device, runs, warmup=0, on_device=False):
        fn()  # the replay or eager call still runs; only its clock is replaced
        grids = np.asarray(fn.args[-1])
        attention = slope * float((grids[:, 0] * (grids[:, 1] * grids[:, 2]) ** 2).sum()) / 1e6
        if len(fn.args) == 3:  # runner.replay(budget, pixels, grids): the budget's fixed cost, whatever it holds
            return [2.0 + fn.args[0] / 16 + attention] * runs
        return [1.0 + float(grids.prod(axis=1).sum()) / 4 / 32 + attention] * runs  # eager: its real tokens

    def modelled_until_steady(fn, device, max_runs, warmup=0, min_runs=3, spread=0.02):
        return modelled_times(fn, device, min_runs)  # identical runs agree at once

    def modelled_eager(model, pixels, grids):  # eager forwards: latency.time_eager's calls, clock replaced
        return modelled_times(partial(model, pixels, grids), model.device, 5)

    monkeypatch.setattr(latency, "time_until_steady", modelled_until_steady)
    monkeypatch.setattr(latency, "time_eager", modelled_eager)
    path = tmp_path / "latency.json"
    assert latency.main(["--device", "cpu", "--config", "tiny", "--quiet", "--warmup", "0", "--runs", "2",
                         "--budgets", "16,64,128", "--json", str(path)]) == 0
    table = load_latency_table(path)
    assert table.tokens == (16, 64, 128) and table.config == "tiny" and table.dtype == "float32"
    assert table.mode == "graph" and table.changed == () and "current" in table.describe()
    # exact up to float64 rounding of a least-squares fit over a handful of layouts
    assert table.attention_ms == pytest.approx(slope, rel=1e-9)
    assert table.graph_ms == pytest.approx([2.0 + t / 16 for t in table.tokens], rel=1e-9)
    assert table.eager_ms == pytest.approx([1.0 + t / 32 for t in table.tokens], rel=1e-9)
    raw = json.loads(path.read_text())
    assert raw["kind"] == "latency" and raw["measurement"]["runner_mode"] == "emulate" and raw["compiled"] is False
    assert [b["grid"] for b in raw["budgets"]] == [[1, 8, 8], [1, 16, 16], [1, 16, 32]]
    names = [x["name"] for x in raw["budgets"][2]["layouts"]]
    assert names == ["full", "full-many", "half", "one-small", "many-small"]  # no room for the 256-token clip
    for b in raw["budgets"]:  # the table's graph time of a budget is its slowest layout
        assert b["graph_ms"] == max(x["graph_ms"] for x in b["layouts"]) >= b["full_graph_ms"]
    assert set(raw["capture"]) == {"16", "64", "128"} and all(c["seconds"] >= 0 for c in raw["capture"].values())


def test_default_limits_size_the_segment_slots_to_the_workload():
    from glmvit.geometry import ItemSpec
    from glmvit.packing import BudgetConfig

    images = [[ItemSpec(64, 1)], [ItemSpec(64, 1), ItemSpec(16, 1)]]
    config = BudgetConfig.for_requests(images)
    assert (config.max_items, config.max_segments) == (2, 2)
    assert BudgetConfig.for_requests([[ItemSpec(256, 4)]]).max_segments == 4
    tiny = BudgetConfig.for_requests(images, token_budgets=(1, 128))
    assert (tiny.max_items, tiny.max_segments) == (1, 2)  # one token per item at most in a 1-token budget


def test_default_segment_slots_never_refuse_small_budgets():
    """Only a --max-segments the user gives can exceed the largest budget; the default one is sized to the
    workload (8 segments for two 8-frame clips) and clamped, as the runner never uses slots past a budget."""
    from glmvit.cli.bench import build_parser, check_args

    parser = build_parser()
    check_args(parser, parser.parse_args(["--workload", "video2x8x224", "--budgets", "2,4", "--device", "cpu"]))
    with pytest.raises(SystemExit):
        check_args(parser, parser.parse_args(["--workload", "video2x8x224", "--budgets", "2,4", "--max-segments", "8",
                                              "--device", "cpu"]))


class _Captured(BaseException):
    """Stops a bench run at its first capture (a BaseException: bench keeps going past a mode's Exception)."""


def test_memory_is_checked_for_the_budgets_each_graph_mode_captures(tmp_path, monkeypatch):
    """A mode's table moves where its ladder stops doubling (costmodel.ladder_split); the memory check must see
    the budgets that mode then captures, not the ladder of the default split."""
    import glmvit.cli.bench as bench
    from glmvit.cli.common import read_latency_table
    from glmvit.costmodel import ladder_split
    from glmvit.packing import LADDER_SPLIT, default_ladder

    raw = json.loads((ROOT / "data" / "bench" / "latency_compiled.json").read_text())
    raw["compiled"] = False  # measured as graph-compiled; relabelled so that the emulated graph mode routes by it

    def slower_host(node):  # eager four times slower: its launch floor covers budgets past the default split
        if isinstance(node, dict):
            return {k: v * 4 if k.startswith("eager_") and isinstance(v, float) else slower_host(v)
                    for k, v in node.items()}
        return [slower_host(v) for v in node] if isinstance(node, list) else node

    raw["budgets"] = slower_host(raw["budgets"])
    table = tmp_path / "t.json"
    table.write_text(json.dumps(raw))
    assert read_latency_table(table).mode == "graph" and ladder_split(read_latency_table(table)) != LADDER_SPLIT
    checked, captured = [], []

    def check(config, *args, **kwargs):
        checked.append(config)
        return config

    def make_mode(mode, model, config, *args, **kwargs):
        captured.append(config)
        raise _Captured

    monkeypatch.setattr(bench, "check_budget_fits", check)
    monkeypatch.setattr(bench, "make_mode", make_mode)
    with pytest.raises(_Captured):  # requests of 1,024 tokens: the two splits give different ladders up to them
        main([*CPU_ARGS, "--num-requests", "1", "--bucket-config", "{(896, 896, 1): 1.0}", "--modes", "graph",
              "--tables", f"graph={table}"])
    assert len(captured) == 1 and captured[0] in checked
    assert captured[0].token_budgets != default_ladder(captured[0].largest)  # not what the default split gives


def test_throughput_counts_the_requests_timed_when_the_last_pass_stops_part_way(tmp_path, monkeypatch):
    """A later pass may stop once the median is precise (glmvit.timing.time_passes): rates count each timed
    request once (the i-th time is request i % n), not every request once per pass begun."""
    from glmvit.cli import bench

    def partial_passes(call, n, device, precision, max_passes, after=None, progress=None):
        for j in range(n + 2):  # one whole pass, then two requests of a second
            out = call(j % n)
            if after is not None:
                after(j % n, out)
        return [1.0] * (n + 2), [1.0] * (n + 2), 2

    monkeypatch.setattr(bench, "time_passes", partial_passes)
    path = tmp_path / "b.json"
    assert main([*CPU_ARGS, "--bucket-config", "{(112, 112, 1): 0.5, (224, 224, 1): 0.5}", "--modes", "eager",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    merge = data["settings"]["vision_config"]["spatial_merge_size"] ** 2
    tokens = [sum(t * h * w // merge for t, h, w in g) for g in data["workload"]["grids"]]
    mode = data["modes"]["eager"]
    assert mode["timed_requests"] == 5 and mode["passes"] == 2
    assert mode["tokens_per_s"] == pytest.approx((sum(tokens) + tokens[0] + tokens[1]) / 5e-3)


@pytest.mark.parametrize(("flags", "measured"), [(["--uniform-graphs", "auto"], True),
                                               (["--uniform-graphs", "auto"], False),
                                               (["--uniform-graphs", "off"], True),
                                               (["--attn-backend", "sdpa_masked"], True)])
def test_graph_modes_capture_uniform_graphs_for_the_workload_s_segment_lengths(tmp_path, monkeypatch, flags, measured):
    """Two 448² images a request (1024-row frames). ``auto`` where the rule was measured (CUDA in half precision:
    stood in for here by patching glmvit.uniform.uniform_graphs_pay) captures 1024-row uniform graphs at the budgets
    whose uniform shape holds DENSE_MIN_ROWS rows or more (512 tokens: 2048 rows; 256: 1024), and every request
    replays there; on this CPU in fp32 as it is, ``off``, or an attention backend named (that kernel everywhere),
    none. The record's settings name the lengths."""
    from glmvit import uniform

    monkeypatch.setattr(uniform, "uniform_graphs_pay", lambda device, dtype: measured)
    path = tmp_path / "b.json"
    assert main([*CPU_ARGS, "--bucket-config", "{(448, 448, 1): 1.0}", "--items-per-request", "2",
                 "--modes", "eager,graph", *flags, "--json", str(path)]) == 0
    r = json.loads(path.read_text())
    graph = r["modes"]["graph-emulated"]
    if not (measured and flags == ["--uniform-graphs", "auto"]):
        assert r["settings"]["uniform_lengths"] == [] and graph["uniform_captured"] == []
        assert graph["runner"]["uniform_replays"] == 0
        return
    assert r["settings"]["uniform_lengths"] == [1024]
    assert graph["budgets"] == [64, 128, 256, 512]
    assert graph["uniform_captured"] == [[256, 1024], [512, 1024]]
    assert graph["runner"]["uniform_replays"] == graph["runner"]["replays"] == graph["timed_requests"]


def test_uniform_graphs_pay_only_where_the_rule_was_measured():
    from glmvit.uniform import uniform_graphs_pay

    assert uniform_graphs_pay("cuda", "bfloat16") and uniform_graphs_pay("cuda", "float16")
    assert not uniform_graphs_pay("cuda", "float32") and not uniform_graphs_pay("cpu", "bfloat16")
