"""The budget explorer's wiring, driven like a user would: set widget values, click, read the HTML it shows."""
import datetime
import html
import json

import ipywidgets as widgets
import pytest

from glmvit.cli.explorer import TRACE, BudgetExplorer, explorer
from glmvit.costmodel import load_latency_table
from glmvit.deployment import evaluate_budgets, recommend_budgets
from glmvit.packing import BudgetConfig, combined_stats, plan_workload
from glmvit.traces import parse_trace
from glmvit.workloads import PRESETS, random_mm_workload

MIXED = "mixed-large"


@pytest.fixture
def app():
    return BudgetExplorer(latency_table=None)


@pytest.fixture
def table_path(tmp_path):
    """A synthetic latency table, made up for this test only."""
    rows = [{"tokens": t, "graph_ms": 1.0 + 0.004 * t, "eager_ms": 6.0 + 0.005 * t,
             "graph_p99_ms": 2.0 + 0.004 * t, "eager_p99_ms": 9.0 + 0.005 * t} for t in (64, 256, 1024, 4096)]
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"provenance": {"source": "synthetic test table"}, "dtype": "bfloat16",
                                "config": "glm41v", "budgets": rows,
                                "capture": {"64": {"seconds": 0.5}, "4096": {"seconds": 2.5}}}))
    return path


NOW = datetime.datetime.now(datetime.timezone.utc)
TRACE_CSV = b"request,height,width,frames\nr1,1080,1920,1\nr1,720,1280,16\nr2,224,224,1\n"


def specs(requests):
    return [[item.spec for item in request] for request in requests]


def preset_requests(app):
    p = PRESETS[app.preset.value]
    return random_mm_workload(p.bucket_config, app.num_requests.value, app.items_per_request.value, p.range_ratio,
                              app.seed.value, p.limit_per_request)


def test_initial_view_shows_auto_budgets_without_inventing_times(app):
    assert app.message.value == ""
    assert "64, 128, 256, 512, 1024, 2048, 4096" in app.summary.value
    assert "1000 requests, 1000 items, 64000 tokens" in app.summary.value
    assert "unknown (no latency table" in app.summary.value
    assert bytes(app.picture.value).startswith(b"\x89PNG")
    assert '&quot;encoder_cudagraph_token_budgets&quot;: [64, 128, 256, 512, 1024, 2048, 4096]' in app.export_text.value


@pytest.mark.parametrize("packer", ["ffd", "vllm"])
def test_numbers_follow_the_controls(app, packer):
    app.preset.value = MIXED
    app.packer.value = packer
    app.budgets.value = "256, 1024, 4096"
    app.max_items.value = 4
    app.max_segments.value = 4
    stats = combined_stats(plan_workload(specs(preset_requests(app)), BudgetConfig((256, 1024, 4096), 4, 4), packer))
    assert f"<b>{stats.batches} (" in app.summary.value
    assert f"{stats.padding_fraction:.1%} of replayed tokens ({stats.padded_tokens} tokens" in app.summary.value
    assert "4 items, 4 segments" in app.summary.value


def test_preset_sets_items_per_request(app):
    app.preset.value = MIXED
    assert app.items_per_request.value == PRESETS[MIXED].items_per_request
    sizes = {len(r) for r in preset_requests(app)}
    assert sizes == {1, 2, 3, 4}


def test_frame_limit_sends_videos_to_eager(app):
    app.preset.value = "video8x224"
    eager = "eager items (over the limits)</td><td style='padding-right:1em'><b>"
    assert eager + "0<" in app.summary.value
    app.max_items.value, app.max_segments.value = 1, 2  # a video of 8 frames has 4 temporal patches
    assert eager + "1000<" in app.summary.value


@pytest.mark.parametrize("budgets, max_items, max_segments, message", [
    ("64, abc", 8, 8, "budget &#x27;abc&#x27; is not an integer"),
    ("32, 128", 64, 64, "max_items=64 exceeds the smallest budget 32"),
    ("0, 128", 8, 8, "budget 0 is not in [1, 131,072] tokens"),
    ("64, 1000000000", 8, 8, "budget 1,000,000,000 is not in [1, 131,072] tokens"),
    ("64, 128", 8, 200, "max_segments=200 exceeds the largest budget 128"),
    ("auto", 16, 8, "max_segments=8 is below max_items=16"),
])
def test_bad_input_shows_a_message_not_a_traceback(app, budgets, max_items, max_segments, message):
    app.max_items.value, app.max_segments.value, app.budgets.value = max_items, max_segments, budgets
    assert "glmvit-error" in app.message.value and message in app.message.value
    assert app.summary.value == "" and bytes(app.picture.value) == b"" and app.export_text.value == ""
    app.max_items.value, app.max_segments.value, app.budgets.value = 8, 8, "auto"
    assert app.message.value == "" and "64, 128" in app.summary.value


