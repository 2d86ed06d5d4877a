"""glmvit.lab.static_forward's notebook views: padded buffers, the sync and error catchers, the layout and
padding-work pictures, the latency sweep's reading, the recorded tables, and the exercises' guard, mask and slots."""
from __future__ import annotations

import json
from types import SimpleNamespace

import matplotlib
import pytest
import torch

from glmvit.attention import attend
from glmvit.env import RECORDED
from glmvit.lab import static_forward as lab
from glmvit.metadata import BatchShape, attention_work, build_metadata
from glmvit.records import LatencySweep, find_one
from glmvit.testing import forbid_host_syncs
from glmvit.workloads import random_batch

matplotlib.use("Agg")


def test_padded_copies_into_the_head_of_a_zero_buffer():
    buf = lab.padded(torch.ones(3, 2), 5)
    assert buf.tolist() == [[1, 1]] * 3 + [[0, 0]] * 2
    with pytest.raises(ValueError, match="3 pixel rows do not fit a buffer of 2"):
        lab.padded(torch.ones(3, 2), 2)


def test_sync_message_names_a_host_sync_and_passes_device_work():
    x = torch.arange(4.0)
    assert lab.sync_message(lambda: x * 2) is None
    assert "host sync" in lab.sync_message(lambda: x.sum().item())


def test_value_error_returns_the_message_and_lets_other_errors_through():
    assert lab.value_error(lambda: None) is None
    assert lab.value_error(lambda: int("x")).startswith("invalid literal")
    with pytest.raises(KeyError):
        lab.value_error(lambda: {}["k"])


def test_the_layout_mask_is_block_diagonal_with_padding_alone():
    meta = build_metadata([[1, 2, 2], [1, 2, 4]], 2, BatchShape(rows=16, segments=4, max_seqlen=16)).to("cpu")
    fig, mask = lab.plot_packed_layout(meta)
    expected = torch.block_diag(torch.ones(4, 4), torch.ones(8, 8), torch.eye(4)).bool()
    assert torch.equal(mask, expected) and len(fig.axes) == 2
    assert sum(len(ax.patches) for ax in fig.axes) == 3  # two segments and the padding


def test_padding_work_outside_every_segment_and_in_a_dummy_one():
    shape = BatchShape(rows=64, segments=4, max_seqlen=64)
    assert lab.dummy_segment_work([[1, 4, 4]], shape) == 16**2 + 48**2
    fig, work = lab.plot_padding_work(shape)
    assert work["sides"] == [2, 4, 6, 8] and work["padded_rows"] == [60, 48, 28, 0]
    assert work["outside"] == [16, 256, 1296, 4096] and work["dummy"] == [16 + 3600, 256 + 2304, 1296 + 784, 4096]
    assert len(fig.axes[0].lines) == 2


def layout(name, tokens, graph_ms, eager_ms=1.0, rows2=0):
    return SimpleNamespace(name=name, real_tokens=tokens, graph_ms=graph_ms, eager_ms=eager_ms, segment_rows2=rows2)


def hand_sweep():
    budgets = [SimpleNamespace(tokens=t, full_graph_ms=g, graph_ms=g, worst_layout_vs_full=1.0,
                               layouts=[layout("full", t, g), layout("one-small", 16, g / 2)] if t > 16
                               else [layout("full", t, g)]) for t, g in ((16, 1.0), (64, 4.0))]
    return SimpleNamespace(budgets=budgets, attn_backend="auto", provenance=SimpleNamespace(gpu="G"))


def test_the_dummy_segment_prediction_adds_the_padding_squared():
    sweep = hand_sweep()
    assert set(lab.sweep_layouts(sweep)[64]) == {"full", "one-small"}
    # budget 64: 48 padded tokens, 192 padded rows: 192² / 10⁶ at 10 ms per 10⁶ rows², on 2 ms measured
    assert lab.dummy_segment_ms(sweep, 10.0) == {64: pytest.approx(2.0 + 10 * 192**2 / 1e6)}


def test_latency_lines_and_figure_on_a_hand_made_sweep():
    sweep = hand_sweep()
    predicted = lab.dummy_segment_ms(sweep, 10.0)
    lines = lab.latency_lines(sweep, predicted)
    assert len(lines) == 2 and "one 224² image" not in lines[0] and "2.00 ms replayed" in lines[1]
    fig = lab.plot_latency_sweep(sweep, predicted)
    assert len(fig.axes[0].lines) == len(lab.LAYOUTS) + 2


