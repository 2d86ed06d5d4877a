"""EncoderGraphRunner's uniform graphs on CPU, through the emulated mode (the same capture list, planning and routing
as on CUDA; ``forward_static`` where a graph would replay): a batch whose frames all have one h·w replays in its
budget's graph for that length with the ``dense`` attention, any other batch where it did before; outputs equal the
eager forward; items stay isolated; a runner without ``uniform_lengths`` is the runner it was.

Tolerance against the eager forward: 1e-5, what tests/test_graphs.py asks of every emulated replay (fp32; the
batch's GEMMs and attention sum in another order than the item's alone).
"""
import numpy as np
import pytest
import torch

from conftest import assert_items_match_forward
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import BatchShape
from glmvit.packing import BudgetConfig
from glmvit.workloads import random_batch

CONFIG = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)  # 32, 64 and 128 rows
LENGTHS = (16, 24)  # 4×4 frames (divide every budget's rows) and 4×6 frames (divide none: ⌊rows/24⌋ segments)


@pytest.fixture
def uniform(tiny_model):
    return EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", check_pointers=True, uniform_lengths=LENGTHS,
                              uniform_attention="dense").capture()


def test_every_budget_gets_a_graph_per_length_of_whole_segments(uniform):
    assert set(uniform.uniform_graphs) == {(b, n) for b in CONFIG.token_budgets for n in LENGTHS}
    assert set(uniform.graphs) == set(CONFIG.token_budgets) and not uniform.failed and not uniform.uniform_failed
    assert uniform.uniform_graphs[16, 16].shape == BatchShape(64, 4, 16, uniform=True)
    assert uniform.uniform_graphs[32, 24].shape == BatchShape(120, 5, 24, uniform=True)  # ⌊128 / 24⌋ = 5 segments
    assert uniform.uniform_graphs[8, 24].shape == BatchShape(24, 1, 24, uniform=True)
    assert uniform.uniform_graphs[32, 24].output.shape[0] == 30 == uniform.uniform_captures[32, 24].rows // 4
    assert uniform.uniform_shape(8, 48) is None  # not one 48-row segment fits 32 rows: no graph to capture


@pytest.mark.parametrize(("grids", "budget", "length"), [
    ([[1, 4, 4], [2, 4, 4], [1, 2, 8]], 16, 16),  # images and a clip, every frame 16 rows: 64 rows, budget 16
    ([[1, 4, 6], [1, 6, 4], [1, 2, 12]], 32, 24),  # 72 rows, budget 32, whose 24-row graph holds 120
    ([[1, 4, 4]], 8, 16),  # one image alone
])
def test_a_uniform_batch_replays_in_its_length_s_graph(uniform, tiny_model, tiny_config, grids, budget, length):
    pixels, grid = random_batch(grids, tiny_config, seed=40)
    [step] = uniform.plan(grid)
    assert step.replay and step.captured is uniform.uniform_graphs[budget, length]
    outs = uniform.run(pixels, grid)
    assert uniform.stats.replays == uniform.stats.uniform_replays == 1
    assert_items_match_forward(tiny_model, outs, pixels, grids)


def test_a_mixed_batch_replays_in_the_ordinary_graph(uniform, tiny_model, tiny_config):
    grids = [[1, 4, 4], [1, 4, 6], [2, 2, 2]]  # 16-, 24- and 4-row frames
    pixels, grid = random_batch(grids, tiny_config, seed=41)
    [step] = uniform.plan(grid)
    assert step.captured is uniform.graphs[16] and not step.captured.shape.uniform
    outs = uniform.run(pixels, grid)
    assert uniform.stats.replays == 1 and uniform.stats.uniform_replays == 0
    assert_items_match_forward(tiny_model, outs, pixels, grids)


def test_a_length_without_a_graph_and_eager_batches_route_as_before(uniform, tiny_model, tiny_config):
    grids = [[1, 2, 4], [1, 4, 2], [1, 12, 12]]  # 8-row frames (no 8-row graph) and one item too large for any budget
    pixels, grid = random_batch(grids, tiny_config, seed=42)
    steps = uniform.plan(grid)
    assert len(steps) == 2 and sum(s.replay for s in steps) == 1
    for s in steps:
        assert s.captured is (uniform.graphs[8] if s.replay else None)
    outs = uniform.run(pixels, grid)
    assert uniform.stats.uniform_replays == 0 and uniform.stats.eager_batches == 1
    assert_items_match_forward(tiny_model, outs, pixels, grids)


