"""The HTTP face of a :class:`~glmvit.scheduler.BatchScheduler` (aiohttp): what ``glmvit serve`` runs.

``POST /v1/encode`` takes one of three bodies:

- ``application/json``: content parts as vLLM's chat API carries them, ``{"content": [...]}`` or a chat
  ``{"messages": [...]}``, each ``image_url`` / ``video_url`` part (a ``data:`` URL; ``file://`` only under an
  allowed directory) one item, in order (:mod:`glmvit.cli.serve_media`);
- ``multipart/form-data``: one part per image or video file, its filename's suffix saying which (the types
  ``glmvit encode`` takes);
- ``application/x-safetensors`` (or ``application/octet-stream``): a safetensors file of ``pixel_values``
  [rows, C·T·P²] (float32, bfloat16 or float16) and ``grid_thw`` [items, 3] (integers), the rows as
  :mod:`glmvit.processing` makes them.

Media (JSON and multipart) is checked, decoded and preprocessed as ``encode`` does, in decode worker processes
(:mod:`glmvit.cli.decode_pool`), within per-request pixel and time bounds, up to the resize, a task an item, requests
taking turns item by item (a small request is never held behind a large one's whole media); their uint8 frames come
back through shared memory (:mod:`glmvit.cli.pixel_rows`) and become pixel rows on the model's device, in its dtype,
on a thread, on that thread's own stream (:meth:`~glmvit.cli.serve_media.RequestMedia.rows`; finite by
construction, so admission reads nothing back from the device). With ``rows="host"`` (``serve --rows host``) the
decode workers make the rows themselves, in the model's dtype, and hand them over instead, bitwise the same; the
engine only copies them to its device (without a shared-memory folder the frames go as with ``"device"``). Pixel
rows sent as safetensors are checked on a thread. Neither runs on the event loop or the scheduler's worker; answers
are serialised on threads of their own, each embedding copied from the device straight into its place in the body
(:mod:`glmvit.cli.answer_body`), and written from that body in slices (:func:`write_answer`, :data:`ANSWER_SLICE`),
each write awaited, never copied whole. It answers ``200`` with ``application/x-safetensors`` in
``encode --out``'s layout (tensors ``item_<i>``, float32; ``?dtype=model`` returns the model's dtype instead, half
the bytes in bfloat16), with headers ``X-Request-Id``, ``X-Queue-Delay-Ms`` (admission to the first batch holding
one of its items), ``X-Encode-Ms`` (admission to its last item encoded), ``X-Prepare-Ms`` (reading and decoding
before admission), ``X-Batches`` and ``Server-Timing`` (its time by phase, :data:`PHASES` but ``write``, which
follows the headers; ``/metrics`` sums every phase; ``decode`` counts the waits for a decoder and the media's
decoding into pixels, ``preprocess`` the resize, the rows made (in a decode worker or on the model's device) and
admission's checks). Every
error is JSON ``{"error": one line, "status": code}``:
400 bad input (naming the item, the file or the JSON part) or a request aiohttp's HTTP parser refuses, 403 a
``file://`` URL outside the allowed directory, 408 a body that did not arrive within ``read_timeout_s`` (a slow
client never keeps its place), 413 too large (a body is never read past ``max_body_bytes``, a multipart preamble
counted, and what a refused body held is freed at once; a picture past the pixel bounds; media that took longer
than the decode timeout), 415 another content type or a compressed body (any ``Content-Encoding`` but identity,
refused before it is read), 429 past a bound of what the server holds: requests, body bytes (``max_held_bytes``),
requests waiting for a decoder, or the scheduler's requests, tokens and bytes (with ``Retry-After``), 507 no room in
shared memory for a request's rows or answer (several API server processes only: :mod:`glmvit.cli.serve_link`), 503
shutting down or past ``max_connections`` open connections, 500 an internal error (its traceback goes to the server's
log, never to the client). A refused body is never kept: after the error is sent, what the client still sends is read
and discarded for at most aiohttp's lingering time (10 s), then the connection is closed. A connection whose request
headers take longer than ``header_timeout_s`` is closed.
``GET /health``: a little JSON (status, mode, where rows are made: ``rows``, limits); ``GET /v1/info``: that and the
model, the floor, the capture, the decoders, the media bounds, the provenance and the code's fingerprint.
``GET /metrics``: Prometheus text (each family's HELP and TYPE once; seconds, ``_total`` counters), or JSON with
``?format=json``. A request whose client closes its connection before the answer is written gets none and is counted
apart from the answered ones
(``glmvit_http_clients_left_total``, ``http.clients_left``), never as an error; its answer is not serialised, and
if no batch has taken its items yet they are dropped unencoded (``glmvit_scheduler_withdrawn_total``). A FIN
from the client before the answer counts as its leaving, unless its request said ``Connection: close`` (or was
HTTP/1.0) and arrived whole: such a client may shut only its sending side (``shutdown(SHUT_WR)``), and is answered,
then the connection closed. TCP cannot tell a half-close from a close until something is written, and a client
that gives up on a keep-alive connection (a timeout) closes with the same FIN: its request is withdrawn, not encoded
for nobody. So a client that half-closes a keep-alive connection is taken as gone: what is not answered yet
never is (send ``Connection: close`` to half-close).

:func:`run_server` serves until asked to stop, then drains: it stops listening; while requests are in flight it
keeps open connections open and answers a new request on any of them (an idle keep-alive one included) with 503
and closes it; once every request in flight has finished (up to ``shutdown_timeout``) it closes the idle
connections, then the scheduler and the decoders. A drain that runs out of time says how many requests it
abandoned, cancels their handlers and returns False (``serve`` exits 1). :class:`ServerThread` runs it in a
thread of its own (tests, in-process use). Several processes can serve the same application on one port in front
of one engine process (``serve --api-servers N``): :mod:`glmvit.cli.serve_frontends`.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import resource
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from http import HTTPStatus
from pathlib import PurePosixPath
from typing import Any, Awaitable, Callable, cast
from urllib.parse import unquote

import numpy as np
import torch
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from typing_extensions import Buffer

from ..metadata import as_grid_array
from ..records import fingerprint_now
from ..scheduler import (
    DEFAULT_MAX_REQUESTS,
    BatchScheduler,
    QueueFull,
    RequestTooLarge,
    SchedulerClosed,
)
from ..workloads import shown
from .answer_body import answer_body
from .decode_pool import DecodeBusy, DecodeClosed, DecodePool, DecodeRequest, DecodeTimeout, WorkerDied
from .embedding_file import file_metadata, item_record
from .pixel_rows import remove_shared_dir, shared_dir
from .serve_backend import ClientLeft, LocalBackend, Prepared, Refused, status_of
from .serve_media import (
    MediaError,
    MediaLimits,
    PreparedMedia,
    RequestMedia,
    media_items,
    prepare_first_item,
    prepare_item,
)

log = logging.getLogger(__name__)

SAFETENSORS = "application/x-safetensors"
PIXEL_TYPES = (SAFETENSORS, "application/octet-stream")
BODY_TYPES = ("multipart/form-data", "application/json", *PIXEL_TYPES)
PIXEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHUNK = 1 << 16
MAX_NAME = 200  # characters of an uploaded file's name kept for messages and the item's "source"


# An answer is written in slices of this many bytes, each write awaited. aiohttp's StreamResponse.write hands a slice
# to StreamWriter.write, which passes it to the transport (asyncio's socket transport sends what the socket takes at
# once and copies the rest into its own buffer: Python 3.11 extends a bytearray, 3.12+ keeps the memoryview), then,
# as the slice is past the writer's LIMIT (64 KiB), awaits drain(), which waits while the transport has paused the
# protocol (its buffer past the high-water mark, 64 KiB) until the buffer is below the low-water mark. So the
# transport holds at most one slice (and 64 KiB) of an answer beyond the body itself, and the event loop serves
# other connections between slices. The whole body in one write (web.Response) cost a copy of all of it (headers
# and body joined: StreamWriter._writelines joins them before Python 3.12.9) and another of all the socket did not
# take at once (the transport's buffer): two copies of up to tens of MB, on the event loop, per big answer. A smaller
# slice costs more writes (each an await and a few µs of Python: 38 for a 38 MB answer at 1 MiB, 600 at 64 KiB);
# a larger one larger copies and a longer turn of the loop.
ANSWER_SLICE = 1 << 20


class BadRequest(ValueError):
    """An HTTP-level problem with the request (a status other than 400 may go with it)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status



