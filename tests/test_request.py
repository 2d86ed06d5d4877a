"""One typed request: each item counted by one function (geometry.item_spec), the request validated once.

Every module that reports an item's rows, tokens or attention work Σ L² is asked, through its public entry point,
about the same grids, and each answer is held to the definition worked out here by hand (t segments of h·w rows;
t·h·w / m² tokens): a wrong count planted in any one of them fails this file.
"""
import dataclasses

import numpy as np
import pytest
import torch

import glmvit.metadata
import glmvit.model
import glmvit.request
from glmvit.cli.latency import layout_spec
from glmvit.costmodel import LatencyTable, ladder_split, predict_time
from glmvit.floor import flops_breakdown
from glmvit.geometry import ItemSpec, grid_specs, item_spec, output_tokens
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import attention_work, build_metadata
from glmvit.packing import BudgetConfig, plan_batches
from glmvit.parallel import patch_counts_of
from glmvit.request import EncoderRequest
from glmvit.scheduler import BatchScheduler
from glmvit.workloads import random_batch

CONFIG = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)
GRID_SETS = [[[1, 2, 2]], [[1, 4, 6], [3, 2, 2]], [[2, 4, 4], [1, 12, 12], [1, 2, 8]], [[4, 6, 2], [1, 8, 8]]]


