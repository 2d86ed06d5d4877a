"""The budget explorer, driven like a user would: set widget values, click, read the HTML it shows; its file fields
tried as a hostile user would; and its server, started on loopback, refusing requests without the token."""
import datetime
import html
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import ipywidgets as widgets
import pytest

from glmvit.cli.explorer import DEFAULT_PRESET, NO_TABLE, TRACE, BudgetExplorer, explorer
from glmvit.cli.explorer_files import MAX_FILE_BYTES, Workspace, table_from_bytes
from glmvit.cli.explorer_report import OVER, REPLAY, ROUTED, SLOWER, analyse, batch_rows, plan_groups
from glmvit.cli.explorer_serve import MIN_TOKEN_CHARS, build_server, explorer_token, server_urls
from glmvit.deployment import evaluate_budgets, recommend_budgets
from glmvit.packing import BudgetConfig, plan_workload
from glmvit.recorded import recorded_table, table_from_dict
from glmvit.records import tree_hash
from glmvit.traces import parse_trace
from glmvit.workloads import PRESETS, random_mm_workload

ROOT = Path(__file__).resolve().parents[1]
MIXED = "mixed-large"
NOW = datetime.datetime.now(datetime.timezone.utc)
TRACE_CSV = b"request,height,width,frames\nr1,1080,1920,1\nr1,720,1280,16\nr2,224,224,1\n"


def table_json(small_eager_wins: bool = False, **extra) -> dict:
    """A latency table made up for these tests only. ``small_eager_wins``: eager beats a replay below ~600 tokens,
    so glmvit routes small batches and vLLM replays them slower."""
    def row(t):
        graph, eager = (3.0 + 0.004 * t, 0.5 + 0.0085 * t) if small_eager_wins else (1.0 + 0.004 * t, 6.0 + 0.005 * t)
        return {"tokens": t, "graph_ms": graph, "eager_ms": eager, "graph_p99_ms": graph + 1, "eager_p99_ms": eager + 3}

    return {"provenance": {"gpu": "Synthetic GPU", "git_commit": "f" * 40}, "dtype": "bfloat16", "config": "glm41v",
            "budgets": [row(t) for t in (64, 256, 1024, 4096, 8192)],
            "capture": {"64": {"seconds": 0.5}, "8192": {"seconds": 2.5}}, **extra}


