"""Worker processes that decode and preprocess uploads for ``glmvit serve``, off its event loop and its engine.

:class:`DecodePool` runs picklable module-level functions in ``workers`` processes (started with ``spawn``: the
server holds threads and, on CUDA, a device context, which a fork would copy half-made). Each worker is owned by
one lane thread of this process, which sends it one task at a time over a pipe. Tasks belong to requests
(:meth:`DecodePool.request`, a :class:`DecodeRequest`; :meth:`DecodePool.submit` is a request of one task), and
requests take fair turns: a free lane takes the first waiting task of the request whose turn it is, and that
request, if it has more waiting, goes to the back of the line. So a request of one small picture waits for one
task of each request ahead of it, never for their whole media. A request's tasks run for ``timeout_s`` in all:
a lane waits for an answer at most what is left of it; past that the worker is killed and replaced, and the task
fails with :class:`DecodeTimeout`, so a decode that runs long holds one worker for ``timeout_s`` at most and never
the others. Requests are bounded: past ``workers + max_waiting`` requests open or with tasks not finished,
:meth:`DecodePool.request` (and so :meth:`DecodePool.submit`) raises :class:`DecodeBusy` at once; a request once
open is never refused a task. A worker that dies (killed from outside, out of memory) fails its task with
:class:`WorkerDied` and is replaced. Workers ignore SIGINT: a Ctrl-C meant for the server is its to handle.
Each worker's temporary files go to a directory of its own, removed when the worker ends, killed or stopped (a
killed worker cannot remove what its task left: a request's media would stay on disk); a worker whose server is
gone (killed) removes its own as it ends, and one whose server and worker were both killed is swept when the next
pool starts a worker (an owned directory, :mod:`glmvit.cli.owned_dir`). Each worker computes on one
thread (OpenMP, MKL, OpenBLAS and torch's intra-op pool set to 1): the pool's parallelism is its workers, and
``workers`` processes each running a pool of one thread per CPU would oversubscribe the machine many times over.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot end one worker whose task runs past its time without
breaking the whole pool (every other request decoding in it would fail).
"""
from __future__ import annotations

import collections
import importlib
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Callable

from . import owned_dir

ONE_THREAD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # a worker's numerical thread pools
SCRATCH_PREFIX = "glmvit-worker-"  # a worker's temporary directory under the system's (tempfile.gettempdir())
STARTUP_TIMEOUT_S = 300.0  # a worker's imports (torch, PIL, the processor) on a loaded machine


class DecodeBusy(RuntimeError):
    """Every worker is busy and the queue of waiting tasks is full (HTTP 429)."""


class DecodeTimeout(RuntimeError):
    """A task ran past the pool's ``timeout_s``; its worker was killed and replaced (HTTP 413)."""


class WorkerDied(RuntimeError):
    """The worker running a task ended without answering (it is replaced)."""


class DecodeClosed(RuntimeError):
    """The pool is closed: it takes no new request or task."""


def worker_main(conn: Connection, preload: tuple[str, ...], scratch: str) -> None:
    """A worker: imports ``preload`` (running each module's ``warm_worker()`` where it has one), says it is ready,
    then answers ("ok", result) or ("error", exception) for
    each (function, args) it receives; None, or a server that is gone (its pipe closed), ends it. Its temporary
    files go under ``scratch``, which it owns too (:func:`owned_dir.hold`) and removes as it ends."""
    try:
        owned_dir.hold(scratch)
        _serve(conn, preload, scratch)
    finally:
        owned_dir.remove(scratch)


