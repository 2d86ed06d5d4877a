"""``python -m glmvit bench-serve``: the encoder under load, modelled on ``vllm bench serve`` with ``random-mm``.

Requests come from vLLM's random-mm dataset (:mod:`glmvit.workloads`: a ``--workload`` preset, or
``--bucket-config`` with ``--items-per-request`` / ``--range-ratio`` / ``--limit-per-request``), ``--num-prompts``
of them drawn with ``--seed``. Bodies are built before timing, one per distinct layout. ``--body media`` (the
default) sends what vLLM's clients send: a JSON body of ``image_url`` / ``video_url`` content parts with ``data:``
URLs of random pictures and clips of the bucket's size (seeded noise, as random-mm draws; JPEG pictures, MP4 clips,
or animated GIFs without PyAV), each kind checked once to decode to the grid the workload expects; ``--body pixels``
sends pixel rows (random normal, seeded; a safetensors body). Arrivals as in vLLM: ``--request-rate inf`` sends
everything at once, a finite rate draws gaps from a gamma distribution of shape ``--burstiness`` (1: Poisson) and
mean 1/rate; several rates in one list make a sweep, and a rate may be a share of saturation (``inf,20%,50%``:
each share of the requests/s that the sweep's ``inf`` run achieved, run after it). ``--max-concurrency`` caps
the requests in flight. Per request:
the time to embedding (from sending it to its whole answer read) and the server's queueing delay (its
``X-Queue-Delay-Ms``: admission to the first batch holding one of its items). Every answer is checked (one tensor
per item, of its tokens and width). Refusals (429, 503) are counted apart from failures. Each answered request's
time is split as the server's ``Server-Timing`` header says (read, decode, preprocess, queue, host_to_device,
encode, serialise), and ``write`` is the rest of its time to embedding (the answer written and read, the request
sent before the server read it); the record's ``per_request`` keeps each request's split as the server sent it
(``timing_ms``), so that the slow requests can be read one by one.

Where the load goes:

- ``--url URL``: a running ``glmvit serve`` (one mode: the server's);
- ``--spawn``: for each of ``--modes`` a ``python -m glmvit serve`` child process on 127.0.0.1 (an ephemeral port),
  with the model and batching flags given here, stopped by SIGTERM (drained) after its runs; a process of its own,
  as ``vllm serve`` is for ``vllm bench serve``, so that client and server do not share an interpreter lock;
- ``--in-process``: no HTTP: the same scheduler in this process, what the encoder and scheduler alone sustain.

The floor-limited rate is the server's measured matmul rate (``serve --measure-floor``) over the workload's mean
analytic FLOPs per item (:mod:`glmvit.floor`): at saturation batches are large, the weights are read once per
batch, and the matmuls bound the rate. Examples (the seed's serve workload; a sweep)::

    python -m glmvit bench-serve --spawn --modes eager,graph-compiled --workload video8x224 \\
        --num-prompts 100 --request-rate inf --json data/bench/serve_video8x224.json
    python -m glmvit bench-serve --spawn --modes graph-compiled --workload mixed-av --num-prompts 60 \\
        --request-rate inf,20%,50%,90% --json data/bench/serve_mixed_av.json

Why one module of this length: the workload, the arrivals, the three targets and the report are one command.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import torch
from safetensors.torch import save as save_safetensors

from ..config import VisionConfig
from ..defaults import DTYPES
from ..floor import flops_breakdown
from ..modes import RunMode
from ..provenance import collect
from ..records import Fingerprint, ServeRecord, fingerprint_now, make
from ..scheduler import BatchScheduler, QueueFull, SchedulerClosed
from ..timing import distribution, steady_rate
from ..uniform import planned_uniform_lengths
from ..workloads import PRESETS, MMItem, random_batch, random_mm_workload, shown
from .common import (
    Parser,
    add_model_args,
    bucket_config_arg,
    check_writable,
    device_memory_bytes,
    float_in,
    int_in,
    model_from_args,
    output_path,
    plural,
    refuse_preset_flags,
    resolve_model_args,
    write_record,
)
from .media_files import data_url, encode_clip, encode_image, mp4_available
from .serve import MODES, add_serving_args, check_serving_args, make_scheduler, measure_floor, resolve_processes
from .serve_app import DEFAULT_ROWS, FD_RESERVE, ROWS, raise_open_files

if TYPE_CHECKING:
    from .session import Session

MAX_PROMPTS = 100_000
MIN_RATE = 0.01  # requests per second: one every 100 s; slower, 100 prompts would take hours
MAX_RATES = 16  # rates in one sweep: each is a full run of --num-prompts requests
PIXEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HOST_SHARE = 0.5  # the request bodies are built before timing: at most half of this machine's memory
Send = Callable[[int], Awaitable["Outcome"]]


SERVER_PHASES = ("read", "decode", "preprocess", "queue", "host_to_device", "encode", "serialise")
BODIES = ("media", "pixels")
DEFAULT_BUCKETS = "{(224, 224, 8): 1.0}"


@dataclass(frozen=True)
class Outcome:
    """One request: whether it came back right or was refused (429, 503), when it was sent and answered
    (perf_counter s), its queue delay, and the server's split of its time (ms, ``Server-Timing``)."""

    ok: bool
    sent: float
    done: float
    queue_ms: float | None = None
    error: str | None = None
    refused: bool = False
    timing_ms: dict[str, float] | None = None


def server_timing(header: str | None) -> dict[str, float] | None:
    """``Server-Timing: read;dur=1.2, decode;dur=3.4`` → {"read": 1.2, "decode": 3.4} (ms); None if absent."""
    if not header:
        return None
    out = {}
    for entry in header.split(","):
        name, _, rest = entry.strip().partition(";")
        if rest.startswith("dur="):
            try:
                out[name] = float(rest[4:])
            except ValueError:
                continue
    return out or None


@dataclass(frozen=True)
class Rate:
    """A request rate of a sweep: ``per_s`` requests a second (math.inf: all at once), or ``share`` of the
    saturated rate — the requests/s the same mode's ``inf`` run of this sweep achieved (run before any share)."""

    per_s: float = math.inf
    share: float | None = None

    def __str__(self) -> str:
        if self.share is not None:
            return f"{self.share * 100:g}%"
        return "inf" if math.isinf(self.per_s) else f"{self.per_s:g}"


