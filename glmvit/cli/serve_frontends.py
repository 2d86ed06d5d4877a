"""``glmvit serve --api-servers N``: N API server processes in front of one engine process.

One Python process's HTTP handling (reading bodies, parsing them, writing answers of megabytes) is the bound of a
one-process server well before the GPU is. vLLM splits the same way: ``vllm serve --api-server-count N`` runs N API
server processes in front of its engine core processes (``run_multi_api_server`` in ``vllm/entrypoints/cli/serve.py`` at
vLLM commit 00a5fdd20935: the parent binds the listening socket and hands it to ``APIServerProcessManager``; requests
reach the engine over ZMQ). With N > 1 the process ``serve`` started is the engine: it holds the model, the captured
runner, the scheduler, the rows-on-device step (with ``--rows host`` only the rows' copy to the device: the API
servers' decode workers make them) and the answers' serialisation (a
:class:`~glmvit.cli.serve_backend.LocalBackend`). It starts N API server processes (``spawn``: they never initialise
CUDA nor build the model), each running the same aiohttp application (:class:`~glmvit.cli.serve_app.EncoderService`) on
the same port (the engine binds and listens, as the one-process server would: a port in use fails the start, port 0 is
one ephemeral port for every address; it hands each API server a copy of its own, bound with SO_REUSEPORT so that the
kernel spreads connections evenly over them: :func:`listen`), each reading and parsing bodies and running its share of
``--decode-workers`` (at least one each) and of the HTTP side's bounds. Each hands its requests to the engine over a
pipe of its own (:mod:`glmvit.cli.serve_link`: what crosses is small, frames and answers stay in files of the engine's
shared-memory folder, the only files it opens; without a shared-memory folder ``serve`` refuses to start, and a request
whose rows or answer find no room there is answered 507 Insufficient Storage). Answers, headers and statuses are the
one-process server's. The HTTP side's bounds of what the server holds (``--max-requests``, ``--max-held-mb``,
``--decode-queue``) are the whole server's: each API server takes its share, the bound divided by N (at least 1;
:func:`share_bounds`), so N API servers hold what one process would; ``--max-connections`` holds per API server (a
connection holds no request); the scheduler's bounds (``--max-queue``, its tokens and bytes) are the engine's, for the
whole server, as before.

Metrics: ``/health``, ``/v1/info`` and ``/metrics`` work on every API server. The scheduler's and the runner's
counters (``glmvit_scheduler_*``) come from the engine; the HTTP and decode counters (``glmvit_http_*``,
``glmvit_decode_*``) are those of the API server that answered, labelled with its name (``frontend="1"`` of
``0`` … N−1): a scraper that wants the whole server sums them over the labels it has seen (each API server's
counters only ever grow, as one process's do). They wait at most a second for the engine's counters, then give
its last ones; ``/health``'s and ``/metrics``' JSON say the engine's state (``"engine"``: ``ok``, ``draining``,
``unresponsive``, ``gone``), and an engine draining or gone reads as a draining server (``"status":
"draining"``). Requests an engine that is gone held are answered 503.

Lifetime: SIGINT or SIGTERM to the engine drains: it asks every API server to drain (each stops listening, answers
what it holds, as the one-process server does, closes its decode workers and exits), waits for them (up to
``--shutdown-timeout`` and a little), then closes the scheduler and removes its answers' shared-memory folder. An
API server that dies (killed, out of memory) is logged and the engine keeps serving with the others (its requests
in the engine are withdrawn; its clients' connections are lost); once none is left, the engine drains and exits 1.
Exit status: 0 if every API server drained in time and exited 0 and the scheduler answered everything it admitted,
else 1.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from ..config import VisionConfig
from ..records import fingerprint_now
from .pixel_rows import no_room, remove_shared_dir, shared_dir
from .serve_app import (
    BACKLOG,
    DECODE_QUEUE,
    DEFAULT_ROWS,
    EncoderService,
    HttpLimits,
    default_decode_pool,
    format_url,
    run_server,
    usable_cpus,
)
from .serve_backend import LocalBackend
from .serve_link import EngineLink, ModelFacts, RemoteBackend
from .serve_media import MediaLimits

# API server processes per usable CPU, and the most the default runs: on the H200 host (16 CPUs), 4 API servers
# answered 203 video8x224 requests a second against one process's 102, graph-compiled, 500 requests at an unbounded
# rate, with GIF clips (data/sweeps/api_servers_h200.json); more than 4 were not measured. With MP4 clips one process
# served more (data/bench/serve_video8x224_one_process.json beside serve_video8x224.json).
CPUS_PER_API_SERVER = 4
MAX_DEFAULT_API_SERVERS = 4


def default_api_servers() -> int:
    """API server processes for this machine: one per ``CPUS_PER_API_SERVER`` CPUs this process may use, at least 1,
    at most ``MAX_DEFAULT_API_SERVERS``; 1 where there is no shared-memory folder (the API servers hand the engine
    their pixels through it)."""
    count = max(1, min(MAX_DEFAULT_API_SERVERS, usable_cpus() // CPUS_PER_API_SERVER))
    return 1 if count > 1 and no_room() else count

log = logging.getLogger("glmvit.cli.serve_app")
STARTUP_TIMEOUT_S = 300.0  # an API server's imports and its decode workers' start on a loaded machine
EXIT_GRACE_S = 10.0  # after the drain's timeout: how long an API server gets to close its decoders and exit


@dataclass(frozen=True)
class FrontendSpec:
    """What an API server process needs: picklable, no tensors, nothing of the device."""

    name: str
    host: str
    port: int
    limits: HttpLimits
    media: MediaLimits
    threads: int
    decode_workers: int
    decode_queue: int
    decode_timeout: float
    shutdown_timeout: float
    info: dict[str, Any]
    provenance: dict[str, Any]
    extra_health: dict[str, Any]
    config: VisionConfig
    dtype: str
    mode: str
    shared: str  # the engine's shared-memory folder: frames and rows are written there, answers read from there
    rows: str = DEFAULT_ROWS  # where media's pixel rows are made: serve --rows (EncoderService's rows)


def share_bounds(limits: HttpLimits, decode_queue: int, count: int) -> tuple[HttpLimits, int]:
    """One of ``count`` API servers' share of the whole server's bounds of what it holds: ``max_requests``,
    ``max_held_bytes`` and ``decode_queue`` divided by ``count``, at least 1 each."""
    return replace(limits, max_requests=max(1, limits.max_requests // count),
                   max_held_bytes=max(1, limits.max_held_bytes // count)), max(1, decode_queue // count)


def split_workers(workers: int, count: int) -> list[int]:
    """``workers`` decode processes shared among ``count`` API servers as evenly as may be, at least one each."""
    return [max(1, workers // count + (k < workers % count)) for k in range(count)]


def frontend_main(spec: FrontendSpec, conn: Any, sockets: list[socket.socket]) -> int:
    """An API server process: the application over a :class:`RemoteBackend`, until the engine says drain (or is
    gone, or SIGTERM reaches it); exits 0 if its drain answered everything in time. It ignores SIGINT: a Ctrl-C
    reaches every process of the terminal's group, and the engine, which gets it too, drains them in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"glmvit serve [api {spec.name}]: %(message)s")
    torch.set_num_threads(1)  # it parses and checks; the engine computes
    drained = asyncio.run(_frontend(spec, conn, sockets))
    conn.close()
    raise SystemExit(0 if drained else 1)


