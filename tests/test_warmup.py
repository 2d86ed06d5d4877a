"""glmvit.warmup: one row count per kernel class, read off the launch tables, and the scheduler's worker warming its
eager route before its first batch. On CUDA: after the warm-up, a first forward of a new shape compiles nothing."""
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from glmvit import VisionConfig
from glmvit.kernels import fused_gemm_table
from glmvit.packing import BudgetConfig
from glmvit.scheduler import BatchScheduler
from glmvit.warmup import SCAN_ROWS, SPECIALISE, WarmUp, eager_classes, kernel_class
from glmvit.workloads import random_batch

FULL = VisionConfig.glm41v()
TINY = VisionConfig.tiny()
LIMITS = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)
TIMEOUT = 60


@pytest.fixture
def hopper(monkeypatch):
    """The tables as a Hopper GPU reads them (the fused GEMMs' rule asks the device), without one."""
    pytest.importorskip("triton")  # the attention table's configurations are Triton's
    monkeypatch.setattr(fused_gemm_table, "measured_gpu", lambda device: True)


def test_every_threshold_of_the_launch_tables_lies_below_the_scan():
    """What makes the scan's end safe: past SCAN_ROWS no table changes its choice."""
    from glmvit.kernels import fa4_table
    from glmvit.kernels.attention_table import CONFIGS, CUDNN_MIN_ROWS

    thresholds = [limit for limit, _ in CONFIGS if limit is not None] + [
        CUDNN_MIN_ROWS, fa4_table.FA4_MIN_ROWS, fused_gemm_table.SWIGLU_MIN_ROWS,
        fused_gemm_table.SWIGLU_PERSISTENT_MIN_ROWS, fused_gemm_table.QKV_ROPE_MIN_ROWS]
    assert max(t for t in thresholds if t is not None) < SCAN_ROWS