async def write_answer(request: web.Request, response: web.StreamResponse, body: Buffer) -> None:
    """``body`` (any buffer) sent as ``response``'s whole body: its Content-Length set, ``response`` prepared (its
    headers go with the first slice), then :data:`ANSWER_SLICE` bytes at a time, each a ``memoryview`` of
    ``body`` (never a copy) and each write awaited, so the transport's back-pressure paces the writes; then its end.
    The views are released before it returns (or raises): nothing here keeps ``body``'s buffer (a mapping of a
    shared-memory file) alive. A client gone mid-answer is a ConnectionError (aiohttp's), or the handler cancelled."""
    with memoryview(body) as whole, whole.cast("B") as view:
        response.content_length = view.nbytes
        await response.prepare(request)
        for begin in range(0, view.nbytes, ANSWER_SLICE):
            await response.write(view[begin : begin + ANSWER_SLICE])
    await response.write_eof()


def _gone(request: web.Request) -> bool:
    """Whether ``request``'s client has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


@dataclass(frozen=True)
class HttpLimits:
    """What one request may hold, and how many requests the server holds at once (reading, decoding, queued or
    being encoded); past that it answers 429 before reading the body. A body must arrive within
    ``read_timeout_s`` (408 otherwise): a client that sends its headers and stalls frees its place. A connection
    whose request headers have not all arrived within ``header_timeout_s`` of its opening (or of its last answer)
    is closed; past ``max_connections`` open connections a new one gets 503 and is closed at once, so clients
    that connect and stall can never use up the process's open files."""

    max_body_bytes: int = 64 * 2**20
    max_items: int = 64
    max_requests: int = DEFAULT_MAX_REQUESTS
    read_timeout_s: float = 30.0
    header_timeout_s: float = 30.0
    max_connections: int = 1024
    max_held_bytes: int = 4 << 30  # request bodies read and not yet answered; past that 429


MEDIA_MODULES = ("glmvit.cli.serve_media",)  # what a decode worker imports before its first task
ROWS = ("device", "host")  # where a media request's pixel rows are made: the engine, on the model's device; a worker
DEFAULT_ROWS = "device"  # until a record decides (glmvit.cli.recorder's serve_video8x224_rows_host job)
PHASES = ("read", "decode", "preprocess", "queue", "host_to_device", "encode", "serialise", "write")


@dataclass(frozen=True)
class Upload:
    name: str
    data: bytes


class _Held:
    """The bytes of one request's body counted in its service's ``held_bytes`` until :meth:`release`; past
    ``max_held_bytes`` for all requests together the body is refused (429) as it is read."""

    def __init__(self, service: "EncoderService"):
        self.service, self.nbytes = service, 0

    def add(self, n: int) -> None:
        service = self.service
        if service.held_bytes + n > service.limits.max_held_bytes:
            raise BadRequest(f"the server holds {service.held_bytes:,} bytes of requests already (at most "
                             f"{service.limits.max_held_bytes:,}); retry later", 429)
        service.held_bytes += n
        self.nbytes += n

    def release(self) -> None:
        self.service.held_bytes -= self.nbytes
        self.nbytes = 0


def upload_name(raw: str | None, index: int) -> str:
    """An uploaded file's name (percent-encoding undone, as aiohttp's client sends it) without folders or control
    characters, at most MAX_NAME characters. It names the item; it never becomes a path."""
    name = PurePosixPath(unquote(raw or "").replace("\\", "/")).name
    name = "".join(c for c in name if c.isprintable())[:MAX_NAME]
    return name or f"file{index}"


