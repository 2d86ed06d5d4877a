"""glmvit.timing.time_passes: how bench times a request and latency an eager forward — passes of n calls while the
median is known worse than ±precision, a pass cut short by its time budget — and that both commands use it with
the same warm-up, precision and passes. Calls advance a fake clock, so the counts are exact."""
import numpy as np
import pytest
import torch

from glmvit import timing


class Clock:
    """perf_counter and thread_time for glmvit.timing: a call advances it by the next of ``steps`` (seconds)."""

    def __init__(self, steps):
        self.now, self.steps, self.calls = 0.0, list(steps), 0

    def call(self, j):
        self.now += self.steps[self.calls % len(self.steps)]
        self.calls += 1
        return j

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    def make(steps):
        c = Clock(steps)
        monkeypatch.setattr(timing.time, "perf_counter", c)
        monkeypatch.setattr(timing.time, "thread_time", c)
        return c
    return make


def test_a_steady_call_takes_one_pass_after_its_warmup(clock):
    c = clock([0.010])
    ms, cpu, passes = timing.time_passes(c.call, 50, "cpu", warmup=5)
    assert passes == 1 and len(ms) == 50 and c.calls == 55
    assert ms == pytest.approx([10.0] * 50) and cpu == pytest.approx(ms)


def test_a_noisy_call_runs_more_passes_up_to_the_most(clock):
    noisy = clock([0.010, 0.020])  # half at 10 ms, half at 20: the median's interval spans both
    ms, _, passes = timing.time_passes(noisy.call, 20, "cpu", precision=0.02, max_passes=3)
    assert passes == 3 and len(ms) == 60
    assert timing.relative_halfwidth(ms) > 0.02


def test_a_pass_budget_cuts_slow_calls_but_not_fast_ones(clock):
    slow = clock([0.2])
    ms, _, passes = timing.time_passes(slow.call, 50, "cpu", pass_budget_s=0.5, min_calls=3)
    assert (len(ms), passes) == (3, 1)  # 0.6 s > 0.5 s after three calls; identical times: precise, no second pass
    fast = clock([0.01])
    ms, _, _ = timing.time_passes(fast.call, 50, "cpu", pass_budget_s=0.6, min_calls=3)
    assert len(ms) == 50


def test_outputs_are_kept_after_the_clock_stops(clock):
    c = clock([0.01])
    seen = []

    def after(j, out):
        seen.append((j, out, c.now))
        c.now += 1.0  # time spent here is not any call's

    ms, _, _ = timing.time_passes(c.call, 4, "cpu", after=after)
    assert [s[:2] for s in seen] == [(j, j) for j in range(4)] and ms == pytest.approx([10.0] * 4)


def test_bench_and_latency_time_an_eager_forward_by_one_rule(monkeypatch):
    """latency times each distinct batch's eager forward once, with bench's warm-up, precision and passes and at
    least as many forwards a pass as bench's one-shape workloads send requests."""
    from glmvit.cli import bench, latency
    from glmvit.cli.common import model_from_args

    args = bench.build_parser().parse_args([])
    assert (args.warmup, args.precision, args.max_passes) == (timing.WARMUP, timing.PRECISION, timing.MAX_PASSES)
    calls = []

    def spy(call, n, device, precision=timing.PRECISION, max_passes=timing.MAX_PASSES, warmup=0, **kw):
        calls.append((n, warmup, precision, max_passes))
        return [1.0] * 3, [1.0] * 3, 1

    monkeypatch.setattr(latency, "time_passes", spy)
    largs, config = latency.parse(["--device", "cpu", "--config", "tiny", "--quiet", "--warmup", "0", "--runs", "1",
                                   "--budgets", "64,128"])
    model = model_from_args(largs)
    runner = latency.EncoderGraphRunner(model, config, mode="emulate", progress=False).capture()
    eager: latency.EagerTimes = {}
    with torch.inference_mode():
        rows = latency.measure(runner, model, 1, 0, 0, True, eager)
    grids = {tuple(map(tuple, lay["grids"])) for row in rows for lay in row["layouts"]}
    assert len(calls) == len(grids) == len(eager) < sum(len(row["layouts"]) for row in rows)
    assert all(c == (50, timing.WARMUP, timing.PRECISION, timing.MAX_PASSES) for c in calls)
    assert np.all([lay["eager_ms"] == 1.0 for row in rows for lay in row["layouts"]])


def test_distribution_is_the_one_summary_of_what_a_server_observes():
    assert timing.distribution([]) == dict.fromkeys(("mean", "median", "p99", "min", "max"))
    summary = timing.distribution([3.0, 1.0, 2.0])
    assert (summary["mean"], summary["median"], summary["min"], summary["max"]) == (2.0, 2.0, 1.0, 3.0)
    assert 2.0 < summary["p99"] <= 3.0


def test_demo_times_with_the_library(monkeypatch, capsys):
    """The demo's eager and runner times come from timing.time_calls (one call per item, one for the runner), not
    from a loop of its own."""
    from glmvit.cli import main

    calls = []
    real = timing.time_calls

    def counted(fn, device, runs, warmup=0, on_device=False):
        calls.append(runs)
        return real(fn, device, runs, warmup, on_device)

    monkeypatch.setattr(timing, "time_calls", counted)
    assert main(["demo", "--device", "cpu"]) == 0
    items = capsys.readouterr().out.count(" image ") + 1  # four images and the clip
    assert len(calls) == items + 1 and calls[-1] == 1


def test_a_later_pass_stops_once_the_median_is_known_and_a_noisy_call_fills_every_pass(clock):
    # the first pass (every request once) is noisy: a second is needed; from then on every call takes 15 ms, and
    # after 20 of them the interval is within ±2 %: the second pass stops there, not at its 40th call
    settles = clock([0.010, 0.020] * 20 + [0.015] * 1000)
    ms, _, passes = timing.time_passes(settles.call, 40, "cpu", precision=0.02, max_passes=3)
    assert passes == 2 and len(ms) == 40 + 2 * timing.CHECK_EVERY
    assert timing.relative_halfwidth(ms) <= 0.02
    noisy = clock([0.010, 0.020])
    ms, _, passes = timing.time_passes(noisy.call, 40, "cpu", precision=0.02, max_passes=3)
    assert passes == 3 and len(ms) == 120  # never precise: every pass whole, to the cap


def test_a_replay_is_timed_until_its_median_is_precise_between_a_floor_and_a_cap(clock):
    steady = clock([0.025])
    assert len(timing.time_to_precision(lambda: steady.call(0), "cpu", 20, 50, 0.005, warmup=5)) == 20
    assert steady.calls == 25
    noisy = clock([0.025, 0.030])
    assert len(timing.time_to_precision(lambda: noisy.call(0), "cpu", 20, 50, 0.005)) == 50
    with pytest.raises(ValueError):
        timing.time_to_precision(lambda: None, "cpu", 30, 20, 0.005)