def test_latency_views_read_the_recorded_sweep():
    _, sweep = find_one(LatencySweep, compiled=False)
    predicted = lab.dummy_segment_ms(sweep, 1.0)
    assert len(lab.latency_lines(sweep, predicted)) == len(sweep.budgets)
    assert all(predicted[t] > lay["one-small"].graph_ms for t, lay in lab.sweep_layouts(sweep).items()
               if "one-small" in lay and 4 * lay["one-small"].real_tokens < 4 * t)


def test_record_tables_have_a_line_per_backend():
    captured = json.loads((RECORDED / "04_capture_on_a_replay_b.json").read_text())
    lines = lab.capture_lines(captured)
    assert len(lines) == len(captured["max_abs_diff"]) + 1 and lines[-1].startswith("capturing the shipped segments")
    ab = json.loads((RECORDED / "04_attention_backends.json").read_text())
    lines = lab.backend_lines(ab)
    assert len(lines) == len(ab["attention_vs_fp32"]) + len(ab["encoder_vs_transformers_fp32"])
    assert "µs per call" in lines[0] and lines[-1].startswith("tiny encoder")


def test_time_forward_static_runs_each_backend_and_restores_the_default():
    seen = []
    net = SimpleNamespace(attn_backend=None)
    net.forward_static = lambda buf, meta: seen.append(net.attn_backend) or buf * 2
    results = lab.time_forward_static(net, torch.ones(2), None, ["a", "b"])
    assert set(results) == {"a", "b"} and torch.equal(results["a"][0], torch.full((2,), 2.0))
    assert results["b"][1] >= 0 and net.attn_backend is None and seen.count("a") == 10


def two_segments():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 1, 4, generator=gen) for _ in range(3))
    return q, k, v, build_metadata([[1, 2, 2], [1, 2, 2]]).to("cpu")


def test_plain_masked_matches_per_segment_attention_and_leaks_nan():
    q, k, v, meta = two_segments()
    torch.testing.assert_close(lab.plain_masked(q, k, v, meta, None), attend(q, k, v, meta, "segments"))
    v[6, 0, 0] = float("nan")
    assert lab.plain_masked(q, k, v, meta, None)[:4, 0, 0].isnan().all()


def test_forward_static_with_where_is_forward_static_and_multiply_leaks(tiny_model, tiny_config):
    pixels, grid = random_batch([[1, 4, 4]], tiny_config, seed=0)
    meta = build_metadata(grid, 2, BatchShape(rows=32, segments=2, max_seqlen=32)).to("cpu")
    buf = lab.padded(pixels, 32)
    buf[16:] = float("nan")
    tiny_model.attn_backend = "sdpa_masked"
    with torch.no_grad():
        expected = tiny_model.forward_static(buf, meta)
        torch.testing.assert_close(lab.forward_static_with(tiny_model, buf, meta, "where"), expected)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("glmvit.attention.attend", lab.plain_masked)
            assert lab.forward_static_with(tiny_model, buf, meta, "multiply")[:4].isnan().all()
    tiny_model.attn_backend = None
    with pytest.raises(ValueError, match="guard 'mask'"):
        lab.forward_static_with(tiny_model, buf, meta, "mask")


def test_sdpa_blocks_matches_segments_without_a_host_sync():
    gen = torch.Generator().manual_seed(1)
    shape = BatchShape(rows=48, segments=4, max_seqlen=48)
    meta = build_metadata([[1, 4, 4], [2, 2, 2]], 2, shape).to("cpu")  # 16 + 4 + 4 rows, then 24 padded
    q, k, v = (torch.randn(48, 2, 8, generator=gen) for _ in range(3))
    with forbid_host_syncs():
        got = lab.sdpa_blocks(q, k, v, meta)
    expected = attend(q, k, v, meta, "segments")
    torch.testing.assert_close(got[:24], expected[:24])
    assert torch.all(got[24:] == 0) and attention_work(build_metadata([[1, 4, 4], [2, 2, 2]], 2, shape)) == 288