def parse_rates(text: str) -> list[Rate]:
    """``"inf"``, ``"10, 50,inf"`` or ``"inf,10%,50%,90%"`` → the sweep's rates: requests per second (each ≥
    MIN_RATE, or inf for no pacing) or shares of the saturated rate (in (0, 100] %, with inf in the sweep)."""
    rates = []
    for word in text.replace(",", " ").split():
        what = f"request rate {shown(word, 40)}"
        if word.endswith("%"):
            try:
                share = float(word[:-1]) / 100
            except ValueError:
                raise argparse.ArgumentTypeError(f"{what} is not a percentage of the saturated rate") from None
            if not 0 < share <= 1:
                raise argparse.ArgumentTypeError(f"{what}: a share of the saturated rate lies in (0, 100]%")
            rates.append(Rate(share=share))
            continue
        try:
            rate = float(word)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} is not a number, inf or a percentage") from None
        if not rate >= MIN_RATE:
            raise argparse.ArgumentTypeError(f"{what} must be at least {MIN_RATE:g} per second (or inf)")
        if math.isinf(rate) and word.lower().lstrip("+") not in ("inf", "infinity"):
            raise argparse.ArgumentTypeError(f"{what} is too large for a float: write inf for no pacing")
        rates.append(Rate(rate))
    if not rates:
        raise argparse.ArgumentTypeError("no request rate given")
    if len(rates) > MAX_RATES:
        raise argparse.ArgumentTypeError(f"{len(rates)} request rates: at most {MAX_RATES} in one sweep")
    if any(r.share is not None for r in rates) and Rate() not in rates:
        raise argparse.ArgumentTypeError("a rate given as a share of the saturated rate needs inf in the sweep "
                                         "(the run that measures saturation)")
    return rates


def sweep_order(rates: list[Rate]) -> list[Rate]:
    """The order a sweep runs in: the rates per second as given (inf among them), then the shares of saturation."""
    return [r for r in rates if r.share is None] + [r for r in rates if r.share is not None]


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each of ``n`` requests is sent: all at 0 for an infinite rate; otherwise
    gaps ~ Gamma(shape=burstiness, scale=1/(rate·burstiness)) after each request, as vLLM's ``get_request``."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


# ---- the workload ----------------------------------------------------------------------------------------------
@dataclass
class Workload:
    grids: list[np.ndarray]  # per request, [items, 3]
    item_tokens: list[list[int]]  # per request, per item
    layouts: list[int]  # per request: its index into ``pixels`` (requests of the same grids share pixels)
    pixels: list[torch.Tensor]  # per distinct layout
    settings: dict[str, Any]
    items: list[list[MMItem]] | None = None  # per request: the sizes drawn (what media bodies are made of)

    @property
    def tokens(self) -> list[int]:
        return [sum(t) for t in self.item_tokens]

    def distinct_grids(self) -> list[np.ndarray]:
        first = {i: g for g, i in reversed(list(zip(self.grids, self.layouts, strict=True)))}
        return [first[i] for i in range(len(first))]


def build_workload(args: argparse.Namespace) -> Workload:
    """The requests, drawn as ``bench`` draws them, and one seeded tensor of pixel rows per distinct layout."""
    if args.workload:
        p = PRESETS[args.workload]
        buckets, n, ratio, limit = dict(p.bucket_config), p.items_per_request, p.range_ratio, p.limit_per_request
    else:
        buckets = dict(args.bucket_config if args.bucket_config is not None else bucket_config_arg(DEFAULT_BUCKETS))
        n, ratio, limit = args.items_per_request or 1, args.range_ratio or 0.0, args.limit_per_request
    requests = [r for r in random_mm_workload(buckets, args.num_prompts, n, ratio, args.seed, limit) if r]
    if not requests:
        raise ValueError("the workload drew no items (raise --items-per-request or lower --range-ratio)")
    grids = [np.array([item.grid for item in r], dtype=np.int64) for r in requests]
    index: dict[bytes, int] = {}
    layouts = [index.setdefault(g.tobytes(), len(index)) for g in grids]
    workload = Workload(grids, [[item.spec.tokens for item in r] for r in requests], layouts, [], items=requests,
                        settings={
        "workload": args.workload, "bucket_config": {str(k): v for k, v in buckets.items()}, "items_per_request": n,
        "range_ratio": ratio, "limit_per_request": limit, "num_prompts": args.num_prompts, "requests": len(requests),
        "seed": args.seed})
    if args.body == "media" and not args.in_process:
        return workload  # media bodies are made from the sizes: media_bodies
    config, dtype = VisionConfig(), PIXEL_DTYPES[args.pixel_dtype]  # GLM-4V's patch geometry: rows of 1176
    distinct = workload.distinct_grids()
    nbytes = sum(int(g.prod(axis=1).sum()) for g in distinct) * config.patch_dim * dtype.itemsize
    if nbytes > HOST_SHARE * device_memory_bytes("cpu"):
        raise ValueError(f"the workload's distinct requests need {nbytes / 2**30:,.1f} GiB of pixels, more than half "
                         "of this machine's memory: fewer or smaller requests")
    workload.pixels = [random_batch(g, config, seed=args.seed + i)[0].to(dtype) for i, g in enumerate(distinct)]
    return workload


