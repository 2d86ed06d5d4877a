"""The CPU helpers the notebooks moved into glmvit.lab: the seed's configuration, the staging-race emulation, the tape,
the worker simulation, the multipart body and the data-parallel check summary."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from glmvit.lab.data_parallel import check_costs, slowest
from glmvit.lab.seed import SEED_PATH, WORKLOADS, load_seed, seed_budget_config, seed_rows, seed_serve
from glmvit.lab.serving import multipart, simulate_worker
from glmvit.lab.staging import serve
from glmvit.lab.tape import CaptureError, capture
from glmvit.packing import BudgetConfig


def test_the_seed_config_is_the_published_one():
    published = json.loads(SEED_PATH.read_text())["compilation_config"]
    config = seed_budget_config(load_seed())
    assert config == BudgetConfig(tuple(published["encoder_cudagraph_token_budgets"]),
                                  published["encoder_cudagraph_max_vision_items_per_batch"],
                                  published["encoder_cudagraph_max_frames_per_batch"])


def test_seed_rows_follow_the_file():
    seed = load_seed()
    rows = seed_rows(seed, "1× RTX 4090")
    assert set(rows) == set(WORKLOADS)
    for preset, workload in WORKLOADS.items():
        row = next(r for r in seed["encoder_forward_ms"] if r["workload"] == workload and r["gpus"] == "1× RTX 4090")
        assert rows[preset]["mean"] == (row["eager"]["mean_ms"], row["graph"]["mean_ms"])
        assert rows[preset]["p99"] == (row["eager"]["p99_ms"], row["graph"]["p99_ms"])
    assert seed_serve(seed)["request throughput (req/s)"] == (seed["serve"]["eager"]["request_throughput"],
                                                              seed["serve"]["graph"]["request_throughput"])


@pytest.mark.parametrize(("buffers", "guard", "seen", "waits"), [
    (1, False, [3, 3, 3], 0), (2, False, [3, 2, 3], 0), (1, True, [1, 2, 3], 2), (2, True, [1, 2, 3], 1)])
def test_the_staging_emulation_races_exactly_where_a_buffer_is_reused_unguarded(buffers, guard, seen, waits):
    got, log, waited = serve([np.full(4, k) for k in (1, 2, 3)], buffers, guard)
    assert [v[0] for v in got] == seen and waited == waits and len(log) == 9


def test_the_tape_replays_on_the_captured_buffers_and_refuses_a_host_read():
    net = torch.nn.Linear(3, 2)
    x = torch.zeros(1, 3)
    tape, y = capture(net, x)
    new = torch.randn(1, 3)
    x.copy_(new)
    tape.replay()
    with torch.no_grad():
        assert torch.allclose(y, net(new))
    with pytest.raises(CaptureError, match="host needs a value"):
        capture(lambda t: t.sum().item(), x)


def test_a_lone_arrival_waits_for_the_window_and_its_batch():
    service = {1: 0.002, 2: 0.003}.get
    times = simulate_worker(rate=1e-3, wait=0.0, service=service, capacity=2, n=50)
    assert np.allclose(times, 0.002)  # one arrival per 1000 s: never queued, never batched
    waited = simulate_worker(rate=1e-3, wait=0.001, service=service, capacity=2, n=50)
    assert np.allclose(waited, 0.003)  # the window is paid in full when nobody else arrives


def test_multipart_names_every_file(tmp_path):
    paths = [tmp_path / "a.jpg", tmp_path / "b.gif"]
    for p in paths:
        p.write_bytes(b"x" * 10)
    body, content_type = multipart(paths)
    boundary = content_type.split("boundary=")[1]
    assert body.count(f"--{boundary}".encode()) == 3 and b'filename="a.jpg"' in body and b'filename="b.gif"' in body


def test_check_costs_takes_the_slower_rank_per_request():
    rank = {"ms": {"glmvit": [3.0, 5.0], "gather-only": [1.0, 1.0]}, "hash_ms": [1.0], "inputs_ms": [0.5],
            "exchange_ms": {"8": [0.1]}, "check_phase_ms": [2.0], "pixel_bytes": 1000}
    other = {**rank, "ms": {"glmvit": [4.0, 4.0], "gather-only": [2.0, 0.5]}}
    costs = check_costs([rank, other])
    assert slowest([[1.0, 4.0], [2.0, 3.0]]) == 3.0
    assert costs["med"] == {"glmvit": 4.5, "gather-only": 1.5} and costs["gap"] == 3.0
    assert costs["exchanges"] == [(8, 0.1)] and costs["parts"] == pytest.approx(1.6)
    assert costs["hash_rate"] == pytest.approx(1000 / 1e-3)
