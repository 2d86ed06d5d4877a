"""glmvit.lab.cuda_graphs' notebook views: the tape listing, the capture's allocations and peak, the host-sync
verdicts, the pool growth and pictures."""
from __future__ import annotations

import json
from types import SimpleNamespace

import matplotlib
import torch

from glmvit.env import RECORDED
from glmvit.lab import cuda_graphs as lab
from glmvit.lab.tape import Tape, capture
from glmvit.testing import forbid_host_syncs

matplotlib.use("Agg")


def taped(depth=2):
    net, x = lab.TinyMLP(depth=depth).eval(), torch.zeros(4, 32)
    tape, _ = capture(net, x)
    return tape, net, x, {x.data_ptr()} | {p.data_ptr() for p in net.parameters()}


def test_listing_names_views_and_new_tensors():
    tape, net, x, _ = taped()
    names = {x.data_ptr(): "x"} | {p.data_ptr(): n for n, p in net.named_parameters()}
    lines = lab.tape_listing(tape, names)
    assert len(lines) == 6 and "a view of layers.0.weight" in lines[0]
    assert lines[1].endswith("writes t1") and "reads t1" in lines[2] and "reads layers.1.bias, t2" in lines[4]


def test_allocations_and_peak_count_only_what_the_capture_made():
    tape, _, _, outside = taped(depth=3)
    made = lab.capture_allocations(tape, outside)
    assert len(made) == 6 and set(made.values()) == {4 * 32 * 4}
    assert lab.peak_alive(tape, outside) == 2
    assert lab.peak_alive(tape, set()) > 2  # counting the weights and input as made by the capture keeps them alive


def test_raises_under_and_the_verdict_table():
    x = torch.randn(3)
    assert lab.raises_under(forbid_host_syncs, lambda: x.sum().item())
    assert lab.raises_under(Tape, lambda: torch.nonzero(x > 0)) and not lab.raises_under(Tape, lambda: x + 1)
    table = lab.sync_table({"a": (True, False)}, {"a": True}).splitlines()
    assert len(table) == 2 and table[1].split() == ["a", "raises", "-", "raises"]


def test_pool_views():
    sweep = SimpleNamespace(capture={"64": {"graph_bytes": 2**20}, "4096": {"graph_bytes": 2**30}})
    growth = lab.pool_growth(sweep)
    assert growth == {64: 2**20, 4096: 2**30}
    bars = lab.plot_pool_growth(growth, "abc1234").axes[0].patches
    assert [b.get_height() for b in bars] == [1024, 1]  # MiB, largest budget first
    pools = json.loads((RECORDED / "03_pools.json").read_text())
    assert len(lab.plot_pool_strategies(pools).axes[0].lines) == len(pools["strategies"])
