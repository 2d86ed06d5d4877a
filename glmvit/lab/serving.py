"""Notebook 11's CPU pieces: toy requests, a runner that notes its batches, clients submitting from threads, a
simulation of the scheduler's worker under Poisson arrivals, and ``glmvit serve`` started as a child process."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..config import VisionConfig
from ..graphs import EncoderGraphRunner
from ..workloads import random_batch

REPO = Path(__file__).resolve().parents[2]


def toy_request(seed: int, config: VisionConfig) -> Any:
    """1–3 items: small images, clips of 2–3 temporal patches (4–6 frames), and now and then one (a [1, 12, 12]
    image) that a 32-token budget does not hold; (pixel_values, grid_thw) as ``random_batch`` makes them."""
    rng = np.random.default_rng(seed)
    grids = []
    for _ in range(int(rng.integers(1, 4))):
        kind = rng.choice(["image", "video", "large"], p=[0.6, 0.3, 0.1])
        h, w = (2 * rng.integers(1, 4, size=2)).tolist()
        grids.append([1, 12, 12] if kind == "large" else [int(rng.integers(2, 4)) if kind == "video" else 1, h, w])
    return random_batch(grids, config, seed=1000 + seed)


class RecordingRunner(EncoderGraphRunner):
    """The runner, noting the grids of every batch it is given, through ``run`` or the scheduler's ``encode``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[list[list[int]]] = []

    def run(self, pixel_values: Any, grid_thw: Any, check_finite: bool = True) -> Any:
        self.batches.append(np.asarray(getattr(grid_thw, "grids", grid_thw)).tolist())
        return super().run(pixel_values, grid_thw, check_finite)

    def encode(self, pixel_values: Any, request: Any, *, sync: bool) -> Any:
        """The scheduler's entry (:class:`~glmvit.encoder.Encoder`): noted as ``run`` notes a batch."""
        self.batches.append(np.asarray(request.grids).tolist())
        return super().encode(pixel_values, request, sync=sync)