def test_uniform_and_ordinary_batches_in_turn_match_a_runner_without_uniform_graphs(uniform, tiny_model, tiny_config):
    plain = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_attention="dense").capture()
    assert not plain.uniform_graphs and not plain.uniform_captures  # no lengths: no uniform graph at all
    batches = [[[1, 4, 4], [1, 4, 4]], [[1, 4, 6], [1, 2, 2]], [[3, 4, 4]], [[1, 6, 4]]]
    for seed, grids in enumerate(batches):
        pixels, grid = random_batch(grids, tiny_config, seed=43 + seed)
        for a, b in zip(uniform.run(pixels, grid), plain.run(pixels, grid), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert uniform.stats.uniform_replays == 3 and uniform.stats.replays == plain.stats.replays == 4
    assert plain.stats.uniform_replays == 0


def test_a_default_runner_captures_and_plans_exactly_as_before(tiny_model, tiny_config):
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate").capture()
    assert runner.uniform_lengths == () and not runner.uniform_graphs
    assert all(cb.shape == runner.batch_shape(b) for b, cb in runner.graphs.items())
    pixels, grid = random_batch([[1, 4, 4], [1, 4, 4]], tiny_config, seed=47)
    [step] = runner.plan(grid)
    assert step.captured is runner.graphs[8]
    runner.run(pixels, grid)
    assert runner.stats.uniform_replays == 0 and runner.stats.replays == 1


def test_a_non_finite_item_reaches_no_other_item_in_a_uniform_graph(uniform, tiny_config):
    grids = [[1, 4, 4], [2, 4, 4], [1, 2, 8]]
    pixels, grid = random_batch(grids, tiny_config, seed=48)
    clean = uniform.run(pixels, grid)
    starts = np.cumsum([0] + [t * h * w for t, h, w in grids])
    for kind in ("nan", "inf"):
        for item in range(len(grids)):
            dirty = pixels.clone()
            dirty[(starts[item] + starts[item + 1]) // 2, 5] = float(kind)
            with pytest.raises(ValueError, match=rf"item\(s\) \[{item}\] hold NaN or Inf"):
                uniform.run(dirty, grid)
            outs = uniform.run(dirty, grid, check_finite=False)
            assert all(torch.equal(outs[i], clean[i]) for i in range(len(grids)) if i != item), (kind, item)
            assert not torch.isfinite(outs[item]).all()
    assert uniform.stats.uniform_replays == uniform.stats.replays


def test_a_plan_names_the_uniform_graph(uniform):
    text = repr(uniform.plan([[1, 4, 4], [1, 4, 4]]))
    assert text == "[BatchStep(items=(0, 1), tokens=8, budget=8, uniform 16-row segments, route=replay)]"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"uniform_lengths": (6,)}, r"^uniform length 6 must be a positive multiple of 4 \(a frame's h·w\)$"),
    ({"uniform_lengths": (0,)}, r"^uniform length 0 must be a positive multiple of 4"),
    ({"uniform_lengths": (True,)}, r"^uniform length True must be"),
    ({"uniform_lengths": (16,), "uniform_attention": "nope"}, r"^unknown attention backend 'nope'"),
    ({"uniform_lengths": (16,), "uniform_attention": "varlen"}, r"^attention backend 'varlen' is not available"),
])
def test_bad_uniform_options_are_one_line_errors(tiny_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", **kwargs)


def test_uniform_graphs_may_run_another_backend(tiny_model, tiny_config):
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_lengths=(16,),
                                uniform_attention="sdpa_masked").capture()
    assert runner.uniform_attention == "sdpa_masked"
    grids = [[1, 4, 4], [2, 4, 4]]
    pixels, grid = random_batch(grids, tiny_config, seed=49)
    assert_items_match_forward(tiny_model, runner.run(pixels, grid), pixels, grids)
    assert runner.stats.uniform_replays == 1


def test_a_compiled_capture_has_room_for_the_uniform_graphs_too(tiny_model, monkeypatch):
    """Each uniform graph is one more specialisation to compile; a uniform graph whose budget was not captured is
    not captured either (its batches never replay)."""
    import torch._dynamo.config as dynamo_config

    from glmvit import graphs

    seen = []
    monkeypatch.setattr(graphs, "_held_specialisations", lambda functions: 20)
    monkeypatch.setattr(graphs.EncoderGraphRunner, "_capture_budget",
                        lambda self, budget, length=None: seen.append((length, dynamo_config.recompile_limit)))
    EncoderGraphRunner(tiny_model, BudgetConfig((16, 32), 2, 4), mode="emulate", torch_compile=True,
                       uniform_lengths=(16,)).capture()
    assert seen == [(None, 20 + 2 * 4 + 8)] * 2  # two budgets and their two uniform graphs; no budget captured