async def _frontend(spec: FrontendSpec, conn: Any, sockets: list[socket.socket]) -> bool:
    decode = default_decode_pool(spec.decode_workers, spec.decode_queue, spec.decode_timeout)
    backend = RemoteBackend(conn, spec.mode, lambda: service._pixel_dir())  # the service's, made below
    service = EncoderService(None, spec.info, spec.provenance, spec.limits, spec.threads, spec.extra_health,
                             decode=decode, media=spec.media, own_decode=True, backend=backend,
                             model=ModelFacts(spec.config, getattr(torch, spec.dtype)), frontend=spec.name,
                             pixel_dir=spec.shared, rows=spec.rows)
    decode.start()
    stop = asyncio.Event()
    backend.start(stop.set)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    def ready(url: str) -> None:
        backend.send(("ready", url))

    return await run_server(service, spec.host, spec.port, spec.shutdown_timeout, ready, stop, sockets=sockets)


def listen(host: str, port: int, copies: int = 1, backlog: int = BACKLOG) -> list[list[socket.socket]]:
    """``copies`` lists of listening sockets on ``host``:``port``, each list one socket an address ``host`` has (as
    the one-process server's: address reuse, an IPv6 socket IPv6 only); port 0: the ephemeral port the first one
    gets, for every address and copy. A port a server already listens on is EADDRINUSE.

    One copy per API server: several copies are bound with SO_REUSEPORT (Linux only: elsewhere it does not spread
    connections, and several copies are refused), so the kernel spreads new connections over them evenly (by a hash
    of each connection's addresses), whatever each process is doing. One socket shared by every API server is taken
    by whichever process's loop wakes first, and asyncio accepts up to 100 connections a wake-up: of a burst of 400,
    one of four processes took 181 and another 1. What SO_REUSEPORT gives up:

    - a port given (not 0) is first bound without SO_REUSEPORT (:func:`_free_port`), which no listening socket lets
      through, then released for the copies: a server of the same user that binds it with SO_REUSEPORT in those
      microseconds, or later, joins the group and takes a share of the connections (port 0 has no such window: the
      kernel never hands out a port a group holds);
    - connections still queued on the copy of an API server that ends are reset (new ones go to the other copies);
      Linux 5.14+ moves them instead with ``sysctl net.ipv4.tcp_migrate_req=1``."""
    if copies > 1 and not sys.platform.startswith("linux"):
        raise RuntimeError(f"{copies} API servers need SO_REUSEPORT's even spread of connections, which only Linux "
                           "has: run one (--api-servers 1)")
    addresses = [(family, kind, proto, address) for family, kind, proto, _, address
                 in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)]
    if copies > 1 and port != 0:
        _free_port(addresses, port)
    made: list[socket.socket] = []
    try:
        groups = [[_bound(family, kind, proto, address, port, copies > 1, made) for family, kind, proto, address
                   in addresses] for _ in range(copies)]
        for sock in made:
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        _close(made)
        raise
    return groups


