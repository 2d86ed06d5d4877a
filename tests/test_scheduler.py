"""BatchScheduler on CPU (tiny tower, fp32, the runner's emulate backend): many concurrent submitters, each request
gets exactly its own items back, batches respect the limits, back-pressure, drain and failures are typed.

Why the first test holds each item to float32 rounding of itself alone, and no looser: with one budget every batch
the runner runs has the same shape (budget·m² rows), so each matmul, norm and the per-segment attention (the CPU
default backend) of an item's rows runs at the same sizes whether the rest of the batch holds other requests' items,
the same request's or padding; rows never reach each other (tests/test_isolation.py). On most CPUs that is bitwise;
a BLAS may still sum a row in another order at another row position (the H200 machine's CPU does), so the bound is
the one tests/test_graphs.py holds the runner to against the forward of each item alone — and another item's output
is orders of magnitude further away (asserted), so no item can pass for another. Other batch shapes (another
budget, or the eager model on an unpadded batch) change the summation order everywhere: the same bound.
"""
import threading
import time

import numpy as np
import pytest
import torch

from glmvit import VisionConfig
from glmvit.graphs import EncoderGraphRunner
from glmvit.packing import BudgetConfig
from glmvit.scheduler import (
    BatchScheduler,
    QueueFull,
    RequestTooLarge,
    RequestWithdrawn,
    ResultMismatch,
    SchedulerClosed,
)
from glmvit.workloads import random_batch

ONE_BUDGET = BudgetConfig(token_budgets=(32,), max_items=4, max_segments=8)
LADDER = BudgetConfig(token_budgets=(8, 16, 32), max_items=4, max_segments=8)
FORWARD_ATOL = 1e-5  # tests/test_graphs.py: the runner against the forward of each item alone, fp32
TIMEOUT = 60  # seconds any wait in these tests may take at most (a hang fails instead of blocking CI)
TINY = VisionConfig.tiny()


def random_request(seed: int):
    """1–3 items: images, 2–3 frame clips, now and then one no budget holds (runs alone, eagerly)."""
    rng = np.random.default_rng(seed)
    grids = []
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["image", "video", "oversize"], p=[0.6, 0.3, 0.1])
        h, w = (2 * rng.integers(1, 4, size=2)).tolist()
        grids.append([1, 12, 12] if kind == "oversize" else [int(rng.integers(2, 4)) if kind == "video" else 1, h, w])
    return random_batch(grids, TINY, seed=1000 + seed)


def runner_for(model, config):
    return EncoderGraphRunner(model, config, mode="emulate").capture()


def submit_from_threads(scheduler, requests, threads=8):
    """Submit ``requests`` from ``threads`` threads at once (request j from thread j mod threads); the futures."""
    futures = [None] * len(requests)
    barrier = threading.Barrier(threads)

    def client(k):
        barrier.wait()
        for j in range(k, len(requests), threads):
            futures[j] = scheduler.submit(*requests[j])

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(TIMEOUT)
    return futures


def recording(scheduler):
    """Wrap the scheduler's encoder so that every batch's grids are recorded."""
    batches, encode = [], scheduler._encode

    def wrapped(pixels, request):
        batches.append(request.grids.copy())
        return encode(pixels, request)

    scheduler._encode = wrapped
    return batches


@pytest.mark.parametrize("paused", [True, False], ids=["queued-then-run", "live"])
def test_concurrent_requests_get_exactly_their_own_items(tiny_model, paused):
    requests = [random_request(seed) for seed in range(48)]
    alone = runner_for(tiny_model, ONE_BUDGET)
    expected = [alone.run(*r) for r in requests]
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=not paused)
    futures = submit_from_threads(scheduler, requests)
    scheduler.start()
    results = [f.result(TIMEOUT) for f in futures]
    scheduler.close(TIMEOUT)
    assert sorted(r.request_id for r in results) == list(range(len(requests)))
    for j, (result, want) in enumerate(zip(results, expected, strict=True)):
        assert len(result.outputs) == len(want), j
        for i, (got, ref) in enumerate(zip(result.outputs, want, strict=True)):
            torch.testing.assert_close(got, ref, atol=FORWARD_ATOL, rtol=FORWARD_ATOL, msg=f"request {j} item {i}")
    everyone = [ref for want in expected for ref in want]
    nearest_other = min((a - b).abs().max().item() for a in everyone for b in everyone
                        if a is not b and a.shape == b.shape)
    assert nearest_other > 1e3 * FORWARD_ATOL  # the bound cannot confuse one item's output with another's
    stats = scheduler.stats()
    assert stats["completed"] == len(requests) and stats["failed"] == 0 and stats["outstanding_requests"] == 0
    if paused:  # everything was queued before the worker started: batches must mix requests
        assert stats["mixed_batches"] > 0


