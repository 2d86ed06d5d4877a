"""Continuous batching: the items of concurrent requests share the encoder's batches; each request gets its own back.

:class:`BatchScheduler` takes requests from any number of threads (:meth:`~BatchScheduler.submit` returns a
``concurrent.futures.Future``) and one worker thread, the only caller of the encoder, runs them:

1. **Admission** (the submitting thread): the request is validated once (``model.check_request``: grids, row
   count, NaN/Inf, each error naming the item) into an :class:`~glmvit.request.EncoderRequest` that every later
   step takes as it is, counted against a bounded queue (:class:`QueueFull` when it would
   overflow, :class:`SchedulerClosed` once closing) and its pixels are moved to the model's device and dtype
   (:func:`stage`), so that the worker only concatenates rows that are already there.
2. **Batching** (the worker): items wait in arrival order. When the worker is free it takes items from the head of
   the queue, next-fit, until the next one would overflow the largest budget, ``max_items`` or ``max_segments``
   (:func:`fits`); an item that fits no budget, or has more segments than a batch, runs alone (the runner runs it
   eagerly).
   Items of several requests share a batch; a request's items may span batches.
3. **Encoding, one batch ahead**: one ``encoder.encode(..., sync=False)`` per batch (:class:`~glmvit.encoder.Encoder`),
   given an :class:`~glmvit.request.EncoderRequest` of its items (a graph runner packs it into its smallest fitting
   budget and routes it, replay or eager; the eager baseline runs one forward). The call queues the batch's work on
   the worker's stream and returns; while the device runs it, if the queue already holds a full next batch (nothing
   more could join it), the worker takes that batch and queues it too (its packing, metadata and copies are host work
   that would otherwise leave the device idle), and only then waits for the first batch (one CUDA event) and answers
   it. An under-full next batch is not taken early: the worker waits for the batch in flight, so that items arriving
   meanwhile join the next batch rather than the one after it. So at most two batches are in flight, the second
   queued behind the first on one stream, and a batch is delivered only once its outputs are computed. Off CUDA
   the encoder returns computed outputs: each batch is answered as soon as it returns, before the next is taken.
4. **Delivery, checked**: a batch must return one output per item, of that item's token count (t·h·w / m²) and
   ``out_hidden_size``; every output goes to the slot its item was taken from (request id, item index), each slot
   is filled exactly once, and a request is answered only when all its slots are. Anything else fails the requests
   of that batch with :class:`ResultMismatch`; an error inside the encoder fails them with that error. The next
   batch runs either way. (A permutation of same-sized items inside the encoder cannot be seen from sizes:
   tests/test_scheduler.py compares outputs bitwise against requests encoded alone.)

**Waiting for more items**: ``max_wait_s`` (default 0) keeps an under-full batch open that long for more arrivals;
0 starts a batch as soon as the worker is free, which under load fills batches by itself (what arrived during the
previous batch). Notebook 11 measures when a wait pays.

**The interpreter's switch interval**: the worker's every torch call lets go of the GIL and must win it back
from the server's Python threads (reading bodies, admitting, serialising answers), and CPython hands a held GIL over
only after the switch interval (5 ms by default): a batch of a few dozen calls could wait longer for the GIL than
the device takes to run it. While a scheduler runs, the process's interval is at most ``switch_interval_s``
(:data:`SWITCH_INTERVAL_S`; restored when the last running scheduler stops, unless it was changed meanwhile by
someone else, whose interval then stays).

**Drain**: :meth:`~BatchScheduler.close` refuses new requests at once, lets every admitted one finish, then stops
the worker. Every admitted request is answered exactly once: its future is running from admission on (``cancel()``
returns False), and if the worker ever stops with requests unanswered (a fault of its own, logged to the
``glmvit.scheduler`` logger) they fail with :class:`SchedulerClosed`, as every later submission does. A caller
that no longer wants a request (its client left) may :meth:`~BatchScheduler.withdraw` it: dropped unless a batch
has taken one of its items already.
:meth:`~BatchScheduler.stats` reports queue delays, batch sizes and padding.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterator, Protocol

import torch

from .encoder import EagerEncoder, Encoder
from .model import GlmVisionEncoder
from .packing import BudgetConfig
from .request import EncoderRequest
from .timing import distribution
from .warmup import warm_eager

Encode = Callable[[torch.Tensor, EncoderRequest], list[torch.Tensor]]  # a batch's pixels and its validated items
DELAY_SAMPLES = 10_000  # queue delays and batch sizes kept for the percentiles: the most recent ones
DEFAULT_MAX_REQUESTS = 4096  # a count that tokens and bytes bound first: a burst is held, not refused
DEFAULT_MAX_BYTES = 4 << 30  # staged pixel bytes admitted and not answered (on the model's device)
SWITCH_INTERVAL_S = 2e-4  # the process's GIL switch interval while a scheduler runs, at most (module docstring)

log = logging.getLogger("glmvit.scheduler")


class _SwitchInterval:
    """The process's switch interval, lowered while any scheduler's worker runs and restored after the last, unless
    someone else set it meanwhile: an interval that is no longer the one set here is theirs, and is left alone."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: list[float] = []  # each running worker's wanted interval
        self._saved = 0.0
        self._set = 0.0  # the interval as set here last (as the interpreter reads it back)

    def _apply(self, seconds: float) -> None:
        sys.setswitchinterval(seconds)
        self._set = sys.getswitchinterval()

    def hold(self, seconds: float | None) -> None:
        if seconds is None:
            return
        with self._lock:
            if not self._holders:
                self._saved = sys.getswitchinterval()
            self._holders.append(seconds)
            self._apply(min(self._saved, *self._holders))

    def release(self, seconds: float | None) -> None:
        if seconds is None:
            return
        with self._lock:
            self._holders.remove(seconds)
            if sys.getswitchinterval() == self._set:  # else changed by someone else meanwhile: theirs stays
                self._apply(min(self._saved, *self._holders) if self._holders else self._saved)


