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
