"""EncoderGraphRunner on CPU through the emulate mode (same buffers and bookkeeping, no CUDA graph)."""
import dataclasses
import threading

import numpy as np
import pytest
import torch

from conftest import assert_items_match_forward
from glmvit.costmodel import LatencyTable
from glmvit.graphs import EncoderGraphRunner
from glmvit.packing import BudgetConfig
from glmvit.workloads import random_batch

CONFIG = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)


def random_grids(rng, n):
    """A random mix of images, videos and items too large for every budget (tiny config)."""
    grids = []
    for _ in range(n):
        kind = rng.choice(["image", "video", "oversize"], p=[0.6, 0.3, 0.1])
        h, w = 2 * rng.integers(1, 5, size=2)
        if kind == "video":
            grids.append([int(rng.integers(2, 4)), int(h), int(w)])
        elif kind == "oversize":
            grids.append([1, 12, 12])
        else:
            grids.append([1, int(h), int(w)])
    return grids


@pytest.fixture
def runner(tiny_model):
    return EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", check_pointers=True, progress=False).capture()


@pytest.mark.parametrize("seed", range(6))
def test_runner_equals_forward_per_item(runner, tiny_model, tiny_config, seed):
    rng = np.random.default_rng(seed)
    grids = random_grids(rng, int(rng.integers(1, 9)))
    pixels, grid = random_batch(grids, tiny_config, seed=seed)
    outs = runner.run(pixels, grid)
    assert len(outs) == len(grids)
    assert_items_match_forward(tiny_model, outs, pixels, grids)


def test_earlier_outputs_stay_unchanged(runner, tiny_config):
    """small → large → small: results handed out earlier are clones, never views of static buffers."""
    small = random_batch([[1, 4, 4]], tiny_config, seed=1)
    large = random_batch([[1, 8, 8], [2, 4, 4]], tiny_config, seed=2)
    first = runner.run(*small)
    kept = [t.clone() for t in first]
    runner.run(*large)
    again = runner.run(*random_batch([[1, 4, 6]], tiny_config, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(first, kept, strict=False))
    assert again[0].shape == (6, tiny_config.out_hidden_size)


def test_stats_add_up(runner, tiny_config):
    grids = [[1, 4, 4], [1, 2, 2], [2, 4, 4], [1, 12, 12], [1, 6, 6]]
    runner.run(*random_batch(grids, tiny_config, seed=4))
    s = runner.stats
    assert s.runs == 1 and s.items == 5
    assert s.fallback_items == 1 and s.eager_batches == 1  # the 12×12 image (36 tokens > 32)
    assert s.real_tokens == 4 + 1 + 8 + 9  # replayed items' tokens only
    # the four that fit: 22 tokens, 4 items, 5 segments → one batch in budget 32 (FFD packs them together)
    assert s.replays == 1 and s.budget_tokens == 32 and s.padding_fraction == pytest.approx(10 / 32)
    assert s.host_s > 0 and s.wait_s >= 0 and s.routed_eager == 0 and s.timed_batches == 0  # no table: no routing
    assert set(runner.captures) == set(CONFIG.token_budgets)
    s.reset()
    assert s == type(s)() and runner.stats is s


def test_frame_capacity_overflow_falls_back(tiny_model, tiny_config):
    """A clip with more temporal patches than any graph's frame capacity runs eagerly instead of crashing."""
    config = BudgetConfig(token_budgets=(16, 32), max_items=2, max_segments=3)
    runner = EncoderGraphRunner(tiny_model, config, mode="emulate", progress=False).capture()
    pixels, grid = random_batch([[5, 2, 2]], tiny_config, seed=5)  # 5 tokens but 5 temporal patches
    out = runner.run(pixels, grid)
    with torch.no_grad():
        torch.testing.assert_close(out[0], tiny_model(pixels, grid), atol=1e-5, rtol=1e-5)
    assert runner.stats.fallback_items == 1 and runner.stats.replays == 0


def test_rebound_buffer_is_detected(runner, tiny_config):
    runner.graphs[8].pixels = runner.graphs[8].pixels.clone()
    with pytest.raises(RuntimeError, match="rebound"):
        runner.run(*random_batch([[1, 4, 4]], tiny_config))


def test_empty_request(runner, tiny_config):
    assert runner.run(torch.zeros(0, tiny_config.patch_dim), torch.zeros(0, 3, dtype=torch.long)) == []


def test_rejects_what_cannot_be_captured(tiny_model, monkeypatch):
    with pytest.raises(ValueError, match="CUDA device"):
        EncoderGraphRunner(tiny_model, CONFIG, mode="cuda")
    with pytest.raises(ValueError, match="unknown GraphMode 'graph'; choose one of cuda, emulate"):
        EncoderGraphRunner(tiny_model, CONFIG, mode="graph")
    monkeypatch.setattr(tiny_model, "attn_backend", "segments")
    EncoderGraphRunner(tiny_model, CONFIG, mode="emulate")  # emulation captures nothing: any backend runs
    monkeypatch.setattr(type(tiny_model), "device", property(lambda self: torch.device("cuda")))  # no GPU needed
    with pytest.raises(ValueError, match="not graph-safe"):
        EncoderGraphRunner(tiny_model, CONFIG, mode="cuda")




def test_metadata_is_rebuilt_only_when_the_grids_change(runner, tiny_model, tiny_config, monkeypatch):
    """A budget keeps the metadata of its last batch: same grids ⇒ no rebuild; other grids ⇒ rebuilt and correct."""
    import glmvit.graphs as graphs

    calls = []
    real = graphs.build_metadata
    monkeypatch.setattr(graphs, "build_metadata", lambda *a, **k: calls.append(a[0].grids.tolist()) or real(*a, **k))
    a = random_batch([[1, 4, 4], [1, 2, 4]], tiny_config, seed=4)  # 6 tokens: budget 8
    b = random_batch([[1, 2, 2], [1, 4, 2], [1, 2, 2]], tiny_config, seed=5)  # 4 tokens: budget 8, other layout
    for pixels, grid in (a, a, b, a, a):
        outs = runner.run(pixels, grid)
        with torch.no_grad():
            torch.testing.assert_close(torch.cat(outs), tiny_model(pixels, grid), atol=1e-5, rtol=1e-5)
    assert len(calls) == 3  # a, b, a: the repeats reuse what the budget's buffers hold


def test_a_request_layout_is_planned_once(runner, tiny_config, monkeypatch):
    """Requests with the same grids reuse their plan; a new capture() forgets plans (they name its graphs)."""
    import glmvit.graphs as graphs

    calls = []
    real = graphs.plan_batches
    monkeypatch.setattr(graphs, "plan_batches", lambda *a, **k: calls.append(1) or real(*a, **k))
    request = random_batch([[1, 4, 4], [1, 12, 12], [2, 2, 2]], tiny_config, seed=6)  # one oversize item: eager
    first = runner.run(*request)
    second = runner.run(*request)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(first, second, strict=False))
    assert runner.stats.eager_batches == 2 and runner.stats.replays == 2
    runner.capture()
    runner.run(*request)
    assert len(calls) == 2