def _one_thread() -> None:
    """A worker's parallelism is the pool: torch on one thread, nor FFmpeg's frame threads
    (glmvit.video.frame_threads), for the modules imported so far."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    if "glmvit.video" in sys.modules:
        video: Any = sys.modules["glmvit.video"]
        video.frame_threads = False


def _serve(conn: Connection, preload: tuple[str, ...], scratch: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tempfile.tempdir = os.environ["TMPDIR"] = scratch
    for variable in ONE_THREAD:  # before any numerical library is imported: they read these once
        os.environ[variable] = "1"
    modules = [importlib.import_module(module) for module in preload]
    _one_thread()  # before the warm-ups: they pay the first-use costs of the decodes a task runs, threads alike
    for module in modules:
        warm = getattr(module, "warm_worker", None)
        if callable(warm):  # first-use costs (a codec's registry, a resizer's first call) paid before "ready"
            try:
                warm()
            except Exception as err:  # noqa: BLE001 - a task that meets the same failure answers it, in one line
                print(f"glmvit decode worker: {module.__name__}.warm_worker failed, serving cold: "
                      f"{type(err).__name__}: {str(err).strip()[:200]}", file=sys.stderr, flush=True)
    _one_thread()  # again: a warm-up may have imported torch or glmvit.video first
    try:
        conn.send(("ready", None))
    except OSError:  # the server is gone (killed while this worker started): nobody to answer
        return
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        fn, args = task
        try:
            answer: tuple[str, Any] = ("ok", fn(*args))
        except Exception as err:  # noqa: BLE001 - handed back to the task's submitter, who decides
            answer = ("error", err)
        try:
            conn.send(answer)
        except OSError:  # the server is gone: nobody to answer
            return
        except Exception as err:  # noqa: BLE001 - an answer or error that cannot be pickled
            conn.send(("error", RuntimeError(f"the worker's answer could not be sent back ({type(err).__name__})")))


class _Worker:
    def __init__(self, context: Any, preload: tuple[str, ...]):
        self.conn, child = context.Pipe()
        self.scratch = owned_dir.make(tempfile.gettempdir(), SCRATCH_PREFIX)
        self.process = context.Process(target=worker_main, args=(child, preload, self.scratch),
                                       name="glmvit-decode", daemon=True)
        try:
            self.process.start()
        except BaseException:
            owned_dir.remove(self.scratch)
            raise
        child.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S) or self.conn.recv()[0] != "ready":
            self.kill()
            raise WorkerDied(f"a decode worker did not start within {STARTUP_TIMEOUT_S:g} s")

    def call(self, fn: Callable, args: tuple, wait_s: float, timeout_s: float) -> Any:
        """``fn(*args)``'s answer within ``wait_s`` (what is left of its request's ``timeout_s``)."""
        self.conn.send((fn, args))
        if not self.conn.poll(max(0.0, wait_s)):
            raise DecodeTimeout(f"decoding took more than {timeout_s:g} s")
        status, value = self.conn.recv()
        if status == "error":
            raise value
        return value

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()
        owned_dir.remove(self.scratch)

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.kill()
        else:
            self.conn.close()
            owned_dir.remove(self.scratch)


class DecodeRequest:
    """One request's tasks in a :class:`DecodePool` (from :meth:`DecodePool.request`): :meth:`submit` queues one,
    served in the request's turns; its tasks run for the pool's ``timeout_s`` in all. It holds its place in the
    pool's bound until it is closed (:meth:`close`, or leaving its ``with`` block) and its tasks are finished."""

    def __init__(self, pool: "DecodePool"):
        self.pool = pool
        self.run_s = 0.0  # its tasks' time in a worker so far
        self._unfinished = 0
        self._open = True

    def submit(self, fn: Callable, *args: Any) -> Future:
        """``fn(*args)`` in a worker in this request's turn; the future holds its result or its exception
        (DecodeTimeout, WorkerDied, or what ``fn`` raised). Raises DecodeClosed once the pool or this request is
        closed."""
        return self.pool._queue(self, fn, args)

    def close(self) -> None:
        """No more tasks; its place in the pool's bound is given back once the tasks submitted are finished."""
        self.pool._close_request(self)

    def __enter__(self) -> "DecodeRequest":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()


