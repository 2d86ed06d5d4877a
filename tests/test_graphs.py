"""EncoderGraphRunner on CPU through the emulate backend (same buffers and bookkeeping, no CUDA graph)."""
import numpy as np
import pytest
import torch

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
    return EncoderGraphRunner(tiny_model, CONFIG, backend="emulate", check_pointers=True, progress=False).capture()


@pytest.mark.parametrize("seed", range(6))
def test_runner_equals_forward_per_item(runner, tiny_model, tiny_config, seed):
    rng = np.random.default_rng(seed)
    grids = random_grids(rng, int(rng.integers(1, 9)))
    pixels, grid = random_batch(grids, tiny_config, seed=seed)
    outs = runner.run(pixels, grid)
    assert len(outs) == len(grids)
    start = 0
    with torch.no_grad():
        for out, (t, h, w) in zip(outs, grids, strict=False):
            rows = t * h * w
            expected = tiny_model(pixels[start : start + rows], torch.tensor([[t, h, w]]))
            start += rows
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


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
    assert s.budget_tokens >= s.real_tokens and 0 <= s.padding_fraction < 1
    assert s.replays >= 1 and s.total_s >= s.host_s > 0
    assert set(s.capture) == set(CONFIG.token_budgets)


def test_frame_capacity_overflow_falls_back(tiny_model, tiny_config):
    """A clip with more temporal patches than any graph's frame capacity runs eagerly instead of crashing."""
    config = BudgetConfig(token_budgets=(16, 32), max_items=2, max_segments=3)
    runner = EncoderGraphRunner(tiny_model, config, backend="emulate", progress=False).capture()
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
        EncoderGraphRunner(tiny_model, CONFIG, backend="cuda")
    with pytest.raises(ValueError, match="backend must be"):
        EncoderGraphRunner(tiny_model, CONFIG, backend="graph")
    monkeypatch.setattr(tiny_model, "attn_backend", "segments")
    EncoderGraphRunner(tiny_model, CONFIG, backend="emulate")  # emulation captures nothing: any backend runs
    monkeypatch.setattr(type(tiny_model), "device", property(lambda self: torch.device("cuda")))  # no GPU needed
    with pytest.raises(ValueError, match="not graph-safe"):
        EncoderGraphRunner(tiny_model, CONFIG, backend="cuda")


def test_emulation_never_claims_a_graph(runner):
    assert runner.backend == "emulate" and all(bg.graph is None for bg in runner.graphs.values())


def test_metadata_is_rebuilt_only_when_the_grids_change(runner, tiny_model, tiny_config, monkeypatch):
    """A budget keeps the metadata of its last batch: same grids ⇒ no rebuild; other grids ⇒ rebuilt and correct."""
    import glmvit.graphs as graphs

    calls = []
    real = graphs.build_metadata
    monkeypatch.setattr(graphs, "build_metadata", lambda *a, **k: calls.append(a[0].tolist()) or real(*a, **k))
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


def test_compile_scope_is_checked_and_blocks_compile_one_function_for_all(tiny_model):
    config = BudgetConfig((16, 32), 2, 4)
    with pytest.raises(ValueError, match="compile_scope must be one of"):
        EncoderGraphRunner(tiny_model, config, backend="emulate", torch_compile=True, compile_scope="layers")
    runner = EncoderGraphRunner(tiny_model, config, backend="emulate", torch_compile=True)
    embed, block, head = runner.forward_static.keywords["parts"]  # nothing compiles until the first call
    assert block is not tiny_model.blocks[0] and all(callable(f) for f in (embed, block, head))
    whole = EncoderGraphRunner(tiny_model, config, backend="emulate", torch_compile=True, compile_scope="model")
    assert not hasattr(whole.forward_static, "keywords")
    assert EncoderGraphRunner(tiny_model, config, backend="emulate").forward_static == tiny_model.forward_static
