"""The one Encoder boundary: RunMode/GraphMode parse strings once, an encoder's attention backend is fixed when it
is made, and eager and graph encoders give the same bits (every command's encoder comes from build_encoder:
test_cli.py)."""
import json

import pytest
import torch

import glmvit.model
from glmvit.encoder import EagerEncoder, Encoder, build_encoder
from glmvit.graphs import EncoderGraphRunner
from glmvit.modes import GraphMode, RunMode
from glmvit.packing import BudgetConfig
from glmvit.request import EncoderRequest
from glmvit.scheduler import BatchScheduler
from glmvit.workloads import random_batch

CONFIG = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)


@pytest.mark.parametrize("enum, word, choices", [(RunMode, "graph-emulated", "eager, graph, graph-compiled"),
                                                 (GraphMode, "graph", "cuda, emulate")])
def test_an_unknown_mode_is_one_line_naming_the_choices(enum, word, choices):
    with pytest.raises(ValueError) as info:
        enum.parse(word)
    assert str(info.value) == f"unknown {enum.__name__} {word!r}; choose one of {choices}"


def test_modes_are_their_strings():
    """Records, flags and dictionaries keyed by the strings see the members as those strings."""
    for mode in (*RunMode, *GraphMode):
        assert mode == mode.value and hash(mode) == hash(mode.value) and f"{mode}" == str(mode) == mode.value
        assert {mode.value: 1}[mode] == 1 and json.dumps(mode) == json.dumps(mode.value)
        assert type(mode).parse(mode.value) is mode
    assert GraphMode.for_device(torch.device("cpu")) is GraphMode.EMULATE
    assert GraphMode.for_device("cuda:1") is GraphMode.CUDA
    labels = {(m, g): m.label(g) for m in RunMode for g in GraphMode}
    assert labels[RunMode.GRAPH, GraphMode.EMULATE] == "graph-emulated"
    assert labels[RunMode.GRAPH_COMPILED, GraphMode.CUDA] == "graph-compiled"
    assert labels[RunMode.EAGER, GraphMode.EMULATE] == "eager"


def test_build_encoder_refuses_an_unknown_mode_and_backend(tiny_model):
    with pytest.raises(ValueError, match="unknown RunMode 'cuda'; choose one of eager, graph, graph-compiled"):
        build_encoder(tiny_model, "cuda", CONFIG)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        build_encoder(tiny_model, "eager", CONFIG, attention="nope")


@pytest.fixture
def backends_run(monkeypatch):
    """The attention backend of every block the model runs, in order."""
    seen: list[str] = []
    real = glmvit.model.run_block

    def spy(block, x, cos, sin, meta, backend, captured=False):
        seen.append(backend)
        return real(block, x, cos, sin, meta, backend, captured)

    monkeypatch.setattr(glmvit.model, "run_block", spy)
    return seen


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_the_attention_backend_cannot_change_after_construction(tiny_model, tiny_config, monkeypatch, backends_run,
                                                                 mode):
    """Setting model.attn_backend after the encoder is made changes nothing it runs: neither its replays nor the
    runner's eager fallback (an item larger than every budget)."""
    monkeypatch.setattr(tiny_model, "attn_backend", None)
    encoder = build_encoder(tiny_model, mode, CONFIG, attention="sdpa_masked")
    assert isinstance(encoder, Encoder) and encoder.attention == "sdpa_masked"
    monkeypatch.setattr(tiny_model, "attn_backend", "segments")
    pixels, grid = random_batch([[1, 4, 4], [1, 16, 16]], tiny_config, seed=3)  # 4 tokens, and 64: beyond 32
    backends_run.clear()
    encoder.encode(pixels, tiny_model.check_request(pixels, grid), sync=True)
    assert backends_run and set(backends_run) == {"sdpa_masked"}
    if isinstance(encoder, EncoderGraphRunner):
        assert encoder.stats.replays == 1 and encoder.stats.fallback_items == 1  # both paths ran


def test_eager_and_graph_encoders_give_the_same_bits_per_item(tiny_model, tiny_config):
    pixels, grid = random_batch([[1, 4, 4], [2, 2, 4], [1, 8, 8]], tiny_config, seed=7)
    request = tiny_model.check_request(pixels, grid)
    eager = build_encoder(tiny_model, RunMode.EAGER, CONFIG).encode(pixels, request, sync=False)
    runner = build_encoder(tiny_model, RunMode.GRAPH, CONFIG)
    assert isinstance(runner, EncoderGraphRunner) and runner.mode is GraphMode.EMULATE
    assert runner.label == "graph-emulated" and runner.budgets is CONFIG
    graph = runner.encode(pixels, request, sync=True)
    assert [o.shape[0] for o in eager] == request.item_tokens
    ref = tiny_model(pixels, grid)
    assert torch.equal(torch.cat(eager), ref)
    assert all(torch.equal(a, b) for a, b in zip(runner.run(pixels, grid), graph, strict=True))


def test_the_scheduler_takes_any_encoder(tiny_model, tiny_config):
    """A model is wrapped as the eager encoder; anything that is not an encoder is refused by name."""
    scheduler = BatchScheduler(tiny_model, CONFIG, start=False)
    assert isinstance(scheduler.encoder, EagerEncoder) and scheduler.mode == "eager"
    scheduler.close()
    with pytest.raises(ValueError, match="needs limits"):
        BatchScheduler(EagerEncoder(tiny_model), start=False)
    with pytest.raises(TypeError, match="expected an Encoder or a GlmVisionEncoder, got str"):
        BatchScheduler("graph", CONFIG, start=False)  # type: ignore[arg-type]


def test_a_request_of_another_merge_size_is_refused_by_every_encoder(tiny_model, tiny_config):
    pixels, grid = random_batch([[1, 4, 4]], tiny_config, seed=1)
    other = EncoderRequest.of(grid, merge=1)
    for mode in ("eager", "graph"):
        with pytest.raises(ValueError, match="merge size 1"):
            build_encoder(tiny_model, mode, CONFIG).encode(pixels, other, sync=True)