# ---- the targets -----------------------------------------------------------------------------------------------
def answer_error(body: bytes | bytearray, tokens: list[int], width: int) -> str | None:
    """Why an answer is not one [tokens_i, width] tensor per item (None when it is): read from its header alone."""
    try:
        size = int.from_bytes(body[:8], "little")
        header = json.loads(body[8 : 8 + size])
    except (ValueError, UnicodeDecodeError):
        return "the answer is not a safetensors file"
    shapes = {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    want = {f"item_{i}": [t, width] for i, t in enumerate(tokens)}
    return None if shapes == want else f"the answer holds {shapes}, not {want}"


def media_bodies(workload: Workload, seed: int) -> tuple[list[bytes], dict[str, Any]]:
    """One JSON body of content parts per distinct layout (random noise pictures as JPEG, clips as MP4, or GIF
    without PyAV, seeded by layout and item), and what was made. Each (size, frames) is first checked to decode,
    through the server's own preprocessing, to the grid the workload drew for it."""
    from .serve_media import MediaLimits, prepare_media

    assert workload.items is not None
    clip_format = "mp4" if mp4_available() else "gif"
    first: dict[int, list[MMItem]] = {}
    for items, layout in zip(workload.items, workload.layouts, strict=True):
        first.setdefault(layout, items)
    checked: set[tuple[int, int, int]] = set()
    bodies = []
    for layout in range(len(first)):
        parts = []
        for k, item in enumerate(first[layout]):
            rng = np.random.default_rng([seed, layout, k])
            if item.num_frames == 1:
                data = encode_image(rng.integers(0, 256, (item.height, item.width, 3), dtype=np.uint8))
                part = {"type": "image_url", "image_url": {"url": data_url(data, "jpeg")}}
            else:
                frames = rng.integers(0, 256, (item.num_frames, item.height, item.width, 3), dtype=np.uint8)
                data = encode_clip(frames, clip_format)
                part = {"type": "video_url", "video_url": {"url": data_url(data, clip_format)}}
            key = (item.height, item.width, item.num_frames)
            if key not in checked:
                body = json.dumps({"content": [part]}).encode()
                limits = MediaLimits(max_request_pixels=2**40)
                got = prepare_media("json", body, limits, VisionConfig().merge_area).grid_thw.tolist()
                if got != [list(item.grid)]:
                    raise ValueError(f"a {item.height}×{item.width} {'picture' if item.num_frames == 1 else 'clip of '}"
                                     f"{'' if item.num_frames == 1 else f'{item.num_frames} frames'} decodes to grid "
                                     f"{got[0]}, not {list(item.grid)}: send --body pixels")
                checked.add(key)
            parts.append(part)
        bodies.append(json.dumps({"content": parts}).encode())
    made = {"image": "jpeg", "video": clip_format, "bytes_per_request_mean": float(np.mean(
        [len(bodies[j]) for j in workload.layouts]))}
    return bodies, made


READ_BUFFER = 16 << 20  # bytes a response may buffer before reading pauses


MAX_SIZED_ANSWER = 1 << 30  # bytes: the largest Content-Length read_body allocates up front (answers are megabytes)


async def read_body(response: aiohttp.ClientResponse) -> bytes | bytearray:
    """``response``'s body. One with a Content-Length and no Content-Encoding is read into one ``bytearray`` of that
    length, each chunk aiohttp's reader holds (``readchunk``: the chunks as they came off the socket, never joined)
    copied into its place: one copy of each byte, and at most the answer and the chunks not read yet held at once.
    ``response.read()`` joins the chunks buffered at each wake-up (``readany``), then every block at the end: up to
    twice the answer held, and copied twice. A coded body (aiohttp inflates it: its length is not the Content-Length)
    or one without a length, or one declaring more than :data:`MAX_SIZED_ANSWER` bytes (never allocated on a
    server's word), is read by ``read()``. A body that ends short of its Content-Length is an
    ``aiohttp.ClientPayloadError``."""
    length = response.content_length
    coding = response.headers.get("Content-Encoding", "identity").strip().lower()
    if length is None or length > MAX_SIZED_ANSWER or coding not in ("", "identity"):
        return await response.read()
    body = bytearray(length)
    filled = 0
    with memoryview(body) as view:
        while filled < length:
            chunk, _ = await response.content.readchunk()
            if not chunk:
                if response.content.at_eof():
                    raise aiohttp.ClientPayloadError(f"the answer ended after {filled:,} of its {length:,} bytes "
                                                     "(Content-Length)")
                continue  # the end of an HTTP chunk: no data
            view[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
    return body


class HttpTarget:
    """Requests to a running server: one pre-built body per distinct layout (JSON media or safetensors pixels)."""

    def __init__(self, url: str, workload: Workload, health: dict, response_dtype: str, timeout: float,
                 bodies: list[bytes] | None = None):
        self.url, self.workload, self.health = url.rstrip("/"), workload, health
        self.width = int(health["vision_config"]["out_hidden_size"])
        self.content_type = "application/json" if bodies is not None else "application/x-safetensors"
        self.bodies = bodies if bodies is not None else [
            save_safetensors({"pixel_values": p, "grid_thw": torch.from_numpy(g)})
            for p, g in zip(workload.pixels, workload.distinct_grids(), strict=True)]
        self.params = {"dtype": response_dtype}
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "HttpTarget":
        # one connection per request in flight (TCPConnector(limit=0)): at rate inf every request of the run at once,
        # each an open file, so the soft limit on open files is raised as far as the hard one allows
        raise_open_files(len(self.workload.grids) + FD_RESERVE)
        # a whole answer (megabytes: one clip's float32 embeddings are 4 MiB) is read without pausing the socket
        # every 64 KiB, aiohttp's default buffer: at rate inf the client's reading, not the server, set the pace
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=self.timeout,
                                             read_bufsize=READ_BUFFER)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self.session is not None
        await self.session.close()

    async def send(self, j: int) -> Outcome:
        assert self.session is not None
        body = self.bodies[self.workload.layouts[j]]
        sent = time.perf_counter()
        try:
            async with self.session.post(f"{self.url}/v1/encode", data=body, params=self.params,
                                         headers={"Content-Type": self.content_type}) as response:
                data = await read_body(response)
                done = time.perf_counter()
                if response.status != 200:
                    try:
                        why = json.loads(data)["error"]
                    except (ValueError, KeyError, TypeError):
                        why = data[:200].decode("utf-8", "replace")
                    return Outcome(False, sent, done, error=f"HTTP {response.status}: {why}",
                                   refused=response.status in (429, 503))
                wrong = answer_error(data, self.workload.item_tokens[j], self.width)
                queue_ms = float(response.headers.get("X-Queue-Delay-Ms", "nan"))
                return Outcome(wrong is None, sent, done, queue_ms, wrong,
                               timing_ms=server_timing(response.headers.get("Server-Timing")))
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:  # one line: a message may hold line breaks
            return Outcome(False, sent, time.perf_counter(), error=" ".join(f"{type(err).__name__}: {err}".split()))

    async def server_stats(self) -> dict:
        assert self.session is not None
        async with self.session.get(f"{self.url}/metrics", params={"format": "json"}) as response:
            return (await response.json())["scheduler"]


class InProcessTarget:
    """Requests straight to a scheduler in this process (no HTTP): admission in a thread pool, as the server does."""

    def __init__(self, scheduler: BatchScheduler, workload: Workload, threads: int):
        self.scheduler, self.workload = scheduler, workload
        self.width = scheduler.model.config.out_hidden_size
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="glmvit-bench-serve")

    async def __aenter__(self) -> "InProcessTarget":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=True)

    async def send(self, j: int) -> Outcome:
        loop = asyncio.get_running_loop()
        pixels, grids = self.workload.pixels[self.workload.layouts[j]], self.workload.grids[j]
        sent = time.perf_counter()
        try:
            future = await loop.run_in_executor(self.pool, self.scheduler.submit, pixels, grids)
            result = await asyncio.wrap_future(future)
        except (QueueFull, SchedulerClosed) as err:
            return Outcome(False, sent, time.perf_counter(), error=f"{type(err).__name__}: {err}", refused=True)
        except (ValueError, RuntimeError) as err:
            return Outcome(False, sent, time.perf_counter(), error=f"{type(err).__name__}: {err}")
        done = time.perf_counter()
        shapes = [list(o.shape) for o in result.outputs]
        want = [[t, self.width] for t in self.workload.item_tokens[j]]
        timing = {"host_to_device": result.stage_s * 1e3, "queue": result.queue_s * 1e3,
                  "encode": (result.total_s - result.queue_s) * 1e3}
        return Outcome(shapes == want, sent, done, result.queue_s * 1e3,
                       None if shapes == want else f"outputs {shapes}, not {want}", timing_ms=timing)

    async def server_stats(self) -> dict:
        return self.scheduler.stats()