_switch_interval = _SwitchInterval()


class QueueFull(RuntimeError):
    """The scheduler holds as many requests (or tokens) as it may: retry later (HTTP 429)."""


class SchedulerClosed(RuntimeError):
    """The scheduler is draining or stopped and takes no new requests (HTTP 503)."""


class RequestTooLarge(ValueError):
    """One request holds more tokens than the whole queue may (HTTP 413): it can never be admitted."""


class RequestWithdrawn(RuntimeError):
    """Its caller withdrew the request (:meth:`BatchScheduler.withdraw`) before any of its items ran."""


class ResultMismatch(RuntimeError):
    """A batch returned outputs that do not match its items (count or shape): nothing of it was handed out."""


@dataclass(frozen=True)
class RequestResult:
    """What one request gets back: its outputs in input order, and where its time went (seconds)."""

    request_id: int
    outputs: list[torch.Tensor]
    queue_s: float  # from admission to the start of the first batch holding one of its items
    total_s: float  # from admission to the last of its items encoded
    batches: tuple[int, ...]  # the ids of the batches its items ran in
    stage_s: float = 0.0  # its pixels' copy to the model's device and dtype, before admission to the queue


def fits(limits: BudgetConfig, items: int, tokens: int, segments: int) -> bool:
    """Whether a batch of ``items`` items, ``tokens`` tokens and ``segments`` segments is within ``limits``."""
    return items <= limits.max_items and tokens <= limits.largest and segments <= limits.max_segments