def test_a_request_is_validated_once(runner, tiny_model, tiny_config, monkeypatch):
    """run() checks a request's grids once, with its pixels, and plans from the checked array; plan(), public,
    still checks what it is given."""
    import glmvit.request

    calls = []
    real = glmvit.request.as_grid_array
    monkeypatch.setattr(glmvit.request, "as_grid_array", lambda g: calls.append(1) or real(g))
    request = random_batch([[1, 4, 4], [2, 2, 2]], tiny_config, seed=8)
    runner.run(*request)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="divisible|merge"):
        runner.plan([[1, 3, 4]])


def test_compile_scope_is_checked_and_blocks_compile_one_function_for_all(tiny_model):
    config = BudgetConfig((16, 32), 2, 4)
    with pytest.raises(ValueError, match="compile_scope must be one of"):
        EncoderGraphRunner(tiny_model, config, mode="emulate", torch_compile=True, compile_scope="layers")
    runner = EncoderGraphRunner(tiny_model, config, mode="emulate", torch_compile=True)
    embed, block, head = runner.forward_static.keywords["parts"]  # nothing compiles until the first call
    assert block is not tiny_model.blocks[0] and all(callable(f) for f in (embed, block, head))
    whole = EncoderGraphRunner(tiny_model, config, mode="emulate", torch_compile=True, compile_scope="model")
    assert "parts" not in whole.forward_static.keywords
    plain = EncoderGraphRunner(tiny_model, config, mode="emulate").forward_static
    assert plain.func == tiny_model.forward_static
    assert plain.keywords == {"attention": tiny_model.attention_backend(), "captured": False}  # emulated: no graph


