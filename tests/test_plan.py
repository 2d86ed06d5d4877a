"""Budgets to production: traces, P99 and capture time from a latency table, the vLLM export, ``glmvit plan``."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from glmvit.__main__ import main
from glmvit.costmodel import LatencyTable, predict_time
from glmvit.deployment import evaluate_budgets, vllm_compilation_config, vllm_frames_needed
from glmvit.geometry import ItemSpec
from glmvit.packing import BudgetConfig, plan_workload
from glmvit.recorded import load_latency_table, recorded_table, table_from_dict
from glmvit.records import LatencySweep, find_one, staleness
from glmvit.traces import MAX_FRAMES, load_trace, parse_trace
from glmvit.workloads import make_item

RECORDED = "data/bench/latency.json"
TRACE = b"request,height,width,frames\nr1,1080,1920,1\nr1,720,1280,16\nr2,224,224,\nr1,448,448,1\n"


@pytest.fixture
def table_path(tmp_path):
    """A synthetic latency table with P99 columns and capture times, made up for these tests only."""
    rows = [{"tokens": t, "graph_ms": 1.0 + 0.004 * t, "eager_ms": 6.0 + 0.005 * t,
             "graph_p99_ms": 2.0 + 0.004 * t, "eager_p99_ms": 9.0 + 0.005 * t} for t in (64, 256, 1024, 4096)]
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"provenance": {"source": "synthetic test table"}, "budgets": rows,
                                "capture": {"64": {"seconds": 0.5}, "4096": {"seconds": 2.5}}}))
    return path


# --- the latency table: P99 columns and capture times -------------------------------------------------------------
def test_the_recorded_table_gives_its_p99_columns_and_capture_times():
    raw = json.loads(open(RECORDED).read())
    table = load_latency_table(RECORDED)
    rows = sorted(raw["budgets"], key=lambda r: r["tokens"])
    for r, base, p99 in zip(rows, table.graph_ms, table.graph_p99_ms, strict=True):  # base + the largest layout tail
        assert p99 == pytest.approx(base + max(x["graph_p99_ms"] - x["graph_ms"] for x in r["layouts"]))
    assert table.capture_s == {int(k): v["seconds"] for k, v in raw["capture"].items()}
    slow = table.p99()
    assert slow.graph_time(4096) == table.graph_p99_ms[-1] and slow.eager_floor_ms >= table.eager_floor_ms


def test_capture_time_is_measured_or_interpolated(table_path):
    table = load_latency_table(table_path)
    assert table.capture_time(64) == 0.5 and table.capture_time(4096) == 2.5
    assert table.capture_time(2080) == pytest.approx(1.5)  # halfway between the two measured budgets
    only_one = LatencyTable((64, 128), (1.0, 2.0), (1.0, 2.0), capture_s={64: 0.5})
    assert only_one.capture_time(64) == 0.5 and only_one.capture_time(128) is None


def test_a_table_without_the_optional_columns_says_unknown():
    rows = [{"tokens": 64, "graph_ms": 1.0, "eager_ms": 2.0}, {"tokens": 128, "graph_ms": 2.0, "eager_ms": 3.0}]
    table = table_from_dict({"budgets": rows})
    assert table.p99() is None and table.capture_time(64) is None
    with pytest.raises(ValueError, match="P99 columns on some budgets only"):  # never half a column, ignored
        table_from_dict({"budgets": [{**rows[0], "graph_p99_ms": 1.5, "eager_p99_ms": 3.0}, rows[1]]})


@pytest.mark.parametrize("data, message", [
    ({"capture": [1, 2]}, "capture: Input should be a valid dictionary"),
    ({"capture": {"64": {"s": 1}}}, "capture.64.seconds: Field required"),
    ({"capture": {"64": {"seconds": -1}}}, "capture.64.seconds: Input should be greater than or equal to 0"),
    ({"capture": {"64": {"seconds": 10**400}}}, "capture.64.seconds: Input should be a valid number"),
    ({"capture": {"64": {"seconds": True}}}, "capture.64.seconds: Input should be a valid number"),
    ({"capture": {" 64": {"seconds": 1.0}}}, r"capture\. 64\.\[key\]: String should match pattern"),
    ({"p99": -1.0}, "budgets.0.graph_p99_ms: Input should be greater than or equal to 0"),
    ({"p99": 0.5}, "budgets.0: Value error, graph_p99_ms 0.5 is below its median graph_ms 1"),
])
def test_bad_optional_columns_are_refused(data, message):
    p99 = data.pop("p99", 1.0)
    rows = [{"tokens": t, "graph_ms": 1.0, "eager_ms": 1.0, "graph_p99_ms": p99, "eager_p99_ms": 1.0}
            for t in (64, 128)]
    with pytest.raises(ValueError, match=message):
        table_from_dict({"budgets": rows, **data})


# --- evaluating a budget set ----------------------------------------------------------------------------------------
def test_evaluate_budgets_matches_the_plans_by_hand(table_path):
    table = load_latency_table(table_path)
    requests = [[ItemSpec(64, 1)] * k for k in range(1, 30)] + [[ItemSpec(5000, 1)]]  # the last one runs eagerly
    config = BudgetConfig((64, 256, 1024, 4096), 8, 8)
    report = evaluate_budgets(requests, config, table)
    totals = [predict_time(p, table).total_ms for p in plan_workload(requests, config)]
    slow = [predict_time(p, table.p99()).total_ms for p in plan_workload(requests, config)]
    assert report.graphs.p99_ms == pytest.approx(np.percentile(totals, 99))
    assert report.graphs.median_ms == pytest.approx(np.median(totals))
    assert report.graphs_at_p99.p99_ms == pytest.approx(np.percentile(slow, 99))
    assert report.graphs_at_p99.p99_ms > report.graphs.p99_ms
    assert report.stats.fallbacks == 1
    per = (0.5 + 2.5) / 2  # the median of the table's two captures; the one-time rest is 0.5 + 2.5 − 2 × per = 0
    assert report.capture_s == pytest.approx(4 * per) and report.capture.one_time_s == pytest.approx(0)
    no_table = evaluate_budgets(requests, config)
    assert no_table.graphs is None and no_table.capture_s is None and no_table.stats == report.stats


# --- the vLLM export --------------------------------------------------------------------------------------------------
def test_vllm_export_has_vllms_keys_and_our_limits():
    config = BudgetConfig((64, 256, 1024), 8, 16)
    assert vllm_compilation_config(config) == {
        "cudagraph_mm_encoder": True, "encoder_cudagraph_token_budgets": [64, 256, 1024],
        "encoder_cudagraph_max_vision_items_per_batch": 8, "encoder_cudagraph_max_frames_per_batch": 16}


def test_vllm_packs_without_a_frame_check_so_the_export_makes_room():
    """Eight 64-token clips of 4 temporal patches fit 512 tokens and 8 items: vLLM puts them in one batch of 32
    segments (on budgets 64…512 no deferral splits them), where our packer (max_segments 8) makes four batches."""
    config = BudgetConfig((64, 128, 256, 512), 8, 8)
    requests = [[ItemSpec(64, 4)] * 8]
    assert max(b.segments for b in plan_workload(requests, config)[0].batches) == 8
    assert vllm_frames_needed(requests, config) == 32


# --- traces -----------------------------------------------------------------------------------------------------------
def test_a_csv_trace_groups_items_by_request():
    requests = parse_trace(TRACE, "t.csv")
    assert [[(i.height, i.width, i.num_frames) for i in r] for r in requests] == [
        [(1080, 1920, 1), (720, 1280, 16), (448, 448, 1)], [(224, 224, 1)]]
    assert requests[0][1] == make_item(720, 1280, 16) and requests[0][1].grid[0] == 8


@pytest.mark.parametrize("name, data", [
    ("t.json", b'[{"height": 224, "width": 224}, {"height": 448, "width": 448, "frames": 8}]'),
    ("t.jsonl", b'{"height": 224, "width": 224}\n\n{"height": 448, "width": 448, "frames": 8}\n'),
    ("t.csv", b"height,width,frames,timestamp\n224,224,1,3.5\n448,448,8,4.0\n"),
])
def test_without_a_request_field_every_record_is_a_request(name, data):
    requests = parse_trace(data, name)
    assert [[(i.height, i.num_frames) for i in r] for r in requests] == [[(224, 1)], [(448, 8)]]


def test_json_requests_may_be_numbers_or_strings():
    data = b'[{"height": 224, "width": 224, "request": 7}, {"height": 224, "width": 224, "request": "7"}]'
    assert [len(r) for r in parse_trace(data, "t.json")] == [2]


@pytest.mark.parametrize("name, data, message", [
    ("t.csv", b"h,w\n1,2\n", "t.csv line 1: the header must name height and width"),
    ("t.csv", b"height,width\n224,224\n224,abc\n", "t.csv line 3: width must be a positive integer, got 'abc'"),
    ("t.csv", b"height,width\n224,0\n", "t.csv line 2: width must be a positive integer, got 0"),
    ("t.csv", b"height,width\n224,\n", "t.csv line 2: width is missing"),
    ("t.csv", b"height,width\n224,22400000\n", "t.csv line 2: aspect ratio of 224×22,400,000 (height×width) exceeds"),
    ("t.csv", f"height,width,frames\n224,224,{MAX_FRAMES + 1}\n".encode(), "t.csv line 2: frames 641 is more"),
    ("t.csv", b"height,width,request\n224,224,\n", "t.csv line 2: request must be a non-empty string"),
    ("t.csv", b"height,width\n1,2,3\n", "t.csv line 2: more values than header columns"),
    ("t.csv", b"height,width\n", "t.csv: no items"),
    ("t.csv", b"\xff\xfe", "t.csv: not UTF-8 text"),
    ("t.jsonl", b'{"height": 224, "width": 224}\nnope\n', "t.jsonl line 2: not valid JSON"),
    ("t.jsonl", b'{"height": 224}\n', "t.jsonl line 1: width is missing"),
    ("t.json", b'{"height": 224}', "t.json: expected a JSON array of item objects, got dict"),
    ("t.json", b'[{"height": 224, "width": 224}, 3]', "t.json record 2: expected an object"),
    ("t.json", b'[{"height": 224.0, "width": 224}]', "t.json record 1: height must be a positive integer"),
    ("t.json", b'[{"height": 224, "width": 224, "request": [1]}]', "t.json record 1: request must be"),
    ("t.txt", b"height,width\n224,224\n", "t.txt: a trace must be .csv, .json, .jsonl"),
])
def test_bad_traces_are_one_line_errors_naming_the_line(name, data, message):
    with pytest.raises(ValueError) as err:
        parse_trace(data, name)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_load_trace_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.csv: no such trace file"):
        load_trace(tmp_path / "missing.csv")


# --- glmvit plan ------------------------------------------------------------------------------------------------------
def test_plan_from_a_trace_compares_exports_and_reports(tmp_path, table_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_bytes(TRACE)
    export, report = tmp_path / "out" / "vllm.json", tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace), "--latency-table", str(table_path), "--budgets", "64,1024,4096",
                 "--max-items", "4", "--max-segments", "16", "--compare", "auto", "--export", str(export),
                 "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "trace " in out and "2 requests, 4 items" in out
    assert "64, 1024, 4096" in out and "64, 128, 256, 512, 1024, 2048, 4096, 8192" in out  # side by side
    assert "P99" in out and "capture time" in out and "s per budget, fitted on " in out
    exported = json.loads(export.read_text())
    assert exported == {"cudagraph_mm_encoder": True, "encoder_cudagraph_token_budgets": [64, 1024, 4096],
                        "encoder_cudagraph_max_vision_items_per_batch": 4,
                        "encoder_cudagraph_max_frames_per_batch": 16}
    assert f"--compilation-config '{json.dumps(exported)}'" in out
    data = json.loads(report.read_text())
    assert [r["token_budgets"] for r in data["reports"]] == [[64, 1024, 4096],
                                                            [64, 128, 256, 512, 1024, 2048, 4096, 8192]]
    assert data["reports"][0]["graphs_ms"]["p99_ms"] > 0 and data["vllm_compilation_config"] == exported


def test_plan_without_a_table_says_times_are_unknown(capsys):
    assert main(["plan", "--workload", "video8x224", "--num-requests", "5", "--latency-table", "none"]) == 0
    out = capsys.readouterr().out
    assert "predicted time" in out and "unknown (no latency table" in out and "graph memory" in out


@pytest.mark.parametrize("mode, compiled", [("graph-compiled", True), ("graph", False)])
def test_plan_predicts_from_the_table_recorded_for_its_mode_and_says_which(mode, compiled, capsys):
    """The table is chosen by what it measured; its file, mode and staleness are printed, and what the plan cannot
    vouch for is a warning: here budgets past the table's measured range (8192 > its largest budget)."""
    _, sweep = find_one(LatencySweep, compiled=compiled)
    assert main(["plan", "--workload", "mixed-img", "--num-requests", "20", "--mode", mode]) == 0
    out, err = capsys.readouterr()
    line = next(x for x in out.splitlines() if x.startswith("times: "))
    assert f"({mode}, {sweep.attn_backend}," in line and sweep.provenance.short_commit in line
    assert ("STALE" in line) == bool(staleness(sweep))
    assert "warning: budgets [8192] lie outside the measured 64..4096 tokens" in err