@pytest.mark.parametrize("eager", [False, True], ids=["runner-ladder", "eager-model"])
def test_other_batch_shapes_stay_within_the_forward_bound(tiny_model, eager):
    requests = [random_request(seed) for seed in range(100, 124)]
    scheduler = BatchScheduler(tiny_model if eager else runner_for(tiny_model, LADDER), LADDER, start=False)
    futures = submit_from_threads(scheduler, requests, threads=4)
    scheduler.start()
    for (pixels, grid), future in zip(requests, futures, strict=True):
        outs, start = future.result(TIMEOUT).outputs, 0
        for out, (t, h, w) in zip(outs, grid.tolist(), strict=True):
            with torch.inference_mode():
                ref = tiny_model(pixels[start : start + t * h * w], torch.tensor([[t, h, w]]))
            start += t * h * w
            torch.testing.assert_close(out, ref, atol=FORWARD_ATOL, rtol=FORWARD_ATOL)
    assert scheduler.stats()["mixed_batches"] > 0
    scheduler.close(TIMEOUT)


def test_batches_respect_the_limits_and_keep_arrival_order(tiny_model):
    requests = [random_request(seed) for seed in range(200, 240)]
    scheduler = BatchScheduler(runner_for(tiny_model, LADDER), start=False)
    batches = recording(scheduler)
    futures = [scheduler.submit(*r) for r in requests]
    scheduler.start()
    for f in futures:
        f.result(TIMEOUT)
    scheduler.close(TIMEOUT)
    for grids in batches:
        tokens, segments = int((grids.prod(axis=1) // 4).sum()), int(grids[:, 0].sum())
        alone = len(grids) == 1 and (tokens > LADDER.largest or segments > LADDER.max_segments)
        assert alone or (len(grids) <= LADDER.max_items and tokens <= LADDER.largest
                         and segments <= LADDER.max_segments), grids.tolist()
    # next-fit in arrival order: the batches, read one after another, are the items in the order they came
    assert np.concatenate(batches).tolist() == [g for _, grid in requests for g in grid.tolist()]
    stats = scheduler.stats()
    assert stats["items"] == sum(len(g) for g in batches) and stats["batches"] == len(batches)
    assert stats["batch_items"]["max"] <= LADDER.max_items


def test_padding_counts_the_budget_each_batch_packs_into(tiny_model):
    scheduler = BatchScheduler(runner_for(tiny_model, LADDER), start=False)
    future = scheduler.submit(*random_batch([[1, 4, 4], [1, 4, 6], [1, 2, 2]], TINY, seed=5))
    scheduler.start()
    future.result(TIMEOUT)
    scheduler.close(TIMEOUT)
    stats = scheduler.stats()  # 4 + 6 + 1 = 11 tokens: one batch in budget 16
    assert (stats["batches"], stats["packed_tokens"], stats["budget_tokens"]) == (1, 11, 16)
    assert stats["padding_fraction"] == pytest.approx(5 / 16)


def test_the_queue_is_bounded_in_requests_tokens_and_bytes(tiny_model):
    small = random_batch([[1, 2, 2]], TINY)  # 1 token
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), max_requests=3, start=False)
    futures = [scheduler.submit(*small) for _ in range(3)]
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.submit(*small)
    scheduler.start()
    for f in futures:
        f.result(TIMEOUT)
    scheduler.submit(*small).result(TIMEOUT)  # answered requests leave the queue
    assert scheduler.stats()["rejected_full"] == 1
    scheduler.close(TIMEOUT)

    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), max_tokens=40, start=False)
    with pytest.raises(RequestTooLarge, match="more than the queue holds"):
        scheduler.submit(*random_batch([[1, 14, 14]], TINY))  # 49 tokens: never
    scheduler.submit(*random_batch([[1, 12, 12]], TINY))  # 36 tokens
    scheduler.submit(*random_batch([[1, 4, 4]], TINY))  # 4 more: 40, full to the token
    with pytest.raises(QueueFull, match="40 tokens, .* bytes waiting"):
        scheduler.submit(*small)
    scheduler.close(TIMEOUT)

    row_bytes = small[0].numel() * tiny_model.dtype.itemsize  # staged in the model's dtype
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), max_bytes=2 * row_bytes, start=False)
    with pytest.raises(RequestTooLarge, match="bytes of pixels, more than the queue holds"):
        scheduler.submit(*random_batch([[1, 2, 2]] * 3, TINY))
    futures = [scheduler.submit(*small) for _ in range(2)]
    assert scheduler.stats()["outstanding_bytes"] == 2 * row_bytes
    with pytest.raises(QueueFull, match=f"at most 4096 requests, .* tokens, {2 * row_bytes:,} bytes"):
        scheduler.submit(*small)
    scheduler.start()
    for f in futures:
        f.result(TIMEOUT)
    assert scheduler.stats()["outstanding_bytes"] == 0
    scheduler.submit(*small).result(TIMEOUT)
    scheduler.close(TIMEOUT)


