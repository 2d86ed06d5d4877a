"""``python -m glmvit serve``: the encoder as an HTTP service; the items of concurrent requests share batches.

One worker thread owns the encoder (:class:`~glmvit.scheduler.BatchScheduler`): ``--mode graph`` is the captured
runner (``graph-emulated`` off CUDA), ``graph-compiled`` the same with ``torch.compile`` (CUDA), ``eager`` the model
under the same batch limits. Listens on 127.0.0.1 unless ``--host`` says otherwise and prints its URL once it
listens; SIGINT or SIGTERM drains (requests in flight finish, new ones get 503) and exits: 0, or 1 if requests
were still in flight after ``--shutdown-timeout`` (a line says how many were abandoned). Endpoints, bodies and
status codes: :mod:`glmvit.cli.serve_app`. ``--api-servers N`` runs the HTTP side in N processes on the same port in
front of this one, which encodes (:mod:`glmvit.cli.serve_frontends`). Examples::

    python -m glmvit serve --port 8000
    curl -s -F file=@data/images/coffee.jpg -F file=@data/clip.gif http://127.0.0.1:8000/v1/encode -o emb.safetensors
    printf '{"content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,%s"}}]}' \\
        "$(base64 -w0 data/images/coffee.jpg)" | curl -s -H 'Content-Type: application/json' --data-binary @- \\
        http://127.0.0.1:8000/v1/encode -o emb.safetensors
    curl -s http://127.0.0.1:8000/health; curl -s http://127.0.0.1:8000/metrics
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any, Callable, Coroutine

import torch

from ..defaults import dtype_name
from ..deployment import check_budget_fits
from ..encoder import EagerEncoder, build_encoder
from ..floor import measure_copy_bandwidth, measure_matmul_tflops, weight_bytes
from ..graphs import EncoderGraphRunner
from ..metadata import MAX_ROWS
from ..model import GlmVisionEncoder
from ..modes import RunMode
from ..packing import SERVING_LARGEST_BUDGET, SERVING_MAX_ITEMS, BudgetConfig
from ..provenance import collect
from ..recorded import recorded_table_for
from ..records import RECORD_DIRS
from ..scheduler import DEFAULT_MAX_BYTES, DEFAULT_MAX_REQUESTS, SWITCH_INTERVAL_S, BatchScheduler
from .common import (
    MAX_BUDGET_TOKENS,
    Parser,
    add_model_args,
    budgets_arg,
    float_in,
    graph_memory_target,
    int_in,
    model_from_args,
    resolve_model_args,
)
from .decode_pool import DecodePool
from .encode import model_metadata
from .pixel_rows import no_room, sweep_shared_dirs
from .serve_app import (
    DEFAULT_ROWS,
    ROWS,
    EncoderService,
    HttpLimits,
    default_decode_pool,
    default_decode_workers,
    run_server,
)
from .serve_frontends import default_api_servers, run_frontends
from .serve_media import DEFAULT_FRAME_PIXELS, DEFAULT_REQUEST_PIXELS, MediaLimits
from .session import runner_key

if TYPE_CHECKING:
    from .session import Session

MODES = tuple(m.value for m in RunMode)


def add_serving_args(parser: argparse.ArgumentParser, uniform_default: str = "none") -> None:
    """Batch limits and scheduling: the same flags for ``serve`` and ``bench-serve --in-process``."""
    g = parser.add_argument_group("batching")
    g.add_argument("--budgets", type=budgets_arg, default=None,
                   help="graph token budgets, e.g. 256,1024,4096 (default: the default ladder up to "
                        f"{SERVING_LARGEST_BUDGET})")
    g.add_argument("--max-items", type=int_in(1, MAX_BUDGET_TOKENS), default=None,
                   help=f"items per batch (default {SERVING_MAX_ITEMS}, at most the smallest budget)")
    g.add_argument("--max-segments", type=int_in(1, MAX_BUDGET_TOKENS), default=None,
                   help="attention segments (temporal patches) per batch (default: max items)")
    g.add_argument("--max-wait-ms", type=float_in(0, 1000), default=0.0,
                   help="keep an under-full batch open this long for more items (default 0: see glmvit.scheduler)")
    g.add_argument("--switch-interval-ms", type=switch_interval_ms, default=SWITCH_INTERVAL_S * 1e3,
                   help="the interpreter's GIL switch interval while the encoder's worker runs, at most (default "
                        f"{SWITCH_INTERVAL_S * 1e3:g}: see glmvit.scheduler; 0: leave the interpreter's as it is)")
    g.add_argument("--max-queue", type=int_in(1, 100_000), default=DEFAULT_MAX_REQUESTS,
                   help=f"requests admitted and not yet answered (default {DEFAULT_MAX_REQUESTS}); then 429")
    g.add_argument("--max-queue-tokens", type=int_in(1, 2**31), default=None,
                   help="their output tokens (default 64 × the largest budget); then 429")
    g.add_argument("--max-queue-mb", type=float_in(1, 2**20), default=DEFAULT_MAX_BYTES / 2**20,
                   help=f"their pixels, in MiB in the model's dtype on its device (default {DEFAULT_MAX_BYTES >> 20}); "
                        "then 429")
    g.add_argument("--attn-backend", default=None, help="attention backend (default: the device's)")
    g.add_argument("--uniform-lengths", type=uniform_lengths_arg, default=(), metavar="L,L",
                   help="also capture graphs for batches whose segments (frames) all have L rows (h·w patches, e.g. "
                        "256 for 224² frames, 1024 for 448²), run with the dense attention where they hold "
                        f"glmvit.uniform.DENSE_MIN_ROWS rows or more (default: {uniform_default})")


def uniform_lengths_arg(text: str) -> tuple[int, ...]:
    """``--uniform-lengths``: comma-separated positive integers (the runner checks each against the model)."""
    lengths = []
    for part in text.split(","):
        try:
            value = int(part.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a whole number of rows") from None
        if not 0 < value <= MAX_ROWS:
            raise argparse.ArgumentTypeError(f"{value} rows: a segment length is between 1 and {MAX_ROWS}")
        lengths.append(value)
    return tuple(sorted(set(lengths)))


def switch_interval_ms(text: str) -> float:
    """``--switch-interval-ms``: 0 (leave the interpreter's interval alone) or 0.001 … 1000 milliseconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if value != 0 and not 0.001 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text} ms: give 0 (leave the interpreter's interval) or 0.001 to 1000 ms")
    return value