def test_plan_warns_of_a_table_for_another_tower_and_of_exports_slower_than_eager(tmp_path, capsys):
    slow = [{"tokens": t, "graph_ms": 100.0 + t, "eager_ms": 1.0} for t in (64, 4096)]
    table = tmp_path / "cpu.json"
    table.write_text(json.dumps({"config": "tiny", "dtype": "float32", "provenance": {"device": "cpu"},
                                 "budgets": slow}))
    assert main(["plan", "--num-requests", "5", "--budgets", "64,4096", "--latency-table", str(table)]) == 0
    err = capsys.readouterr().err
    assert "measured the tiny tower in float32, but the plan is for GLM-4.1V in bfloat16" in err
    assert "measured on cpu, not a GPU" in err and "predicted slower than running every request eagerly" in err


def test_plan_export_is_checked_before_planning(tmp_path, capsys):
    folder = tmp_path / "taken.json"
    folder.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--num-requests", "5", "--export", str(folder)])
    assert exc.value.code == 2 and "is a directory" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*"))  # no probe or temporary file left behind


@pytest.mark.parametrize("system", ["vllm", "glmvit"])
def test_plan_prints_the_vllm_config_line_only_for_the_vllm_system(system, capsys):
    """``--compilation-config`` deploys vLLM's runtime; modelling glmvit's runner, the plan does not suggest it."""
    assert main(["plan", "--workload", "video8x224", "--num-requests", "5", "--latency-table", "none",
                 "--system", system]) == 0
    out = capsys.readouterr().out
    assert ("--compilation-config" in out) == (system == "vllm"), out