# ---- routing ---------------------------------------------------------------------------------------------------
def table(graph_ms: float, eager_ms: float, mode: str | None = "graph") -> LatencyTable:
    """A hand-made latency table (no attention fit): every replay costs graph_ms, every eager forward eager_ms."""
    return dataclasses.replace(LatencyTable((8, 32), (graph_ms, graph_ms), (eager_ms, eager_ms)), mode=mode)


@pytest.mark.parametrize("graph_ms, eager_ms, replays", [(1.0, 5.0, True), (5.0, 1.0, False)])
def test_routing_follows_the_table(tiny_model, tiny_config, graph_ms, eager_ms, replays):
    """A table that says replays are faster replays every batch a budget holds; one that says eager is faster runs
    them eagerly. Either way the outputs equal the eager forward's, and the stats count the choice and both times."""
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", latency_table=table(graph_ms, eager_ms)).capture()
    grids = [[1, 4, 4], [2, 2, 4], [1, 12, 12]]  # two items that fit a budget, one that fits none
    pixels, grid = random_batch(grids, tiny_config, seed=30)
    steps = runner.plan(grid)
    assert [s.replay for s in steps] == [replays, False] and steps[1].budget is None
    assert [s.predicted_ms for s in steps] == [min(graph_ms, eager_ms), eager_ms]
    outs = runner.run(pixels, grid)
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(outs), tiny_model(pixels, grid), atol=1e-5, rtol=1e-5)
    s = runner.settle_stats()
    assert (s.replays, s.eager_batches, s.routed_eager) == ((1, 1, 0) if replays else (0, 2, 1))
    assert s.timed_batches == 2 and s.predicted_ms == pytest.approx(min(graph_ms, eager_ms) + eager_ms)
    assert s.measured_ms > 0 and s.prediction_error == pytest.approx(s.predicted_ms / s.measured_ms - 1)


def test_a_table_of_another_mode_is_refused(tiny_model):
    with pytest.raises(ValueError, match="measured 'graph-compiled'"):
        EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", latency_table=table(1, 2, mode="graph-compiled"))
    EncoderGraphRunner(tiny_model, CONFIG, mode="emulate", latency_table=table(1, 2, mode=None))  # made by hand


def test_the_plan_names_only_captured_budgets(tiny_model, tiny_config, monkeypatch):
    """A budget that failed to capture is never planned: its batches go to the next budget that was captured."""
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate")
    real = runner._capture_one

    def fail_16(cb):
        if cb.budget == 16:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real(cb)

    monkeypatch.setattr(runner, "_capture_one", fail_16)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (0, 0))
    runner.capture()
    assert sorted(runner.graphs) == [8, 32] and 16 in runner.failed
    pixels, grid = random_batch([[1, 6, 6]], tiny_config, seed=31)  # 9 tokens: budget 16 if it existed
    (step,) = runner.plan(grid)
    assert step.captured is runner.graphs[32] and step.budget == 32 and step.replay
    with torch.no_grad():
        torch.testing.assert_close(runner.run(pixels, grid)[0], tiny_model(pixels, grid), atol=1e-5, rtol=1e-5)


def test_items_of_a_batch_that_are_not_adjacent_are_gathered(runner, tiny_model, tiny_config):
    """FFD orders a batch largest first: items 1, 2, 0, whose rows are not one range of the request's, so they are
    gathered with one index into the static buffer."""
    grids = [[1, 2, 2], [1, 8, 8], [1, 2, 4]]  # 1, 16 and 2 tokens: one batch of 19 in budget 32
    pixels, grid = random_batch(grids, tiny_config, seed=32)
    (step,) = runner.plan(grid)
    assert step.items == (1, 2, 0) and step.captured is runner.graphs[32] and step.row_index is not None
    assert step.row_index.tolist() == list(range(4, 68)) + list(range(68, 76)) + list(range(0, 4))
    outs = runner.run(pixels, grid)
    with torch.no_grad():
        for out, g, (a, b) in zip(outs, grids, [(0, 4), (4, 68), (68, 76)], strict=True):
            torch.testing.assert_close(out, tiny_model(pixels[a:b], [g]), atol=1e-5, rtol=1e-5)