def switch_interval_s(args: argparse.Namespace) -> float | None:
    """The scheduler's ``switch_interval_s`` of the flags: None for ``--switch-interval-ms 0``."""
    return args.switch_interval_ms / 1e3 if args.switch_interval_ms else None


def budget_config(args: argparse.Namespace) -> BudgetConfig:
    """The batch limits the flags ask for (:meth:`BudgetConfig.serving <glmvit.packing.BudgetConfig.serving>`)."""
    return BudgetConfig.serving(args.budgets, args.max_items, args.max_segments)


def check_serving_args(parser: argparse.ArgumentParser, args: argparse.Namespace, modes: list[str]) -> None:
    """Refuse what cannot run, before the model is built (one line, exit 2)."""
    device = torch.device(args.device)
    if RunMode.GRAPH_COMPILED in modes and device.type != "cuda":
        parser.error("graph-compiled needs CUDA (off CUDA the runner only emulates graphs: use graph)")
    try:
        check_budget_fits(budget_config(args), dtype_name(args.dtype),
                          graph_memory_target(args.device))
    except ValueError as err:
        parser.error(str(err))


def make_scheduler(model: GlmVisionEncoder, mode: RunMode | str, args: argparse.Namespace, progress: bool = False,
                   attention: str | None = None, session: Session | None = None
                   ) -> tuple[BatchScheduler, EncoderGraphRunner | None]:
    """The scheduler of ``mode`` over ``model``'s encoder (:func:`~glmvit.encoder.build_encoder`: a runner captured
    first for the graph modes, routing by its recorded table, with uniform graphs for ``args.uniform_lengths``)
    running ``attention`` (None: the model's backend), and its runner if any. A ``session`` (a record run) lends a
    runner an earlier job captured (:meth:`Session.runner <glmvit.cli.session.Session.runner>`;
    :meth:`Session.source_of <glmvit.cli.session.Session.source_of>` says where it came from)."""
    run_mode = RunMode.parse(mode)
    config = budget_config(args)
    attention = model.attention_backend(attention)  # checked before anything is captured
    table = recorded_table_for(model, run_mode.compiled, attention, dirs=RECORD_DIRS) if run_mode.graphs else None
    uniform = tuple(getattr(args, "uniform_lengths", ()))
    if session is not None and run_mode.graphs:
        def build() -> EncoderGraphRunner:
            built = build_encoder(model, run_mode, config, attention=attention, latency_table=table,
                                  progress=progress, uniform_lengths=uniform)
            assert isinstance(built, EncoderGraphRunner)
            return built

        key = runner_key(model, run_mode, config, attention, table, uniform_lengths=uniform)
        encoder: EagerEncoder | EncoderGraphRunner
        encoder, _ = session.runner(key, build, model.device)
    else:
        encoder = build_encoder(model, run_mode, config, attention=attention, latency_table=table, progress=progress,
                                uniform_lengths=uniform)
    scheduler = BatchScheduler(encoder, config, max_wait_s=args.max_wait_ms / 1e3, max_requests=args.max_queue,
                               max_tokens=args.max_queue_tokens, max_bytes=int(args.max_queue_mb * 2**20),
                               switch_interval_s=switch_interval_s(args))
    return scheduler, encoder if isinstance(encoder, EncoderGraphRunner) else None