def prepare_pixels(body: bytes, check: Callable[[torch.Tensor, Any], np.ndarray], merge_area: int) -> Prepared:
    """``pixel_values`` and ``grid_thw`` out of a safetensors body, checked (``check``: the model's
    ``check_inputs`` without the NaN/Inf pass, which admission runs), with a record per item."""
    try:
        tensors = load_safetensors(body)
    except (SafetensorError, ValueError) as err:
        raise BadRequest(f"the body is not a safetensors file ({err})") from None
    extra = sorted(set(tensors) - {"pixel_values", "grid_thw"})
    missing = sorted({"pixel_values", "grid_thw"} - set(tensors))
    if missing or extra:
        raise BadRequest(f"the safetensors body must hold exactly pixel_values and grid_thw (missing {missing}, "
                         f"unexpected {extra})")
    pixels, grid = tensors["pixel_values"], tensors["grid_thw"]
    if pixels.dtype not in PIXEL_DTYPES:
        raise BadRequest(f"pixel_values must be float32, bfloat16 or float16, not {str(pixels.dtype)[6:]}")
    if grid.dtype.is_floating_point or grid.dtype.is_complex or grid.dtype == torch.bool:
        raise BadRequest(f"grid_thw must hold integers, not {str(grid.dtype)[6:]}")
    grids = check(pixels, as_grid_array(grid))
    if len(grids) == 0:
        raise BadRequest("the request holds no items (grid_thw has no rows)")
    rows = np.concatenate([[0], np.cumsum(grids.prod(axis=1))])
    raw = pixels.contiguous().view(torch.uint8).numpy()  # each item's rows as sent: its sha256
    records = [item_record(None, hashlib.sha256(raw[rows[i] : rows[i + 1]].data).hexdigest(),
                           "image" if t == 1 else "video", [int(t), int(h), int(w)], int(t * h * w) // merge_area)
               for i, (t, h, w) in enumerate(grids)]
    return Prepared(pixels, torch.from_numpy(grids), records)


def _discard_rows(future: Any) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    result = future.result()  # an item's PreparedMedia, or a JSON request's first (PreparedMedia, the items after)
    media = result[0] if isinstance(result, tuple) else result
    if isinstance(media, PreparedMedia):
        media.frames.discard()


async def _turn(turns: DecodeRequest, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` as the next task of a request in the decode pool; if the client leaves meanwhile, the frames
    it decodes are removed when they come."""
    future = turns.submit(fn, *args)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        future.add_done_callback(_discard_rows)
        raise


# Requests waiting for a decoder: as many as the scheduler admits (a count that bytes bound first). The bodies they hold
# are bounded in bytes (max_held_bytes); a count bound of its own refused bursts the bytes bound would have held: with
# 1024 split over four API servers (256 each), one server's uneven share of a burst of 1000 overflowed it.
DECODE_QUEUE = DEFAULT_MAX_REQUESTS


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)


def default_decode_workers() -> int:
    """Decode processes for this machine: one per CPU this process may use, less four (the event loop, the
    scheduler's worker, the answers' serialisation and a client on the same host), at least one, at most 32."""
    return max(1, min(32, usable_cpus() - 4))


def default_decode_pool(workers: int | None = None, waiting: int = DECODE_QUEUE,
                        timeout_s: float = 30.0) -> DecodePool:
    """``workers`` decode processes (default :func:`default_decode_workers`), ``waiting`` requests queued for
    them (taking turns item by item), ``timeout_s`` a request's decoding (its items' together)."""
    return DecodePool(workers or default_decode_workers(), waiting, timeout_s, MEDIA_MODULES)


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status, headers=headers)


def prometheus_family(name: str, kind: str, help_text: str, samples: list[tuple[str, float | None]]) -> list[str]:
    """One metric family in Prometheus' text format: its HELP and TYPE once, then a line per (labels, value)
    sample (labels as ``{key="value"}`` or empty; a None value is left out, a family without values too)."""
    present = [(labels, value) for labels, value in samples if value is not None]
    if not present:
        return []
    return [f"# HELP glmvit_{name} {help_text}", f"# TYPE glmvit_{name} {kind}",
            *(f"glmvit_{name}{labels} {value if isinstance(value, int) else format(value, 'g')}"
              for labels, value in present)]


def labelled(sample: str, key: str, value: str) -> str:
    """A Prometheus sample line with ``key="value"`` first among its labels."""
    name, rest = sample.split(" ", 1)
    name, brace, labels = name.partition("{")
    return f'{name}{{{key}="{value}"{"," + labels if brace else "}"} {rest}'


def scheduler_lines(s: dict[str, Any]) -> list[str]:
    """The scheduler's families of /metrics, from its ``stats()``."""
    lines: list[str] = []
    for key, name, help_text in (("submitted", "submitted", "requests admitted"),
                                 ("completed", "completed", "requests answered"),
                                 ("failed", "failed", "requests failed"), ("batches", "batches", "batches run"),
                                 ("items", "items", "items encoded"), ("tokens", "tokens", "output tokens encoded"),
                                 ("mixed_batches", "mixed_batches", "batches of several requests"),
                                 ("busy_s", "busy_seconds", "seconds inside the encoder")):
        lines += prometheus_family(f"scheduler_{name}_total", "counter", help_text, [("", s[key])])
    lines += prometheus_family("scheduler_withdrawn_total", "counter",
                               "requests dropped from the queue unencoded: their client left",
                               [("", s["withdrawn"])])
    lines += prometheus_family("scheduler_rejected_total", "counter", "requests refused, by reason",
                               [(f'{{reason="{r}"}}', s[f"rejected_{r}"]) for r in ("full", "closed")])
    lines += prometheus_family("scheduler_outstanding_requests", "gauge", "admitted, not answered",
                               [("", s["outstanding_requests"])])
    for key, help_text in (("tokens", "output tokens"), ("bytes", "pixel bytes on the model's device")):
        lines += prometheus_family(f"scheduler_outstanding_{key}", "gauge", f"{help_text} admitted, not answered",
                                   [("", s[f"outstanding_{key}"])])
        lines += prometheus_family(f"scheduler_max_{key}", "gauge", f"{help_text} admitted at most; then 429",
                                   [("", s[f"max_{key}"])])
    lines += prometheus_family("scheduler_padding_ratio", "gauge", "padded share of budget tokens",
                               [("", s["padding_fraction"])])
    delays = s["queue_ms"]
    lines += prometheus_family("scheduler_recent_queue_delay_seconds", "gauge", "recent queue delays",
                               [(f'{{stat="{k}"}}', None if delays[k] is None else delays[k] / 1e3)
                                for k in ("median", "p99")])
    lines += prometheus_family("scheduler_recent_batch_items", "gauge", "recent batch sizes",
                               [(f'{{stat="{k}"}}', s["batch_items"][k]) for k in ("median", "p99")])
    return lines


class EncoderService:
    """The application: its handlers, the limits, the counters, the processes that decode media (``decode``,
    default :func:`default_decode_pool`; :meth:`close` closes it if ``own_decode``, by default when it was made
    here) and the thread pool that checks pixel rows, admits and answers. What takes a request once it is read
    and decoded is its ``backend`` (:mod:`glmvit.cli.serve_backend`): by default a
    :class:`~glmvit.cli.serve_backend.LocalBackend` over ``scheduler``; an API server process of several
    (``frontend``: its name in /metrics) passes no scheduler, a :class:`~glmvit.cli.serve_link.RemoteBackend` and
    the ``model``'s facts (:class:`~glmvit.cli.serve_link.ModelFacts`: its config, dtype and input checks), and the
    engine's shared-memory folder (``pixel_dir``), where its frames and rows go, the only one the engine reads.
    ``rows`` (:data:`ROWS`): where media's pixel rows are made, ``device`` by the engine on the model's device,
    ``host`` by the decode workers in the model's dtype (:func:`~glmvit.cli.serve_media.prepare_item`)."""

    def __init__(self, scheduler: BatchScheduler | None, info: dict[str, Any], provenance: dict[str, Any],
                 limits: HttpLimits = HttpLimits(), threads: int = 4, extra_health: dict[str, Any] | None = None,
                 runner_stats: Callable[[], dict] | None = None, decode: DecodePool | None = None,
                 media: MediaLimits | None = None, own_decode: bool | None = None, backend: Any = None,
                 model: Any = None, frontend: str | None = None, pixel_dir: str | None = None,
                 rows: str = DEFAULT_ROWS):
        self.scheduler, self.info, self.provenance, self.limits = scheduler, info, provenance, limits
        if scheduler is None and (backend is None or model is None):
            raise ValueError("an EncoderService needs a scheduler, or a backend and the model's facts")
        if rows not in ROWS:
            raise ValueError(f"rows must be one of {', '.join(ROWS)}, got {rows!r}")
        self.rows = rows
        self.model = model if model is not None else cast(BatchScheduler, scheduler).model
        self.frontend = frontend  # which of several API server processes this is (None: the only one)
        self.extra_health = extra_health or {}
        self.runner_stats = runner_stats
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="glmvit-serve")
        # answers are serialised on threads of their own: a burst of answers never delays the next admissions
        self.answers = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="glmvit-answer")
        # what takes a request once it is read and decoded: the scheduler here, or an engine in another process
        self.backend = backend if backend is not None else LocalBackend(cast(BatchScheduler, scheduler), self.pool,
                                                                        self.answers, self._pack, runner_stats)
        self.decode = decode or default_decode_pool()
        self._pixels: list[str | None] = []  # the directory decode workers hand rows over in, once made
        self._given_pixels = pixel_dir  # or the engine's (several API server processes): not this one's to remove
        self._owns_decode = decode is None if own_decode is None else own_decode
        self.media = media or MediaLimits()
        self.draining = False
        self.in_server = 0
        self.held_bytes = 0  # request bodies read and not yet answered
        self.phase_s: collections.Counter[str] = collections.Counter()  # Σ over answered requests, by phase
        self.timed = 0  # requests answered 200 (those phase_s sums)
        self.responses: collections.Counter[int] = collections.Counter()
        self.clients_left = 0  # requests whose client closed the connection before the answer: no response counted
        self.handling = 0  # requests inside a handler (an answer being written included)
        self.abandoned = 0  # requests still in a handler when a drain ran out of time
        self.url: str | None = None
        self.server: web.Server | None = None  # aiohttp's, once run_server listens: its open connections
        self.app = web.Application(client_max_size=limits.max_body_bytes, middlewares=[self._errors])
        self.app.router.add_post("/v1/encode", self.encode)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/v1/info", self.describe)
        self.app.router.add_get("/metrics", self.metrics)

    # ---- the handlers --------------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        """Every error as one line of JSON (aiohttp's own 404/405/413 included), every status counted; a request
        whose client left before its answer is counted apart (``clients_left``), never as an error."""
        self.handling += 1
        try:
            response = await handler(request)
        except ClientLeft:
            self.clients_left += 1
            return web.Response(status=499)  # nobody reads it: aiohttp's write to the closed connection is dropped
        except asyncio.CancelledError:  # the client left (aiohttp cancels its handler), or a drain gave up on it
            if _gone(request):
                self.clients_left += 1
            raise
        except web.HTTPException as err:
            response = error_response(err.status, err.text if err.text and err.status == 413 else err.reason)
        except Exception as err:  # noqa: BLE001 - the client gets one line; the log gets the traceback
            log.exception("internal error on %s %s", request.method, request.path)
            response = error_response(500, f"internal error: {type(err).__name__}: {str(err).splitlines()[0]}"
                                      if str(err) else f"internal error: {type(err).__name__}")
        finally:
            self.handling -= 1
        if self.draining and not response.prepared:  # the client's next request goes to another server
            response.force_close()
        self.responses[response.status] += 1
        return response

    async def encode(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()
        if self.draining:
            return error_response(503, "the server is shutting down and takes no new requests")
        if self.in_server >= self.limits.max_requests:
            return error_response(429, f"the server holds {self.in_server} requests already (at most "
                                  f"{self.limits.max_requests}); retry later", {"Retry-After": "1"})
        if request.content_length is not None and request.content_length > self.limits.max_body_bytes:
            response = error_response(413, f"the body has {request.content_length:,} bytes: at most "
                                      f"{self.limits.max_body_bytes:,}")  # never 429: no retry would fit it
            response.force_close()  # its body is never read
            return response
        if self.held_bytes + (request.content_length or 0) > self.limits.max_held_bytes:
            return error_response(429, f"the server holds {self.held_bytes:,} bytes of requests already (at most "
                                  f"{self.limits.max_held_bytes:,}); retry later", {"Retry-After": "1"})
        dtype = request.query.get("dtype", "float32")
        if dtype not in ("float32", "model"):
            return error_response(400, f"dtype must be float32 or model, not {dtype!r}")
        self.in_server += 1
        held = _Held(self)
        timing: dict[str, float] = {}
        try:
            source = await self._read(request, held, timing, start)
            if len(source.records) > self.limits.max_items:
                if isinstance(source, RequestMedia):
                    source.discard()
                raise BadRequest(f"{len(source.records)} items in one request: at most {self.limits.max_items}",
                                 413)
            handed = time.perf_counter()
            result = await self.backend.encode(source, dtype, lambda: _gone(request))
            timing["serialise"] = result.serialise_s
        except BadRequest as err:
            response = error_response(err.status, str(err))
            if not request.content.is_eof():  # the rest of a refused body is never read (nor inflated): close
                response.force_close()
            return response
        except (Refused, RequestTooLarge, ValueError, QueueFull, SchedulerClosed) as err:
            # the model's checks (ValueError: grids, rows, NaN/Inf, each naming the item), the scheduler's bounds,
            # or an engine's error already given its status (several API server processes)
            status = status_of(err)
            return error_response(status, str(err), {"Retry-After": "1"} if status == 429 else None)
        finally:
            self.in_server -= 1
            held.release()
        # preprocess: the media's rows made on the model's device, and admission's own checks (grids, NaN/Inf);
        # its copy to the device apart
        timing["preprocess"] = timing.get("preprocess", 0.0) + result.rows_s + result.admit_s
        timing.update(host_to_device=result.stage_s, queue=result.queue_s, encode=result.total_s - result.queue_s)
        prepared_ms = (handed - start + result.rows_s) * 1e3
        headers = {"X-Request-Id": str(result.request_id), "X-Queue-Delay-Ms": f"{result.queue_s * 1e3:.3f}",
                   "X-Encode-Ms": f"{result.total_s * 1e3:.3f}", "X-Prepare-Ms": f"{prepared_ms:.3f}",
                   "X-Batches": ",".join(map(str, result.batches)),
                   "Server-Timing": ", ".join(f"{k};dur={timing[k] * 1e3:.3f}" for k in PHASES if k in timing)}
        answer = web.StreamResponse(headers={**headers, "Content-Type": SAFETENSORS})
        if self.draining:  # its headers say so: the client's next request goes to another server
            answer.force_close()
        writing = time.perf_counter()
        try:
            await write_answer(request, answer, result.body)
        except ConnectionError:  # the client left as its answer was written
            raise ClientLeft from None
        finally:  # the body (perhaps a mapping of the engine's shared-memory file) is let go at once, written or not
            result.body = b""
        timing["write"] = time.perf_counter() - writing
        if self.draining:  # the drain began while the answer was written: the connection closes after it
            answer.force_close()
        self.phase_s.update(timing)
        self.timed += 1
        return answer

    async def _read(self, request: web.Request, held: "_Held", timing: dict[str, float], start: float
                    ) -> RequestMedia | Prepared:
        """The body read and parsed: decoded media (the backend makes its rows), or pixel rows checked."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):  # inflating would take memory and time the body limit does not see
            raise BadRequest(f"Content-Encoding {shown(encoding, 40)}: send the body uncompressed (identity)", 415)
        if request.content_type not in BODY_TYPES:
            raise BadRequest(f"content type {request.content_type!r}: send multipart/form-data (files), "
                             f"application/json (content parts with data: URLs) or {SAFETENSORS} (pixel_values "
                             "and grid_thw)", 415)
        timeout = self.limits.read_timeout_s
        try:
            body = await asyncio.wait_for(self._receive(request, held), timeout)
        except asyncio.TimeoutError:
            raise BadRequest(f"the body did not arrive within {timeout:g} s", 408) from None
        except HttpProcessingError as err:  # a malformed multipart part (its headers)
            why = " ".join(str(err.message).split()) or type(err).__name__
            raise BadRequest(f"the multipart body is malformed ({why})") from None
        except ConnectionError:  # the client left mid-body: nobody to answer, no error
            raise ClientLeft from None
        read = time.perf_counter()
        timing["read"] = read - start
        loop = asyncio.get_running_loop()
        merge_area = self.model.config.merge_area
        if isinstance(body, list) or request.content_type == "application/json":
            kind, payload = ("files", [(u.name, u.data) for u in body]) if isinstance(body, list) else ("json", body)
            del body
            try:
                media = await self._decode(kind, payload)
            except DecodeBusy as err:
                raise BadRequest(str(err), 429) from None
            except DecodeClosed:
                raise BadRequest("the server is shutting down and takes no new requests", 503) from None
            except MediaError as err:
                raise BadRequest(str(err), err.status) from None
            except DecodeTimeout as err:
                raise BadRequest(f"the request's media: {err} (--decode-timeout)", 413) from None
            except WorkerDied as err:
                raise BadRequest(f"internal error: {err}", 500) from None
            # preprocess: the worker's resizing, and the rows it made if it did (those made on the model's device
            # are the backend's); decode: everything else from the body read to the frames here (the waits for the
            # request's turns in the decode pool, the parse, the files' checks, the media decoded into pixels, the
            # hand-overs)
            timing["preprocess"] = media.timing["preprocess"]
            timing["decode"] = time.perf_counter() - read - media.timing["preprocess"]
            return media
        check = lambda pixels, grids: self.model.check_inputs(pixels, grids, check_finite=False)  # noqa: E731
        prepared = await loop.run_in_executor(self.pool, prepare_pixels, body, check, merge_area)
        timing["decode"] = time.perf_counter() - read  # the safetensors body parsed and checked
        return prepared

    async def _decode(self, kind: str, payload: Any) -> RequestMedia:
        """A media request's items decoded and resized in the decode pool, as one request of its tasks there (so
        that requests take turns item by item): each item in order, the request's pixel budget left passed on; a
        JSON body is parsed in its first item's task (:func:`~glmvit.cli.serve_media.prepare_first_item`), never
        here. A refused item fails the whole request with its error; the frames of the items before it are
        removed, as are those of a request whose client left."""
        merge_area = self.model.config.merge_area
        done = RequestMedia([])
        with self.decode.request() as turns:
            try:
                if kind == "json":
                    first, items = await _turn(turns, prepare_first_item, payload, self.media,
                                               self.limits.max_items, merge_area, self._pixel_dir(),
                                               self._rows_dtype())
                    done.items.append(first)
                else:
                    items = media_items(kind, payload, self.limits.max_items)
                del payload
                left = self.media.max_request_pixels - sum(part.pixels for part in done.items)
                for k, item in enumerate(items, start=len(done.items)):
                    part: PreparedMedia = await _turn(turns, prepare_item, k, item, self.media, left, merge_area,
                                                      self._pixel_dir(), self._rows_dtype())
                    done.items.append(part)
                    left -= part.pixels
            except BaseException:
                done.discard()
                raise
        return done

    async def _receive(self, request: web.Request, held: "_Held") -> list[Upload] | bytes:
        """The body: a multipart request's files, or a pixel or JSON request's bytes."""
        if request.content_type == "multipart/form-data":
            return await self._read_multipart(request, held)
        data = bytearray()
        while chunk := await request.content.read(CHUNK):
            if len(data) + len(chunk) > self.limits.max_body_bytes:
                data.clear()  # freed now, whatever still refers to this frame (a traceback, a task)
                raise BadRequest(f"the body has more than {self.limits.max_body_bytes:,} bytes", 413)
            held.add(len(chunk))
            data += chunk
        return bytes(data)

    async def _read_multipart(self, request: web.Request, held: "_Held") -> list[Upload]:
        reader = await request.multipart()
        uploads: list[Upload] = []
        total = 0
        limit = self.limits.max_body_bytes
        too_large = f"the body has more than {limit:,} bytes"
        try:
            while (part := await reader.next()) is not None:
                k = len(uploads)
                if request.content.total_bytes > limit:  # a preamble or part headers count as the files do
                    raise BadRequest(too_large, 413)
                if not isinstance(part, BodyPartReader) or part.filename is None:
                    raise BadRequest(f"part {k} is not a file: send each image or video as a file part (with a "
                                     "filename)")
                if k >= self.limits.max_items:
                    raise BadRequest(f"more than {self.limits.max_items} files in one request", 413)
                data = bytearray()
                while chunk := await part.read_chunk(CHUNK):
                    total += len(chunk)
                    if total > limit or request.content.total_bytes > limit:
                        data.clear()
                        raise BadRequest(too_large, 413)
                    held.add(len(chunk))
                    data += chunk
                uploads.append(Upload(upload_name(part.filename, k), bytes(data)))
                del data
            if request.content.total_bytes > limit:
                raise BadRequest(too_large, 413)
        except BaseException:
            uploads.clear()  # what a refused body held is freed now, not when the cycle collector runs
            raise
        return uploads

    def _pixel_dir(self) -> str | None:
        """Where decode workers write frames for this service (:mod:`glmvit.cli.pixel_rows`), made on first use."""
        if self._given_pixels is not None:
            return self._given_pixels
        if not self._pixels:
            self._pixels.append(shared_dir())
        return self._pixels[0]

    def _rows_dtype(self) -> str | None:
        """What a decode task is told to make its rows in: the model dtype's name with ``rows="host"``, else None
        (it hands over frames). A plain string: it crosses to the worker process."""
        return str(self.model.dtype).removeprefix("torch.") if self.rows == "host" else None

    def _pack(self, outputs: list[torch.Tensor], records: list[dict[str, Any]], dtype: str,
              allocate: Callable[[int], Any] = bytearray) -> Any:
        """The answer's body, each output copied from the device straight into its place (:mod:`.answer_body`), in
        ``allocate(size)``."""
        out_dtype = torch.float32 if dtype == "float32" else self.model.dtype
        return answer_body(outputs, out_dtype, file_metadata(records, self.info, self.provenance), allocate)

    def health_json(self) -> dict[str, Any]:
        """Light: whether it serves, how, and its limits (``/v1/info`` says what the model and its code are)."""
        scheduler = {k: v for k, v in self.backend.stats().items()
                     if k in ("limits", "max_requests", "max_tokens", "max_bytes", "max_wait_s")}
        engine = getattr(self.backend, "engine_state", None)  # an engine in another process: its state
        draining = self.draining or engine in ("draining", "gone")
        return {"status": "draining" if draining else "ok", "mode": self.backend.mode, "rows": self.rows,
                "url": self.url, "description": self.info.get("description"), "in_server": self.in_server,
                "limits": asdict(self.limits), "scheduler": scheduler, **({"engine": engine} if engine else {})}

    async def health(self, request: web.Request) -> web.Response:
        await self.backend.refresh()
        return web.json_response(self.health_json())

    async def describe(self, request: web.Request) -> web.Response:
        """All /health says, with the model, the floor, the capture, the provenance and the code's fingerprint."""
        await self.backend.refresh(fingerprint=True)
        return web.json_response({
            **self.health_json(), "vision_config": vars(self.model.config), **self.info, **self.extra_health,
            "decode": self.decode.stats(), "media": asdict(self.media), "provenance": self.provenance,
            # the code this server runs, what a benchmark of it measures: taken now, so that it names the modules
            # loaded on first use (the Triton kernels, imported by the capture) as well as those of the start-up
            # (an engine in another process takes its own)
            "fingerprint": self.backend.fingerprint or fingerprint_now().model_dump(mode="json"),
        })

    def metrics_json(self) -> dict[str, Any]:
        connections = len(self.server.connections) if self.server else 0
        return {"http": {"in_server": self.in_server, "connections": connections, "draining": self.draining,
                         "held_bytes": self.held_bytes, "max_held_bytes": self.limits.max_held_bytes,
                         "responses": {str(k): v for k, v in sorted(self.responses.items())},
                         "clients_left": self.clients_left,
                         "timed_requests": self.timed, "phase_s": {k: self.phase_s[k] for k in PHASES},
                         **({"frontend": self.frontend} if self.frontend is not None else {}),
                         **({"engine": self.backend.engine_state} if hasattr(self.backend, "engine_state") else {})},
                "decode": self.decode.stats(), "scheduler": self.backend.stats(), "runner": self.backend.runner_stats()}

    async def metrics(self, request: web.Request) -> web.Response:
        await self.backend.refresh()
        data = self.metrics_json()
        if request.query.get("format") == "json":
            return web.json_response(data)
        s, http = data["scheduler"], data["http"]
        lines = prometheus_family("http_responses_total", "counter", "responses by status",
                                  [(f'{{status="{k}"}}', v) for k, v in http["responses"].items()])
        lines += prometheus_family("http_clients_left_total", "counter",
                                   "requests whose client closed the connection before the answer (not errors)",
                                   [("", http["clients_left"])])
        lines += prometheus_family("http_requests_in_server", "gauge", "requests read, decoded, queued or running",
                                   [("", self.in_server)])
        lines += prometheus_family("http_connections", "gauge", "open connections", [("", http["connections"])])
        lines += prometheus_family("http_held_bytes", "gauge", "request bodies read and not yet answered",
                                   [("", self.held_bytes)])
        lines += prometheus_family("http_held_bytes_limit", "gauge", "past this, 429",
                                   [("", self.limits.max_held_bytes)])
        lines += prometheus_family("http_request_phase_seconds_total", "counter",
                                   "time of the requests answered 200, by phase",
                                   [(f'{{phase="{k}"}}', self.phase_s[k]) for k in PHASES])
        lines += prometheus_family("http_timed_requests_total", "counter", "requests answered 200 (phases summed)",
                                   [("", self.timed)])
        d = data["decode"]
        lines += prometheus_family("decode_busy_requests", "gauge", "requests decoding or waiting for a decoder",
                                   [("", d["busy"])])
        lines += prometheus_family("decode_timeouts_total", "counter", "decodes past the timeout (worker replaced)",
                                   [("", d["timeouts"])])
        if self.frontend is not None:  # one API server's of several: its own counters, labelled with its name
            lines = [line if line.startswith("#") else labelled(line, "frontend", self.frontend) for line in lines]
        if s:  # an engine in another process that never answered has no counters to give yet
            lines += scheduler_lines(s)
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    # ---- lifetime ------------------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            log.warning("shutting down: %d request(s) in the server will finish, new ones get 503", self.in_server)

    def close(self, timeout: float | None = None) -> bool:
        """Drain the scheduler (within ``timeout``), stop the threads and the decoders; True if the scheduler
        answered every request it had admitted within ``timeout``."""
        drained = self.backend.close(timeout)
        self.pool.shutdown(wait=True)
        self.answers.shutdown(wait=True)
        if self._owns_decode:
            self.decode.close(timeout)
        for folder in self._pixels:
            remove_shared_dir(folder)
        return drained


class _JsonErrors(web.RequestHandler):
    """aiohttp's connection handler, except that a request its HTTP parser refuses (a malformed request line, a
    Content-Length of 10³⁰) is answered, counted and logged as every other error: one line of JSON, one log line;
    a Content-Encoding it has no codec for is a 415, as the handler answers every compressed body."""

    def __init__(self, manager: web.Server, responses: collections.Counter[int], **kwargs: Any):
        super().__init__(manager, **kwargs)
        self.responses = responses
        self._last_sent: tuple[Any, Any] | None = None  # the newest request parsed and its body

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        # aiohttp's queue of parsed requests not yet handled, the newest last (a private name: an aiohttp without it
        # leaves half-closing clients unanswered, as before, rather than failing every request)
        messages = getattr(self, "_messages", None)
        if messages:
            self._last_sent = messages[-1]

    def eof_received(self) -> bool | None:  # type: ignore[override]  # asyncio.Protocol's: True keeps it open
        """The client shut its sending side (a FIN). aiohttp closes the connection, which cancels the request in
        flight: right for a client that left. A client whose last request said the connection ends with it
        (``Connection: close``, or HTTP/1.0) and arrived whole may close so, half of it (RFC 9112 §9.6): the
        connection stays open for the answer, then closes as that request asked."""
        if self._last_sent is not None:
            message, payload = self._last_sent  # a request the parser refused has no should_close: answered too
            if getattr(message, "should_close", True) and payload.is_eof():
                return True
        return None

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's: an answer has begun, so the connection is broken
            raise ConnectionError("an answer was being sent when the request failed")
        why = " ".join((message or HTTPStatus(status).phrase).split())[:200]
        log.warning("refused a malformed HTTP request from %s: %s", request.remote, why)
        if isinstance(exc, ContentEncodingError):  # a coding aiohttp cannot undo (br, zstd): as every other one
            status, text = 415, "Content-Encoding: send the body uncompressed (identity)"
        else:
            text = f"malformed HTTP request: {why}"
        self.responses[status] += 1
        response = error_response(status, text)
        response.force_close()
        return response


class _Busy(asyncio.Protocol):
    """A connection past the limit: a JSON 503 and the socket closed, before anything is read from it."""

    def __init__(self, answer: bytes):
        self.answer = answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(self.answer)
        transport.close()


class _Connections:
    """The listening socket's protocol factory: a :class:`_JsonErrors` handler for each of up to ``limit`` open
    connections (a burst of accepts may pass it by the listen backlog), a :class:`_Busy` past that."""

    def __init__(self, server: web.Server, service: EncoderService, limit: int):
        self.server, self.service, self.limit = server, service, limit
        self.loop = asyncio.get_running_loop()
        body = json.dumps({"error": f"the server holds {limit} connections already (at most {limit}); retry later",
                           "status": 503}).encode()
        self.busy = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
                     b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s" % (len(body), body))

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.limit:
            self.service.responses[503] += 1
            return _Busy(self.busy)
        return _JsonErrors(self.server, self.service.responses, loop=self.loop, access_log=None,
                           keepalive_timeout=self.service.limits.header_timeout_s)


FD_RESERVE = 128  # open files kept for all but connections: the model's, uploads' temporary files, the log's


def raise_open_files(wanted: int) -> int:
    """Raise this process's soft limit on open files (``ulimit -n``) towards ``wanted``, never past its hard limit,
    which only an administrator may raise; returns the soft limit now (``RLIM_INFINITY`` where unlimited). A server
    holding a burst of connections, or a load generator opening one per request, needs a file for each: the common
    soft limit of 1024 would refuse a burst of 1000 requests long before the hard limit does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return soft
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a sandbox that refuses: the limit stays, and the caller sizes to it
            pass
    return soft


def connection_limit(wanted: int) -> int:
    """``wanted`` connections, fewer if this process may not open that many files besides FD_RESERVE (its soft
    limit raised first, up to the hard one: :func:`raise_open_files`)."""
    soft = raise_open_files(wanted + FD_RESERVE)
    if soft == resource.RLIM_INFINITY or wanted <= soft - FD_RESERVE:
        return wanted
    limit = max(1, soft - FD_RESERVE)
    log.warning("at most %d connections, not %d: this process may open %d files (ulimit -n)", limit, wanted, soft)
    return limit


def format_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# connections the kernel queues on a listening socket before one is accepted: a load generator's burst at rate inf
# opens hundreds at once, and a SYN past a full queue is retried a second later (asyncio's own default is 100)
BACKLOG = 1024
CANCEL_AFTER_S = 1.0  # a drain past its timeout: how long handlers still running get before they are cancelled,
# and then how long the encoder's worker gets to end the batch it holds (a worker thread that ends while the
# interpreter exits, having used torch, aborts the process)


async def run_server(service: EncoderService, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 60.0,
                     on_ready: Callable[[str], None] | None = None, stop: asyncio.Event | None = None,
                     handle_signals: bool = False, sockets: list[socket.socket] | None = None) -> bool:
    """Serve ``service`` until ``stop`` is set (or SIGINT/SIGTERM with ``handle_signals``), then drain (module
    docstring); True if the drain answered every request within ``shutdown_timeout``. Otherwise it logs one line
    of how many requests it abandoned (``service.abandoned``), cancels their handlers and stops, waiting for the
    scheduler only for the batch it holds (:data:`CANCEL_AFTER_S` at most). ``on_ready`` gets the URL once the
    socket listens (port 0: an ephemeral port). ``sockets``: listening sockets to accept on instead of binding
    ``host``:``port`` (an API server process's, from the engine, which other API servers accept on too)."""
    # the drain below waits for the handlers itself: aiohttp's own wait, after it, only for what outlived it
    # a client that leaves cancels its handler: a request of it still queued is withdrawn from the scheduler
    runner = web.AppRunner(service.app, handle_signals=False, shutdown_timeout=min(shutdown_timeout, CANCEL_AFTER_S),
                           handler_cancellation=True)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()
    listeners: list[asyncio.Server] = []
    try:
        assert runner.server is not None
        service.server = runner.server
        factory = _Connections(runner.server, service, connection_limit(service.limits.max_connections))
        if sockets is None:
            listeners.append(await loop.create_server(factory, host, port, reuse_address=True, backlog=BACKLOG))
        else:
            for sock in sockets:  # asyncio calls listen() again, with this backlog
                listeners.append(await loop.create_server(factory, sock=sock, backlog=BACKLOG))
        service.url = format_url(host, listeners[0].sockets[0].getsockname()[1])
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        if on_ready:
            on_ready(service.url)
        await stop.wait()
    finally:
        for sig in signals:  # a second signal acts as usual (ends the process)
            loop.remove_signal_handler(sig)
        service.begin_drain()
        for listener in listeners:
            listener.close()  # stop listening
        # open connections stay open while requests are in flight: a request on one (an idle keep-alive one
        # included) gets a 503 and its connection closed; then the idle ones are closed
        deadline = time.monotonic() + shutdown_timeout
        while (service.in_server or service.handling) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        service.abandoned = service.handling
        if service.abandoned:
            log.warning("the drain ran out of time (%g s): %d request(s) in flight abandoned", shutdown_timeout,
                        service.abandoned)
        await runner.cleanup()  # close idle connections, cancel the handlers still in flight
        closed = await loop.run_in_executor(None, service.close,
                                            CANCEL_AFTER_S if service.abandoned else shutdown_timeout)
    return closed and not service.abandoned


class ServerThread:
    """:func:`run_server` (or ``serve``, which takes its arguments: :func:`~glmvit.cli.serve_frontends.run_frontends`)
    in a thread with its own event loop, started with :meth:`start`, drained by :meth:`shutdown` (which returns once
    every request in flight is answered)."""

    def __init__(self, service: EncoderService, host: str = "127.0.0.1", port: int = 0,
                 shutdown_timeout: float = 60.0, serve: Callable[..., Awaitable[bool]] | None = None):
        self.service, self.host, self.port, self.shutdown_timeout = service, host, port, shutdown_timeout
        self.serve = serve or run_server
        self.url: str | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.drained: bool | None = None  # once stopped: whether the drain answered every request in time
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._thread = threading.Thread(target=self._main, name="glmvit-serve-loop", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as err:  # noqa: BLE001 - reported to the thread that started the server
            self._error = err
        finally:  # a server that ended without listening (its API servers did not start) wakes start() at once
            self._ready.set()

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested:  # shutdown() ran before this loop existed: serve nothing, drain at once
            self._stop.set()

        def ready(url: str) -> None:
            self.url = url
            self._ready.set()

        self.drained = await self.serve(self.service, self.host, self.port, self.shutdown_timeout, ready, self._stop)

    def start(self, timeout: float = 60.0) -> "ServerThread":
        """Start the server's thread and return once it listens; a server that fails, or does not listen within
        ``timeout``, is stopped (its thread joined, whatever it started drained) before the error is raised."""
        self._thread.start()
        if not self._ready.wait(timeout):
            self.shutdown()
            raise TimeoutError(f"the server did not start listening within {timeout:g} s")
        if self._error is not None:
            self.shutdown()
            raise self._error
        if self.url is None:  # it ended before it listened: its log lines say why
            self.shutdown()
            raise RuntimeError("the server ended before it listened")
        return self

    def shutdown(self, timeout: float | None = None) -> bool:
        """Drain and stop; True if the server thread ended within ``timeout``."""
        self._stop_requested = True  # seen by _serve if its loop does not exist yet
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> "ServerThread":
        """``with server:`` starts it; ``with server.start(timeout=…):`` enters the one already started; a server
        whose thread was started but is not up (stopped, or failed to start) raises RuntimeError."""
        if self._thread.ident is None:
            return self.start()
        if self._ready.is_set() and self.url is not None and self._error is None and self._thread.is_alive() \
                and not self._stop_requested:
            return self
        raise RuntimeError("the server already stopped, is draining, or failed to start")

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
