"""The budget explorer's wiring, driven like a user would: set widget values, click, read the HTML it shows."""
import json

import ipywidgets as widgets
import pytest

from glmvit.cli.explorer import BudgetExplorer, explorer
from glmvit.costmodel import recommend_budgets
from glmvit.packing import BudgetConfig, combined_stats, plan_workload
from glmvit.workloads import PRESETS, random_mm_workload

MIXED = "mixed-large"


@pytest.fixture
def app(tmp_path):
    return BudgetExplorer(latency_table=tmp_path / "missing.json")


@pytest.fixture
def table_path(tmp_path):
    """A synthetic latency table, made up for this test only."""
    rows = [{"tokens": t, "graph_ms": 1.0 + 0.004 * t, "eager_ms": 6.0 + 0.005 * t} for t in (64, 256, 1024, 4096)]
    path = tmp_path / "latency.json"
    path.write_text(json.dumps({"provenance": {"source": "synthetic test table"}, "dtype": "bfloat16",
                                "config": "glm41v", "budgets": rows}))
    return path


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
    assert "no latency table recorded" in app.summary.value
    assert bytes(app.picture.value).startswith(b"\x89PNG")


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
    assert "fallbacks (eager items)</td><td><b>0<" in app.summary.value
    app.max_items.value, app.max_segments.value = 1, 2  # a video of 8 frames has 4 temporal patches
    assert "fallbacks (eager items)</td><td><b>1000<" in app.summary.value


@pytest.mark.parametrize("budgets, max_items, max_segments, message", [
    ("64, abc", 8, 8, "budget &#x27;abc&#x27; is not an integer"),
    ("32, 128", 64, 64, "max_items=64 exceeds the smallest budget 32"),
    ("0, 128", 8, 8, "token budget must be a positive integer, got 0"),
    ("auto", 16, 8, "max_segments=8 is below max_items=16"),
])
def test_bad_input_shows_a_message_not_a_traceback(app, budgets, max_items, max_segments, message):
    app.max_items.value, app.max_segments.value, app.budgets.value = max_items, max_segments, budgets
    assert "glmvit-error" in app.message.value and message in app.message.value
    assert app.summary.value == "" and bytes(app.picture.value) == b""
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


def test_latency_table_gives_times_and_time_objective(table_path):
    app = BudgetExplorer(latency_table=table_path)
    assert "ms (of which eager fallbacks" in app.summary.value and "vs eager" in app.summary.value
    app.recommend.click()
    assert "minimising predicted time" in app.message.value


def test_unusable_latency_table_is_reported(tmp_path):
    path = tmp_path / "latency.json"
    path.write_text('{"budgets": []}')
    app = BudgetExplorer(latency_table=path)
    assert "unusable" in app.message.value and "no latency table recorded" in app.summary.value


def test_explorer_returns_the_widget(tmp_path):
    assert isinstance(explorer(tmp_path / "missing.json"), widgets.VBox)