def test_recommend_fills_the_budgets_field(app):
    app.preset.value = MIXED
    app.max_graphs.value = 4
    app.recommend.click()
    expected = recommend_budgets(specs(preset_requests(app)), 4, max_items=64, max_segments=64)
    assert app.budgets.value == ", ".join(map(str, expected))
    assert f"<b>{app.budgets.value}</b>" in app.summary.value
    assert "minimising predicted padding" in app.message.value


def test_recommend_reports_an_impossible_memory_limit(app):
    app.memory_gib.value = 0.01
    app.recommend.click()
    assert "no budget set fits in memory_limit_bytes" in app.message.value
    assert app.budgets.value == "auto"


def test_latency_table_gives_p99_capture_time_and_time_objective(table_path):
    app = BudgetExplorer(latency_table=table_path)
    report = evaluate_budgets(specs(preset_requests(app)), BudgetConfig.resolve(), load_latency_table(table_path))
    g = report.graphs
    assert f"{g.median_ms:.2f} · {g.mean_ms:.2f} · {g.p99_ms:.2f}" in app.summary.value
    assert f"<b>{report.graphs_at_p99.p99_ms:.2f}</b>" in app.summary.value
    assert f"≈ {report.capture_s:.2f} s" in app.summary.value and "all eager" in app.summary.value
    app.recommend.click()
    assert "minimising predicted time" in app.message.value


def test_the_table_field_loads_another_table(tmp_path, table_path):
    app = BudgetExplorer(latency_table=tmp_path / "missing.json")
    assert "unusable" in app.message.value and "cannot read the latency table" in app.message.value
    app.table_path.value = str(table_path)
    assert app.message.value == "" and "P99" in app.summary.value and str(table_path) in app.summary.value
    app.table_path.value = ""
    assert "unknown (no latency table" in app.summary.value


def test_unusable_latency_table_is_reported(tmp_path):
    path = tmp_path / "latency.json"
    path.write_text('{"budgets": []}')
    app = BudgetExplorer(latency_table=path)
    assert "unusable" in app.message.value and "unknown (no latency table" in app.summary.value


def test_a_second_budget_set_is_shown_beside_the_first(app):
    app.preset.value = MIXED
    app.compare.value = "256, 1024, 4096"
    assert "budget set A" in app.summary.value and "budget set B" in app.summary.value
    requests = specs(preset_requests(app))
    for config in (BudgetConfig.resolve(), BudgetConfig.resolve((256, 1024, 4096), 64, 64)):
        stats = combined_stats(plan_workload(requests, config))
        assert f"<b>{stats.padding_fraction:.1%} of replayed tokens ({stats.padded_tokens} tokens)</b>" \
            in app.summary.value
    app.compare.value = "32, 64"
    assert "compare with: max_items=64 exceeds the smallest budget 32" in html.unescape(app.message.value)
    app.compare.value = ""
    assert "budget set B" not in app.summary.value


def test_a_trace_path_becomes_the_workload(app, tmp_path):
    path = tmp_path / "traffic.csv"
    path.write_bytes(TRACE_CSV)
    app.trace_path.value = str(path)
    assert app.preset.value == TRACE and "traffic.csv (2 requests, 3 items)" in app.preset.label
    assert app.num_requests.disabled and app.seed.disabled
    tokens = sum(item.spec.tokens for request in parse_trace(TRACE_CSV, "t.csv") for item in request)
    assert f"2 requests, 3 items, {tokens} tokens" in app.summary.value
    app.preset.value = MIXED
    assert not app.num_requests.disabled and "1000 requests" in app.summary.value


def test_an_uploaded_trace_becomes_the_workload_and_bad_ones_say_where(app):
    app.upload.value = ({"name": "up.jsonl", "type": "", "size": 10, "last_modified": NOW,
                         "content": memoryview(b'{"height": 448, "width": 448}\n{"height": 224, "width": 224}\n')},)
    assert app.preset.value == TRACE and "2 requests, 2 items, 320 tokens" in app.summary.value
    app.upload.value = ({"name": "bad.csv", "type": "", "size": 10, "last_modified": NOW,
                         "content": memoryview(b"height,width\n224,-3\n")},)
    assert "bad.csv line 2: width must be a positive integer" in html.unescape(app.message.value)


def test_export_writes_the_vllm_config(app, tmp_path):
    app.budgets.value = "64, 256, 1024"
    app.max_items.value, app.max_segments.value = 8, 16
    app.export_path.value = str(tmp_path / "vllm.json")
    app.export.click()
    assert json.loads((tmp_path / "vllm.json").read_text()) == {
        "cudagraph_mm_encoder": True, "encoder_cudagraph_token_budgets": [64, 256, 1024],
        "encoder_cudagraph_max_vision_items_per_batch": 8, "encoder_cudagraph_max_frames_per_batch": 16}
    assert "wrote" in app.message.value and "--compilation-config" in app.message.value
    app.export_path.value = str(tmp_path)
    app.export.click()
    assert "is a directory" in app.message.value


def test_explorer_returns_the_widget(tmp_path):
    assert isinstance(explorer(tmp_path / "missing.json"), widgets.VBox)
