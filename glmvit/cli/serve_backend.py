"""What ``glmvit serve``'s HTTP handler hands a request to once its body is read and its media decoded: a backend.

A request reaches a backend as a :class:`~glmvit.cli.serve_media.RequestMedia` (decoded media: uint8 frames in
shared-memory files, or the rows decode workers made of them) or a :class:`Prepared` (pixel rows parsed from a
safetensors body, checked but for NaN/Inf); :meth:`LocalBackend.encode` makes the media's pixel rows on the model's
device, or copies there those a worker made (on a thread of its own, on that thread's stream), admits the request to the
:class:`~glmvit.scheduler.BatchScheduler`, waits for its outputs and serialises the answer
(:mod:`glmvit.cli.answer_body`), returning an :class:`Encoded`. Its errors are the scheduler's
and the model's (:class:`~glmvit.scheduler.QueueFull`, :class:`~glmvit.scheduler.SchedulerClosed`,
:class:`~glmvit.scheduler.RequestTooLarge`, ValueError naming the item), raised as they are; :func:`status_of` maps
them to statuses (for the handler, and for the engine that answers an API server). A caller that stops waiting (its
task cancelled: the client left) withdraws the request, as :meth:`BatchScheduler.withdraw
<glmvit.scheduler.BatchScheduler.withdraw>` says: unencoded unless a batch has taken it, its answer never serialised.

The one process server (``--api-servers 1``) calls a :class:`LocalBackend` from its event loop; with several API
server processes each calls a :class:`~glmvit.cli.serve_link.RemoteBackend`, which hands the same inputs to the
engine process's :class:`LocalBackend` (:mod:`glmvit.cli.serve_link`). Both answer :meth:`stats` (the scheduler's),
:meth:`runner_stats`, :meth:`refresh` (a no-op here) and :meth:`close`.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..scheduler import BatchScheduler, QueueFull, RequestTooLarge, SchedulerClosed, finished_work
from .serve_media import RequestMedia

NO_ROOM = 507  # Insufficient Storage: the shared memory an answer or its rows must be written to is full


class Refused(Exception):
    """A request failed with its HTTP status decided already (``status``); the message is the client's line."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple:
        return type(self), (str(self), self.status)


STATUSES: tuple[tuple[type[BaseException], int], ...] = (
    (QueueFull, 429), (SchedulerClosed, 503), (RequestTooLarge, 413), (ValueError, 400))


def status_of(err: BaseException) -> int:
    """The HTTP status of a backend's error, decided here for the one-process server and the engine alike: a
    :class:`Refused`'s own, :data:`STATUSES`' (the first class ``err`` is an instance of), else 500."""
    if isinstance(err, Refused):
        return err.status
    return next((status for kind, status in STATUSES if isinstance(err, kind)), 500)


def first_line(err: BaseException) -> str:
    """``err``'s message, its first line."""
    text = str(err)
    return text.splitlines()[0] if text else ""


class ClientLeft(Exception):
    """The client closed its connection before its answer was written: nobody to answer, no error of the server."""


@dataclass(frozen=True)
class Prepared:
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    records: list[dict[str, Any]]
    finite: bool = False  # True: finite by construction (rows looked up from the processor's finite levels)


@dataclass
class Encoded:
    """A request's answer (``body``: the safetensors file) and where its time went, in seconds: ``rows_s`` its
    media's pixel rows made on the device (0 for pixel rows sent as such), ``admit_s`` admission's checks (the
    copy to the device apart: ``stage_s``), ``serialise_s`` the answer's serialisation; the scheduler's
    ``request_id``, ``queue_s``, ``total_s`` and ``batches``."""

    body: bytes | bytearray | memoryview
    request_id: int
    queue_s: float
    total_s: float
    stage_s: float
    batches: list[int]
    rows_s: float
    admit_s: float
    serialise_s: float