def test_uniform_min_rows_leaves_out_the_budgets_whose_uniform_shape_is_smaller(tiny_model, tiny_config):
    """Budgets 8, 16, 32 tokens hold 32, 64, 128 rows: with 64 rows at least, budget 8's 16-row graph (32 rows) is
    not captured, and a batch there replays in its ordinary graph; budget 16's takes its uniform batches of 64 rows,
    not one of 48 (the dense kernel would compute the padding block too)."""
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_lengths=(16,), uniform_min_rows=64
                                ).capture()
    assert set(runner.uniform_graphs) == {(16, 16), (32, 16)}
    pixels, grid = random_batch([[1, 4, 4]], tiny_config, seed=50)  # 16 rows: budget 8
    assert_items_match_forward(tiny_model, runner.run(pixels, grid), pixels, [[1, 4, 4]])
    assert runner.stats.replays == 1 and runner.stats.uniform_replays == 0
    for grids, uniform_replays in (([[1, 4, 4], [2, 4, 4]], 0), ([[2, 4, 4], [2, 4, 4]], 1)):  # 48, 64 rows: budget 16
        runner.stats.reset()
        pixels, grid = random_batch(grids, tiny_config, seed=51)
        assert_items_match_forward(tiny_model, runner.run(pixels, grid), pixels, grids)
        assert runner.stats.replays == 1 and runner.stats.uniform_replays == uniform_replays, grids
    assert runner.uniform_graph(16, np.array([[2, 4, 4], [2, 4, 4]])) is runner.uniform_graphs[16, 16]
    assert runner.uniform_graph(16, np.array([[1, 4, 4], [2, 4, 4]])) is None


@pytest.mark.parametrize("rows", [-1, True, 1.5])
def test_a_bad_uniform_min_rows_is_a_one_line_error(tiny_model, rows):
    with pytest.raises(ValueError, match=rf"^uniform_min_rows must be a non-negative integer, got {rows!r}$"):
        EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_lengths=(16,), uniform_min_rows=rows)


@pytest.mark.parametrize(("frames", "lengths"), [
    ([(1024, 1)] * 8, (1024,)),  # eight 448² images
    ([(256, 4)], (256,)),  # one 8-frame 224² clip: four 256-row frames
    ([(256, 1), (1024, 1)], (1024,)),  # 256 of 1280 rows: a fifth
    ([(256, 2), (1024, 1)], (256, 1024)),  # 512 of 1536 rows: a third
    ([(16, 1), (32, 1), (64, 1), (128, 1), (256, 1)], (128, 256)),  # 128 of 496 rows is 25.8 %, 64 is 12.9 %
    ([], ()),
])
def test_uniform_lengths_for_keeps_the_lengths_holding_a_quarter_of_the_rows(frames, lengths):
    from glmvit.uniform import uniform_lengths_for

    assert uniform_lengths_for(frames) == lengths


def test_replay_uniform_runs_a_budget_s_uniform_graph_and_refuses_where_there_is_none(uniform, tiny_model,
                                                                                      tiny_config):
    """``replay(budget, …, uniform=True)`` (what ``glmvit kernels`` profiles) takes the budget's graph for the batch's
    one frame length: the same tokens as the budget's ordinary graph; a batch of two lengths has none."""
    grids = [[1, 4, 4], [2, 4, 4]]
    pixels, grid = random_batch(grids, tiny_config, seed=53)
    ordinary = uniform.replay(16, pixels, grid).clone()
    dense = uniform.replay(16, pixels, grid, uniform=True)
    tokens = 12  # 48 rows / 4
    assert dense.shape[0] == uniform.uniform_graphs[16, 16].output.shape[0]
    torch.testing.assert_close(dense[:tokens], ordinary[:tokens], rtol=1e-5, atol=1e-5)
    pixels, grid = random_batch([[1, 4, 4], [1, 4, 6]], tiny_config, seed=54)
    with pytest.raises(ValueError, match=r"^budget 16 has no uniform graph for these frames \(captured: "):
        uniform.replay(16, pixels, grid, uniform=True)


