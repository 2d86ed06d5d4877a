"""The pipe between an API server process of ``glmvit serve --api-servers N`` and the engine process.

What crosses is small, always: a request's decoded media as :class:`~glmvit.cli.serve_media.RequestMedia` (its uint8
frames stay in the shared-memory files the decode workers wrote, :mod:`glmvit.cli.pixel_rows`), or pixel rows parsed
from a safetensors body (:class:`SharedPrepared`: the rows written to such a file by the API server); the answer comes
back as an :class:`~glmvit.cli.serve_backend.Encoded` whose body is a file the engine wrote in its own shared-memory
directory (mapped and unlinked by the API server: the bytes live as long as the response that sends them). Bytes never
travel through the pipe (a blocking send of megabytes on each side's event loop would deadlock them): ``--api-servers
N`` refuses to start without a shared folder, and a request whose rows or answer find no room in it fails with 507
(:data:`~glmvit.cli.serve_backend.NO_ROOM`).

Messages, each a tuple, the API server's first: ``("encode", key, source, dtype)``, ``("withdraw", key)`` (its client
left: the engine cancels the request's task, which withdraws it as the one-process server does), ``("stats", key,
fingerprint)``, ``("ready", url)``, ``("bye",)``; the engine's: ``("done", key, encoded, body)``, ``("error", key,
class name, one line, status)`` (never a live exception, which may not unpickle: its status decided by the engine,
:func:`~glmvit.cli.serve_backend.status_of`), ``("stats", key, snapshot)``, ``("drain",)``. :class:`RemoteBackend` is
the API server's end (a backend as :mod:`glmvit.cli.serve_backend` defines it); :class:`EngineLink` serves the
engine's ends with the engine's :class:`~glmvit.cli.serve_backend.LocalBackend`, on the engine's event loop. An engine
that is gone fails what waits on it with :class:`~glmvit.scheduler.SchedulerClosed` (503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import mmap
import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np
import torch

from ..config import VisionConfig
from ..model import GlmVisionEncoder
from ..scheduler import SchedulerClosed
from .pixel_rows import PixelRows
from .serve_backend import NO_ROOM, ClientLeft, Encoded, LocalBackend, Prepared, Refused, first_line, status_of
from .serve_media import RequestMedia

log = logging.getLogger("glmvit.cli.serve_app")
REFRESH_TIMEOUT_S = 1.0  # /health, /v1/info and /metrics wait this long for the engine's counters, then use the last


class ModelFacts:
    """What an API server needs of the model, without building it (no weights, no device): its config, dtype and
    the model's own input checks (:meth:`GlmVisionEncoder.check_inputs <glmvit.model.GlmVisionEncoder.check_inputs>`,
    which read only the config)."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype):
        self.config, self.dtype = config, dtype

    def request_of(self, grid_thw: Any) -> Any:
        return GlmVisionEncoder.request_of(self, grid_thw)  # type: ignore[arg-type]

    def check_request(self, pixel_values: torch.Tensor, grid_thw: Any, check_finite: bool = True) -> Any:
        return GlmVisionEncoder.check_request(self, pixel_values, grid_thw, check_finite)  # type: ignore[arg-type]

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: Any, check_finite: bool = True) -> np.ndarray:
        return GlmVisionEncoder.check_inputs(self, pixel_values, grid_thw, check_finite)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SharedPrepared:
    """A :class:`~glmvit.cli.serve_backend.Prepared` whose pixel rows are in a shared file (or bytes)."""

    rows: PixelRows
    grid_thw: np.ndarray
    records: list[dict[str, Any]]

    @classmethod
    def of(cls, prepared: Prepared, folder: str | None) -> "SharedPrepared":
        return cls(PixelRows.of(prepared.pixel_values, folder), prepared.grid_thw.numpy(), prepared.records)

    def prepared(self) -> Prepared:
        """The rows mapped (their file unlinked) as a Prepared, not checked for NaN/Inf (admission does that)."""
        return Prepared(self.rows.tensor(), torch.from_numpy(self.grid_thw), self.records)

    def discard(self) -> None:
        self.rows.discard()