def test_bad_input_is_refused_at_once_naming_the_item(tiny_model):
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET))
    pixels, grid = random_batch([[1, 4, 4], [2, 2, 2], [1, 2, 4]], TINY)
    pixels[20, 3] = float("nan")  # a row of item 1 (rows 16..23)
    with pytest.raises(ValueError, match=r"item\(s\) \[1\]"):
        scheduler.submit(pixels, grid)
    with pytest.raises(ValueError, match="item 1: grid h×w = 3×2"):
        scheduler.submit(*random_batch([[1, 2, 2], [1, 3, 2]], TINY))
    with pytest.raises(ValueError, match="rows"):
        scheduler.submit(pixels[:-1], grid)
    assert scheduler.stats()["submitted"] == 0 and scheduler.stats()["outstanding_requests"] == 0
    scheduler.close(TIMEOUT)


def gate(scheduler):
    """Make the encoder wait, inside its first batch, until the returned ``release`` event is set."""
    entered, release, encode = threading.Event(), threading.Event(), scheduler._encode

    def held(pixels, grids):
        entered.set()
        assert release.wait(TIMEOUT)
        return encode(pixels, grids)

    scheduler._encode = held
    return entered, release


def test_close_finishes_every_admitted_request_and_refuses_new_ones(tiny_model):
    requests = [random_request(seed) for seed in range(300, 310)]
    alone = runner_for(tiny_model, ONE_BUDGET)
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET))
    entered, release = gate(scheduler)
    futures = [scheduler.submit(*r) for r in requests]
    assert entered.wait(TIMEOUT)  # the first batch is running, the rest are queued
    closer = threading.Thread(target=scheduler.close, args=(TIMEOUT,))
    closer.start()
    deadline = time.monotonic() + TIMEOUT
    while scheduler.accepting and time.monotonic() < deadline:
        time.sleep(0.001)
    with pytest.raises(SchedulerClosed):
        scheduler.submit(*requests[0])
    release.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    for request, future in zip(requests, futures, strict=True):
        for a, b in zip(future.result(0).outputs, alone.run(*request), strict=True):
            torch.testing.assert_close(a, b, atol=FORWARD_ATOL, rtol=FORWARD_ATOL)  # module docstring: the bound
    assert scheduler.stats()["rejected_closed"] == 1


def test_closing_before_the_worker_starts_fails_what_was_admitted(tiny_model):
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    future = scheduler.submit(*random_request(1))
    assert scheduler.close(TIMEOUT)
    with pytest.raises(SchedulerClosed):
        future.result(0)