def by_hand(grids, merge=2):
    """(rows, tokens, work) per item from the definitions: t segments of h·w rows, one token per merge² rows."""
    return [(t * h * w, t * h * w // merge**2, t * (h * w) ** 2) for t, h, w in grids]


def totals(grids, merge=2):
    return tuple(sum(col) for col in zip(*by_hand(grids, merge), strict=True))


def test_item_spec_counts_with_its_own_merge_size():
    """The merge size given to from_grid decides rows and work too, not only tokens (Σ L² of a 3×3 frame: 81)."""
    for merge, grid in [(1, (1, 3, 3)), (3, (2, 6, 6)), (2, (3, 4, 2))]:
        spec = ItemSpec.from_grid(grid, merge)
        (rows, tokens, work), = by_hand([grid], merge)
        assert (spec.rows, spec.tokens, spec.segments, spec.work) == (rows, tokens, grid[0], work), (merge, grid)
        assert spec.segment_rows2 == work and item_spec(*grid, merge) == spec
        assert output_tokens(*grid, merge) == tokens


def test_a_spec_of_tokens_and_segments_alone_keeps_its_meaning():
    """ItemSpec(tokens, segments), as notebooks write it: equal segments at the tower's merge size."""
    assert ItemSpec(256, 4) == item_spec(4, 16, 16) and ItemSpec(64, 1).segment_rows2 == 256**2
    assert ItemSpec.total([ItemSpec(64, 1), item_spec(2, 2, 2)]) == ItemSpec(66, 3, 256 + 8, 256**2 + 2 * 16)


@pytest.mark.parametrize("grids", GRID_SETS, ids=str)
def test_every_module_counts_an_item_as_item_spec_does(grids, tiny_model, tiny_config):
    rows, tokens, work = totals(grids)
    per_item = by_hand(grids)
    request = EncoderRequest.of(grids, rows)
    assert [(s.rows, s.tokens, s.work) for s in request.items] == per_item
    assert request.row_starts.tolist() == [0, *np.cumsum([r for r, _, _ in per_item]).tolist()]
    assert patch_counts_of(grids) == [r for r, _, _ in per_item]
    assert [(s.rows, s.tokens, s.work) for s in grid_specs(grids)] == per_item
    # metadata: its rows, its valid tokens, and Σ L² read back from the segments it laid out
    meta = build_metadata(grids)
    valid = int(meta.to().token_valid.sum())
    assert (meta.num_rows, valid, attention_work(meta)) == (rows, tokens, work)
    # the analytic floor and the latency table's layout record (what the cost model is fitted on)
    c = tiny_config
    parts = flops_breakdown(c, grids)
    assert parts["attention"] == c.depth * 4 * work * c.hidden_size
    assert parts["patch_embed"] == 2 * rows * c.patch_dim * c.hidden_size
    assert parts["downsample"] == 2 * tokens * c.merge_area * c.hidden_size * c.out_hidden_size
    spec = layout_spec(np.array(grids), c)
    assert (spec.rows, spec.tokens, spec.work) == (rows, tokens, work)
    # packing and the cost model's query of its plan
    plan = plan_batches(grid_specs(grids), CONFIG)
    assert sum(b.tokens for b in plan.batches) == tokens and sum(b.segment_rows2 for b in plan.batches) == work
    table = LatencyTable((8, 32), (1.0, 2.0), (1.5, 3.0), attention_ms=0.5)
    assert predict_time(plan, table).eager_ms == pytest.approx(table.eager_time(tokens, work))
    # the runner's plan, and every module's output sizes
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", progress=False).capture()
    steps = runner.plan(grids)
    assert sum(s.tokens for s in steps) == tokens and sum(s.segment_rows2 for s in steps) == work
    assert sum(s.num_rows for s in steps) == rows
    pixels, grid = random_batch(grids, c)
    assert [o.shape[0] for o in runner.run(pixels, grid)] == [t for _, t, _ in per_item]
    assert tiny_model(pixels, grid).shape[0] == tokens


def test_the_ladder_split_queries_the_work_the_table_was_fitted_on():
    """ladder_split asks for one full image of 2·split tokens: one segment of 2·split·m² rows."""
    base = LatencyTable((64, 128, 256, 512), (1.0, 1.0, 1.0, 1.0), (2.0, 2.0, 2.0, 2.0), attention_ms=0.0,
                        eager_floor_ms=1.5)
    one = item_spec(1, 16, 32)  # 128 tokens: the image that decides whether the ladder doubles past 64
    at_floor = (base.eager_floor_ms - base.graph_time(128)) / (one.work / 1e6)  # attention_ms where it just fits
    assert ladder_split(dataclasses.replace(base, attention_ms=at_floor * 1.01)) == 64
    assert ladder_split(dataclasses.replace(base, attention_ms=at_floor * 0.99)) > 64


@pytest.mark.parametrize(("grids", "pixel_rows", "match"), [
    ([[1, 2, 2], [1, 3, 4]], None, r"^item 1: grid h×w = 3×4 is not divisible by the spatial merge size 2$"),
    ([[1, 2, 2], [1, 2, 2], [0, 2, 2]], None, r"^item 2: grid \[t, h, w\] = \[0, 2, 2\] has a non-positive entry$"),
    ([[1, 2.5, 2]], None, r"^item 0: grid \[t, h, w\] = \[1\.0, 2\.5, 2\.0\] must hold integers"),
    ([[1, 2, 2], [1, 2**15, 2**16]], None, r"^item 1: grid \[t, h, w\] = \[1, 32768, 65536\] is t·h·w"),
    ([[1, 2, 2], [2, 2, 2]], 13, r"^pixel_values has 13 rows but grid_thw needs Σ t·h·w = 12 \(per item: \[4, 8\]\)$"),
    ([[1, 2]], None, r"^grid_thw must have shape \[n, 3\]"),
])
def test_a_request_refuses_bad_grids_in_one_line_naming_the_item(grids, pixel_rows, match):
    with pytest.raises(ValueError, match=match) as info:
        EncoderRequest.of(grids, pixel_rows)
    assert "\n" not in str(info.value)


def test_a_request_is_read_only_and_its_parts_need_no_second_check():
    request = EncoderRequest.of([[1, 2, 2], [2, 4, 2], [1, 2, 6]])
    with pytest.raises(ValueError):
        request.grids[0, 0] = 5
    part = request.select([2, 0])
    assert part.grids.tolist() == [[1, 2, 6], [1, 2, 2]] and part.items == (request.items[2], request.items[0])
    joined = EncoderRequest.gather([(request, 1), (part, 0)])
    assert joined.grids.tolist() == [[2, 4, 2], [1, 2, 6]] and joined.rows == 16 + 12
    with pytest.raises(ValueError, match="merge sizes"):
        EncoderRequest.gather([(request, 0), (EncoderRequest.of([[1, 3, 3]], merge=3), 0)])


def count_grid_checks(monkeypatch) -> list[int]:
    """Count every grid validation (as_grid_array, under any name a module imported it by)."""
    calls: list[int] = []
    real = glmvit.metadata.as_grid_array
    for module in (glmvit.metadata, glmvit.model, glmvit.request):
        if hasattr(module, "as_grid_array"):
            monkeypatch.setattr(module, "as_grid_array", lambda g: calls.append(1) or real(g))
    return calls


def test_a_scheduled_request_is_validated_once(tiny_model, tiny_config, monkeypatch):
    """submit validates; the batch, the runner, its eager fallback and the metadata take the request as it is."""
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", progress=False).capture()
    batches = [random_batch(g, tiny_config, seed=i) for i, g in enumerate(GRID_SETS)]  # [1, 12, 12] runs eagerly
    expected = [runner.run(*b) for b in batches]
    calls = count_grid_checks(monkeypatch)
    with BatchScheduler(runner, start=False) as scheduler:
        futures = [scheduler.submit(*b) for b in batches]
        assert len(calls) == len(batches)
        scheduler.start()
        results = [f.result(60) for f in futures]
    assert len(calls) == len(batches)
    for result, want in zip(results, expected, strict=True):
        assert [o.shape for o in result.outputs] == [w.shape for w in want]
    calls.clear()
    request = EncoderRequest.of(GRID_SETS[2])
    calls.clear()
    outs = runner.run(batches[2][0], request)
    assert not calls and all(torch.equal(a, b) for a, b in zip(outs, expected[2], strict=True))


def test_a_request_of_another_merge_size_is_refused(tiny_model, tiny_config):
    pixels, _ = random_batch([[1, 3, 3]], tiny_config)
    with pytest.raises(ValueError, match="merge size 3, the tower merges 2"):
        tiny_model(pixels, EncoderRequest.of([[1, 3, 3]], merge=3))


def test_the_array_checks_still_hand_back_grids_of_the_callers_own(tiny_model, tiny_config):
    """check_inputs and check_grid_thw return writable copies (a server wraps them with torch.from_numpy)."""
    pixels, grid = random_batch([[1, 2, 2], [2, 2, 4]], tiny_config)
    for grids in (tiny_model.check_inputs(pixels, grid), tiny_model.check_grid_thw(grid)):
        assert grids.flags.writeable and grids.tolist() == grid.tolist()