@pytest.fixture
def workspace(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    return Workspace(root)


@pytest.fixture
def app(workspace):
    return BudgetExplorer(latency_table=None, workspace=workspace, num_requests=100)  # small: every change re-plans


@pytest.fixture
def table():
    return table_from_dict(table_json())


def with_table(workspace, data=None, name="my_gpu.json"):
    """An explorer predicting from a made-up table given as a file, like ``explorer(latency_table=path)``."""
    path = workspace.root / name
    path.write_text(json.dumps(data or table_json()))
    return BudgetExplorer(latency_table=path, workspace=workspace, num_requests=100)


def specs(requests):
    return [[item.spec for item in request] for request in requests]


def preset_requests(app):
    p = PRESETS[app.preset.value]
    return random_mm_workload(p.bucket_config, app.num_requests.value, app.items_per_request.value, p.range_ratio,
                              app.seed.value, p.limit_per_request)


def times(summary):
    return f"{summary.median_ms:.2f} · {summary.mean_ms:.2f} · {summary.p99_ms:.2f}"


AUTO = BudgetConfig((64, 128, 256, 512, 1024, 2048, 4096, 8192), 64, 8192)  # vLLM's auto, segments capped


# ---- what it shows -------------------------------------------------------------------------------------------------
def test_default_view_predicts_vllm_from_the_recorded_compiled_table_and_says_what_that_table_is():
    app = BudgetExplorer()
    table = recorded_table("graph-compiled")
    assert app.preset.value == DEFAULT_PRESET == "mixed-av" and app.system.value == "vllm"
    assert app.table is not None and app.table.mode == "graph-compiled" and app.table.source == table.source
    info = html.unescape(app.table_info.value)
    prov = table.provenance
    for fact in (Path(table.source).name, "runner mode: graph-compiled", "compiled: yes",
                 f"attention: {table.attention}", f"GPU: {prov['gpu']}",
                 f"commit: {prov['git_commit'][:7]}", f"recorded: {prov['date_utc'][:10]}"):
        assert fact in re.sub("<[^>]+>", "", info), fact
    warnings = html.unescape(app.warnings.value)
    assert (table.describe() in warnings) == bool(table.changed)  # the sweeps of an old commit show as STALE
    assert ("STALE" in info) == bool(table.changed)
    assert ("are extrapolated" in warnings) == (table.tokens[-1] < 8192)
    report = evaluate_budgets(specs(preset_requests(app)), AUTO, table, packer="vllm", route=False)
    assert f"<b>{times(report.graphs)}</b>" in app.summary.value and "vLLM 0.33" in app.summary.value
    assert "64 items, 8,192 segments" in app.summary.value
    assert bytes(app.picture.value).startswith(b"<?xml") and b"<svg" in bytes(app.picture.value)
    assert app.picture.format == "svg+xml"
    export = html.unescape(app.export_text.value)
    assert '"encoder_cudagraph_token_budgets": [\n  64,' in export and f"{times(report.graphs)} ms/request" in export


def test_without_a_table_it_shows_packing_but_invents_no_times(app):
    assert app.message.value == "" and app.table is None
    assert "unknown (no latency table" in app.summary.value and "no latency table" in app.table_info.value
    assert "no routing" in app.routing.value and "ms/request" not in app.summary.value


@pytest.mark.parametrize("system, packer, route", [("vllm", "vllm", False), ("glmvit", "ffd", True)])
@pytest.mark.parametrize("per", ["request", "step"])
def test_numbers_follow_the_controls(workspace, system, packer, route, per):
    app = with_table(workspace)
    app.preset.value = MIXED
    app.system.value, app.per.value = system, per
    app.budgets.value = "256, 1024, 4096"
    app.max_items.value, app.max_segments.value = 4, "16"
    config = BudgetConfig((256, 1024, 4096), 4, 16)
    report = evaluate_budgets(specs(preset_requests(app)), config, app.table, packer=packer, route=route, per=per)
    assert f"<b>{times(report.graphs)}</b>" in app.summary.value
    assert f"<b>{times(report.eager)}</b>" in app.summary.value
    assert "4 items, 16 segments" in app.summary.value
    assert app.step_tokens.disabled == (per == "request")
    if per == "step":
        assert f"{report.groups} steps of ≤ 8,192 vision tokens" in app.summary.value


def test_steps_follow_the_step_budget(workspace):
    app = with_table(workspace)
    app.per.value = "step"
    app.step_tokens.value = 2048
    report = evaluate_budgets(specs(preset_requests(app)), AUTO, app.table, packer="vllm", per="step",
                              step_tokens=2048)
    assert f"{report.groups} steps of ≤ 2,048 vision tokens" in app.summary.value
    assert f"<b>{times(report.graphs)}</b>" in app.summary.value


def test_routing_is_shown_per_batch_and_matches_the_runners_rule(workspace):
    """glmvit replays a batch only where graph_time ≤ eager_time (EncoderGraphRunner); vLLM replays them all."""
    app = with_table(workspace, table_json(small_eager_wins=True))
    app.preset.value = "img1x224"  # 64-token batches: eager wins by the made-up table
    requests = specs(preset_requests(app))
    plans = plan_workload(requests, AUTO, "ffd")
    eager_wins = sum(app.table.eager_time(b.tokens, b.segment_rows2) < app.table.graph_time(b.budget, b.segment_rows2)
                     for p in plans for b in p.batches)
    assert eager_wins == len(requests)  # every batch: the test's premise
    assert f"{eager_wins} replayed ({eager_wins} predicted faster eagerly)" in app.summary.value  # vLLM
    assert SLOWER in app.routing.value and "vLLM replays every batch" in app.routing.value
    app.system.value = "glmvit"
    assert f"0 replayed, {eager_wins} routed to eager" in app.summary.value
    assert ROUTED in app.routing.value and f"{eager_wins} of {eager_wins} batches" in app.routing.value
    routed = evaluate_budgets(requests, AUTO, app.table, packer="ffd", route=True)
    assert f"<b>{times(routed.graphs)}</b>" in app.summary.value
    assert routed.graphs.mean_ms == pytest.approx(routed.eager.mean_ms)  # all routed: graphs cost what eager does
    assert "predicted slower than running every request eagerly" not in app.warnings.value
    app.system.value = "vllm"
    assert "vllm is predicted slower than running every request eagerly" in app.warnings.value
    assert "vLLM is predicted slower with these graphs than without" in app.export_text.value


def test_batch_rows_are_the_common_shapes_and_every_way_of_running(table):
    config = BudgetConfig((64, 256), 8, 64)  # mixed-large has items above 256 tokens: they run eagerly
    requests = specs(PRESETS[MIXED].requests(200, seed=3))
    analysis = analyse(requests, config, table, "glmvit")
    rows = batch_rows(analysis, limit=3)
    counts = [r.count for r in rows[:3]]
    assert counts == sorted(counts, reverse=True) and sum(r.count for r in rows) <= len(analysis.batches)
    assert OVER in {r.runs for r in rows} and max(r.tokens for r in rows) == max(b.tokens for b in analysis.batches)
    for r in rows:  # the made-up table has no attention fit: times depend on tokens and budget alone
        assert r.replay_ms == (None if r.budget is None else pytest.approx(table.graph_time(r.budget)))
        assert r.eager_ms == pytest.approx(table.eager_time(r.tokens))
    assert {r.runs for r in rows} <= {REPLAY, ROUTED, OVER}


@pytest.mark.parametrize("per", ["request", "step"])
def test_plan_groups_index_the_items_each_plan_packs(per):
    requests = specs(PRESETS["mixed-av"].requests(60, seed=1))
    config = BudgetConfig((64, 256, 1024, 4096), 16, 64)
    groups = plan_groups(requests, config, "vllm", per, 4096)
    for group in groups:
        for plan, items in group:
            assert sorted(i for b in plan.batches for i in b.item_indices) == list(range(len(items)))
            for b in plan.batches:
                assert sum(items[i].tokens for i in b.item_indices) == b.tokens
    assert sum(len(items) for g in groups for _, items in g) == sum(map(len, requests))


def test_the_chart_is_a_reproducible_svg(app):
    first = bytes(app.picture.value)
    app.budgets.value = "64, 128"
    app.budgets.value = "auto"
    assert bytes(app.picture.value) == first and b"<text" in first  # text kept as text: sharp at any zoom


def test_preset_sets_items_per_request(app):
    app.preset.value = MIXED
    assert app.items_per_request.value == PRESETS[MIXED].items_per_request
    assert {len(r) for r in preset_requests(app)} == {1, 2, 3, 4}


def test_frame_limit_sends_videos_to_eager(app):
    app.preset.value = "video8x224"
    assert ", 0 over the limits" in app.summary.value
    app.max_items.value, app.max_segments.value = 1, "2"  # a video of 8 frames has 4 temporal patches
    assert f", {app.num_requests.value} over the limits" in app.summary.value
    assert OVER in app.routing.value


@pytest.mark.parametrize("budgets, max_items, max_segments, message", [
    ("64, abc", 8, "8", "budget &#x27;abc&#x27; is not an integer"),
    ("32, 128", 64, "64", "max_items=64 exceeds the smallest budget 32"),
    ("0, 128", 8, "8", "budget 0 is not in [1, 131,072] tokens"),
    ("64, 1000000000", 8, "8", "budget 1,000,000,000 is not in [1, 131,072] tokens"),
    ("64, 128", 8, "200", "max_segments=200 exceeds the largest budget 128"),
    ("auto", 16, "8", "max_segments=8 is below max_items=16"),
    ("auto", 16, "-3", "max segments &#x27;-3&#x27; is not a positive integer or &#x27;auto&#x27;"),
    ("auto", 16, "9" * 400, "is not a positive integer"),
])
def test_bad_input_shows_a_message_not_a_traceback(app, budgets, max_items, max_segments, message):
    app.max_items_auto.value = False  # the slider's value as it is, even where it already shows it
    app.max_items.value, app.max_segments.value, app.budgets.value = max_items, max_segments, budgets
    assert "glmvit-error" in app.message.value and message in app.message.value
    assert app.summary.value == "" and bytes(app.picture.value) == b"" and app.export_text.value == ""
    app.max_items.value, app.max_segments.value, app.budgets.value = 8, "auto", "auto"
    assert app.message.value == "" and "64, 128" in app.summary.value


def test_recommend_fills_the_budgets_field(app):
    app.preset.value = MIXED
    app.max_graphs.value = 4
    app.recommend.click()
    expected = recommend_budgets(specs(preset_requests(app)), 4, max_items=64, max_segments=8192, packer="vllm")
    assert app.budgets.value == ", ".join(map(str, expected))
    assert f"<b>{app.budgets.value}</b>" in app.summary.value
    assert "minimising predicted padding (vllm packer" in app.message.value


def test_recommend_by_time_with_a_table(workspace):
    app = with_table(workspace)
    app.system.value = "glmvit"
    app.recommend.click()
    assert "minimising predicted time (ffd packer" in app.message.value


def test_recommend_reports_an_impossible_memory_limit(app):
    app.memory_gib.value = 0.01
    app.recommend.click()
    assert "no budget set fits in memory_limit_bytes" in app.message.value
    assert app.budgets.value == "auto"


def test_a_second_budget_set_is_shown_beside_the_first(workspace):
    app = with_table(workspace)
    app.preset.value = MIXED
    app.compare.value = "256, 1024, 4096"
    assert "budget set A" in app.summary.value and "budget set B" in app.summary.value
    requests = specs(preset_requests(app))
    for config in (AUTO, BudgetConfig((256, 1024, 4096), 128, 4096)):  # max items auto: each set's own, as plan's
        report = evaluate_budgets(requests, config, app.table, packer="vllm")
        assert f"<b>{report.stats.padding_fraction:.1%} of replayed tokens ({report.stats.padded_tokens} tokens)</b>" \
            in app.summary.value
        assert f"<b>{times(report.graphs)}</b>" in app.summary.value
    app.max_items_auto.value = False  # the slider's 64 for both sets
    app.compare.value = "32, 64"
    assert "compare with: max_items=64 exceeds the smallest budget 32" in html.unescape(app.message.value)
    app.compare.value = ""
    assert "budget set B" not in app.summary.value


# ---- tables --------------------------------------------------------------------------------------------------------
def test_the_table_selector_switches_between_recorded_tables_and_none(tmp_path):
    app = BudgetExplorer(workspace=Workspace(tmp_path), num_requests=100)
    app.table_choice.value = "recorded:graph"
    uncompiled = recorded_table("graph")
    assert app.table.source == uncompiled.source and "runner mode: <b>graph</b>" in app.table_info.value
    assert "compiled: <b>no</b>" in app.table_info.value
    report = evaluate_budgets(specs(preset_requests(app)), AUTO, uncompiled, packer="vllm")
    assert f"<b>{times(report.graphs)}</b>" in app.summary.value
    app.table_choice.value = NO_TABLE
    assert "unknown (no latency table" in app.summary.value


def test_a_table_file_in_the_workspace_is_added_and_selected(app, workspace):
    (workspace.root / "gpu.json").write_text(json.dumps(table_json()))
    app.table_path.value = "gpu.json"
    assert app.message.value == "" and app.table_choice.label == "yours: gpu.json"
    assert "file: <b>gpu.json</b>" in app.table_info.value and "GPU: <b>Synthetic GPU</b>" in app.table_info.value
    assert "every batch at its P99 latency" in app.summary.value and "≈ " in app.summary.value
    assert "status: <b>unknown (a plain table" in app.table_info.value and "a plain one" in app.warnings.value


@pytest.mark.parametrize("current", [True, False])
def test_a_recorded_sweep_says_whether_the_code_changed_since(app, current):
    """The status comes from the sweep's fingerprint against this tree (glmvit.records.staleness)."""
    sweep = json.loads(Path(recorded_table("graph-compiled").source).read_text())
    digest = tree_hash("glmvit.costmodel") if current else "0" * 16
    sweep["fingerprint"] = {"modules": {"glmvit.costmodel": digest}}
    app.table_upload.value = ({"name": "sweep.json", "type": "", "size": 10, "last_modified": NOW,
                               "content": memoryview(json.dumps(sweep).encode())},)
    assert "runner mode: <b>graph-compiled</b>" in app.table_info.value
    if current:
        assert "status: <b>current</b>" in app.table_info.value and "STALE" not in app.warnings.value
    else:
        assert "status: <b>STALE: glmvit.costmodel changed since</b>" in app.table_info.value
        assert "re-record it on the GPU" in app.warnings.value


def test_an_uploaded_table_is_added_and_a_bad_one_says_why(app):
    app.table_upload.value = ({"name": "up.json", "type": "", "size": 10, "last_modified": NOW,
                               "content": memoryview(json.dumps(table_json()).encode())},)
    assert app.table_choice.label == "yours: up.json" and "P99" in app.summary.value
    app.table_upload.value = ({"name": "bad.json", "type": "", "size": 10, "last_modified": NOW,
                               "content": memoryview(b'{"budgets": [], "provenance": 5}')},)
    assert "latency table unusable: bad.json: not a latency table" in html.unescape(app.message.value)
    assert app.table_choice.label == "yours: up.json"  # the good one stays


@pytest.mark.parametrize("data, message", [
    (table_json(config="tiny"), "measured the &#x27;tiny&#x27; tower, not GLM-4.1V"),
    (table_json(provenance={}), "the table names no GPU"),
])
def test_tables_out_of_their_depth_are_flagged(workspace, data, message):
    app = with_table(workspace, data)
    assert message in app.warnings.value


def test_an_extrapolated_budget_is_flagged(workspace):
    app = with_table(workspace)
    assert "extrapolated" not in app.warnings.value  # the made-up table measured 8192
    app.budgets.value = "64, 16384"
    assert "budgets 16384 lie above the largest measured (8192)" in app.warnings.value


def test_an_unusable_table_given_in_code_is_reported(tmp_path):
    app = BudgetExplorer(latency_table=tmp_path / "missing.json", workspace=Workspace(tmp_path), num_requests=100)
    assert "latency table unusable" in app.message.value and app.table is None
    assert "unknown (no latency table" in app.summary.value


@pytest.mark.parametrize("data", [
    b"\xff\xfe", b"[" * 100_000, b'{"kind": "latency"}', b'{"budgets": 5}',
    json.dumps(table_json(budgets=[{"tokens": 10**400, "graph_ms": 1, "eager_ms": 2},
                                   {"tokens": 10**401, "graph_ms": 1, "eager_ms": 2}])).encode(),
    json.dumps(table_json(capture={"9" * 400: {"seconds": 1}})).encode(),
])
def test_table_from_bytes_refuses_what_is_not_a_usable_table_naming_the_upload(data):
    with pytest.raises(ValueError, match=r"^x\.json: not a latency table"):
        table_from_bytes(data, "x.json")


def test_table_from_bytes_names_the_table_after_the_upload():
    assert table_from_bytes(json.dumps(table_json()).encode(), "t.json").source == "t.json"


# ---- files: what a hostile user can type ----------------------------------------------------------------------------
def test_a_trace_path_becomes_the_workload(app, workspace):
    (workspace.root / "traffic.csv").write_bytes(TRACE_CSV)
    app.trace_path.value = str(workspace.root / "traffic.csv")
    assert app.preset.value == TRACE and "traffic.csv (2 requests, 3 items)" in app.preset.label
    assert app.num_requests.disabled and app.seed.disabled
    tokens = sum(item.spec.tokens for request in parse_trace(TRACE_CSV, "t.csv") for item in request)
    assert f"2 requests, 3 items (1 video), {tokens:,} tokens" in app.summary.value
    app.preset.value = MIXED
    assert not app.num_requests.disabled and "100 requests" in app.summary.value


@pytest.mark.parametrize("make, text, message", [
    (None, "/etc/passwd", "is outside"),
    (None, "../outside.csv", "is outside"),
    (lambda root: (root / ".hidden").mkdir() or (root / ".hidden" / "t.csv").write_bytes(TRACE_CSV),
     ".hidden/t.csv", "hidden files and folders are off limits"),
    (lambda root: (root / "t.txt").write_bytes(TRACE_CSV), "t.txt", "must end in .csv, .json, .jsonl"),
    (lambda root: (root / "link.csv").symlink_to(root.parent / "secret.csv"), "link.csv", "is outside"),
    (lambda root: os.mkfifo(root / "fifo.csv"), "fifo.csv", "not a regular file"),
    (lambda root: (root / "big.csv").write_bytes(b"height,width\n" + b"224,224\n" * (MAX_FILE_BYTES // 8)),
     "big.csv", "larger than 16 MiB"),
    (None, "missing.csv", "cannot read it"),
])
def test_file_fields_read_only_small_regular_files_inside_the_workspace(app, workspace, make, text, message):
    (workspace.root.parent / "secret.csv").write_bytes(TRACE_CSV)
    (workspace.root.parent / "outside.csv").write_bytes(TRACE_CSV)
    if make:
        make(workspace.root)
    app.trace_path.value = text
    assert message in html.unescape(app.message.value) and app.preset.value != TRACE
    app.table_path.value = text.replace(".csv", ".json")
    assert "latency table unusable" in app.message.value


def test_a_trace_with_too_many_items_is_refused(app, workspace):
    (workspace.root / "many.csv").write_bytes(b"height,width\n" + b"224,224\n" * 100_001)
    app.trace_path.value = "many.csv"
    assert "100,001 items; the explorer re-plans on every change" in html.unescape(app.message.value)


def test_an_uploaded_trace_becomes_the_workload_and_bad_ones_say_where(app):
    app.upload.value = ({"name": "up.jsonl", "type": "", "size": 10, "last_modified": NOW,
                         "content": memoryview(b'{"height": 448, "width": 448}\n{"height": 224, "width": 224}\n')},)
    assert app.preset.value == TRACE and "2 requests, 2 items (0 videos), 320 tokens" in app.summary.value
    app.upload.value = ({"name": "bad.csv", "type": "", "size": 10, "last_modified": NOW,
                         "content": memoryview(b"height,width\n224,-3\n")},)
    assert "bad.csv line 2: width must be a positive integer" in html.unescape(app.message.value)


def test_export_writes_the_vllm_config_in_the_workspace(app, workspace):
    app.budgets.value = "64, 256, 1024"
    app.max_items.value, app.max_segments.value = 8, "16"
    app.export_path.value = "vllm.json"
    app.export.click()
    expected = {"cudagraph_mm_encoder": True, "encoder_cudagraph_token_budgets": [64, 256, 1024],
                "encoder_cudagraph_max_vision_items_per_batch": 8, "encoder_cudagraph_max_frames_per_batch": 16}
    assert json.loads((workspace.root / "vllm.json").read_text()) == expected
    assert "wrote" in app.message.value and "--compilation-config" in app.message.value
    app.budgets.value = "64, 512"
    app.export.click()  # an earlier export is replaced
    assert json.loads((workspace.root / "vllm.json").read_text())["encoder_cudagraph_token_budgets"] == [64, 512]
    assert "download it" in app.export_text.value and "data:application/json;base64," in app.export_text.value


@pytest.mark.parametrize("make, name, message", [
    (None, "../up.json", "without folders"),
    (None, "/tmp/x.json", "without folders"),
    (None, "sub/x.json", "without folders"),
    (None, "x.sh", "ending in .json"),
    (None, ".x.json", "ending in .json"),
    (lambda root: (root / "record.json").write_text('{"kind": "latency"}'), "record.json",
     "is not an earlier export; not replacing it"),
    (lambda root: (root / "link.json").symlink_to(root.parent / "target.json"), "link.json", "not a regular file"),
    (lambda root: (root / "dir.json").mkdir(), "dir.json", "not a regular file"),
    (lambda root: os.mkfifo(root / "fifo.json"), "fifo.json", "not a regular file"),
])
def test_export_never_writes_outside_the_workspace_or_over_other_files(app, workspace, make, name, message):
    target = workspace.root.parent / "target.json"
    target.write_text("precious")
    if make:
        make(workspace.root)
    before = {p.name: p.lstat().st_mode for p in workspace.root.iterdir()}
    app.export_path.value = name
    app.export.click()
    assert message in html.unescape(app.message.value)
    assert target.read_text() == "precious" and not (workspace.root.parent / "up.json").exists()
    assert {p.name: p.lstat().st_mode for p in workspace.root.iterdir()} == before
    if name == "record.json":
        assert (workspace.root / "record.json").read_text() == '{"kind": "latency"}'


def test_the_workspace_defaults_to_the_environment_then_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("GLMVIT_EXPLORER_DIR", str(tmp_path))
    assert Workspace.default().root == tmp_path.resolve()
    monkeypatch.delenv("GLMVIT_EXPLORER_DIR")
    monkeypatch.chdir(tmp_path)
    assert Workspace.default().root == tmp_path.resolve()


def test_explorer_returns_the_widget(tmp_path):
    assert isinstance(explorer(tmp_path / "missing.json"), widgets.VBox)


# ---- serving: a token on every page ----------------------------------------------------------------------------------
def test_the_token_is_the_users_or_a_random_one_and_never_short():
    token, chosen = explorer_token({})
    assert not chosen and len(token) >= MIN_TOKEN_CHARS and token != explorer_token({})[0]
    assert explorer_token({"JUPYTER_TOKEN": "x" * 20}) == ("x" * 20, True)
    for short in ("", "   ", "short"):
        with pytest.raises(ValueError, match="at least 16"):
            explorer_token({"JUPYTER_TOKEN": short})


@pytest.mark.parametrize("arg", ["--token", "--Voila.token=", "--Voila.auto_token=False",
                                 "--Voila.identity_provider_class=x", "--VoilaConfiguration.file_allowlist=['.*']"])
def test_the_server_refuses_options_that_touch_authentication(arg):
    with pytest.raises(ValueError, match="sets its own authentication"):
        build_server(["notebooks/explorer.ipynb", arg], "x" * 20)


def test_server_urls_carry_the_token_and_name_a_reachable_host():
    assert server_urls("127.0.0.1", 8866, "t" * 20, False) == [f"http://127.0.0.1:8866/?token={'t' * 20}"]
    assert server_urls("0.0.0.0", 8866, "t" * 20, True) == [
        f"http://{socket.gethostname()}:8866/?token=<your JUPYTER_TOKEN>", "http://127.0.0.1:8866/?token=<your "
                                                                           "JUPYTER_TOKEN>"]


def needs_voila():
    pytest.importorskip("voila")


def test_on_every_address_and_whatever_the_config_files_say_the_token_is_set(tmp_path, monkeypatch):
    """HOST=0.0.0.0 changes only where it listens; a voila.json in the directory (Voilà reads config from the current
    directory) that empties the token or allows files does not survive. Nothing listens: the server is not started."""
    needs_voila()
    (tmp_path / "voila.json").write_text(json.dumps({"Voila": {"token": "", "auto_token": False},
                                                     "VoilaConfiguration": {"file_allowlist": [".*"]}}))
    monkeypatch.chdir(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)  # Voilà's initialize takes SIGTERM over
    try:
        app = build_server([str(ROOT / "notebooks" / "explorer.ipynb"), "--Voila.ip=0.0.0.0", "--port=9"], "s" * 24)
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert (app.ip, app.token, app.auto_token, app.voila_configuration.file_allowlist, app.port_retries) == \
        ("0.0.0.0", "s" * 24, False, [], 0)


def test_a_pages_kernel_is_shut_down_once_no_page_uses_it(tmp_path, monkeypatch):
    """Voilà never shuts a page's kernel down: the explorer culls kernels idle with no page connected (the kernel
    manager Voilà makes at start reads this config), unless Voilà was told otherwise."""
    from glmvit.cli.explorer_serve import KERNEL_CULL_INTERVAL_S, KERNEL_IDLE_S

    needs_voila()
    monkeypatch.chdir(tmp_path)
    handler = signal.getsignal(signal.SIGTERM)
    notebook = str(ROOT / "notebooks" / "explorer.ipynb")
    try:
        app = build_server([notebook, "--port=9"], "s" * 24)
        chosen = build_server([notebook, "--port=9", "--MappingKernelManager.cull_idle_timeout=7"], "s" * 24)
    finally:
        signal.signal(signal.SIGTERM, handler)
    culling = app.config.MappingKernelManager
    assert (culling.cull_idle_timeout, culling.cull_interval) == (KERNEL_IDLE_S, KERNEL_CULL_INTERVAL_S)
    assert not culling.get("cull_connected", False)  # a page left open keeps its kernel
    assert str(chosen.config.MappingKernelManager.cull_idle_timeout) == "7"  # read as the trait decides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate a server started by a test; kill it if it has not exited after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def status(url: str, method: str = "GET") -> tuple[int, str]:
    """(status, Location) of one request, reading no body (a page with the token starts a kernel)."""
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(urllib.request.Request(url, method=method), timeout=30) as response:
            return response.status, response.headers.get("Location", "")
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Location", "")


def test_the_served_page_refuses_requests_without_the_token(tmp_path):
    """make explorer's command on loopback, started beside a voila.json that empties the token and allows every
    file: no token, a wrong one → the login page; the kernel API → 403; Voilà's file route → 403 (not allowlisted,
    not a 404); the token it printed → the page. Bounded: 90 s to listen, then a handful of requests."""
    needs_voila()
    (tmp_path / "voila.json").write_text(json.dumps({"Voila": {"token": ""},
                                                     "VoilaConfiguration": {"file_allowlist": [".*"]}}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "JUPYTER_TOKEN"}
    env.update(PYTHONPATH=str(ROOT), GLMVIT_EXPLORER_DIR=str(tmp_path))
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "glmvit.cli.explorer_serve",
                                 str(ROOT / "notebooks" / "explorer.ipynb"), "--no-browser", "--Voila.ip=127.0.0.1",
                                 f"--port={port}"], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not (_printed_url(log.read_text(), port) and _listening(port)):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"not listening on {port} within 90 s:\n{log.read_text()}"
            time.sleep(0.25)
        url = _printed_url(log.read_text(), port)
        token = url.split("token=")[1]
        assert len(token) >= MIN_TOKEN_CHARS and "make explorer" in log.read_text()
        base = f"http://127.0.0.1:{port}"
        for path in ("/", "/?token=" + "w" * 32):
            code, location = status(base + path)
            assert code == 302 and location.startswith("/login"), (path, code, location)
        assert status(f"{base}/voila/files/anything.png?token={token}")[0] == 403  # given nothing to serve
        assert f"only in {tmp_path}" in log.read_text()  # the workspace: GLMVIT_EXPLORER_DIR
        assert status(f"{base}/api/kernels/00000000-0000-0000-0000-000000000000")[0] == 403
        assert status(f"{base}/voila/api/shutdown/00000000-0000-0000-0000-000000000000", "POST")[0] == 403
        with urllib.request.urlopen(f"{base}/login?next=%2F", timeout=30) as response:
            page = response.read().decode()
        assert "make explorer" in page and "?token=" in page and "jupyter server list" not in page
        assert status(url)[0] == 200
    finally:
        stop_server(proc)


def _printed_url(text: str, port: int) -> str:
    urls = re.findall(rf"^    (http://127\.0\.0\.1:{port}/\?token=\S+)$", text, re.M)
    return urls[0] if urls else ""


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("budgets", [(256, 1024), (64, 128, 4096), (16, 32), (1024, 8192)])
def test_plan_its_help_and_the_explorer_give_the_same_default_max_items(app, tmp_path, budgets, capsys):
    """One rule (glmvit.packing.default_max_items) decides max items when none is given: plan resolves it, its
    --help states it, and the explorer's "auto" uses it and shows it on the slider."""
    from glmvit.cli.plan import main as plan_main
    from glmvit.packing import default_max_items

    text = ",".join(map(str, budgets))
    assert plan_main(["--workload", "mixed-av", "--num-requests", "5", "--budgets", text,
                      "--export", str(tmp_path / "x.json")]) == 0
    planned = json.loads((tmp_path / "x.json").read_text())["encoder_cudagraph_max_vision_items_per_batch"]
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    rule = re.search(r"--max-items MAX_ITEMS items per batch .*?min\((\d+) // (\d+), smallest budget\)", help_text)
    hi, lo = map(int, rule.groups())
    app.budgets.value = text
    explored = app._configs()[0].max_items
    assert planned == explored == min(hi // lo, budgets[0]) == default_max_items(budgets) == app.max_items.value
    assert app.max_items_auto.value


def test_the_committed_explorer_picture_draws_what_the_explorer_computes_now():
    """notebooks/explorer_pr40576.png is committed beside the notebook, and the numbers it draws (the JSON beside it)
    are what tools/explorer_picture.py gets from the explorer now: a change to packing, the cost model, the recorded
    table or the page fails here until the picture is redrawn."""
    from tools.explorer_picture import NUMBERS, PICTURE, draw, numbers

    assert PICTURE.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", PICTURE
    committed = json.loads(NUMBERS.read_text())
    assert committed == numbers(), "the picture is stale: run python tools/explorer_picture.py"
    assert [s["name"] for s in committed["sets"]] == ["PR 40576", "auto (vLLM)", "Recommend"]
    assert len(draw(committed).axes) == 5  # four panels and the budgets below them