def test_the_next_batch_is_queued_before_the_one_in_flight_is_answered(tiny_model):
    """The worker queues batch 2 while batch 1 is on the device, then answers batch 1: the host work of the next
    batch overlaps the replay of this one. Every answer is still its own (compared with the requests alone)."""
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    events, encode, lock = [], scheduler._encode, threading.Lock()

    class Computed:  # the CPU's outputs are computed when the encoder returns: an event that has fired
        def synchronize(self):
            pass

    scheduler._mark_done = lambda outputs: Computed()  # as on CUDA: the worker waits for each batch's event

    def logged(pixels, request):
        with lock:
            events.append(("queued", len(request)))
        return encode(pixels, request)

    scheduler._encode = logged
    requests = [random_request(seed) for seed in range(400, 408)]
    alone = runner_for(tiny_model, ONE_BUDGET)
    futures = []
    for k, request in enumerate(requests):
        futures.append(scheduler.submit(*request))
        futures[-1].add_done_callback(lambda _, k=k: events.append(("answered", k)))
    scheduler.start()
    for request, future in zip(requests, futures, strict=True):
        for a, b in zip(future.result(TIMEOUT).outputs, alone.run(*request), strict=True):
            torch.testing.assert_close(a, b, atol=FORWARD_ATOL, rtol=FORWARD_ATOL)
    scheduler.close(TIMEOUT)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["queued", "queued"], events  # the second batch queued before any answer
    first = next(i for i, kind in enumerate(kinds) if kind == "answered")
    assert first < len(kinds) - 1 and kinds.count("queued") >= 2
    stats = scheduler.stats()
    assert stats["batches"] == kinds.count("queued") and 0 < stats["busy_s"] <= stats["uptime_s"]


def test_off_cuda_each_batch_is_answered_before_the_next_is_taken(tiny_model):
    """Off CUDA a batch's outputs are computed when the encoder returns: its requests are answered at once, not
    after the next batch (nothing runs meanwhile that the next batch's host work could overlap)."""
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    events, encode = [], scheduler._encode

    def logged(pixels, request):
        events.append("queued")
        return encode(pixels, request)

    scheduler._encode = logged
    futures = [scheduler.submit(*numbered(k)) for k in range(9)]  # batches of 4, 4 and 1
    for k, future in enumerate(futures):
        future.add_done_callback(lambda _, k=k: events.append(k))
    scheduler.start()
    for future in futures:
        future.result(TIMEOUT)
    assert scheduler.close(TIMEOUT)
    assert events == ["queued", 0, 1, 2, 3, "queued", 4, 5, 6, 7, "queued", 8]


def test_the_switch_interval_is_lowered_while_a_scheduler_runs_and_restored_after_the_last(tiny_model):
    """The worker's torch calls each give the GIL away; while any scheduler runs, another thread may keep it at
    most switch_interval_s. Two schedulers at once: the lower interval holds until both stop, then the original."""
    import sys

    original = sys.getswitchinterval()
    a = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), switch_interval_s=1e-3)
    b = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), switch_interval_s=2e-4)
    try:
        deadline = time.monotonic() + TIMEOUT
        while sys.getswitchinterval() != pytest.approx(2e-4) and time.monotonic() < deadline:
            time.sleep(0.001)  # both workers are starting
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        a.encode(*random_request(1), timeout=TIMEOUT)
        assert a.close(TIMEOUT)
        assert sys.getswitchinterval() == pytest.approx(2e-4)  # b still runs
        assert b.stats()["switch_interval_s"] == 2e-4
    finally:
        a.close(TIMEOUT)
        b.close(TIMEOUT)
    assert sys.getswitchinterval() == original
    for bad in (0, True, "1e-3", float("nan")):
        with pytest.raises(ValueError, match="switch_interval_s"):
            BatchScheduler(runner_for(tiny_model, ONE_BUDGET), switch_interval_s=bad, start=False)