def test_a_record_s_uniform_graphs_read_as_the_runner_plans(tiny_model):
    """``glmvit.lab.budget_views.UniformGraphs``, what notebooks 05b and 08 read from a bench record to predict and
    explain its replays, names the graph this runner replays each batch in: uniform, mixed, too small for
    ``uniform_min_rows``, a length without a graph. It is read from the record's ``uniform_capture`` entries."""
    from types import SimpleNamespace

    from glmvit.geometry import item_spec
    from glmvit.lab.budget_views import UniformGraphs
    from glmvit.packing import plan_batches
    from glmvit.uniform import DENSE_MIN_ROWS

    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_lengths=LENGTHS, uniform_min_rows=64
                                ).capture()
    record = SimpleNamespace(model_extra={"uniform_capture": {f"{b}x{f}": {"budget": cb.budget, "rows": 0}
                                                              for (b, f), cb in runner.uniform_graphs.items()}})
    read = UniformGraphs.of(record)
    assert read.budgets == {k: cb.budget for k, cb in runner.uniform_graphs.items()} and read.budgets
    reading = UniformGraphs(read.budgets, runner.uniform_min_rows)  # the bench's runners use DENSE_MIN_ROWS
    assert read.min_rows == DENSE_MIN_ROWS and UniformGraphs.of(SimpleNamespace(model_extra={})).budgets == {}
    uniform_steps = 0
    for grids in ([[1, 4, 4]], [[2, 4, 4], [2, 4, 4]], [[1, 4, 4], [2, 4, 4]], [[1, 4, 6], [1, 6, 4], [1, 2, 12]],
                  [[1, 4, 4], [1, 4, 6]], [[4, 4, 4], [4, 4, 4]], [[2, 6, 6]], [[1, 2, 2]]):
        items = [item_spec(*g) for g in grids]
        steps, batches = runner.plan(np.array(grids)), plan_batches(items, CONFIG, packer=runner.packer).batches
        assert [s.items for s in steps] == [b.item_indices for b in batches]
        for s, b in zip(steps, batches, strict=True):
            graph = None if b.budget is None else reading.graph_budget(b.budget, [items[i] for i in b.item_indices])
            assert s.budget == (graph or b.budget) and (graph is not None) == bool(s.captured and
                                                                                    s.captured.shape.uniform), grids
            uniform_steps += graph is not None
    assert uniform_steps >= 2  # the rule was exercised both ways


def test_a_batch_is_routed_by_the_graph_it_would_replay_in(tiny_model, tiny_config):
    """Budget 32's ragged graph is slower than an eager forward by this table, its 24-row uniform graph (30 tokens)
    faster: a batch of 24-row frames replays there, a mixed batch of the same budget runs eagerly. Under a rule that
    routes by the ladder's budget first, both would run eagerly."""
    from glmvit.costmodel import LatencyTable

    table = LatencyTable((8, 30, 32), (1.0, 1.0, 10.0), (5.0, 5.0, 5.0))
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_lengths=LENGTHS, latency_table=table
                                ).capture()
    [step] = runner.plan([[1, 4, 6], [1, 6, 4], [1, 2, 12]])  # 72 rows, 18 tokens: budget 32
    assert step.replay and step.captured is runner.uniform_graphs[32, 24] and step.predicted_ms == 1.0
    [mixed] = runner.plan([[1, 4, 6], [1, 4, 4], [1, 2, 14]])  # 24-, 16- and 28-row frames, 17 tokens: budget 32
    assert not mixed.replay and mixed.budget == 32 and mixed.predicted_ms == 5.0
    pixels, grid = random_batch([[1, 4, 6], [1, 6, 4], [1, 2, 12]], tiny_config, seed=52)
    assert_items_match_forward(tiny_model, runner.run(pixels, grid), pixels, [[1, 4, 6], [1, 6, 4], [1, 2, 12]])
    assert runner.stats.uniform_replays == 1 and runner.stats.eager_batches == 0


def test_the_record_reader_routes_every_batch_where_the_runner_does(tiny_model):
    """glmvit.lab.budget_views.UniformGraphs.route, given the graphs a runner captured, routes each batch of a plan as
    the runner's own plan does: a uniform batch replayed (24-row frames, budget 32's graph of 30 tokens), a uniform
    batch routed eager (16-row frames, budget 16's graph), a mixed one routed by its ladder budget."""
    from glmvit.costmodel import LatencyTable
    from glmvit.geometry import item_spec
    from glmvit.lab.budget_views import UniformGraphs
    from glmvit.packing import plan_batches
    from glmvit.routing import Router

    table = LatencyTable((8, 16, 30, 32), (1.0, 9.0, 1.0, 10.0), (5.0, 5.0, 5.0, 5.0))
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", uniform_lengths=LENGTHS, latency_table=table
                                ).capture()
    reader = UniformGraphs({key: cb.budget for key, cb in runner.uniform_graphs.items()}, runner.uniform_min_rows)
    router = Router(table)
    routes = []
    for grids in ([[1, 4, 6], [1, 6, 4], [1, 2, 12]], [[2, 4, 4], [1, 4, 4]], [[1, 4, 6], [1, 4, 4], [1, 2, 14]],
                  [[1, 4, 4]], [[1, 12, 12]]):
        items = [item_spec(*g) for g in grids]
        plan = plan_batches(items, runner.captured_config(), packer=runner.packer)
        steps = runner.plan(grids)
        assert len(plan.batches) == len(steps)
        for batch, step in zip(plan.batches, steps, strict=True):
            route = reader.route(router, batch, [items[i] for i in batch.item_indices])
            assert (route.replay, route.predicted_ms) == (step.replay, step.predicted_ms), grids
            routes.append((step.replay, step.captured is not None and step.captured.shape.uniform))
    assert {(True, True), (False, True), (False, False)} <= set(routes)