@pytest.mark.parametrize("fa4", [False, True], ids=["without-fa4", "fa4-loads"])
@pytest.mark.parametrize("attention", ["auto", "triton", "cudnn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_past_the_scan_is_of_a_class_the_warm_up_runs(hopper, monkeypatch, fa4, attention, dtype):
    """Row counts from the scan's end to 400K (below cuDNN's int32 offsets), sampled: each falls in the class of a
    listed row count, and each listed one is the smallest of its class (none below it shares it)."""
    monkeypatch.setattr("glmvit.kernels.fa4_attention.loads", lambda: fa4)
    cuda = torch.device("cuda")
    rows_of = eager_classes(attention, FULL, cuda, dtype)
    classes = {kernel_class(r, attention, FULL, cuda, dtype): r for r in rows_of}
    assert len(classes) == len(rows_of) and list(rows_of) == sorted(rows_of)
    for rows in range(SCAN_ROWS, 400_000, 4 * 997):
        assert kernel_class(rows, attention, FULL, cuda, dtype) in classes, rows
    for cls, rows in classes.items():
        assert all(kernel_class(r, attention, FULL, cuda, dtype) != cls for r in range(4, rows, 4))
    if fa4 and attention == "auto":
        from glmvit.kernels.fa4_table import FA4_MIN_ROWS

        assert FA4_MIN_ROWS in rows_of and "fa4" in {cls[0] for cls in classes}


def test_the_classes_split_on_the_launch_tables_and_on_tritons_divisibility(hopper):
    """auto in bf16: Triton's two attention configurations and cuDNN, the fused SwiGLU's two configurations from its
    threshold on, each with rows divisible by 16 and not: the row counts where the tables change."""
    from glmvit.kernels.attention_table import CONFIGS, CUDNN_MIN_ROWS

    rows_of = eager_classes("auto", FULL, torch.device("cuda"), torch.bfloat16)
    assert {r % SPECIALISE == 0 for r in rows_of} == {True, False}
    assert CUDNN_MIN_ROWS in rows_of and fused_gemm_table.SWIGLU_MIN_ROWS in rows_of
    assert fused_gemm_table.SWIGLU_PERSISTENT_MIN_ROWS in rows_of
    assert CONFIGS[0][0] + FULL.merge_area in rows_of  # the first row count past the first configuration's limit


def test_a_longer_scan_is_asked_for_by_the_largest_budget(hopper, monkeypatch):
    seen = []
    monkeypatch.setattr("glmvit.warmup.kernel_class", lambda rows, *a: seen.append(rows) or rows % SPECIALISE == 0)
    eager_classes("auto", FULL, torch.device("cuda"), torch.bfloat16, max_rows=2 * SCAN_ROWS)
    assert max(seen) == 2 * SCAN_ROWS


def test_off_cuda_the_warm_up_runs_nothing(tiny_model):
    from glmvit.warmup import warm_eager

    assert warm_eager(tiny_model, "sdpa_masked") == WarmUp((), 0.0)
    scheduler = BatchScheduler(tiny_model, LIMITS)
    assert scheduler.stats()["warmup_forwards"] == 0
    scheduler.close(TIMEOUT)


def test_the_worker_warms_up_in_its_own_thread_before_its_first_batch(tiny_model, monkeypatch):
    """cuDNN's plans are per thread: the warm-up must run where batches run, and start() returns after it."""
    events = []

    def fake_warm(model, attention, max_rows, stop):
        events.append(("warm", threading.current_thread().name, attention, max_rows))
        return WarmUp((4, 16), 0.25)

    monkeypatch.setattr("glmvit.scheduler.warm_eager", fake_warm)
    scheduler = BatchScheduler(tiny_model, LIMITS)
    assert events == [("warm", "glmvit-scheduler", tiny_model.attention_backend(), 32 * TINY.merge_area)]
    scheduler.encode(*random_batch([[1, 4, 4]], TINY, seed=0), timeout=TIMEOUT)
    stats = scheduler.stats()
    assert (stats["warmup_forwards"], stats["warmup_s"], stats["batches"]) == (2, 0.25, 1)
    scheduler.close(TIMEOUT)
    events.clear()
    BatchScheduler(tiny_model, LIMITS, warm_up=False).close(TIMEOUT)
    assert events == []


def test_a_failing_warm_up_is_logged_and_serving_goes_on(tiny_model, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("no memory for the warm-up")

    monkeypatch.setattr("glmvit.scheduler.warm_eager", broken)
    with BatchScheduler(tiny_model, LIMITS) as scheduler:
        result = scheduler.encode(*random_batch([[1, 4, 4]], TINY, seed=0), timeout=TIMEOUT)
    assert len(result.outputs) == 1 and "warm-up failed" in caplog.text


def test_a_close_during_the_warm_up_stops_it_between_forwards(tiny_model, monkeypatch):
    """close() while the warm-up runs: the forward under way ends, no later one starts, start() returns, the worker
    stops, and utilisation counts from the warm-up's end (none before)."""
    entered, release, asked = threading.Event(), threading.Event(), []

    def slow_warm(model, attention, max_rows, stop):
        entered.set()
        release.wait(TIMEOUT)
        asked.append(stop())  # what warm_eager asks before its next forward
        return WarmUp((4,), 0.1)

    monkeypatch.setattr("glmvit.scheduler.warm_eager", slow_warm)
    scheduler = BatchScheduler(tiny_model, LIMITS, start=False)
    starter = threading.Thread(target=scheduler.start)
    starter.start()
    assert entered.wait(TIMEOUT)
    assert scheduler.stats()["uptime_s"] == 0.0  # no start time before the warm-up ended
    closer = threading.Thread(target=scheduler.close, args=(TIMEOUT,))
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while scheduler.accepting and time.monotonic() < deadline:
        time.sleep(0.001)
    release.set()
    starter.join(TIMEOUT)
    closer.join(TIMEOUT)
    assert asked == [True] and not starter.is_alive() and not closer.is_alive()


def test_warm_eager_asks_stop_before_each_forward(monkeypatch):
    """The stop check of warm_eager itself (on a CPU model it runs nothing, so the forwards are counted here)."""
    from glmvit import warmup

    class Model:
        device = torch.device("cuda")
        dtype = torch.bfloat16
        config = TINY

        def __init__(self):
            self.forwards = 0

        def forward(self, *args, **kwargs):
            self.forwards += 1

    monkeypatch.setattr(warmup, "eager_classes", lambda *a: (4, 16, 64))
    # warm_eager's own torch (its body's zeros and synchronize), not the process's: no other thread sees these
    monkeypatch.setattr(warmup, "torch", SimpleNamespace(zeros=lambda *a, **k: None,
                                                          cuda=SimpleNamespace(synchronize=lambda *a: None)))
    model = Model()
    done = warmup.warm_eager(model, "sdpa", stop=lambda: model.forwards == 2)  # type: ignore[arg-type]
    assert done.rows == (4, 16) and model.forwards == 2


def test_a_scheduler_closed_before_it_started_never_starts(tiny_model, monkeypatch):
    calls = []
    monkeypatch.setattr("glmvit.scheduler.warm_eager", lambda *a, **k: calls.append(a) or WarmUp((), 0.0))
    scheduler = BatchScheduler(tiny_model, LIMITS, start=False)
    assert scheduler.close(TIMEOUT)
    assert scheduler.start() is scheduler and calls == [] and not scheduler._worker.is_alive()


@pytest.mark.gpu
def test_after_the_warm_up_a_new_shape_compiles_no_triton_kernel():
    """A fresh process's model, warmed, then one batch of each class in shapes the warm-up never ran (several
    segments, other row counts): no Triton launch misses its cache."""
    from glmvit.random_weights import random_encoder
    from glmvit.warmup import warm_eager
    from tools.first_call_probe import TritonMisses

    model = random_encoder(FULL, "cuda", torch.bfloat16)
    attention = model.attention_backend()
    done = warm_eager(model, attention)
    assert len(done.rows) >= 2
    grids = [[[1, 2, 6]], [[1, 4, 6]], [[1, 16, 16]], [[1, 16, 18]], [[2, 16, 18]], [[4, 16, 16]], [[3, 16, 18]],
             [[1, 32, 38]], [[8, 32, 32], [1, 16, 16]], [[8, 32, 32], [1, 16, 18]], [[8, 32, 32], [1, 2, 6]],
             [[1, 74, 72]]]
    for grid in grids:
        pixels, _ = random_batch(grid, FULL, seed=0)
        with TritonMisses() as misses, torch.inference_mode():
            model(pixels.cuda().bfloat16(), grid, check_finite=False)
            torch.cuda.synchronize()
        assert misses.kernels == [], f"{grid} compiled {misses.kernels}"