def test_nonfinite_pixels_are_refused_after_the_batches_run(runner, tiny_model, tiny_config):
    """run() checks finiteness once, at the end: the items holding NaN/Inf are named; without the check the other
    items' outputs are unchanged and only the poisoned one is not finite."""
    grids = [[1, 4, 4], [1, 2, 2], [1, 4, 2]]
    pixels, grid = random_batch(grids, tiny_config, seed=33)
    clean = runner.run(pixels, grid)
    pixels[17, 3] = float("nan")  # item 1 (rows 16..19)
    with pytest.raises(ValueError, match=r"item\(s\) \[1\] hold NaN or Inf"):
        runner.run(pixels, grid)
    unchecked = runner.run(pixels, grid, check_finite=False)
    assert torch.equal(unchecked[0], clean[0]) and torch.equal(unchecked[2], clean[2])
    assert not torch.isfinite(unchecked[1]).all()
    huge = pixels.clone()
    huge[17, 3] = 0.0
    huge[:16] = 3e38  # finite values whose row sums overflow: suspects, cleared value by value
    assert len(runner.run(huge, grid)) == 3


def test_one_runner_shared_by_threads_returns_each_caller_its_own_items(tiny_model, tiny_config):
    """Four threads share one runner: every output equals what that request gives alone. Without the runner's lock
    the static buffers are shared with no owner, and requests get each other's embeddings."""
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate").capture()
    rng = np.random.default_rng(34)
    requests = [random_batch(random_grids(rng, int(rng.integers(1, 5))), tiny_config, seed=100 + i)
                for i in range(24)]
    alone = [runner.run(*r) for r in requests]
    got: dict[int, list[torch.Tensor]] = {}

    def worker(k: int) -> None:
        for i in range(k, len(requests), 4):
            got[i] = runner.run(*requests[i])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wrong = [i for i in range(len(requests)) if not all(torch.equal(a, b) for a, b in zip(got[i], alone[i],
                                                                                          strict=True))]
    assert wrong == []


# ---- behaviour no other test pins down ------------------------------------------------------------------------
def test_replay_refuses_what_it_cannot_run(runner, tiny_config):
    pixels, grid = random_batch([[1, 8, 8]], tiny_config, seed=50)  # 16 tokens
    with pytest.raises(ValueError, match=r"budget 12 is not captured \(captured: \[8, 16, 32\]\)"):
        runner.replay(12, pixels, grid)
    with pytest.raises(ValueError, match="a batch of 16 tokens in 1 segments does not fit budget 8"):
        runner.replay(8, pixels, grid)
    out = runner.replay(16, pixels, grid)
    assert out is runner.graphs[16].output  # the static buffer itself: the next replay overwrites it


def test_the_layout_cache_is_bounded_and_plans_again_after_eviction(runner, tiny_config, monkeypatch):
    import glmvit.graphs as graphs

    monkeypatch.setattr(graphs, "LAYOUT_CACHE_SIZE", 2)
    a, b, c = ([[1, 2, 2 * k]] for k in (1, 2, 3))
    for grid in (a, b):
        runner.plan(grid)
    assert len(runner._layouts) == 2
    runner.plan(c)  # a third layout: the cache is emptied, then holds it alone
    assert len(runner._layouts) == 1
    first = runner.plan(a)
    assert all(x is y for x, y in zip(runner.plan(a), first, strict=True))  # cached again: the same steps


def test_a_plan_changed_by_its_caller_leaves_the_runner_s_plan_alone(runner, tiny_model, tiny_config):
    """runner.plan hands out the cached plan's steps in a list of the caller's own: emptying it once made every later
    request of those grids lose its items (an assertion, or no outputs for them under python -O)."""
    pixels, grid = random_batch([[1, 4, 4], [1, 2, 2]], tiny_config, seed=52)
    before = runner.run(pixels, grid)
    runner.plan(grid).clear()
    after = runner.run(pixels, grid)
    assert len(after) == 2 and all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_capture_again_replans_and_replays_correctly(tiny_model, tiny_config):
    runner = EncoderGraphRunner(tiny_model, CONFIG, mode="emulate").capture()
    pixels, grid = random_batch([[1, 4, 4], [1, 2, 2]], tiny_config, seed=51)
    before = runner.run(pixels, grid)
    old = runner.plan(grid)
    runner.capture()
    assert not any(x is y for x, y in zip(runner.plan(grid), old, strict=True))  # plans name the budgets they
    # replay: made anew
    after = runner.run(pixels, grid)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_a_plan_shows_budget_and_route_not_tensors():
    from glmvit import BudgetConfig, EncoderGraphRunner
    from glmvit.config import VisionConfig
    from glmvit.random_weights import random_encoder

    model = random_encoder(VisionConfig.tiny(), "cpu", torch.float32, 0)
    runner = EncoderGraphRunner(model, BudgetConfig((64, 256), 4, 8), mode="emulate").capture()
    text = repr(runner.plan([[1, 16, 16], [1, 8, 8]]))
    assert text == "[BatchStep(items=(0, 1), tokens=80, budget=256, route=replay)]"
    captured = repr(runner.graphs[256])
    assert captured.startswith("CapturedBudget(budget=256, ") and "tensor" not in captured