def test_an_interval_set_by_someone_else_while_a_scheduler_runs_stays_after_it_stops(tiny_model):
    import sys

    original = sys.getswitchinterval()
    try:
        scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), switch_interval_s=2e-4)
        scheduler.encode(*random_request(1), timeout=TIMEOUT)  # the worker runs: the interval is lowered
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        sys.setswitchinterval(3e-3)  # the process's owner wants another one
        assert scheduler.close(TIMEOUT)
        assert sys.getswitchinterval() == pytest.approx(3e-3)
    finally:
        sys.setswitchinterval(original)


def test_a_failing_batch_fails_only_its_requests(tiny_model):
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    encode, calls = scheduler._encode, []

    def first_fails(pixels, grids):
        calls.append(len(grids))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return encode(pixels, grids)

    scheduler._encode = first_fails
    one = random_batch([[1, 2, 2]], TINY)
    futures = [scheduler.submit(*one) for _ in range(6)]  # 4 per batch (max_items): the first 4 fail
    scheduler.start()
    for f in futures[:4]:
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(TIMEOUT)
    for f in futures[4:]:  # the same image at two positions of one batch: to float32 rounding (module docstring)
        torch.testing.assert_close(f.result(TIMEOUT).outputs[0], futures[4].result(0).outputs[0], atol=FORWARD_ATOL,
                                   rtol=FORWARD_ATOL)
    stats = scheduler.stats()
    assert (stats["failed"], stats["completed"], stats["failed_batches"]) == (4, 2, 1)
    scheduler.close(TIMEOUT)


@pytest.mark.parametrize("fault", ["dropped", "swapped"])
def test_outputs_that_do_not_match_their_items_are_never_handed_out(tiny_model, fault):
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    encode = scheduler._encode

    def faulty(pixels, grids):
        outs = encode(pixels, grids)
        return outs[:-1] if fault == "dropped" else outs[::-1]

    scheduler._encode = faulty
    futures = [scheduler.submit(*random_batch([[1, 2, 2]], TINY)),
               scheduler.submit(*random_batch([[1, 4, 4]], TINY))]  # 1 and 4 tokens
    scheduler.start()
    for f in futures:
        with pytest.raises(ResultMismatch):
            f.result(TIMEOUT)
    scheduler.close(TIMEOUT)


def test_an_empty_request_is_answered_at_once(tiny_model):
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    result = scheduler.submit(torch.zeros(0, TINY.patch_dim), torch.zeros(0, 3, dtype=torch.long))
    assert result.result(0).outputs == []
    scheduler.close(TIMEOUT)


def test_a_batch_waits_for_later_arrivals_when_asked(tiny_model):
    """With max_wait_s the first request waits in an open batch; the fourth fills it (max_items) and it runs."""
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), max_wait_s=1.0)
    futures = [scheduler.submit(*random_batch([[1, 2, 2]], TINY, seed=k)) for k in range(4)]
    assert [f.result(TIMEOUT).batches for f in futures] == [(0,)] * 4
    scheduler.close(TIMEOUT)


def test_arguments_are_checked(tiny_model):
    with pytest.raises(ValueError, match="needs limits"):
        BatchScheduler(tiny_model)
    with pytest.raises(ValueError, match="max_wait_s"):
        BatchScheduler(tiny_model, LADDER, max_wait_s=-1, start=False)
    with pytest.raises(ValueError, match="max_requests"):
        BatchScheduler(tiny_model, LADDER, max_requests=0, start=False)
    with pytest.raises(TypeError):
        BatchScheduler("model", LADDER)


# ---- on CUDA (the lead's H200): real graphs, pixels staged from other threads' streams ---------------------------
@pytest.fixture(scope="module")
def full_cuda():
    from glmvit.random_weights import random_encoder

    model = random_encoder(VisionConfig.glm41v(), "cuda", torch.bfloat16)
    yield model
    del model
    torch.cuda.empty_cache()


CUDA_LIMITS = BudgetConfig((256, 1024), max_items=4, max_segments=16)