def test_capture_cost_is_one_time_plus_per_budget():
    """The captures that paid the one-time cost (the first, largest ones) do not set the per-budget cost."""
    from glmvit.costmodel import fit_capture_cost

    cost = fit_capture_cost({1024: 10.0, 768: 6.0, 512: 0.1, 256: 0.1, 64: 0.1}, "a run")
    assert cost is not None and cost.per_budget_s == pytest.approx(0.1) and cost.one_time_s == pytest.approx(15.8)
    assert cost.seconds(2) == pytest.approx(16.0) and fit_capture_cost({64: 1.0}, "one") is None


def test_a_budget_set_without_the_largest_budgets_still_pays_the_start_up(capsys):
    """With the recorded compiled table, the recorded cold start's own budgets are estimated at what it measured,
    and a set without its largest budgets (which paid the compilation when captured first) at most of it, not at
    the small captures' sum."""
    from glmvit.records import StartupRecord, find_one

    _, startup = find_one(StartupRecord)
    cold = startup.runs["blocks-auto-cold"]
    requests = [[ItemSpec(64, 1)] * 3]
    table = recorded_table("graph-compiled")
    whole = evaluate_budgets(requests, BudgetConfig(tuple(startup.budgets), 3, 3), table)
    small = evaluate_budgets(requests, BudgetConfig(tuple(startup.budgets[:3]), 3, 3), table)
    measured = sum(b["seconds"] for b in cold["budgets"].values())
    assert whole.capture_s == pytest.approx(measured)
    smallest_captures = sum(cold["budgets"][str(b)]["seconds"] for b in startup.budgets[:3])
    assert small.capture_s > 0.6 * measured  # most of the start-up ...
    # ... the compilation the largest budget paid when captured first, carried whatever the set, and more than the
    # small captures' own sum
    assert small.capture.one_time_s == pytest.approx(whole.capture.one_time_s)
    assert small.capture.one_time_s > smallest_captures
    assert main(["plan", "--budgets", ",".join(map(str, startup.budgets[:3]))]) == 0
    assert f"≈ {small.capture_s:.2f} s ({small.capture.one_time_s:.2f} s once + 3 × " in capsys.readouterr().out