def measure_floor(model: GlmVisionEncoder, measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """The matmul rate and copy bandwidth on the model's device (glmvit.floor), and its weight bytes: ``measured``'s
    rates (matmul_tflops and copy_gbps, on this device and dtype) where a caller has them, else measured here."""
    rates = measured or {"matmul_tflops": measure_matmul_tflops(model.device, model.dtype),
                         "copy_gbps": measure_copy_bandwidth(model.device)}
    return {"matmul_tflops": rates["matmul_tflops"], "matmul_dtype": str(model.dtype).removeprefix("torch."),
            "copy_gbps": rates["copy_gbps"], "weight_bytes": weight_bytes(model)}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m glmvit serve", description=(__doc__ or "").split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(__doc__ or "").split("\n\n", 1)[1])
    parser.add_argument("--mode", choices=MODES, default="graph", help="what encodes (default graph)")
    add_model_args(parser)
    add_serving_args(parser)
    h = parser.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    h.add_argument("--port", type=int_in(0, 65535), default=8000, help="port (default 8000; 0: any free port)")
    h.add_argument("--max-body-mb", type=float_in(0.001, 4096), default=64.0,
                   help="largest request body, in MiB (default 64); larger: 413")
    h.add_argument("--max-items-per-request", type=int_in(1, 4096), default=64, help="default 64; more: 413")
    h.add_argument("--max-requests", type=int_in(1, 100_000), default=None,
                   help="requests in the server at once, decoding included (default: --max-queue); then 429")
    h.add_argument("--max-held-mb", type=float_in(1, 2**20), default=4096.0,
                   help="request bodies read and not yet answered, in MiB (default 4096); then 429")
    h.add_argument("--threads", type=int_in(1, 256), default=min(8, os.cpu_count() or 1),
                   help="threads that check pixel rows and admit requests, and as many again that serialise "
                   "answers (default min(8, CPUs))")
    h.add_argument("--read-timeout", type=float_in(0.1, 3600), default=30.0,
                   help="seconds a request's body may take to arrive (default 30; later: 408, its place freed)")
    h.add_argument("--header-timeout", type=float_in(0.1, 3600), default=30.0,
                   help="seconds a connection may take to send a request's headers, or stay idle between requests "
                        "(default 30; then it is closed)")
    h.add_argument("--max-connections", type=int_in(1, 1_000_000), default=1024,
                   help="open connections at once (default 1024, fewer if ulimit -n is lower); more: 503")
    h.add_argument("--api-servers", type=int_in(1, 64), default=None,
                   help="processes that run the HTTP server on the same port, each reading, parsing and decoding its "
                        "requests, in front of this one, which encodes; 1: this process alone (default: one per "
                        "four CPUs, at most 4, 1 without a shared-memory folder: "
                        "glmvit.cli.serve_frontends.default_api_servers)")
    h.add_argument("--shutdown-timeout", type=float_in(0, 3600), default=60.0,
                   help="seconds a drain waits for requests in flight (default 60); then they are abandoned, exit 1")
    m = parser.add_argument_group("media (multipart files, JSON content parts)")
    m.add_argument("--decode-workers", type=int_in(1, 256), default=None,
                   help="processes that decode and preprocess media, one thread each (default: this process's "
                        "CPUs − 4, at least 1, at most 32: glmvit.cli.serve_app.default_decode_workers)")
    m.add_argument("--decode-queue", type=int_in(0, 100_000), default=None,
                   help=f"requests waiting for a decode process (default: --max-queue, {DEFAULT_MAX_REQUESTS} unless "
                        "given; their bodies count against --max-held-mb too); more: 429")
    m.add_argument("--decode-timeout", type=float_in(0.01, 3600), default=30.0,
                   help="seconds a request's media may take to decode, its items together (default 30; later: 413, the "
                        "process replaced)")
    m.add_argument("--max-frame-pixels", type=int_in(1, 8192 * 8192), default=DEFAULT_FRAME_PIXELS,
                   help=f"pixels of one picture or frame, read from its header (default {DEFAULT_FRAME_PIXELS:,}); "
                        "more: 413 before it is decoded")
    m.add_argument("--max-request-pixels", type=int_in(1, 2**40), default=DEFAULT_REQUEST_PIXELS,
                   help=f"pixels one request may decode (default {DEFAULT_REQUEST_PIXELS:,}); more: 413")
    m.add_argument("--allowed-media-dir", type=media_dir, default=None,
                   help="take file:// URLs of files under this directory (default: none, file:// is refused)")
    m.add_argument("--rows", choices=ROWS, default=DEFAULT_ROWS,
                   help=f"where media's pixel rows are made (default {DEFAULT_ROWS}): device (the engine, on the "
                        "model's device, from the workers' uint8 frames) or host (the decode processes, in the model's "
                        "dtype, handed over in shared memory: the engine only copies them to its device; without a "
                        "shared-memory folder, as device)")
    h.add_argument("--measure-floor", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the matmul rate and copy bandwidth at start (for bench-serve's floor; default on)")
    h.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def media_dir(text: str) -> str:
    """An existing directory, resolved (symlinks followed): where file:// URLs may point."""
    path = os.path.realpath(text)
    if not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory")
    return path


def check_listen(host: str, port: int) -> None:
    """A one-line ValueError when ``host``:``port`` cannot be listened on (an unknown host, a port in use, an
    address not on this machine): found before the model is built and captured, not after."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own socket does
                probe.bind(address)
    except OSError as err:
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None


def build_service(args: argparse.Namespace, command: str, model: GlmVisionEncoder | None = None,
                  floor: dict[str, Any] | None = None, decode: DecodePool | None = None,
                  session: Session | None = None, start_decode: bool = True) -> EncoderService:
    """Model (``model`` if given: the flags' tower, built by the caller), encoder (captured), scheduler and
    application, as the resolved flags say. A caller that measured the floor on this device and dtype already
    (``floor``: matmul_tflops and copy_gbps) or runs a decode pool (``decode``: started, and closed by the caller)
    lends them; otherwise the floor is measured (with --measure-floor) and a pool is made, owned by the service.
    A ``session`` (a record run) may lend the runner (:func:`make_scheduler`); the service's info then says where
    it came from (``runner_source``). ``start_decode=False`` (an engine behind API server processes, which decode)
    makes the pool without starting a process of it."""
    model = model if model is not None else model_from_args(args)
    scheduler, runner = make_scheduler(model, args.mode, args, progress=not args.quiet, attention=args.attn_backend,
                                       session=session)
    source = session.source_of(runner) if session is not None and runner is not None else None
    extra = {"attn_backend": scheduler.encoder.attention,
             "uniform_lengths": list(runner.uniform_lengths) if runner else [],
             "uniform_capture": {f"{b}x{n}": c.as_dict() for (b, n), c in runner.uniform_captures.items()}
             if runner else None,
             "floor": measure_floor(model, floor) if args.measure_floor else None,
             "capture": {str(k): v.as_dict() for k, v in runner.captures.items()} if runner else None,
             "capture_failed": {str(k): v for k, v in runner.failed.items()} if runner else None,
             "routing": (runner.latency_table.describe() if runner.latency_table else "off: no recorded table for "
                         "this model, mode and GPU (every batch a budget holds replays)") if runner else None}
    if source is not None:
        extra["runner_source"] = source
    limits = HttpLimits(int(args.max_body_mb * 2**20), args.max_items_per_request, args.max_requests or args.max_queue,
                        args.read_timeout, args.header_timeout, args.max_connections, int(args.max_held_mb * 2**20))
    media = MediaLimits(args.max_frame_pixels, args.max_request_pixels, args.allowed_media_dir)
    service = EncoderService(scheduler, model_metadata(args, model), collect(model.device, command), limits,
                             args.threads, extra, (lambda: runner.stats.as_dict()) if runner else None, media=media,
                             decode=decode or default_decode_pool(args.decode_workers, decode_queue(args),
                                                                  args.decode_timeout),
                             own_decode=decode is None, rows=args.rows)
    if start_decode:
        service.decode.start()  # its processes start now (their imports take seconds), not with the first upload
    sweep_shared_dirs()  # the frames' folders of servers killed before they could remove them
    return service


def resolve_processes(args: argparse.Namespace) -> None:
    """``--api-servers`` and ``--decode-workers`` left out: this machine's
    :func:`~glmvit.cli.serve_frontends.default_api_servers` and
    :func:`~glmvit.cli.serve_app.default_decode_workers`, set in place. Resolved here, after parsing, not as the
    parser's defaults: ``--help`` and a parse then read the same on every host, and whoever runs a server
    (``serve``, the record run, ``bench-serve --spawn``) names the counts it ran."""
    if args.api_servers is None:
        args.api_servers = default_api_servers()
    if args.decode_workers is None:
        args.decode_workers = default_decode_workers()


def decode_queue(args: argparse.Namespace) -> int:
    """Requests that may wait for a decode process: ``--decode-queue``, else ``--max-queue`` (a request the scheduler
    would hold is not refused before it, for want of a place in the decode queue)."""
    return args.max_queue if args.decode_queue is None else args.decode_queue


def parse_args(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """``glmvit serve``'s parser and its flags from ``argv``, every default resolved (:func:`resolve_model_args`,
    :func:`resolve_processes`): the one way a server's flags are read, by ``serve`` and by the record run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_args(parser, args)
    resolve_processes(args)
    return parser, args


def serve_function(args: argparse.Namespace) -> Callable[..., Coroutine[Any, Any, bool]]:
    """The coroutine that serves a service built from ``args`` (:func:`build_service`, with ``start_decode`` False
    when ``--api-servers`` is above 1): :func:`~glmvit.cli.serve_app.run_server`, or for ``--api-servers N > 1``
    :func:`~glmvit.cli.serve_frontends.run_frontends` with the flags' decode pool split among the N processes.
    Both take run_server's arguments (so a ``ServerThread`` runs either). ``args`` come from :func:`parse_args`."""
    if args.api_servers is None:
        raise ValueError("--api-servers is unresolved: read the flags with glmvit.cli.serve.parse_args")
    if args.api_servers == 1:
        return run_server
    return functools.partial(run_frontends, count=args.api_servers, decode_workers=args.decode_workers,
                             decode_queue=decode_queue(args), decode_timeout=args.decode_timeout, threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, args = parse_args(argv)
    check_serving_args(parser, args, [args.mode])
    try:
        check_listen(args.host, args.port)
    except ValueError as err:
        parser.error(str(err))
    if args.api_servers > 1 and (why := no_room()):
        parser.error(f"--api-servers {args.api_servers} needs a shared-memory folder: {why}")
    if args.rows == "host" and (why := no_room()):  # else every request would hand frames, as device does
        parser.error(f"--rows host needs a shared-memory folder: {why}")
    logging.basicConfig(level=logging.WARNING, format="glmvit serve: %(message)s")
    service = build_service(args, " ".join([sys.executable, "-m", "glmvit", "serve", *argv]),
                            start_decode=args.api_servers == 1)
    mode = service.backend.mode
    many = f" ({args.api_servers} API server processes)" if args.api_servers > 1 else ""

    def ready(url: str) -> None:
        print(f"glmvit serve: {mode}, {service.info['description']}; listening on {url}{many} (POST "
              f"{url}/v1/encode)", flush=True)

    serve = serve_function(args)
    if not asyncio.run(serve(service, args.host, args.port, args.shutdown_timeout, ready, handle_signals=True)):
        return 1  # the drain ran out of --shutdown-timeout (or an API server failed): the log says why
    print("glmvit serve: stopped", flush=True)
    return 0