def _bound(family: int, kind: int, proto: int, address: tuple, port: int, share: bool,
           made: list[socket.socket]) -> socket.socket:
    """A socket bound to ``address`` at ``port`` (0: the port of the first socket in ``made``, or an ephemeral one),
    with SO_REUSEPORT if ``share``; appended to ``made`` before it binds, so that a failure closes it too."""
    sock = socket.socket(family, kind, proto)
    made.append(sock)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if share:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    if port == 0 and len(made) > 1:
        port = made[0].getsockname()[1]
    sock.bind((address[0], port, *address[2:]))
    return sock


def _free_port(addresses: list[tuple], port: int) -> None:
    """EADDRINUSE if anything listens on ``port`` at one of ``addresses``: each is bound without SO_REUSEPORT, then
    released."""
    probes: list[socket.socket] = []
    try:
        for family, kind, proto, address in addresses:
            _bound(family, kind, proto, address, port, False, probes)
    finally:
        _close(probes)


def frontend_specs(service: EncoderService, host: str, port: int, count: int, decode_workers: int,
                   decode_queue: int, decode_timeout: float, threads: int, shutdown_timeout: float, shared: str
                   ) -> list[FrontendSpec]:
    """What each of ``count`` API servers in front of ``service`` (the engine's) is started with: its share of the
    decode workers and of the bounds (:func:`share_bounds`)."""
    model = service.model
    limits, queue = share_bounds(service.limits, decode_queue, count)
    return [FrontendSpec(str(k), host, port, limits, service.media, threads, workers, queue, decode_timeout,
                         shutdown_timeout, service.info, service.provenance, service.extra_health, model.config,
                         str(model.dtype).removeprefix("torch."), service.backend.mode, shared, service.rows)
            for k, workers in enumerate(split_workers(decode_workers, count))]