def test_a_compiled_capture_has_room_for_the_specialisations_earlier_captures_left(tiny_model, monkeypatch):
    """A process that keeps torch.compile's state between runners (a record run) holds earlier runners'
    specialisations on the same code: the capture's recompile limit counts them, so none of its frames falls back
    to running uncompiled when that limit is hit."""
    import torch._dynamo.config as dynamo_config

    from glmvit import graphs

    def specialise(x):
        return x + 1

    compiled = torch.compile(specialise, backend="eager", dynamic=False)
    for n in (1, 2, 3):
        compiled(torch.zeros(n))
    assert graphs._held_specialisations((specialise, tiny_model.embed)) == 3  # noqa: SLF001
    seen = []
    monkeypatch.setattr(graphs, "_held_specialisations", lambda functions: 20)
    monkeypatch.setattr(graphs.EncoderGraphRunner, "_capture_budget",
                        lambda self, budget, length=None: seen.append(dynamo_config.recompile_limit))
    EncoderGraphRunner(tiny_model, BudgetConfig((16, 32), 2, 4), mode="emulate", torch_compile=True).capture()
    assert seen == [20 + 2 * 2 + 8] * 2 and dynamo_config.recompile_limit == 8
    torch._dynamo.reset()


def test_equal_grids_are_validated_once_across_calls_and_anything_else_again(runner, tiny_model, tiny_config,
                                                                           monkeypatch):
    """run() keeps the requests it validated by the exact grids given: the same grid array (or equal bytes of the
    same dtype and shape) is checked once; other grids, the same array changed in place, and bad grids are checked
    on every call, and a cached request still checks its pixels."""
    import glmvit.request

    calls = []
    real = glmvit.request.as_grid_array
    monkeypatch.setattr(glmvit.request, "as_grid_array", lambda g: calls.append(1) or real(g))
    pixels, grid = random_batch([[1, 4, 4], [2, 2, 2]], tiny_config, seed=60)
    grids = grid.numpy().copy()
    first = [runner.run(pixels, grids) for _ in range(3)] + [runner.run(pixels, grids.copy())]
    assert len(calls) == 1 and all(torch.equal(a, b) for outs in first for a, b in zip(outs, first[0], strict=True))
    runner.run(pixels, torch.from_numpy(grids))  # the same grids as a CPU tensor: equal bytes, dtype and shape
    runner.run(pixels, grids.astype(np.int32))  # another dtype: its own key
    assert len(calls) == 2
    grids[0] = [1, 2, 8]  # changed in place: other bytes, validated and planned again
    outs = runner.run(pixels, grids)
    assert len(calls) == 3
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(outs), tiny_model(pixels, grids), atol=1e-5, rtol=1e-5)
    bad, checked = np.array([[1, 3, 4]]), len(calls)
    for _ in range(2):
        with pytest.raises(ValueError, match="divisible"):
            runner.run(torch.zeros(12, tiny_config.patch_dim), bad)
    assert len(calls) == checked + 2
    with pytest.raises(ValueError, match="pixel_values has 23 rows"):
        runner.run(pixels[:23], grids)  # cached grids, wrong pixels


def test_the_request_cache_is_bounded_and_keys_only_exact_host_grids():
    from glmvit.request import EncoderRequest, RequestCache, grids_key

    cache = RequestCache(size=2)
    made = []

    def make(g):
        made.append(1)
        return EncoderRequest.of(g)

    for k in (1, 2, 1, 3, 1):
        cache.of(np.array([[1, 2, 2 * k]]), make)
    assert len(made) == 4 and len(cache) == 2  # the third grids emptied it: 1 made again after them
    assert grids_key([[1, 2, 2]]) is None and grids_key(np.array([[1.0, 2.0, 2.0]])) is None  # lists, floats: no
    assert grids_key(torch.tensor([[1, 2, 2]])) == grids_key(np.array([[1, 2, 2]]))
    cache.of([[1, 2, 2]], make)
    cache.of([[1, 2, 2]], make)
    assert len(made) == 6  # not keyed: validated every time