def cuda_requests(n):
    """Images and 8-frame 224² clips, 1–2 per request, as float32 CPU rows (what the server hands the scheduler)."""
    rng = np.random.default_rng(0)
    shapes = [[1, 16, 16], [4, 16, 16], [1, 10, 14], [2, 12, 12]]
    return [random_batch([shapes[k] for k in rng.integers(0, 4, size=int(rng.integers(1, 3)))], VisionConfig(),
                         seed=j) for j in range(n)]


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_cuda_scheduler_serves_concurrent_submitters(full_cuda, eager):
    """Each item within tests/test_gpu.py's bound (from the item's own bf16 error) of model.forward on it alone."""
    from tests.test_gpu import assert_per_item

    encoder = full_cuda if eager else EncoderGraphRunner(full_cuda, CUDA_LIMITS, mode="cuda").capture()
    requests = cuda_requests(24)
    scheduler = BatchScheduler(encoder, CUDA_LIMITS, start=False)
    futures = submit_from_threads(scheduler, requests, threads=6)
    scheduler.start()
    for (pixels, grid), future in zip(requests, futures, strict=True):
        outs = future.result(TIMEOUT).outputs
        assert all(out.device.type == "cuda" for out in outs)
        assert_per_item(full_cuda, outs, pixels.cuda().bfloat16(), grid)  # the rows the scheduler staged, in bf16
    assert scheduler.stats()["mixed_batches"] > 0
    scheduler.close(TIMEOUT)


# ---- the worker's timing against a stand-in device ---------------------------------------------------------------
def numbered(k):
    """A one-token image whose pixels are all ``k``: a stand-in encoder reads which item it was given."""
    pixels, grid = random_batch([[1, 2, 2]], TINY, seed=k)
    return torch.full_like(pixels, float(k)), grid


def fake_device(scheduler):
    """Stand in for the encoder and the device: a batch "runs" until the worker waits for it, and the first one
    until ``release`` is set (``on_device`` says the worker waits for it). The log holds each batch's items (their
    numbers, :func:`numbered`) when it is queued, and "done" when the worker has waited for it."""
    log, on_device, release = [], threading.Event(), threading.Event()
    width = scheduler.model.config.out_hidden_size

    class Event:
        def __init__(self, first):
            self.first = first

        def synchronize(self):
            if self.first:
                on_device.set()
                assert release.wait(TIMEOUT)
            log.append("done")

    def encode(pixels, request):
        log.append([int(pixels[request.row_range(i)[0], 0]) for i in range(len(request))])
        return [torch.zeros(tokens, width) for tokens in request.item_tokens]

    scheduler._encode = encode
    scheduler._mark_done = lambda outputs: Event(first=len(log) == 1)
    return log, on_device, release


@pytest.mark.parametrize("arrivals, expected", [
    # the second batch, under-full while the first runs, waits for it: the late arrivals join it
    ("QQQQQAAA", ["QQQQ", "done", "QAAA", "done"]),
    ("QAAAAA", ["Q", "done", "AAAA", "done", "A", "done"]),
    # a full next batch is queued while the one before it is on the device
    ("QQQQQQQQQ", ["QQQQ", "QQQQ", "done", "done", "Q", "done"]),
    ("QQAAAAAAAA", ["QQ", "done", "AAAA", "AAAA", "done", "done"]),
])
def test_the_next_batch_is_queued_early_only_when_it_is_full(tiny_model, arrivals, expected):
    """``arrivals``: Q an item queued before the worker starts, A one arriving while the first batch is on the
    device (at most 4 items a batch). The log: each batch's items when it is queued, "done" when it is answered."""
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    log, on_device, release = fake_device(scheduler)
    futures = [scheduler.submit(*numbered(k)) for k, kind in enumerate(arrivals) if kind == "Q"]
    scheduler.start()
    assert on_device.wait(TIMEOUT)
    futures += [scheduler.submit(*numbered(k)) for k, kind in enumerate(arrivals) if kind == "A"]
    release.set()
    for future in futures:
        future.result(TIMEOUT)
    assert scheduler.close(TIMEOUT)
    assert [entry if entry == "done" else "".join(arrivals[k] for k in entry) for entry in log] == expected
    assert [k for entry in log if entry != "done" for k in entry] == list(range(len(arrivals)))  # arrival order