def submit_from_threads(submit: Callable[..., Any], requests: list[Any], threads: int = 8,
                        timeout: float = 60) -> list[Any]:
    """Each request submitted by one of ``threads`` client threads (request j by thread j mod threads, all released
    at once): what ``submit`` returned, in request order."""
    futures: list[Any] = [None] * len(requests)
    start_line = threading.Barrier(threads)

    def client(k: int) -> None:
        start_line.wait()
        for j in range(k, len(requests), threads):
            futures[j] = submit(*requests[j])

    workers = [threading.Thread(target=client, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout)
    return futures


def simulate_worker(rate: float, wait: float, service: Callable[[int], float], capacity: int, n: int = 3000,
                    seed: int = 0) -> np.ndarray:
    """Seconds from arrival to the end of its batch, per request: Poisson arrivals at ``rate``, one worker taking the
    head of the queue when free, the batch open until ``capacity`` items or until ``wait`` seconds have passed, a
    batch of k taking ``service(k)`` seconds."""
    arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
    done, free_at, i = np.empty(n), 0.0, 0
    while i < n:
        start = max(free_at, arrivals[i])  # the worker takes the head of the queue when it is free
        close = start
        if wait > 0 and np.searchsorted(arrivals, start, side="right") - i < capacity:
            full_at = arrivals[i + capacity - 1] if i + capacity - 1 < n else math.inf
            close = min(start + wait, max(full_at, start))  # open until full or until the wait is over
        j = min(int(np.searchsorted(arrivals, close, side="right")), i + capacity)
        done[i:j] = close + service(j - i)
        free_at, i = done[i], j
    result: np.ndarray = done - arrivals
    return result


def multipart(paths: list[Path]) -> tuple[bytes, str]:
    """A multipart/form-data body with one file part per path (what curl -F file=@... sends), and its content type."""
    boundary = uuid.uuid4().hex
    parts = []
    for path in paths:
        head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n")
        parts.append(head.encode() + path.read_bytes() + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def post(url: str, paths: list[Path], timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """POST ``paths`` to ``url``/v1/encode: status, headers, body (an HTTP error's too)."""
    body, content_type = multipart(paths)
    req = urllib.request.Request(url + "/v1/encode", data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


@contextmanager
def serve_child(args: list[str], timeout: float = 60) -> Iterator[dict[str, Any]]:
    """``python -m glmvit serve ARGS --port 0`` as a child process running this tree's glmvit: yields a dict with its
    ``url`` and first line; on exit sends SIGTERM (a drain), and fills in ``returncode`` and ``stdout``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    server = subprocess.Popen([sys.executable, "-m", "glmvit", "serve", *args, "--port", "0"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first_line: list[str] = []
    stdout = server.stdout
    if stdout is None:
        raise RuntimeError("glmvit serve: no stdout pipe")
    reader = threading.Thread(target=lambda: first_line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)  # bounded: capture on a CPU takes seconds
    state: dict[str, Any] = {"first_line": first_line[0] if first_line else ""}
    try:
        if "listening on " not in state["first_line"]:
            raise RuntimeError(f"glmvit serve did not start: {state['first_line']!r}")
        state["url"] = state["first_line"].split("listening on ")[1].split()[0]
        yield state
    finally:
        server.send_signal(signal.SIGTERM)  # drains: a request in flight would finish
        out, _ = server.communicate(timeout=timeout)
        state["returncode"], state["stdout"] = server.returncode, out


# ---- notebook 11's helpers: submissions, comparisons, the records' readers and the figures ----

def submit_all(scheduler: Any, requests: list[tuple[Any, Any]]) -> tuple[list[str], list[Any]]:
    """Submit each (pixels, grid) in turn: per request ``"admitted"`` or the refusal as ``"QueueFull: message"``
    (``RequestTooLarge``, ``SchedulerClosed`` likewise), and the admitted requests' futures."""
    from ..scheduler import QueueFull, RequestTooLarge, SchedulerClosed

    outcomes, futures = [], []
    for pixels, grid in requests:
        try:
            futures.append(scheduler.submit(pixels, grid))
            outcomes.append("admitted")
        except (QueueFull, RequestTooLarge, SchedulerClosed) as err:
            outcomes.append(f"{type(err).__name__}: {err}")
    return outcomes, futures


def own_items(got: list[list[Any]], alone: list[list[Any]]) -> dict[str, Any]:
    """Each request's outputs ``got`` against the same request encoded alone: ``same_count`` (every request got as
    many items), ``own_gap`` (the largest difference over the output's scale, scale at least 1), ``bitwise`` (items
    equal bit for bit), ``items``, and ``other_gap``: the least gap from an output to any other item's of its shape
    (inf where no other item has its shape)."""
    def gap(x: Any, y: Any) -> float:
        return float(((x - y).abs().max() / y.abs().max().clamp(min=1)).item())

    pairs = [(x, y) for g, a in zip(got, alone, strict=True) for x, y in zip(g, a, strict=False)]
    everyone = [y for _, y in pairs]
    return {"same_count": all(len(g) == len(a) for g, a in zip(got, alone, strict=True)),
            "own_gap": max(gap(x, y) for x, y in pairs), "bitwise": sum(bool((x == y).all()) for x, y in pairs),
            "items": len(pairs),
            "other_gap": min((gap(x, z) for x, y in pairs for z in everyone if z.shape == y.shape and z is not y),
                             default=math.inf)}


def one_vs_many(sweep: Any) -> dict[int, dict[str, float]]:
    """Per budget of a ``LatencySweep`` holding a ``many-small`` layout: graph ms of ``one-small``, ``many-small``,
    ``full`` and ``full-many``, and ``ratio`` = one-small / many-small."""
    out = {}
    for b in sweep.budgets:
        by_name = {layout.name: layout for layout in b.layouts}
        if "many-small" in by_name:  # the smallest budget holds one small image and nothing else
            row = {n: by_name[n].graph_ms for n in ("one-small", "many-small", "full", "full-many")}
            out[b.tokens] = {**row, "ratio": row["one-small"] / row["many-small"]}
    return out


def plot_wait(median_ms: dict[float, list[float]], rates: list[float], pay_rate: float, saturation: float) -> Any:
    """Median time to embedding against arrival rate, one line per wait (s), the rate 1 / (T − w) where a wait
    could pay and the saturation rate marked; log-log. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    for wait, ys in median_ms.items():
        ax.plot(rates, ys, "o-", label=f"wait {wait * 1e3:.0f} ms")
    ax.axvline(pay_rate, color="grey", ls="--", lw=1, label="1 / (T − w)")
    ax.axvline(saturation, color="k", ls=":", lw=1, label="saturation")
    ax.set(xscale="log", yscale="log", xlabel="arrivals per second (one clip each)",
           ylabel="median time to embedding, ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def rate_of(run: dict[str, Any]) -> float:
    """A serve run's request rate: ``inf`` for all at once, else the number."""
    return math.inf if run["request_rate"] == "inf" else float(run["request_rate"])


def serve_lines(record: Any) -> list[str]:
    """A ``ServeRecord``'s settings and one line per run (sorted by mode and rate): throughput, share of the
    floor-limited rate, time to embedding and queueing delay (median, P99), items per batch, padding, worker busy."""
    st = record.settings
    lines = [f"  workload {st['workload']}: {st['requests']} requests, {record.workload['items']} items; rates "
             f"{st['request_rates']}; modes {st['modes']}; max wait {st['batching']['max_wait_ms']} ms"]
    for r in sorted(record.runs, key=lambda r: (r["mode"], rate_of(r))):
        sv, floor = r["server"], r["vs_floor"]
        lines.append(f"  {r['mode']:<15}{rate_of(r):>6.1f}: {r['requests_per_s']:.1f} req/s, {r['items_per_s']:.1f} "
                     f"items/s ({'-' if floor is None else f'{floor:.0%}'} of floor); TTE {r['tte_ms']['median']:.1f}"
                     f" (P99 {r['tte_ms']['p99']:.1f}) ms, queue {r['queue_ms']['median']:.1f} (P99 "
                     f"{r['queue_ms']['p99']:.1f}) ms; {sv['items_per_batch']:.2f} items/batch, pad "
                     f"{sv['padding_fraction']:.0%}, busy {sv['utilisation']:.0%}")
    return lines


def plot_phases(runs: dict[str, dict[str, Any]]) -> Any:
    """One stacked bar per named serve run: the mean ms of each phase of a request (``time_split_ms``). Returns the
    figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.85 * len(runs)))
    for y, r in enumerate(runs.values()):
        left = 0.0
        for k, (phase, t) in enumerate(r["time_split_ms"].items()):
            ax.barh(y, t, left=left, color=f"C{k}", label=phase if y == 0 else None)
            left += t
    ax.set(yticks=range(len(runs)), yticklabels=list(runs), xlabel="ms per request (mean of each phase)")
    ax.legend(fontsize=7, ncol=4, loc="lower right")
    fig.tight_layout()
    return fig


def plot_latency_sweep(sweep: list[dict[str, Any]], floor_items_per_s: float, title: str) -> Any:
    """Time to embedding (median, P99) and queueing delay (median) against achieved items/s for a rate sweep's runs,
    each labelled with its share of saturation, the floor-limited rate dotted. Returns the figure."""
    import matplotlib.pyplot as plt

    xs = [r["items_per_s"] for r in sweep]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(xs, [r["tte_ms"]["median"] for r in sweep], "o-", label="time to embedding, median")
    ax.plot(xs, [r["tte_ms"]["p99"] for r in sweep], "x--", label="time to embedding, P99")
    ax.plot(xs, [r["queue_ms"]["median"] for r in sweep], "s:", label="queueing delay, median")
    for r, x in zip(sweep, xs, strict=True):
        share = r.get("saturation_share")
        ax.annotate("inf" if share is None else f"{share:.0%}", (x, r["tte_ms"]["median"]),
                    textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.axvline(floor_items_per_s, color="k", ls=":", lw=1, label="floor-limited rate")
    ax.set(yscale="log", xlabel="items/s achieved", ylabel="ms", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def read_answer(answer: bytes) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ``/v1/encode`` safetensors answer: its tensors by name and each ``item_i``'s JSON metadata, in order."""
    import json

    from safetensors.torch import load as load_safetensors

    tensors = load_safetensors(answer)
    size = int.from_bytes(answer[:8], "little")
    metadata = json.loads(answer[8 : 8 + size])["__metadata__"]
    return tensors, [json.loads(metadata[f"item_{i}"]) for i in range(len(tensors))]


def plot_rates(under_load: dict[str, float], one_at_a_time: dict[str, float], floor: float) -> Any:
    """Items per second per mode under load (wide bars) and one request at a time (narrow bars), the floor-limited
    rate dotted. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3))
    ax.bar(list(under_load), list(under_load.values()), color="C0", label="under load (rate inf)")
    ax.bar(list(one_at_a_time), list(one_at_a_time.values()), color="C1", width=0.4, label="one request at a time")
    ax.axhline(floor, color="k", ls=":", lw=1, label="floor-limited rate")
    ax.set_ylabel("clips per second")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def answer_times(run: dict[str, Any], items_per_request: int) -> list[tuple[float, int]]:
    """A recorded serve run's successful answers as (seconds after its first request was sent, items), from its
    ``per_request`` lists: what :func:`glmvit.timing.steady_rate` takes."""
    pr = run["per_request"]
    return sorted((sent + tte / 1e3, items_per_request)
                  for ok, sent, tte in zip(pr["ok"], pr["sent_s"], pr["tte_ms"], strict=True) if ok)


def plot_answers(runs: dict[str, list[tuple[float, int]]], share: tuple[float, float]) -> Any:
    """Items answered against time for each named run (:func:`answer_times`), the answers between the ``share``
    quantiles of each run's times drawn thick: the steady part its once-full rate is read over. Returns the
    figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    for k, (name, answers) in enumerate(runs.items()):
        t = np.array([a[0] for a in answers])
        items = np.cumsum([a[1] for a in answers])
        lo, hi = (int(q * len(t)) for q in share)
        ax.plot(t, items, color=f"C{k}", lw=1, label=name)
        ax.plot(t[lo:hi], items[lo:hi], color=f"C{k}", lw=3.5, alpha=0.6)
    ax.set(xlabel="s after the first request was sent", ylabel="items answered")
    ax.legend(fontsize=8, title=f"thick: the answers between the {share[0]:.0%} and {share[1]:.0%} quantiles",
              title_fontsize=7)
    fig.tight_layout()
    return fig