def device_rows(media: RequestMedia, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A request's rows made on the model's device on this thread's own stream, finished before they are handed
    to the scheduler (never queued behind the replays); rows a decode worker made already (``serve --rows host``)
    are only copied there. Frames or rows it did not take (it failed) are removed."""
    try:
        with finished_work(device):
            return media.rows(device, dtype)
    finally:
        media.discard()


Pack = Callable[[list[torch.Tensor], list[dict[str, Any]], str, Callable[[int], Any]], Any]


class LocalBackend:
    """The scheduler in this process: rows and admission on ``pool``'s threads (one job a request: an admission
    never queues behind other requests' rows), answers serialised by ``pack`` (outputs, records, the answer's dtype:
    ``float32`` or ``model``, and where to write it: ``allocate(size)``, a writable buffer) on ``answers``'
    threads."""

    fingerprint = None  # the code's fingerprint: the caller takes its own (it runs this process's code)

    def __init__(self, scheduler: BatchScheduler, pool: Executor, answers: Executor, pack: Pack,
                 runner_stats: Callable[[], dict] | None = None):
        self.scheduler, self.pool, self.answers, self.pack = scheduler, pool, answers, pack
        self._runner_stats = runner_stats
        self.model = scheduler.model

    @property
    def mode(self) -> str:
        return self.scheduler.mode

    async def encode(self, source: RequestMedia | Prepared, dtype: str, gone: Callable[[], bool] = lambda: False,
                     allocate: Callable[[int], Any] = bytearray) -> Encoded:
        """``source`` encoded and its answer serialised in ``dtype`` into ``allocate(size)``; :class:`ClientLeft` if
        ``gone()`` says its client left once its outputs are ready (nothing is serialised then)."""
        start = time.perf_counter()
        # one pool job makes the rows and admits them: admission never queues behind other requests' rows
        job = self.pool.submit(self._admit, source, start)
        try:
            prepared, prepared_at, future = await asyncio.wrap_future(job)
        except asyncio.CancelledError:  # its client left: a job that never ran removes no frames, so here; one
            if job.cancel():  # that runs withdraws what it admits once it is done
                if isinstance(source, RequestMedia):
                    source.discard()
            else:
                job.add_done_callback(self._withdraw_admitted)
            raise
        admitted = time.perf_counter()
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # nobody waits for it: not encoded, unless a batch has taken it already
            self.scheduler.withdraw(future)
            raise
        if gone():  # its client left while it waited: nothing to serialise, nobody to answer
            raise ClientLeft
        packing = time.perf_counter()
        body = await asyncio.get_running_loop().run_in_executor(self.answers, self.pack, result.outputs,
                                                                prepared.records, dtype, allocate)
        return Encoded(body, result.request_id, result.queue_s, result.total_s, result.stage_s, list(result.batches),
                       prepared_at - start, max(0.0, admitted - prepared_at - result.stage_s),
                       time.perf_counter() - packing)

    def _admit(self, source: RequestMedia | Prepared, start: float) -> tuple[Prepared, float, Any]:
        """On a pool thread: ``source``'s rows (media: made on the model's device, :func:`device_rows`), then
        admitted to the scheduler; the rows, when they were ready (perf_counter s: ``start`` for pixel rows sent as
        such, so that their wait for a pool thread counts as admission, as :class:`Encoded` says) and the
        scheduler's future."""
        if isinstance(source, RequestMedia):
            rows = device_rows(source, self.model.device, self.model.dtype)
            prepared = Prepared(rows, torch.from_numpy(source.grid_thw), source.records, finite=True)
            prepared_at = time.perf_counter()
        else:
            prepared, prepared_at = source, start
        return prepared, prepared_at, self.scheduler.submit(prepared.pixel_values, prepared.grid_thw,
                                                            not prepared.finite)

    def _withdraw_admitted(self, admission: Any) -> None:
        """An admission job's done callback, its client gone: the request it admitted (if any) is withdrawn."""
        if admission.exception() is None:
            self.scheduler.withdraw(admission.result()[2])

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    def runner_stats(self) -> dict[str, Any] | None:
        """The captured runner's counters (None: no runner)."""
        return self._runner_stats() if self._runner_stats else None

    async def refresh(self, fingerprint: bool = False) -> None:
        """Nothing to fetch: :meth:`stats` reads the scheduler itself."""

    def close(self, timeout: float | None = None) -> bool:
        """Drain the scheduler (within ``timeout``): True if it answered every request it had admitted."""
        return self.scheduler.close(timeout)