async def run_frontends(service: EncoderService, host: str = "127.0.0.1", port: int = 0,
                        shutdown_timeout: float = 60.0, on_ready: Callable[[str], None] | None = None,
                        stop: asyncio.Event | None = None, handle_signals: bool = False, *, count: int = 2,
                        decode_workers: int = 2, decode_queue: int = DECODE_QUEUE, decode_timeout: float = 30.0,
                        threads: int = 4) -> bool:
    """Serve ``service``'s backend (a :class:`LocalBackend`) through ``count`` API server processes until ``stop``
    is set (or SIGINT/SIGTERM with ``handle_signals``), then drain (the module docstring); True if everything was
    answered in time and every API server exited 0. ``on_ready`` gets the URL once every API server listens.
    :func:`~glmvit.cli.serve_app.run_server`'s arguments first, so that :class:`~glmvit.cli.serve_app.ServerThread`
    can run it."""
    assert isinstance(service.backend, LocalBackend), "the engine's service encodes itself"
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    changed = asyncio.Event()
    folder = shared_dir()
    if folder is None:
        raise RuntimeError(f"--api-servers {count} needs a shared-memory folder: {no_room() or 'none was made'}")
    try:
        copies = listen(host, port, copies=count)  # here: a port in use fails the start, as one process's does
    except BaseException:
        remove_shared_dir(folder)
        raise
    sockets = [sock for copy in copies for sock in copy]
    port = sockets[0].getsockname()[1]
    link = EngineLink(service.backend, folder, lambda: fingerprint_now().model_dump(mode="json"), changed.set)
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
    ok = True
    try:
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        for spec, own in zip(frontend_specs(service, host, port, count, decode_workers, decode_queue, decode_timeout,
                                            threads, shutdown_timeout, folder), copies, strict=True):
            parent, child = context.Pipe()
            process = context.Process(target=frontend_main, args=(spec, child, own),
                                      name=f"glmvit-api-{spec.name}")
            process.start()
            child.close()
            processes.append(process)
            link.attach(spec.name, parent)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(f.url or f.done for f in link.fronts) and not stop.is_set():
            if time.monotonic() > deadline:
                log.warning("the API servers did not start listening within %g s: shutting down", STARTUP_TIMEOUT_S)
                return False  # the drain below ends them
            await _wait(changed, stop, 1.0)
        if any(f.done for f in link.fronts):
            log.warning("an API server ended as it started (its lines above say why): shutting down")
            return False
        _close(sockets)  # each API server's copy listens in it alone: one that ends takes its copy out of the group
        service.url = format_url(host, port)
        if on_ready and not stop.is_set():
            on_ready(service.url)
        reaped: set[str] = set()
        while not stop.is_set():
            await _wait(changed, stop, 1.0)
            await _reap(link, processes, reaped)
            if not link.live:
                log.warning("no API server is left: shutting down")
                ok = False
                break
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        _close(sockets)
        link.drain()
        deadline = time.monotonic() + shutdown_timeout + EXIT_GRACE_S
        while link.live and time.monotonic() < deadline:
            await _wait(changed, None, 0.05)
        codes = await loop.run_in_executor(None, _ended, processes, max(1.0, deadline - time.monotonic()))
        if any(code != 0 for code in codes):
            log.warning("API server exit codes: %s", ", ".join(map(str, codes)))
            ok = False
        for front in link.fronts:
            front.conn.close()
        closed = await loop.run_in_executor(None, service.close, shutdown_timeout)
        remove_shared_dir(folder)
        ok = ok and closed
    return ok


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


async def _wait(changed: asyncio.Event, stop: asyncio.Event | None, timeout: float) -> None:
    """Until ``changed`` (cleared then) or ``stop`` is set, or ``timeout`` seconds pass."""
    waits = [asyncio.ensure_future(changed.wait())] + ([asyncio.ensure_future(stop.wait())] if stop else [])
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    changed.clear()


async def _reap(link: EngineLink, processes: list[Any], reaped: set[str]) -> None:
    """Each API server that ended and is not in ``reaped`` (their names) yet: joined, logged once, added."""
    for front in link.fronts:
        if front.done and front.name not in reaped:
            reaped.add(front.name)
            code = await asyncio.get_running_loop().run_in_executor(None, _exit_code, processes[int(front.name)])
            log.warning("API server %s ended (exit code %s); %d left", front.name, code, link.live)


def _exit_code(process: Any) -> int | None:
    process.join(5)
    return process.exitcode


def _ended(processes: list[Any], timeout: float) -> list[int | None]:
    """Each process's exit code once it ends (within ``timeout`` in all; killed past it: a negative code)."""
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            log.warning("API server %s did not exit in time: killed", process.name)
            process.kill()
            process.join()
    return [process.exitcode for process in processes]