def test_a_request_whose_items_went_back_to_the_queue_can_still_be_withdrawn(tiny_model):
    """An under-full next batch goes back to the queue while one is on the device: its requests were never in a
    batch, so their callers may still withdraw them (they are never encoded)."""
    from glmvit.scheduler import RequestWithdrawn

    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    log, on_device, release = fake_device(scheduler)
    futures = [scheduler.submit(*numbered(k)) for k in range(5)]  # a full batch of four, then one put back
    scheduler.start()
    assert on_device.wait(TIMEOUT)
    assert scheduler.withdraw(futures[4])
    release.set()
    assert all(future.result(TIMEOUT).outputs for future in futures[:4])
    with pytest.raises(RequestWithdrawn):
        futures[4].result(TIMEOUT)
    assert scheduler.close(TIMEOUT)
    assert log == [[0, 1, 2, 3], "done"] and scheduler.stats()["withdrawn"] == 1


def test_an_admitted_request_cannot_be_cancelled_and_is_answered(tiny_model):
    """A caller's cancel() is refused once a request is admitted: the worker never meets a cancelled future (setting
    its result would raise in the worker), and the request and the ones after it are answered."""
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    first, second = scheduler.submit(*random_request(1)), scheduler.submit(*random_request(2))
    assert not first.cancel() and first.running()
    scheduler.start()
    assert first.result(TIMEOUT).outputs and second.result(TIMEOUT).outputs
    assert scheduler.close(TIMEOUT)


def test_a_worker_that_stops_on_a_fault_fails_every_unanswered_request(tiny_model, caplog):
    """A fault of the scheduler itself (here: delivering a batch) stops its worker: every request it had admitted
    fails with SchedulerClosed instead of waiting for ever, later ones are refused, and the log says why."""
    from concurrent.futures import wait

    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)

    def broken(*args):
        raise RuntimeError("bookkeeping bug")

    scheduler._deliver = broken
    futures = [scheduler.submit(*numbered(k)) for k in range(9)]  # three batches
    scheduler.start()
    _, waiting = wait(futures, TIMEOUT)
    assert not waiting
    for future in futures:
        with pytest.raises(SchedulerClosed, match="worker stopped before request"):
            future.result(0)
    with pytest.raises(SchedulerClosed):
        scheduler.submit(*numbered(9))
    assert scheduler.close(TIMEOUT)
    stats = scheduler.stats()
    assert stats["failed"] == 9 and stats["outstanding_requests"] == 0
    assert any(r.name == "glmvit.scheduler" and r.exc_info and "bookkeeping bug" in str(r.exc_info[1])
               for r in caplog.records)


def test_a_withdrawn_request_is_dropped_unless_a_batch_has_taken_it(tiny_model):
    """withdraw() drops a request no batch has taken (never encoded, its place freed, its future failed); one
    already in a batch runs and is answered, and an answered one stays answered."""
    scheduler = BatchScheduler(runner_for(tiny_model, ONE_BUDGET), start=False)
    log, on_device, release = fake_device(scheduler)
    running = scheduler.submit(*numbered(0))
    scheduler.start()
    assert on_device.wait(TIMEOUT)  # item 0 is on the device; 1 and 2 (one request) and 3 wait in the queue
    pixels, grid = random_batch([[1, 2, 2]] * 2, TINY)
    dropped = scheduler.submit(torch.cat([torch.full_like(pixels[:4], 1.0), torch.full_like(pixels[4:], 2.0)]), grid)
    kept = scheduler.submit(*numbered(3))
    assert scheduler.stats()["outstanding_requests"] == 3
    assert not scheduler.withdraw(running) and scheduler.withdraw(dropped) and not scheduler.withdraw(dropped)
    assert scheduler.stats()["outstanding_requests"] == 2
    with pytest.raises(RequestWithdrawn, match="withdrawn before it ran"):
        dropped.result(0)
    release.set()
    assert running.result(TIMEOUT).outputs and kept.result(TIMEOUT).outputs
    assert not scheduler.withdraw(kept)
    assert scheduler.close(TIMEOUT)
    assert log == [[0], "done", [3], "done"]  # items 1 and 2 never ran
    stats = scheduler.stats()
    assert (stats["withdrawn"], stats["completed"], stats["failed"], stats["outstanding_requests"]) == (1, 2, 0, 0)