_streams = threading.local()


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """A CUDA stream of this thread's own, so its copies overlap the worker's replays on the default stream."""
    streams = _streams.__dict__.setdefault("by_device", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


@contextlib.contextmanager
def finished_work(device: torch.device) -> Iterator[None]:
    """Device work queued inside the block runs on this thread's own CUDA stream — not behind the replays queued
    on the default stream — and is finished when the block ends, so its tensors are safe to hand to another
    thread. Off CUDA the block simply runs."""
    if device.type != "cuda":
        yield
        return
    stream = _side_stream(device)
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def stage(pixels: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``pixels`` on ``device`` in ``dtype``, finished (:func:`finished_work`): safe to hand to another thread.
    The conversion rounds as the runner's copy into its bfloat16 buffer (or the eager forward's cast) would, so
    staged pixels give bitwise the results unstaged ones give."""
    if pixels.device == device and pixels.dtype == dtype:
        return pixels
    with finished_work(device):
        return pixels.to(device=device, dtype=dtype)


@dataclass(eq=False)
class _Request:
    id: int
    pixels: torch.Tensor
    request: EncoderRequest
    tokens: list[int]
    segments: list[int]
    nbytes: int
    stage_s: float
    admitted: float
    future: Future
    outputs: list[torch.Tensor | None] = field(default_factory=list)
    remaining: int = 0
    started: float | None = None
    batches: list[int] = field(default_factory=list)
    finished: bool = False
    taken: bool = False  # an item of it is in a batch (it can no longer be withdrawn)


@dataclass(eq=False)
class _Batch:
    id: int
    slots: list[tuple[_Request, int]] = field(default_factory=list)
    tokens: int = 0
    segments: int = 0
    full: bool = False  # nothing more may join
    first_taken: list[_Request] = field(default_factory=list)  # requests none of whose items a batch held before


class _Done(Protocol):
    """What a launched batch waits on before it is answered (a CUDA event)."""

    def synchronize(self) -> None: ...


@dataclass(eq=False)
class _Launched:
    """A batch queued on the device, not yet answered: ``done`` (an event; None off CUDA) marks its outputs."""

    batch: _Batch
    outputs: list[torch.Tensor]
    requests: list[_Request]
    start: float
    done: _Done | None


@dataclass
class SchedulerStats:
    """Counters since construction. Queue delays and batch sizes keep the most recent ``DELAY_SAMPLES``."""

    submitted: int = 0
    completed: int = 0
    failed: int = 0
    rejected_full: int = 0
    rejected_closed: int = 0
    withdrawn: int = 0  # requests their callers withdrew before a batch took any of their items (never encoded)
    batches: int = 0
    failed_batches: int = 0
    items: int = 0
    tokens: int = 0
    mixed_batches: int = 0  # batches holding items of two or more requests
    alone_batches: int = 0  # an item no budget holds, run alone (eagerly, by the runner)
    # Σ over the other batches of the smallest budget holding them: what packing pads to (the runner's own stats say
    # what it replayed, if it routes a batch eagerly)
    budget_tokens: int = 0
    packed_tokens: int = 0  # Σ tokens of those batches
    busy_s: float = 0.0  # wall time with a batch in the encoder (queued or running), overlaps counted once
    warmup_s: float = 0.0  # the worker's eager warm-up before its first batch (glmvit.warmup)
    warmup_forwards: int = 0  # its forwards: one per kernel class
    queue_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=DELAY_SAMPLES))
    batch_items: collections.deque = field(default_factory=lambda: collections.deque(maxlen=DELAY_SAMPLES))


class BatchScheduler:
    """Batch the items of concurrent requests into the encoder's budgets (see the module docstring).

    ``encoder``: an :class:`~glmvit.encoder.Encoder` (:func:`~glmvit.encoder.build_encoder`; its ``budgets`` give
    the batch limits unless ``limits`` does), or a :class:`~glmvit.model.GlmVisionEncoder`, run eagerly
    (:class:`~glmvit.encoder.EagerEncoder`) under ``limits`` (the same limits as a runner's, for a fair baseline).
    The worker calls ``encoder.encode(..., sync=False)`` and waits for a batch's outputs (one event) before they go
    to other threads, after queueing the next batch. The scheduler's worker must be the only caller of the encoder
    while it runs.
    ``max_requests``, ``max_tokens`` and ``max_bytes`` (its pixels in the model's dtype) bound what is admitted and
    not yet answered (queued or running); a request of more tokens than ``max_tokens`` or more bytes than
    ``max_bytes`` can never be admitted (:class:`RequestTooLarge`). ``start=False`` admits requests without
    running them until :meth:`start` (to fill the queue first, e.g. in a test or a notebook).
    ``switch_interval_s``: the process's GIL switch interval while the worker runs, at most (None: left alone).
    ``warm_up``: before its first batch the worker runs one eager forward per kernel class
    (:func:`~glmvit.warmup.warm_eager`; nothing off CUDA), and :meth:`start` returns once it has.
    """

    def __init__(self, encoder: Encoder | GlmVisionEncoder, limits: BudgetConfig | None = None, *,
                 max_wait_s: float = 0.0, max_requests: int = DEFAULT_MAX_REQUESTS, max_tokens: int | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, switch_interval_s: float | None = SWITCH_INTERVAL_S,
                 warm_up: bool = True, start: bool = True):
        if isinstance(encoder, GlmVisionEncoder):
            if limits is None:
                raise ValueError("an eager model needs limits (a BudgetConfig): the batches a runner would take")
            encoder = EagerEncoder(encoder, limits)
        elif not isinstance(encoder, Encoder):
            raise TypeError(f"expected an Encoder or a GlmVisionEncoder, got {type(encoder).__name__}")
        budgets = limits or encoder.budgets
        if budgets is None:
            raise ValueError("an encoder without budgets needs limits (a BudgetConfig): the batches to take")
        self.encoder = encoder
        self.model, self.limits, self.mode = encoder.model, budgets, encoder.label
        self._encode: Encode = partial(encoder.encode, sync=False)
        if not (isinstance(max_wait_s, (int, float)) and 0 <= max_wait_s <= 1):
            raise ValueError(f"max_wait_s must be in [0, 1] seconds, got {max_wait_s!r}")
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests must be a positive integer, got {max_requests!r}")
        self.max_wait_s = float(max_wait_s)
        self.max_requests = max_requests
        self.max_tokens = max_tokens if max_tokens is not None else 64 * self.limits.largest
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        if switch_interval_s is not None and (isinstance(switch_interval_s, bool)
                                              or not isinstance(switch_interval_s, (int, float))
                                              or not 1e-6 <= switch_interval_s <= 1):
            raise ValueError(f"switch_interval_s must be in [1e-6, 1] seconds or None, got {switch_interval_s!r}")
        self.switch_interval_s = switch_interval_s
        self.warm_up = warm_up
        self._warmed = threading.Event()  # set by the worker once its warm-up ended (or was not asked for)
        self._cond = threading.Condition()
        self._pending: collections.deque[tuple[_Request, int]] = collections.deque()
        self._outstanding = 0  # admitted, not yet answered
        self._outstanding_tokens = 0
        self._outstanding_bytes = 0
        self._staging = 0  # admitted, pixels still being staged (not yet queued)
        self._unanswered: dict[Future, _Request] = {}  # queued or running, future not yet set
        self._worker_done = False  # the worker stopped: nothing queued from now on would run
        self._closing = False
        self._next_request = 0
        self._next_batch = 0
        self._stats = SchedulerStats()
        self._busy_until = 0.0  # when the last delivered batch was done (busy time counts overlaps once)
        self._started_at: float | None = None  # when the worker could run its first batch (after its warm-up)
        self._worker = threading.Thread(target=self._loop, name="glmvit-scheduler", daemon=True)
        self._worker_started = False
        if start:
            self.start()

    # ---- the callers' side ---------------------------------------------------------------------------------
    def start(self) -> "BatchScheduler":
        """Start the worker (once; the constructor does unless ``start=False``) and return once its warm-up
        (``warm_up``) has ended: requests submitted meanwhile wait in the queue. After :meth:`close`, a scheduler
        that never started stays unstarted (nothing to run, nothing to warm)."""
        with self._cond:
            if not self._worker_started:
                if self._closing:
                    return self
                self._worker.start()  # may raise (no thread to be had): then it never started, and close() says so
                self._worker_started = True
        self._warmed.wait()
        return self

    @property
    def accepting(self) -> bool:
        return not self._closing

    def submit(self, pixel_values: torch.Tensor, grid_thw: Any, check_finite: bool = True) -> Future:
        """Admit one request (``grid_thw``: grids, or an :class:`~glmvit.request.EncoderRequest`); the future
        resolves to its :class:`RequestResult` (or its error). It is running already: it cannot be cancelled.

        Raises at once: ValueError for bad input (naming the item), :class:`RequestTooLarge`, :class:`QueueFull`,
        :class:`SchedulerClosed`. Pixels already on the model's device in its dtype are used
        as they are: leave them unchanged until the future resolves. ``check_finite=False`` skips the NaN/Inf pass
        for pixels finite by construction (it reads a result on the host: on a device, a wait for the stream).
        """
        checked = self.model.check_request(pixel_values, grid_thw, check_finite)
        tokens = checked.item_tokens
        total = sum(tokens)
        nbytes = pixel_values.numel() * self.model.dtype.itemsize
        if total > self.max_tokens:
            raise RequestTooLarge(f"the request has {total:,} tokens, more than the queue holds "
                                  f"({self.max_tokens:,}): split it")
        if nbytes > self.max_bytes:
            raise RequestTooLarge(f"the request has {nbytes:,} bytes of pixels, more than the queue holds "
                                  f"({self.max_bytes:,}): split it")
        with self._cond:
            if self._closing:
                self._stats.rejected_closed += 1
                raise SchedulerClosed("the encoder is shutting down and takes no new requests")
            if (self._outstanding >= self.max_requests or self._outstanding_tokens + total > self.max_tokens
                    or self._outstanding_bytes + nbytes > self.max_bytes):
                self._stats.rejected_full += 1
                raise QueueFull(f"the queue is full ({self._outstanding} requests, {self._outstanding_tokens:,} "
                                f"tokens, {self._outstanding_bytes:,} bytes waiting; at most {self.max_requests} "
                                f"requests, {self.max_tokens:,} tokens, {self.max_bytes:,} bytes); retry later")
            self._outstanding += 1
            self._outstanding_tokens += total
            self._outstanding_bytes += nbytes
            self._staging += 1
            request_id = self._next_request
            self._next_request += 1
            self._stats.submitted += 1
        future: Future = Future()
        future.set_running_or_notify_cancel()  # admitted: cancel() is refused from now on (it is answered)
        staging = time.perf_counter()
        try:
            pixels = stage(pixel_values, self.model.device, self.model.dtype)
        except BaseException:
            with self._cond:
                self._release(total, nbytes)
                self._staging -= 1
                self._cond.notify_all()
            raise
        staged = time.perf_counter()
        request = _Request(request_id, pixels, checked, tokens, [spec.segments for spec in checked.items],
                           nbytes, staged - staging, staged, future,
                           outputs=[None] * len(tokens), remaining=len(tokens))
        with self._cond:
            self._staging -= 1
            # closed, never started, while it was staged; or the worker has stopped
            orphaned = self._closing and (not self._worker_started or self._worker_done)
            if orphaned:
                self._fail(request)
            elif tokens:
                self._unanswered[future] = request
                self._pending.extend((request, i) for i in range(len(tokens)))
            else:
                self._release(0, nbytes)
                self._stats.completed += 1
            self._cond.notify_all()
        if orphaned:
            future.set_exception(SchedulerClosed("the scheduler's worker stopped" if self._worker_started
                                                 else "the scheduler was closed before it started"))
        elif not tokens:
            future.set_result(RequestResult(request_id, [], 0.0, 0.0, (), staged - staging))
        return future

    def withdraw(self, future: Future) -> bool:
        """Drop the request of ``future`` (:meth:`submit`'s) if no batch has taken any of its items yet: its caller
        no longer wants it (a client that left). True if dropped: it is never encoded, its place in the queue is
        freed and ``future`` fails with :class:`RequestWithdrawn`. False if a batch has taken an item of it (it
        runs and is answered as usual) or it is answered already."""
        with self._cond:
            request = self._unanswered.get(future)
            if request is None or request.taken:
                return False
            self._drop(request)
            self._stats.withdrawn += 1
            self._cond.notify_all()
        future.set_exception(RequestWithdrawn(f"request {request.id} was withdrawn before it ran"))
        return True

    def encode(self, pixel_values: torch.Tensor, grid_thw: Any, timeout: float | None = None) -> RequestResult:
        """:meth:`submit` and wait for the result."""
        return self.submit(pixel_values, grid_thw).result(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new requests, finish every admitted one, stop the worker; True if it stopped within ``timeout``.

        Without a started worker, admitted requests fail with :class:`SchedulerClosed`.
        """
        unstarted: list[_Request] = []
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            started = self._worker_started
            while self._pending and not started:
                request, _ = self._pending.popleft()
                if not request.finished:
                    self._fail(request)
                    unstarted.append(request)
        for request in unstarted:
            request.future.set_exception(SchedulerClosed("the scheduler was closed before it started"))
        if started:
            self._worker.join(timeout)
            return not self._worker.is_alive()
        return True

    def __enter__(self) -> "BatchScheduler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict:
        """A snapshot: counters, queue delays (ms) and batch sizes over the recent samples, padding, utilisation."""
        with self._cond:
            s = self._stats
            elapsed = time.perf_counter() - self._started_at if self._started_at is not None else 0.0
            snapshot = {k: v for k, v in vars(s).items() if not isinstance(v, collections.deque)}
            snapshot.update(
                mode=self.mode, accepting=not self._closing, outstanding_requests=self._outstanding,
                outstanding_tokens=self._outstanding_tokens, outstanding_bytes=self._outstanding_bytes,
                queued_items=len(self._pending), max_requests=self.max_requests, max_tokens=self.max_tokens,
                max_bytes=self.max_bytes, max_wait_s=self.max_wait_s, switch_interval_s=self.switch_interval_s,
                limits={"token_budgets": list(self.limits.token_budgets), "max_items": self.limits.max_items,
                        "max_segments": self.limits.max_segments},
                queue_ms=distribution(s.queue_ms), batch_items=distribution(s.batch_items),
                padding_fraction=1 - s.packed_tokens / s.budget_tokens if s.budget_tokens else 0.0,
                utilisation=s.busy_s / elapsed if elapsed > 0 else 0.0, uptime_s=elapsed,
            )
        return snapshot

    # ---- the worker ----------------------------------------------------------------------------------------
    def _release(self, tokens: int, nbytes: int) -> None:
        self._outstanding -= 1
        self._outstanding_tokens -= tokens
        self._outstanding_bytes -= nbytes

    def _fail(self, request: _Request) -> None:
        """Count ``request`` as answered with an error (under the lock); the caller sets the future's exception."""
        self._drop(request)
        self._stats.failed += 1

    def _drop(self, request: _Request) -> None:
        """``request`` is answered (under the lock): its items still queued are skipped, its place is freed."""
        request.finished = True
        self._unanswered.pop(request.future, None)
        self._release(sum(request.tokens), request.nbytes)

    def _fill(self, batch: _Batch) -> None:
        """Move items from the head of the queue into ``batch`` while they fit (under the lock)."""
        while self._pending and not batch.full:
            request, i = self._pending[0]
            if request.finished:  # failed in an earlier batch: its other items are not worth encoding
                self._pending.popleft()
                continue
            tokens, segments = request.tokens[i], request.segments[i]
            if not fits(self.limits, len(batch.slots) + 1, batch.tokens + tokens, batch.segments + segments):
                batch.full = True
                if batch.slots:
                    break  # else it is an item no batch holds (the runner runs it eagerly): a batch of its own
            self._pending.popleft()
            if not request.taken:
                request.taken = True
                batch.first_taken.append(request)
            batch.slots.append((request, i))
            batch.tokens += tokens
            batch.segments += segments
            lim = self.limits
            if len(batch.slots) == lim.max_items or batch.tokens >= lim.largest or batch.segments >= lim.max_segments:
                batch.full = True

    def _take(self, block: bool = True) -> _Batch | None:
        """The next batch: blocking until there is one, None once closing and everything admitted is answered;
        with ``block=False`` (a batch is in flight), at once: a full batch of what is queued now, or None (the items
        stay queued, for later arrivals to join once the batch in flight is answered)."""
        with self._cond:
            while True:
                while not self._pending:
                    if not block or (self._closing and self._staging == 0):
                        return None
                    self._cond.wait()
                batch = _Batch(self._next_batch)
                self._fill(batch)
                if not block and not batch.full:
                    self._pending.extendleft(reversed(batch.slots))  # back at the head, in their order
                    for request in batch.first_taken:
                        request.taken = False  # none of its items is in a batch: it may still be withdrawn
                    return None
                deadline = time.perf_counter() + self.max_wait_s
                while block and not batch.full and not self._closing and self.max_wait_s > 0:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                    self._fill(batch)
                if batch.slots:  # empty when every queued item belonged to a failed request
                    self._next_batch += 1
                    return batch
                if not block:
                    return None

    def _loop(self) -> None:
        """Queue a batch, then, with it in flight, the next one if it is full, then answer the first (module
        docstring, step 3)."""
        held = False
        try:
            _switch_interval.hold(self.switch_interval_s)
            held = True
            self._warm()
            self._run_batches()
        except Exception:  # a fault of the scheduler itself (a batch's errors go to its requests): stop, say why
            log.exception("the encoder's worker stopped on an error; the requests it had not answered fail")
        finally:
            self._stop_worker()
            self._warmed.set()  # start() returns however the worker ended, its warm-up done or not
            if held:
                _switch_interval.release(self.switch_interval_s)

    def _warm(self) -> None:
        """The eager route's warm-up, in this (the worker's) thread: cuDNN's handle and plans are per thread. A
        failure is logged and serving goes on (it only costs the first batch of each class its compile); a close
        stops it between forwards, and one before it began skips it."""
        try:
            if self.warm_up and not self._closing:
                rows = self.limits.largest * self.model.config.merge_area
                done = warm_eager(self.model, self.encoder.attention, rows, stop=lambda: self._closing)
                with self._cond:
                    self._stats.warmup_s, self._stats.warmup_forwards = done.seconds, len(done.rows)
        except Exception:
            log.exception("the eager route's warm-up failed; serving without it")
        finally:
            with self._cond:
                self._started_at = time.perf_counter()  # utilisation counts from the first batch it could run
            self._warmed.set()

    def _stop_worker(self) -> None:
        """The worker ends: refuse new requests, and fail every admitted request not yet answered (none waits for
        a worker that is gone)."""
        with self._cond:
            self._closing = self._worker_done = True
            self._pending.clear()
            left = sorted(self._unanswered.values(), key=lambda request: request.id)
            for request in left:
                self._fail(request)
            self._cond.notify_all()
        for request in left:
            if not request.future.done():
                request.future.set_exception(SchedulerClosed(f"the scheduler's worker stopped before request "
                                                             f"{request.id} was answered"))

    def _run_batches(self) -> None:
        in_flight: _Launched | None = None
        while True:
            batch = self._take(block=in_flight is None)
            if batch is None and in_flight is None:
                return
            launched = self._launch(batch) if batch is not None else None
            if in_flight is not None:
                self._finish(in_flight)
            if launched is not None and launched.done is None:  # off CUDA: computed already, answered at once
                self._finish(launched)
                launched = None
            in_flight = launched

    def _launch(self, batch: _Batch) -> "_Launched | None":
        """Queue ``batch`` on the device; None if it failed (its requests answered with the error)."""
        start = time.perf_counter()
        requests = list(dict.fromkeys(request for request, _ in batch.slots))
        for request in requests:
            if request.started is None:
                request.started = start
            request.batches.append(batch.id)
        try:
            pixels = self._gather(batch)
            items = EncoderRequest.gather([(request.request, i) for request, i in batch.slots])
            outputs = self._encode(pixels, items)
            self._check(batch, outputs)
            done = self._mark_done(outputs)
        except Exception as err:  # noqa: BLE001 - the batch's requests get the error; the worker goes on
            self._fail_batch(requests, err)
            return None
        return _Launched(batch, outputs, requests, start, done)

    def _mark_done(self, outputs: list[torch.Tensor]) -> "_Done | None":
        """What marks a launched batch's outputs computed: an event recorded after its work on the worker's stream
        (on CUDA), or None (off CUDA the outputs are computed when the encoder returns)."""
        if not outputs or outputs[0].device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done

    def _finish(self, launched: _Launched) -> None:
        """Wait until ``launched``'s outputs are computed, then answer its items."""
        try:
            if launched.done is not None:
                launched.done.synchronize()
        except Exception as err:  # noqa: BLE001 - as in _launch
            self._fail_batch(launched.requests, err)
            return
        self._deliver(launched.batch, launched.outputs, launched.requests, launched.start, time.perf_counter())

    def _fail_batch(self, requests: list[_Request], err: BaseException) -> None:
        with self._cond:
            self._stats.failed_batches += 1
            failed = [request for request in requests if not request.finished]
            for request in failed:
                self._fail(request)
            self._cond.notify_all()
        for request in failed:
            request.future.set_exception(err)

    def _gather(self, batch: _Batch) -> torch.Tensor:
        chunks = []
        for request, i in batch.slots:
            a, b = request.request.row_range(i)
            chunks.append(request.pixels[a:b])
        if chunks[0].device.type == "cuda":  # staged on another thread's stream: keep it until the worker is done
            stream = torch.cuda.current_stream(chunks[0].device)
            for request in dict.fromkeys(request for request, _ in batch.slots):
                request.pixels.record_stream(stream)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def _check(self, batch: _Batch, outputs: list[torch.Tensor]) -> None:
        width = self.model.config.out_hidden_size
        if len(outputs) != len(batch.slots):
            raise ResultMismatch(f"batch {batch.id}: {len(batch.slots)} items but {len(outputs)} outputs")
        for (request, i), out in zip(batch.slots, outputs, strict=True):
            if tuple(out.shape) != (request.tokens[i], width):
                raise ResultMismatch(f"batch {batch.id}: request {request.id} item {i} should be "
                                     f"[{request.tokens[i]}, {width}] but got {list(out.shape)}")

    def _deliver(self, batch: _Batch, outputs: list[torch.Tensor], requests: list[_Request], start: float,
                 done: float) -> None:
        answers: list[tuple[_Request, RequestResult | BaseException]] = []
        for (request, i), out in zip(batch.slots, outputs, strict=True):
            if request.finished:
                continue
            if request.outputs[i] is not None:
                answers.append((request, ResultMismatch(f"request {request.id} item {i} was encoded twice")))
                request.finished = True
                continue
            request.outputs[i] = out
            request.remaining -= 1
        for request in requests:
            if request.finished or request.remaining:
                continue
            outs = [o for o in request.outputs if o is not None]
            if len(outs) != len(request.tokens):  # cannot happen unless the bookkeeping above is wrong
                answers.append((request, ResultMismatch(f"request {request.id}: {len(outs)} of "
                                                        f"{len(request.tokens)} items came back")))
            else:
                queue_s = (request.started or start) - request.admitted
                answers.append((request, RequestResult(request.id, outs, queue_s, done - request.admitted,
                                                       tuple(request.batches), request.stage_s)))
            request.finished = True
        with self._cond:
            s = self._stats
            s.batches += 1
            s.items += len(batch.slots)
            s.tokens += batch.tokens
            s.busy_s += done - max(start, self._busy_until)  # the batch before it may still have been in flight
            self._busy_until = done
            s.batch_items.append(len(batch.slots))
            s.mixed_batches += len(requests) > 1
            budget = self.limits.budget_for(batch.tokens) if batch.segments <= self.limits.max_segments else None
            if budget is None:
                s.alone_batches += 1
            else:
                s.budget_tokens += budget
                s.packed_tokens += batch.tokens
            for request in requests:
                if request.batches[0] == batch.id:
                    s.queue_ms.append((start - request.admitted) * 1e3)
            for request, answer in answers:
                self._unanswered.pop(request.future, None)
                self._release(sum(request.tokens), request.nbytes)
                if isinstance(answer, RequestResult):
                    s.completed += 1
                else:
                    s.failed += 1
            self._cond.notify_all()
        for request, answer in answers:  # outside the lock: callbacks run here
            if isinstance(answer, RequestResult):
                request.future.set_result(answer)
            else:
                request.future.set_exception(answer)