class DecodePool:
    """``workers`` decode processes, at most ``max_waiting`` requests beyond them, ``timeout_s`` a request;
    each worker imports the modules ``preload`` names before it takes a task, and runs each one's ``warm_worker()``
    where it has one (so that a task's time is its own, not the worker's first use of a codec).

    Workers start with :meth:`start` (or the first request), each in its lane's thread; ``ready`` counts those
    that have started. :meth:`close` stops them once the tasks already submitted are done. ``busy`` counts
    requests open or with tasks not finished.
    """

    def __init__(self, workers: int, max_waiting: int, timeout_s: float, preload: tuple[str, ...] = ()):
        if workers < 1 or max_waiting < 0 or not timeout_s > 0:
            raise ValueError(f"a decode pool needs workers ≥ 1, max_waiting ≥ 0 and timeout_s > 0, got {workers}, "
                             f"{max_waiting}, {timeout_s}")
        self.workers, self.max_waiting, self.timeout_s, self.preload = workers, max_waiting, timeout_s, preload
        self._context = multiprocessing.get_context("spawn")
        # the requests with tasks waiting, in the order of their turns, each with its tasks in order
        self._waiting: collections.OrderedDict[DecodeRequest, collections.deque[tuple[Callable, tuple, Future]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a task waiting, or the pool closed
        self._lanes: list[threading.Thread] = []
        self._closed = False
        self.busy = 0
        self.ready = 0
        self.timeouts = 0
        self.replaced = 0

    def start(self) -> "DecodePool":
        """Start the lanes and their workers (idempotent); each lane starts its worker in its own thread."""
        with self._lock:
            if not self._lanes and not self._closed:
                self._lanes = [threading.Thread(target=self._lane, name=f"glmvit-decode-{k}", daemon=True)
                               for k in range(self.workers)]
                for lane in self._lanes:
                    lane.start()
        return self

    def request(self) -> DecodeRequest:
        """A new request, its place held in the bound (close it when its last task is submitted). Raises
        DecodeBusy at once when ``workers + max_waiting`` requests are open or unfinished, DecodeClosed once the
        pool is closed."""
        self.start()
        with self._lock:
            if self._closed:
                raise DecodeClosed("the decode pool is closed")
            if self.busy >= self.workers + self.max_waiting:
                raise DecodeBusy(f"the decoders hold {self.busy} requests already (at most {self.workers} decoding "
                                 f"and {self.max_waiting} waiting); retry later")
            self.busy += 1
        return DecodeRequest(self)

    def submit(self, fn: Callable, *args: Any) -> Future:
        """``fn(*args)`` in a worker, a request of one task (:meth:`request`, :meth:`DecodeRequest.submit`)."""
        with self.request() as one:
            return one.submit(fn, *args)

    def _queue(self, request: DecodeRequest, fn: Callable, args: tuple) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed or not request._open:
                raise DecodeClosed("the decode pool is closed" if self._closed else "the decode request is closed")
            request._unfinished += 1
            self._waiting.setdefault(request, collections.deque()).append((fn, args, future))
            self._work.notify()
        future.add_done_callback(lambda _: self._finished(request))
        return future

    def _finished(self, request: DecodeRequest) -> None:
        with self._lock:
            request._unfinished -= 1
            self._release(request)

    def _close_request(self, request: DecodeRequest) -> None:
        with self._lock:
            if request._open:
                request._open = False
                self._release(request)

    def _release(self, request: DecodeRequest) -> None:
        """(Under the lock.) A closed request whose tasks are all finished gives its place back."""
        if not request._open and request._unfinished == 0:
            request._unfinished = -1  # given back once
            self.busy -= 1

    def _next(self) -> tuple[DecodeRequest, Callable, tuple, Future] | None:
        """The next task to run: the first of the request whose turn it is (which then goes to the back of the
        line if it has more); None once the pool is closed and no task waits."""
        with self._lock:
            while not self._waiting and not self._closed:
                self._work.wait()
            if not self._waiting:
                return None
            request, tasks = next(iter(self._waiting.items()))
            fn, args, future = tasks.popleft()
            if tasks:
                self._waiting.move_to_end(request)
            else:
                del self._waiting[request]
            return request, fn, args, future

    def _start_worker(self) -> _Worker:
        worker = _Worker(self._context, self.preload)
        with self._lock:
            self.ready += 1
        return worker

    def _lane(self) -> None:
        worker: _Worker | None = None
        try:
            try:
                worker = self._start_worker()
            except (OSError, WorkerDied):
                worker = None  # tried again with the first task, which then fails with the reason
            while (task := self._next()) is not None:
                request, fn, args, future = task
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if worker is None or not worker.process.is_alive():
                        if worker is not None:
                            worker.kill()
                            with self._lock:
                                self.ready -= 1
                        worker = self._start_worker()
                    started = time.monotonic()
                    try:
                        result = worker.call(fn, args, self.timeout_s - request.run_s, self.timeout_s)
                    finally:
                        request.run_s += time.monotonic() - started
                except DecodeTimeout as err:
                    assert worker is not None
                    worker.kill()
                    worker = None
                    with self._lock:
                        self.ready -= 1
                        self.timeouts += 1
                        self.replaced += 1
                    future.set_exception(err)
                    worker = self._replacement()
                except (EOFError, OSError, WorkerDied) as err:  # the worker ended mid-task: replace it
                    if worker is not None:
                        worker.kill()
                        with self._lock:
                            self.ready -= 1
                    worker = None
                    with self._lock:
                        self.replaced += 1
                    future.set_exception(err if isinstance(err, WorkerDied) else
                                         WorkerDied(f"the decode worker ended without answering ({err or 'EOF'})"))
                except BaseException as err:  # noqa: BLE001 - what the task raised, handed to its submitter
                    future.set_exception(err)
                else:
                    future.set_result(result)
        finally:
            if worker is not None:
                worker.stop()

    def _replacement(self) -> _Worker | None:
        """A new worker at once (not with the next task, whose time would then include the start)."""
        try:
            return self._start_worker()
        except (OSError, WorkerDied):
            return None

    def close(self, timeout: float | None = None) -> None:
        """Finish the tasks submitted, stop every worker (each lane's within ``timeout``)."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes)
            self._work.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in lanes:
            lane.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict[str, Any]:
        return {"workers": self.workers, "max_waiting": self.max_waiting, "timeout_s": self.timeout_s,
                "ready": self.ready, "busy": self.busy, "timeouts": self.timeouts, "replaced": self.replaced}
