"""One routing rule: the runner, the cost model's prediction and the tools that report a runner's batches all ask
:class:`glmvit.routing.Router`, so a rule planted in any one of them alone makes these tests fail."""
import pytest
import torch

from glmvit.cli.bench import runner_prediction
from glmvit.cli.explorer_report import OVER, REPLAY, ROUTED, SLOWER, batch_runs
from glmvit.config import VisionConfig
from glmvit.costmodel import LatencyTable, predict_time
from glmvit.graphs import EncoderGraphRunner
from glmvit.packing import BudgetConfig, plan_batches
from glmvit.random_weights import random_encoder
from glmvit.routing import Route, Router

# replays cost 1 ms at 8 tokens and grow fast; eager forwards cost 1.5 ms and grow slowly: small batches in small
# budgets replay, part-filled large budgets run eagerly, and a 16-token batch in the 16-token budget ties
TABLE = LatencyTable((8, 24), (1.0, 3.0), (1.5, 2.5))
CONFIG = BudgetConfig((8, 16, 32), 4, 8)
REQUESTS = ([[1, 8, 8]], [[1, 4, 4], [1, 2, 2]], [[1, 8, 8], [2, 4, 4]], [[1, 12, 12]], [[1, 8, 8], [1, 4, 4]])


@pytest.mark.parametrize("budget, tokens, expected", [
    (None, 5, Route(False, None)), (8, 5, Route(True, None))])
def test_without_a_table_a_batch_replays_where_a_budget_holds_it(budget, tokens, expected):
    assert Router().route(budget, tokens, 0) == expected


def test_with_a_table_a_batch_replays_only_when_no_slower():
    fast, slow = LatencyTable((8, 32), (1.0, 1.0), (2.0, 2.0)), LatencyTable((8, 32), (2.0, 2.0), (1.0, 1.0))
    tie = LatencyTable((8, 32), (2.0, 2.0), (2.0, 2.0))
    assert Router(fast).route(8, 5, 0) == Route(True, 1.0)
    assert Router(slow).route(8, 5, 0) == Route(False, 1.0)
    assert Router(tie).route(8, 5, 0) == Route(True, 2.0)  # a tie replays: the graph's time does not vary
    assert Router(slow, by_time=False).route(8, 5, 0) == Route(True, 2.0)  # vLLM's rule: replay what a budget holds
    assert Router(fast).route(None, 5, 0) == Route(False, 2.0)
    assert Router(slow).eager_faster(8, 5, 0) and not Router(fast).eager_faster(8, 5, 0)


@pytest.fixture(scope="module")
def runners():
    model = random_encoder(VisionConfig.tiny(), "cpu", torch.float32, 0)
    routed = EncoderGraphRunner(model, CONFIG, mode="emulate", latency_table=TABLE).capture()
    plain = EncoderGraphRunner(model, CONFIG, mode="emulate").capture()
    return model, routed, plain


def test_the_runner_the_cost_model_and_the_tools_route_alike(runners):
    model, routed, plain = runners
    router, seen = Router(TABLE), set()
    for grids in REQUESTS:
        request = model.request_of(grids)
        plan = plan_batches(request.items, routed.captured_config())
        steps = routed.plan(grids)
        assert [s.items for s in steps] == [b.item_indices for b in plan.batches]
        for step, batch in zip(steps, plan.batches, strict=True):
            route = router.route(batch.budget, batch.tokens, batch.segment_rows2)
            assert (step.replay, step.predicted_ms) == route
            held_tie = batch.budget is not None and TABLE.graph_time(batch.budget) == TABLE.eager_time(batch.tokens)
            seen.add("tie" if held_tie else route.replay)
            expected = OVER if batch.budget is None else REPLAY if route.replay else ROUTED
            assert batch_runs(batch, TABLE, route=True) == expected
            assert batch_runs(batch, TABLE, route=False) == (SLOWER if expected == ROUTED else expected)
        assert [s.replay for s in plain.plan(grids)] == [b.budget is not None for b in plan.batches]
        total = predict_time(plan, TABLE, route=True)
        assert sum(s.predicted_ms for s in steps) == pytest.approx(total.total_ms)
        assert total.graph_ms == pytest.approx(sum(s.predicted_ms for s in steps if s.replay))
        assert runner_prediction(routed, grids, TABLE, no_route=False) == pytest.approx(total.total_ms)
        unrouted = predict_time(plan, TABLE, route=False).total_ms
        assert runner_prediction(plain, grids, TABLE, no_route=True) == pytest.approx(unrouted)
    assert seen == {True, False, "tie"}  # every branch of the rule was exercised