def _inline(source: RequestMedia | SharedPrepared) -> bool:
    """Whether ``source`` holds bytes of its own (a write to shared memory failed): they never cross the pipe."""
    rows = [source.rows] if isinstance(source, SharedPrepared) else [m.frames for m in source.items]
    return any(r.path is None and r.data for r in rows)


def _discard_written(job: Any) -> None:
    """A rows write's done callback, its client gone: the file it wrote (if any) is removed."""
    if not job.cancelled() and job.exception() is None:
        job.result().discard()


def _discard(source: Any) -> None:
    if isinstance(source, (RequestMedia, SharedPrepared)):
        source.discard()


class AnswerFile:
    """Where the engine serialises one answer (``allocate`` of :meth:`LocalBackend.encode
    <glmvit.cli.serve_backend.LocalBackend.encode>`): a new file of the answer's size under ``folder``, mapped, its
    space reserved first (a full ``/dev/shm`` is an OSError here, never a SIGBUS mid-write). Without a folder, or
    without room, the request fails (:class:`~glmvit.cli.serve_backend.Refused`, 507): an answer's bytes never
    cross the pipe."""

    def __init__(self, folder: str | None):
        self.folder = folder
        self.path: str | None = None
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()  # allocation (a serialising thread) against discard (the event loop)
        self._discarded = False

    def __call__(self, size: int) -> mmap.mmap:
        if self.folder is None:
            raise Refused("no shared memory to hand the answer over in", NO_ROOM)
        path = os.path.join(self.folder, uuid.uuid4().hex)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
                self._map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as err:
            _unlink(path)
            raise Refused(f"no room in shared memory for the answer's {size:,} bytes ({err.strerror}); "
                          "retry later", NO_ROOM) from None
        with self._lock:
            if self._discarded:  # withdrawn while it was being allocated: written for nobody, its file gone now
                _unlink(path)
            else:
                self.path = path
        return self._map

    def rows(self, body: Any) -> PixelRows:
        """The answer as it is handed over: its file (unmapped here)."""
        assert self._map is not None and self.path is not None, "the answer was not serialised into its file"
        size = len(self._map)
        try:
            self._map.close()  # the reader maps the file itself
        except BufferError:  # a view of it still alive here: unmapped with the last one
            pass
        self._map = None
        return PixelRows((size,), "uint8", path=self.path)

    def discard(self) -> None:
        """Remove the file of an answer nobody takes (its mapping goes with the last view of it); an allocation
        still to come removes its own."""
        with self._lock:
            self._discarded = True
            if self.path is not None:
                _unlink(self.path)
        self._map = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class RemoteBackend:
    """An API server's backend: each request handed to the engine over ``conn``, its answer read from the file the
    engine wrote. :meth:`start` on the server's event loop before the first request; ``on_drain`` is called when the
    engine asks the server to drain, or is gone. ``folder``: where safetensors bodies' pixel rows are written."""

    def __init__(self, conn: Connection, mode: str, folder: Callable[[], str | None]):
        self.conn, self.mode, self._folder = conn, mode, folder
        self.fingerprint: dict[str, Any] | None = None
        self._snapshot: dict[str, Any] = {"scheduler": {}, "runner": None}
        self._keys = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._send_lock = threading.Lock()
        self._rows = ThreadPoolExecutor(max_workers=2, thread_name_prefix="glmvit-rows")  # safetensors rows' writes
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_drain: Callable[[], None] = lambda: None
        self.gone = False
        self._state = "ok"  # the engine's, as /health says it: ok, draining, unresponsive (gone: self.gone)

    def start(self, on_drain: Callable[[], None]) -> None:
        self._loop, self._on_drain = asyncio.get_running_loop(), on_drain
        self._loop.add_reader(self.conn.fileno(), self._readable)

    def send(self, message: tuple) -> None:
        """``message`` to the engine; SchedulerClosed once the engine is gone.

        A blocking send, on the event loop: every message is small (names of shared files, shapes, grids, the
        items' records: a few KiB at most; never a frame's nor an answer's bytes, which fail the request instead,
        507), and the engine reads its pipes whenever they are readable, as this server reads its own, so the
        socket's buffer (hundreds of KiB each way) cannot fill: neither side can block on the other's send."""
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):
            self._lost()
            raise SchedulerClosed("the engine is gone: it takes no new requests") from None

    def _readable(self) -> None:
        """Each message the engine sent, in turn; one that cannot be read or handled fails only its request
        (500, logged): never a request left unanswered, never the pipe."""
        while not self.gone:
            try:
                if not self.conn.poll():
                    return
                message = self.conn.recv()
            except (EOFError, OSError):
                self._lost()
                return
            except Exception:  # noqa: BLE001 - a message that does not unpickle: no key to fail, the rest read on
                log.exception("a message from the engine could not be read")
                continue
            try:
                self._received(message)
            except Exception as err:  # noqa: BLE001 - its request fails, the others go on
                log.exception("a message from the engine could not be handled")
                self._fail(message, err)

    def _fail(self, message: Any, err: Exception) -> None:
        key = message[1] if isinstance(message, tuple) and len(message) > 1 else None
        future = self._waiting.pop(key, None) if isinstance(key, int) else None
        if future is not None and not future.done():
            future.set_exception(Refused(f"internal error: {type(err).__name__}: {first_line(err)}", 500))

    def _received(self, message: tuple) -> None:
        kind = message[0]
        if kind == "drain":
            self._state = "draining"
            self._on_drain()
            return
        if kind == "done":
            _, _, encoded, body = message
            if not isinstance(encoded, Encoded) or not isinstance(body, PixelRows) or body.path is None:
                raise ValueError(f"an answer of {type(encoded).__name__} and {type(body).__name__}")
        elif kind not in ("error", "stats"):
            raise ValueError(f"a message of kind {kind!r}")
        future = self._waiting.pop(message[1], None)
        if future is None or future.done():  # its client left: nobody takes the answer
            if kind == "done":
                message[3].discard()
            return
        future.set_result(message)

    def _lost(self) -> None:
        """The engine closed its end: every request waiting on it fails (503), the server drains."""
        if self.gone:
            return
        self.gone = True
        if self._loop is not None:
            self._loop.remove_reader(self.conn.fileno())
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(SchedulerClosed("the engine is gone: the request was not answered"))
        self._waiting.clear()
        self._on_drain()

    async def _ask(self, message: tuple) -> tuple:
        assert self._loop is not None, "RemoteBackend.start was not called"
        key = message[1]
        future = self._loop.create_future()
        self._waiting[key] = future
        try:
            self.send(message)
        except SchedulerClosed:
            self._waiting.pop(key, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:  # its client left: the engine withdraws the request
            if self._waiting.pop(key, None) is not None and message[0] == "encode" and not self.gone:
                try:
                    self.send(("withdraw", key))
                except SchedulerClosed:
                    pass
            elif future.done() and not future.cancelled() and future.exception() is None:
                reply = future.result()  # its answer came in the same pass of the loop: nobody takes it
                if reply[0] == "done":
                    reply[3].discard()
            raise

    async def encode(self, source: RequestMedia | Prepared, dtype: str,
                     gone: Callable[[], bool] = lambda: False) -> Encoded:
        """As :meth:`LocalBackend.encode <glmvit.cli.serve_backend.LocalBackend.encode>`, in the engine."""
        if isinstance(source, Prepared):
            job = self._rows.submit(SharedPrepared.of, source, self._folder())
            try:
                shared: RequestMedia | SharedPrepared = await asyncio.wrap_future(job)
            except asyncio.CancelledError:  # its client left: the rows written meanwhile are removed when written
                job.add_done_callback(_discard_written)
                raise
        else:
            shared = source
        if _inline(shared):
            _discard(shared)
            raise Refused("no room in shared memory for the request's pixels; retry later", NO_ROOM)
        try:
            reply = await self._ask(("encode", next(self._keys), shared, dtype))
        except SchedulerClosed:
            _discard(shared)  # never sent (a sent source is the engine's to remove)
            raise
        if reply[0] == "error":
            _, _, name, line, status = reply
            raise Refused(f"internal error: {name}: {line}" if status == 500 else line, status)
        encoded, body = reply[2], reply[3]
        if gone():
            body.discard()
            raise ClientLeft
        return replace(encoded, body=body.tensor().numpy().data)

    @property
    def engine_state(self) -> str:
        """``ok``, ``draining`` (it asked this server to drain), ``unresponsive`` (its last refresh went
        unanswered) or ``gone`` (its pipe closed)."""
        return "gone" if self.gone else self._state

    async def refresh(self, fingerprint: bool = False) -> None:
        """The engine's scheduler and runner counters (and the code's fingerprint), fetched now; an engine gone,
        or silent for :data:`REFRESH_TIMEOUT_S`, leaves the last ones (:attr:`engine_state` says which)."""
        try:
            reply = await asyncio.wait_for(self._ask(("stats", next(self._keys), fingerprint)), REFRESH_TIMEOUT_S)
        except asyncio.TimeoutError:
            if not self.gone:
                self._state = "unresponsive"
            return
        except SchedulerClosed:
            return
        if self._state == "unresponsive":
            self._state = "ok"
        self._snapshot = reply[2]
        if fingerprint:
            self.fingerprint = reply[2]["fingerprint"]

    def stats(self) -> dict[str, Any]:
        return self._snapshot["scheduler"]

    def runner_stats(self) -> dict[str, Any] | None:
        return self._snapshot["runner"]

    def close(self, timeout: float | None = None) -> bool:
        """Tell the engine this server is done (its requests were answered by the drain)."""
        try:
            self.send(("bye",))
        except SchedulerClosed:
            pass
        self._rows.shutdown(wait=False)
        return True


@dataclass
class _Front:
    name: str
    conn: Connection
    tasks: dict[int, asyncio.Task]
    waiting: dict[int, Any]  # sources of tasks not started yet (removed if withdrawn before they start)
    url: str | None = None
    done: bool = False  # it said bye, or its pipe closed


class EngineLink:
    """The engine's ends of the API servers' pipes, served on the running event loop by ``backend``; answers are
    written under ``folder`` (None: every request fails, 507), the only folder whose files (direct children, never
    through a symbolic link) the engine opens or removes for an API server: a request naming another fails, 500,
    logged. ``fingerprint()`` is the code's fingerprint
    (``/v1/info``). ``on_change`` is called when an API server is ready or done."""

    def __init__(self, backend: LocalBackend, folder: str | None, fingerprint: Callable[[], dict[str, Any]],
                 on_change: Callable[[], None] = lambda: None):
        self.backend, self.folder, self.fingerprint, self.on_change = backend, folder, fingerprint, on_change
        self.fronts: list[_Front] = []

    def attach(self, name: str, conn: Connection) -> None:
        front = _Front(name, conn, {}, {})
        self.fronts.append(front)
        asyncio.get_running_loop().add_reader(conn.fileno(), self._readable, front)

    def drain(self) -> None:
        """Ask every API server still there to drain."""
        for front in self.fronts:
            if not front.done:
                self._send(front, ("drain",))

    def _readable(self, front: _Front) -> None:
        """Each message ``front`` sent, in turn; one that cannot be read or handled is logged (its request, if
        it names one, fails: 500), the others go on."""
        while not front.done:
            try:
                if not front.conn.poll():
                    return
                message = front.conn.recv()
            except (EOFError, OSError):
                self._lost(front)
                return
            except Exception:  # noqa: BLE001 - a message that does not unpickle
                log.exception("a message from API server %s could not be read", front.name)
                continue
            try:
                self._received(front, message)
            except Exception as err:  # noqa: BLE001 - logged; its request fails, the others go on
                log.exception("a message from API server %s could not be handled", front.name)
                if isinstance(message, tuple) and len(message) > 1 and message[0] == "encode":
                    self._send(front, ("error", message[1], type(err).__name__, first_line(err), 500))

    def _received(self, front: _Front, message: tuple) -> None:
        kind = message[0]
        if kind == "encode":
            _, key, source, dtype = message
            foreign = self._foreign(source)
            if foreign is not None:  # nothing of it is opened, nor removed
                log.warning("API server %s named %s for request %s: not a file of this server's; refused",
                            front.name, foreign, key)
                self._send(front, ("error", key, "ValueError", "a file not of this server's", 500))
                return
            front.waiting[key] = source
            task = asyncio.get_running_loop().create_task(self._encode(front, key, source, dtype))
            front.tasks[key] = task
            task.add_done_callback(lambda _: front.tasks.pop(key, None))  # a task cancelled before it started too
        elif kind == "withdraw":
            source = front.waiting.pop(message[1], None)
            if source is not None:
                _discard(source)
            running = front.tasks.get(message[1])
            if running is not None:
                running.cancel()
        elif kind == "stats":
            snapshot = {"scheduler": self.backend.stats(), "runner": self.backend.runner_stats(),
                        "fingerprint": self.fingerprint() if message[2] else None}
            self._send(front, ("stats", message[1], snapshot))
        elif kind == "ready":
            front.url = message[1]
            self.on_change()
        elif kind == "bye":
            self._lost(front)

    def _foreign(self, source: Any) -> str | None:
        """What in ``source`` (from an API server) is not a file the engine expects, in a few words (None: all
        is): a request's rows and frames are direct children of :attr:`folder`, or empty."""
        if not isinstance(source, (RequestMedia, SharedPrepared)):
            return f"a {type(source).__name__}"
        rows = [source.rows] if isinstance(source, SharedPrepared) else [m.frames for m in source.items]
        for r in rows:
            if not isinstance(r, PixelRows):
                return f"rows of {type(r).__name__}"
            if r.path is None:
                if r.data:
                    return f"{len(r.data):,} bytes through the pipe"
            elif not (isinstance(r.path, str) and self.folder is not None
                      and os.path.dirname(r.path) == self.folder
                      and os.path.basename(r.path) not in ("", ".", "..")):
                return repr(r.path)
        return None

    async def _encode(self, front: _Front, key: int, source: Any, dtype: str) -> None:
        front.waiting.pop(key, None)
        answer = AnswerFile(self.folder)
        try:
            if isinstance(source, SharedPrepared):
                source = source.prepared()
            encoded = await self.backend.encode(source, dtype, allocate=answer)
            body = answer.rows(encoded.body)
            self._send(front, ("done", key, replace(encoded, body=b""), body), body)
        except asyncio.CancelledError:  # withdrawn: nobody waits for it
            answer.discard()
        except Exception as err:  # noqa: BLE001 - handed to the API server, which answers its status
            answer.discard()
            status = status_of(err)
            if status == 500:
                log.exception("request %d of API server %s failed", key, front.name)
            self._send(front, ("error", key, type(err).__name__, first_line(err), status))

    def _send(self, front: _Front, message: tuple, body: PixelRows | None = None) -> None:
        """``message`` to ``front``: a blocking send on the event loop, of a small message only (an answer's file
        name, never its bytes; :meth:`RemoteBackend.send` says why it cannot fill the pipe)."""
        if front.done:
            if body is not None:
                body.discard()
            return
        try:
            front.conn.send(message)
        except (OSError, ValueError):
            if body is not None:
                body.discard()
            self._lost(front)
        except Exception as err:  # noqa: BLE001 - a message that does not pickle: its request fails, 500
            if body is not None:
                body.discard()
            log.exception("a message to API server %s could not be sent", front.name)
            self._send(front, ("error", message[1], type(err).__name__, first_line(err), 500))

    def _lost(self, front: _Front) -> None:
        """``front`` said bye or its pipe closed: its requests still here are withdrawn."""
        if front.done:
            return
        front.done = True
        asyncio.get_running_loop().remove_reader(front.conn.fileno())
        for source in front.waiting.values():
            _discard(source)
        for task in list(front.tasks.values()):
            task.cancel()
        self.on_change()

    @property
    def live(self) -> int:
        return sum(not f.done for f in self.fronts)