def test_recorded_tables_are_found_only_where_the_caller_says(tmp_path):
    """Recorded tables come from the directories given (a checkout's data/ by default), never from where the
    package happens to be installed: an empty directory holds none, a copy of a sweep is found there."""
    import shutil

    from glmvit.config import VisionConfig
    from glmvit.random_weights import random_encoder
    from glmvit.recorded import recorded_table_for

    with pytest.raises(ValueError, match="found none"):
        recorded_table("graph", dirs=[tmp_path])
    source = Path(recorded_table("graph").source)
    shutil.copy(source, tmp_path / source.name)
    assert recorded_table("graph", dirs=[tmp_path]).source == str(tmp_path / source.name)
    model = random_encoder(VisionConfig.tiny(), "cpu", torch.float32, 0)
    assert recorded_table_for(model, compiled=False, dirs=[tmp_path]) is None  # not the recorded tower, nor GPU


def test_record_dirs_are_directories_not_characters(tmp_path):
    """``dirs`` given as one path (a str or a Path) is that directory, not its characters (a str once searched "d",
    "a", …, "/" and found nothing); a directory named twice holds each record once, not two of one sweep."""
    import shutil

    from glmvit.recorded import record_dirs, recorded_capture_cost

    source = Path(recorded_table("graph").source)
    shutil.copy(source, tmp_path / source.name)
    for one in (str(tmp_path), tmp_path):
        assert record_dirs(one) == (tmp_path,)
        assert recorded_table("graph", dirs=one).source == str(tmp_path / source.name)
    assert recorded_table("graph", dirs=[tmp_path, str(tmp_path), tmp_path / "."]).source == str(tmp_path / source.name)
    assert recorded_capture_cost(dirs=str(tmp_path)) is None  # no startup record there


def test_a_latency_table_nested_too_deep_is_a_value_error(tmp_path):
    """load_latency_table's every refusal is a ValueError naming the file, as its callers catch (the explorer's
    table argument among them): JSON nested past Python's recursion limit was a RecursionError."""
    from glmvit.recorded import load_latency_table

    for name, data in (("deep.json", b"[" * 100_000), ("latin1.json", b'{"budgets": "\xff"}')):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=f"{name}: not a latency table: not JSON"):
            load_latency_table(tmp_path / name)