# ---- one run ---------------------------------------------------------------------------------------------------
async def drive(send: Send, n: int, rate: float, burstiness: float, max_concurrency: int | None,
                seed: int) -> tuple[list[Outcome], float, float]:
    """Send requests 0..n−1 at their arrival times; their outcomes, the start and the end (perf_counter s).

    Each request is started as its own task and the event loop runs once before the next is made, so a request
    due now is on the wire while the later ones are still being made. Gathering all n at once would make every
    request (≈ 0.3 ms of the client's CPU each in aiohttp) before the first byte is written: at rate inf the
    server would see nothing for the first n·0.3 ms of the run."""
    offsets = arrival_offsets(n, rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(j: int) -> Outcome:
        await asyncio.sleep(max(0.0, start + offsets[j] - time.perf_counter()))
        if limit is None:
            return await send(j)
        async with limit:
            return await send(j)

    tasks: list[asyncio.Future[Outcome]] = []
    try:
        for j in range(n):
            tasks.append(asyncio.ensure_future(one(j)))
            await asyncio.sleep(0)  # one pass of the loop: the requests started so far write while the next is made
        outcomes = await asyncio.gather(*tasks)
    except BaseException:  # cancelled or a request failed: none of this run's requests outlives it
        for task in tasks:
            task.cancel()
        raise
    return list(outcomes), start, max(o.done for o in outcomes)


def server_delta(before: dict, after: dict, duration: float) -> dict[str, Any]:
    """What the scheduler did during one run: batches, their sizes, padding, mixing, how busy it was."""
    d = {k: after[k] - before[k] for k in ("batches", "items", "tokens", "mixed_batches", "alone_batches",
                                             "budget_tokens", "packed_tokens", "busy_s", "failed_batches")}
    d["items_per_batch"] = d["items"] / d["batches"] if d["batches"] else None
    d["padding_fraction"] = 1 - d["packed_tokens"] / d["budget_tokens"] if d["budget_tokens"] else None
    d["utilisation"] = d["busy_s"] / duration if duration > 0 else None
    return d


async def run_rates(target: Any, workload: Workload, args: argparse.Namespace, mode: str,
                    floor_items_per_s: float | None) -> list[dict[str, Any]]:
    n = len(workload.grids)
    if args.warmup_requests:
        await drive(target.send, min(args.warmup_requests, n), math.inf, 1.0, None, args.seed)
    runs: list[dict[str, Any]] = []
    saturated = None  # requests/s of this mode's inf run
    for rate in sweep_order(args.request_rate):
        per_s = rate.per_s if rate.share is None else max(MIN_RATE, rate.share * (saturated or 0.0))
        before = await target.server_stats()
        outcomes, start, end = await drive(target.send, n, per_s, args.burstiness, args.max_concurrency, args.seed)
        after = await target.server_stats()
        runs.append(run_record(mode, per_s, args, workload, outcomes, end - start, server_delta(before, after,
                                                                                                 end - start),
                               floor_items_per_s))
        runs[-1]["saturation_share"] = rate.share
        if rate == Rate():
            saturated = runs[-1]["requests_per_s"]
        print_run(runs[-1])
    return runs


def run_record(mode: str, rate: float, args: argparse.Namespace, workload: Workload, outcomes: list[Outcome],
               duration: float, server: dict, floor_items_per_s: float | None) -> dict[str, Any]:
    """One run's record. ``vs_floor``: the successful items per second of the run's wall time, as a share of the
    floor-limited rate; ``steady_vs_floor``: :func:`glmvit.timing.steady_rate` (the rate once the pipeline is full,
    the answers between the 10th and 90th percentile of their times) as that share;
    ``encoder_bound_vs_floor``: the items over the scheduler's busy time only (the rate had the encoder never waited
    for work), as a share of that rate — the ceiling no client or HTTP path can lift."""
    ok = [j for j, o in enumerate(outcomes) if o.ok]
    steady = steady_rate((o.done, len(g)) for o, g in zip(outcomes, workload.grids, strict=True) if o.ok)
    items = sum(len(workload.grids[j]) for j in ok)
    tokens = sum(workload.tokens[j] for j in ok)
    tte = [(outcomes[j].done - outcomes[j].sent) * 1e3 for j in ok]
    queue = [q for j in ok if (q := outcomes[j].queue_ms) is not None]
    errors = collections.Counter(o.error for o in outcomes if o.error)
    items_per_s = items / duration if duration > 0 else 0.0
    refused = sum(o.refused for o in outcomes)
    return {
        "mode": mode, "request_rate": "inf" if math.isinf(rate) else rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "requests": len(outcomes), "successful": len(ok),
        "refused": refused, "failed": len(outcomes) - len(ok) - refused, "errors": dict(errors.most_common(10)),
        "time_split_ms": time_split([outcomes[j] for j in ok]), "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0, "items_per_s": items_per_s,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
        "vs_floor": items_per_s / floor_items_per_s if floor_items_per_s else None,
        "steady_items_per_s": steady,
        "steady_vs_floor": steady / floor_items_per_s if floor_items_per_s and steady is not None else None,
        "encoder_bound_vs_floor": (items / server["busy_s"] / floor_items_per_s
                                   if floor_items_per_s and server.get("busy_s") else None),
        "tte_ms": distribution(tte), "queue_ms": distribution(queue), "server": server,
        "per_request": {"ok": [o.ok for o in outcomes], "sent_s": [o.sent - outcomes[0].sent for o in outcomes],
                        "tte_ms": [(o.done - o.sent) * 1e3 for o in outcomes],
                        "queue_ms": [o.queue_ms for o in outcomes],
                        # each request's split as the server sent it (Server-Timing, ms; None: none came, a failure):
                        # the tail's requests studied one by one, where time_split_ms has only the means
                        "timing_ms": [o.timing_ms for o in outcomes]},
    }


def time_split(outcomes: list[Outcome]) -> dict[str, float] | None:
    """The mean of each phase of the server's split over ``outcomes`` (ms), and ``write``: the mean rest of their
    time to embedding (None without a split: a server that sends none)."""
    timed = [o for o in outcomes if o.timing_ms]
    if not timed:
        return None
    out = {p: float(np.mean([o.timing_ms.get(p, 0.0) for o in timed if o.timing_ms])) for p in SERVER_PHASES}
    rest = [(o.done - o.sent) * 1e3 - sum(o.timing_ms.values()) for o in timed if o.timing_ms]
    out["write"] = float(np.mean(rest))
    return out


# ---- the report ------------------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def rate_label(r: dict[str, Any]) -> str:
    """A run's rate as configured: "inf", "12.5", or "12.5 (50%)" for a share of the saturated rate."""
    rate = r["request_rate"] if isinstance(r["request_rate"], str) else f"{r['request_rate']:.3g}"
    share = r.get("saturation_share")
    return rate if share is None else f"{rate} ({share * 100:g}%)"


def print_run(r: dict[str, Any]) -> None:
    lines = [
        f"{' Serving Benchmark Result: ' + r['mode'] + ' ':=^52}",
        f"{'Successful requests:':<40}{r['successful']:>12}",
        f"{'Refused requests (429, 503):':<40}{r['refused']:>12}",
        f"{'Failed requests:':<40}{r['failed']:>12}",
        f"{'Maximum request concurrency:':<40}{str(r['max_concurrency']):>12}",
        f"{'Request rate configured (RPS):':<40}{rate_label(r):>12}",
        f"{'Benchmark duration (s):':<40}{r['duration_s']:>12.2f}",
        f"{'Request throughput (req/s):':<40}{r['requests_per_s']:>12.2f}",
        f"{'Item throughput (items/s):':<40}{r['items_per_s']:>12.2f}",
        f"{'Token throughput (tok/s):':<40}{r['tokens_per_s']:>12.1f}",
    ]
    if r["vs_floor"] is not None:
        lines.append(f"{'Items/s vs the floor-limited rate:':<40}{r['vs_floor']:>12.1%}")
    if r.get("steady_vs_floor") is not None and r["request_rate"] == "inf":  # the middle 80 % of the answers: the
        # rate once the pipeline is full (at a finite rate it would only repeat the rate sent)
        lines.append(f"{'The same, once full (answers 10-90 %):':<40}{r['steady_vs_floor']:>12.1%}")
    if r.get("encoder_bound_vs_floor") is not None:  # the items over the encoder's busy time: its own ceiling
        lines.append(f"{'Items/s while encoding, vs that rate:':<40}{r['encoder_bound_vs_floor']:>12.1%}")
    for title, key in (("Time to Embedding", "tte_ms"), ("Queueing Delay", "queue_ms")):
        lines.append(f"{' ' + title + ' ':-^52}")
        short = "TTE" if key == "tte_ms" else "queue delay"
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            lines.append(f"{f'{label} {short} (ms):':<40}{_ms(r[key][stat]):>12}")
    if r.get("time_split_ms"):
        lines.append(f"{' Time split (mean ms) ':-^52}")
        for phase, value in r["time_split_ms"].items():
            lines.append(f"{phase + ':':<40}{value:>12.2f}")
    s = r["server"]
    lines.append(f"{' Batches ':-^52}")
    batches = f"{s['batches']} ({s['mixed_batches']})"
    lines.append(f"{'Batches (mixing requests):':<40}{batches:>12}")
    lines.append(f"{'Items per batch:':<40}{_ms(s['items_per_batch']):>12}")
    pad = s["padding_fraction"]
    lines.append(f"{'Padding of budget tokens:':<40}{'-' if pad is None else f'{pad:.1%}':>12}")
    lines.append("=" * 52)
    for error, count in r["errors"].items():
        lines.append(f"  {count} × {error}")
    print("\n".join(lines), flush=True)


def print_summary(runs: list[dict[str, Any]]) -> None:
    head = f"{'mode':<16}{'rate':>13}{'ok':>6}{'ref':>5}{'fail':>5}{'req/s':>8}{'items/s':>9}{'%floor':>8}" \
           f"{'steady':>8}{'TTE med':>9}{'P99':>9}{'queue med':>10}{'P99':>9}{'items/b':>8}{'pad':>6}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in runs:
        rate = rate_label(r)
        floor = "-" if r["vs_floor"] is None else f"{r['vs_floor']:.0%}"
        steady = "-" if r.get("steady_vs_floor") is None or rate != "inf" else f"{r['steady_vs_floor']:.0%}"
        pad = r["server"]["padding_fraction"]
        print(f"{r['mode']:<16}{rate:>13}{r['successful']:>6}{r['refused']:>5}{r['failed']:>5}{r['requests_per_s']:>8.2f}"
              f"{r['items_per_s']:>9.1f}{floor:>8}{steady:>8}{_ms(r['tte_ms']['median']):>9}"
              f"{_ms(r['tte_ms']['p99']):>9}"
              f"{_ms(r['queue_ms']['median']):>10}{_ms(r['queue_ms']['p99']):>9}"
              f"{_ms(r['server']['items_per_batch']):>8}{'-' if pad is None else f'{pad:.0%}':>6}")
    print("(%floor: items/s as a share of the floor-limited rate, not bench's ×floor; steady: the same over the "
          "answers between the 10th and 90th percentile of their times (the pipeline full); ref: refused, 429 or 503; "
          "TTE: time to embedding, ms; queue: the server's queueing delay, ms; items/b: "
          "items per batch; pad: padded share of budget tokens)")


# ---- servers ---------------------------------------------------------------------------------------------------
def floor_rate(health: dict, workload: Workload) -> dict[str, Any] | None:
    """The floor-limited items/s: the server's measured matmul rate over the mean analytic FLOPs per item."""
    floor = health.get("floor")
    if not floor:
        return None
    config = VisionConfig(**health["vision_config"])
    flops = [flops_breakdown(config, g[None])["total"] for grids in workload.grids for g in grids]
    mean = float(np.mean(flops))
    return {**floor, "mean_flops_per_item": mean, "items_per_s": floor["matmul_tflops"] * 1e12 / mean,
            "definition": "measured matmul rate / mean analytic FLOPs per item (glmvit.floor)"}


class SpawnedServer:
    """``python -m glmvit serve`` as a child process on 127.0.0.1 with an ephemeral port; its URL once it listens."""

    def __init__(self, argv: list[str], startup_timeout: float):
        self.argv, self.startup_timeout = argv, startup_timeout
        self.process: subprocess.Popen | None = None
        self.url: str | None = None

    def __enter__(self) -> "SpawnedServer":
        self.process = process = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        assert process.stdout is not None
        stdout = process.stdout
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.startup_timeout)
        if not line or "listening on " not in line[0]:
            self.__exit__()
            said = line[0].strip() if line and line[0].strip() else "no output"
            if process.returncode not in (None, -signal.SIGTERM):  # it ended by itself: its stderr said why
                raise OSError(f"the spawned server exited with status {process.returncode} before it listened "
                              f"({said})")
            raise TimeoutError(f"the spawned server did not start listening within {self.startup_timeout:g} s "
                               f"(--startup-timeout; {said})")
        self.url = line[0].split("listening on ")[1].split()[0]
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)  # drains: requests in flight finish
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve_argv(args: argparse.Namespace, mode: str, workload: Workload) -> list[str]:
    """The child server's command line: this command's model and batching flags, a queue for every request."""
    body_mb = max([64.0, *(2 * p.numel() * p.element_size() / 2**20 for p in workload.pixels)])
    argv = [sys.executable, "-m", "glmvit", "serve", "--host", "127.0.0.1", "--port", "0", "--mode", mode,
            "--device", args.device, "--config", args.config, "--dtype", args.dtype, "--seed", str(args.seed),
            "--max-wait-ms", str(args.max_wait_ms), "--switch-interval-ms", str(args.switch_interval_ms),
            "--max-queue", str(queue_requests(args, workload)),
            "--max-queue-tokens", str(queue_tokens(args, workload)), "--max-queue-mb", str(args.max_queue_mb),
            "--max-body-mb", f"{body_mb:.1f}",
            "--max-items-per-request", str(max(64, max(len(g) for g in workload.grids))), "--quiet"]
    if args.weights:
        argv += ["--weights", args.weights]
    for flag, value in (("--budgets", ",".join(map(str, args.budgets)) if args.budgets else None),
                        ("--max-items", args.max_items), ("--max-segments", args.max_segments),
                        ("--attn-backend", args.attn_backend), ("--decode-workers", args.decode_workers),
                        ("--api-servers", args.api_servers), ("--rows", args.rows),
                        ("--uniform-lengths", ",".join(map(str, args.uniform_lengths)) or None)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def queue_requests(args: argparse.Namespace, workload: Workload) -> int:
    """The queue a run needs so that a burst (rate inf) is queued, not refused: unless --max-queue says less."""
    return args.max_queue if args.max_queue_set else max(args.max_queue, len(workload.grids) + args.warmup_requests)


def queue_tokens(args: argparse.Namespace, workload: Workload) -> int:
    return args.max_queue_tokens or max(sum(workload.tokens), 64 * 4096)


async def fetch_health(url: str, wait_s: float = 0.0) -> dict:
    """The server's ``/v1/info``; while nothing listens at ``url`` yet, tried again twice a second for up to
    ``wait_s`` seconds (a server still capturing its graphs), then the connection error is raised."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async with session.get(url.rstrip("/") + "/v1/info") as response:
                    if response.status != 200:
                        raise ValueError(f"{url}/v1/info answered {response.status}: is it a glmvit serve?")
                    return await response.json()
        except aiohttp.ClientConnectorError:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


async def bench_http(url: str, workload: Workload, args: argparse.Namespace, record: dict[str, Any]) -> None:
    health = await fetch_health(url, args.wait_s)
    mode = health["mode"]
    batching = record["settings"]["batching"]
    if batching.get("rows") is None:  # a server someone else started: where it makes rows is its /v1/info's word
        batching["rows"] = health.get("rows")
    floor = floor_rate(health, workload)
    record["servers"][mode], record["floor"][mode] = health, floor
    async with HttpTarget(url, workload, health, args.response_dtype, args.timeout, args.media_bodies) as target:
        record["runs"] += await run_rates(target, workload, args, mode, floor["items_per_s"] if floor else None)


async def bench_in_process(workload: Workload, args: argparse.Namespace, record: dict[str, Any],
                           session: Session | None = None) -> None:
    """Each mode's scheduler driven in this process (no HTTP); a ``session`` (a record run) lends its tower, its
    measured floor and the runners earlier jobs captured."""
    model = model_from_args(args) if session is None else session.model(args)
    attention = model.attention_backend(args.attn_backend)  # a clear error if it cannot run here
    floor = measure_floor(model, None if session is None else session.floor(model.device, model.dtype, None))
    health = {"vision_config": vars(model.config), "floor": floor}
    for mode in args.modes:
        scheduler, runner = make_scheduler(model, mode, _queue_args(args, workload), attention=attention,
                                           session=session)
        label = scheduler.mode
        record["servers"][label] = {"mode": label, "attn_backend": scheduler.encoder.attention,
                                    "uniform_lengths": list(runner.uniform_lengths) if runner else [],
                                    "limits": scheduler.stats()["limits"],
                                    "capture": {str(k): v.as_dict() for k, v in runner.captures.items()}
                                    if runner else None}
        if session is not None and runner is not None and (source := session.source_of(runner)) is not None:
            record["servers"][label]["runner_source"] = source  # a record run's earlier job captured it
        rate = floor_rate(health, workload)
        record["floor"][label] = rate
        try:
            async with InProcessTarget(scheduler, workload, args.threads) as target:
                record["runs"] += await run_rates(target, workload, args, label, rate["items_per_s"] if rate else None)
        finally:
            scheduler.close()
        del scheduler, runner
        if model.device.type == "cuda":
            torch.cuda.empty_cache()


def resolve_uniform(args: argparse.Namespace, workload: Workload) -> str | None:
    """Set ``args.uniform_lengths`` to the segment lengths the server (``--spawn``) or the in-process scheduler
    captures uniform graphs for, and return how they were chosen: ``given`` (``--uniform-lengths``), ``off`` (none)
    or ``auto`` (the default: the workload's lengths where they pay, :func:`~glmvit.uniform.planned_uniform_lengths`,
    the rule ``bench`` captures by, for the model's device and dtype; none when no mode captures graphs); None at
    ``--url`` (that server has its own)."""
    if args.url:
        return None
    if args.uniform_lengths:
        return "given"
    if args.uniform_graphs == "off":
        return "off"
    if all(mode == RunMode.EAGER for mode in args.modes):
        return "auto"  # an eager forward replays no graph: no lengths to capture
    dtype = str(DTYPES[args.dtype]).removeprefix("torch.")
    args.uniform_lengths = planned_uniform_lengths(
        ((int(h) * int(w), int(t)) for g in workload.grids for t, h, w in g), torch.device(args.device).type, dtype,
        args.attn_backend)
    return "auto"


def _queue_args(args: argparse.Namespace, workload: Workload) -> argparse.Namespace:
    copy = argparse.Namespace(**vars(args))
    copy.max_queue, copy.max_queue_tokens = queue_requests(args, workload), queue_tokens(args, workload)
    return copy


# ---- the command -----------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m glmvit bench-serve", description=(__doc__ or "").split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(__doc__ or "").split("\n\n", 1)[1])
    t = p.add_argument_group("target (one of)")
    where = t.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running glmvit serve, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", action="store_true", help="start python -m glmvit serve per mode (a child process)")
    where.add_argument("--in-process", action="store_true", help="drive the scheduler in this process (no HTTP)")
    t.add_argument("--modes", default=None, help=f"with --spawn / --in-process: comma list of {', '.join(MODES)} "
                   "(default graph)")
    t.add_argument("--decode-workers", type=int_in(1, 256), default=None,
                   help="--spawn: the server's processes that decode media (default: the server's: "
                        "glmvit.cli.serve_app.default_decode_workers)")
    t.add_argument("--api-servers", type=int_in(1, 64), default=None,
                   help="--spawn: the server's HTTP processes in front of its engine (default: the server's: "
                        "glmvit.cli.serve_frontends.default_api_servers)")
    t.add_argument("--rows", choices=ROWS, default=None,
                   help="--spawn: where the server makes media's pixel rows, its engine on the model's device or its "
                        f"decode processes (serve --rows; default: the server's, {DEFAULT_ROWS})")
    t.add_argument("--uniform-graphs", choices=("auto", "off"), default=None,
                   help="--spawn / --in-process, unless --uniform-lengths names them: auto (default) = uniform graphs "
                        "for the workload's segment lengths, as bench captures them "
                        "(glmvit.uniform.planned_uniform_lengths); off = none")
    t.add_argument("--wait-s", type=float_in(0, 7200), default=0.0,
                   help="--url: seconds to keep trying a server that does not listen yet (default 0: fail at once)")
    t.add_argument("--startup-timeout", type=float_in(1, 7200), default=1800.0,
                   help="seconds a spawned server may take to capture and listen (default 1800)")
    w = p.add_argument_group("workload (vLLM random-mm)")
    w.add_argument("--workload", choices=list(PRESETS),
                   help="a named preset: " + "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()))
    w.add_argument("--bucket-config", "--random-mm-bucket-config", type=bucket_config_arg, default=None,
                   help=f"{{(height, width, frames): probability, ...}} (default: {DEFAULT_BUCKETS}, one 8-frame 224² "
                   "clip); this and the next three are the preset's with --workload, and refused there")
    w.add_argument("--items-per-request", "--random-mm-base-items-per-request", type=int_in(1, 4096), default=None,
                   help="default 1")
    w.add_argument("--range-ratio", "--random-mm-num-mm-items-range-ratio", type=float_in(0, 1), default=None,
                   help="default 0")
    w.add_argument("--limit-per-request", "--random-mm-limit-mm-per-prompt", type=int_in(1, 4096), default=None)
    w.add_argument("--num-prompts", "--num-requests", type=int_in(1, MAX_PROMPTS), default=100)
    w.add_argument("--body", choices=BODIES, default="media",
                   help="what a request carries: media (default: JSON content parts of data: URLs, JPEG pictures and "
                        "MP4 clips, decoded by the server) or pixels (safetensors pixel rows); --in-process: pixels")
    w.add_argument("--pixel-dtype", choices=list(PIXEL_DTYPES), default="float32",
                   help="--body pixels: dtype of the pixel rows sent (default float32, what glmvit.processing makes)")
    a = p.add_argument_group("load")
    a.add_argument("--request-rate", type=parse_rates, default=[Rate()],
                   help="requests per second, inf (all at once), or a share of the saturated rate (50%%: half the "
                        "requests/s the sweep's inf run achieved); a comma list is a sweep (default inf)")
    a.add_argument("--burstiness", type=float_in(1e-3, 1e3), default=1.0,
                   help="gamma shape of the gaps between arrivals (1: Poisson, as vLLM)")
    a.add_argument("--max-concurrency", type=int_in(1, MAX_PROMPTS), default=None, help="requests in flight at most")
    a.add_argument("--warmup-requests", type=int_in(0, MAX_PROMPTS), default=8,
                   help="untimed requests sent at once before each mode's runs (default 8)")
    a.add_argument("--timeout", type=float_in(1, 36000), default=600.0, help="seconds one request may take")
    a.add_argument("--response-dtype", choices=("float32", "model"), default="float32",
                   help="dtype of the answers (the server's ?dtype=; default float32, encode --out's)")
    a.add_argument("--threads", type=int_in(1, 256), default=min(8, os.cpu_count() or 1),
                   help="--in-process: threads that admit requests (default min(8, CPUs))")
    add_model_args(p)
    add_serving_args(p, uniform_default="--uniform-graphs")
    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", type=output_path,
                   help="write every number and setting, with provenance, to this JSON")
    return p


def check_url(parser: argparse.ArgumentParser, url: str) -> None:
    """A usage error unless ``url`` is http(s)://HOST[:PORT] (the error says what is wrong with it)."""
    try:
        where = urlsplit(url)
        where.port  # noqa: B018 - parsed here: a port out of range or not a number raises ValueError
    except ValueError as err:
        parser.error(f"--url {shown(url)}: not a URL ({err}); expected http://HOST:PORT")
    if where.scheme not in ("http", "https") or not where.hostname:
        parser.error(f"--url {shown(url)}: expected http://HOST:PORT")


# the flags that configure the server bench-serve starts (--spawn; the uniform ones also --in-process's scheduler):
# a running one has its own, so a client sent at a URL drops them
SPAWN_ONLY = ("--decode-workers", "--api-servers", "--rows", "--uniform-lengths", "--uniform-graphs")


def client_argv(argv: list[str]) -> list[str]:
    """``argv`` without the flags that configure a spawned server (:data:`SPAWN_ONLY`, as ``--flag value`` or
    ``--flag=value``): what a load generator sent at a server someone else started takes."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in SPAWN_ONLY:
            skip = True
        elif not arg.startswith(tuple(f"{flag}=" for flag in SPAWN_ONLY)):
            out.append(arg)
    return out


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    args.max_queue_set = any(a == "--max-queue" or a.startswith("--max-queue=") for a in argv)
    if args.url and args.modes is not None:
        parser.error("--modes applies to --spawn and --in-process (a running server has its own mode)")
    if args.decode_workers is not None and not args.spawn:
        parser.error("--decode-workers applies to --spawn (a running server has its own; --in-process decodes nothing)")
    if args.api_servers is not None and not args.spawn:
        parser.error("--api-servers applies to --spawn (a running server has its own; --in-process has no HTTP)")
    if args.rows is not None and not args.spawn:
        parser.error("--rows applies to --spawn (a running server has its own; --in-process decodes nothing)")
    if (args.uniform_lengths or args.uniform_graphs) and args.url:
        parser.error("--uniform-lengths and --uniform-graphs apply to --spawn and --in-process (a running server has "
                     "its own)")
    if args.uniform_lengths and args.uniform_graphs:
        parser.error("--uniform-lengths names the lengths: --uniform-graphs then has nothing to choose")
    refuse_preset_flags(parser, args)
    if args.url:
        check_url(parser, args.url)
    try:
        # each mode once (a record holds one result a mode); an empty --modes is no mode, not the default
        args.modes = list(dict.fromkeys(("graph" if args.modes is None else args.modes).replace(",", " ").split()))
        bad = [m for m in args.modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
        if not args.modes:
            raise ValueError(f"--modes names no mode; choose from {', '.join(MODES)}")
        if args.json:
            check_writable(args.json)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    resolve_model_args(parser, args)
    if not args.url:
        check_serving_args(parser, args, args.modes)
    if args.spawn:  # the counts the child runs, passed to it and named in the record (not the server's unsaid defaults)
        resolve_processes(args)
        args.rows = args.rows or DEFAULT_ROWS


def main(argv: list[str] | None = None, session: Session | None = None) -> int:
    """The command; with ``--in-process``, a ``session`` (a record run) lends its tower, floor and runners."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args, argv)
    command = " ".join([sys.executable, "-m", "glmvit", "bench-serve", *argv])
    workload = build_workload(args)
    uniform_graphs = resolve_uniform(args, workload)
    body = "pixels" if args.in_process else args.body
    made_at = time.perf_counter()
    args.media_bodies, made = media_bodies(workload, args.seed) if body == "media" else (None, None)
    if made is not None:  # in the record's settings: a serve job's time not spent serving
        made["made_s"] = round(time.perf_counter() - made_at, 2)
    target = "url" if args.url else "spawn" if args.spawn else "in-process"
    record: dict[str, Any] = {
        "settings": {"target": target, "url": args.url, "modes": None if args.url else args.modes,
                     **workload.settings, "request_rates": [r.per_s if r.share is None and math.isfinite(r.per_s)
                                                            else str(r) for r in args.request_rate],
                     "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                     "warmup_requests": args.warmup_requests, "body": body, "media": made,
                     "pixel_dtype": args.pixel_dtype if body == "pixels" else None,
                     "response_dtype": args.response_dtype, "timeout_s": args.timeout,
                     "model": {"device": args.device, "config": args.config, "dtype": args.dtype,
                               "weights": args.weights, "seed": args.seed},
                     "batching": {"budgets": list(args.budgets) if args.budgets else None, "max_items": args.max_items,
                                  "max_segments": args.max_segments, "max_wait_ms": args.max_wait_ms,
                                  "switch_interval_ms": args.switch_interval_ms,
                                  "max_queue": queue_requests(args, workload),
                                  "max_queue_tokens": queue_tokens(args, workload), "max_queue_mb": args.max_queue_mb,
                                  "attn_backend": args.attn_backend,
                                  "uniform_graphs": uniform_graphs,
                                  "uniform_lengths": None if args.url else list(args.uniform_lengths),
                                  "decode_workers": args.decode_workers,
                                  "api_servers": args.api_servers, "rows": args.rows},
                     "arrivals": "gamma(burstiness, 1/(rate·burstiness)) gaps after each request, all at 0 for inf",
                     "timing": "time to embedding: request sent → whole answer read; queue: the server's "
                               "X-Queue-Delay-Ms; time split: the server's Server-Timing, write the rest; "
                               "per_request.timing_ms: each request's Server-Timing (ms), null where none came"},
        "workload": {"requests": len(workload.grids), "items": sum(len(g) for g in workload.grids),
                     "tokens": sum(workload.tokens), "distinct_layouts": len(set(workload.layouts)),
                     "grids": [g.tolist() for g in workload.grids]},
        "servers": {}, "floor": {}, "runs": [],
    }
    if args.url:
        asyncio.run(bench_http(args.url, workload, args, record))
    elif args.spawn:
        for mode in args.modes:
            with SpawnedServer(serve_argv(args, mode, workload), args.startup_timeout) as server:
                assert server.url is not None
                asyncio.run(bench_http(server.url, workload, args, record))
    else:
        asyncio.run(bench_in_process(workload, args, record, session))
    provenance = bench_provenance(record, args, command)
    fingerprint = fingerprint_now()  # this process's code, and each server's (it measured theirs)
    for server in record["servers"].values():
        fingerprint = fingerprint.merged(Fingerprint.model_validate(server.pop("fingerprint", None) or {}))
    print_summary(record["runs"])
    if args.json:
        write_record(args.json, make(ServeRecord, provenance=provenance, fingerprint=fingerprint,
                                     **record))
    failed = [run for run in record["runs"] if run["successful"] == 0]
    if failed:
        print(f"glmvit bench-serve: error: every request failed in {plural(len(failed), 'run')} of "
              f"{len(record['runs'])} (first error: {next(iter(failed[0]['errors']), 'none recorded')})",
              file=sys.stderr)
        return 1
    return 0


def bench_provenance(record: dict[str, Any], args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Where it ran: the (first) server's provenance, GPU included, with this command and date; in-process, here."""
    servers = [s["provenance"] for s in record["servers"].values() if s.get("provenance")]
    if not servers:
        return collect(args.device, command)
    prov = dict(servers[0], server_command=servers[0].get("command"), command=command)
    prov["date_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return prov
