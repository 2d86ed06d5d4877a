"""Notebook 06's forced interleaving of two threads on one runner: thread A's forward waits for thread B's to start,
which B can reach only if nothing stops it from copying its own pixels into the budget's buffers first."""
from __future__ import annotations

import threading
from typing import Any
from unittest import mock

import torch


def two_threads(runner: Any, requests: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Run requests ``"A"`` and ``"B"`` on ``runner`` in two threads, A's forward waiting (≤ 1 s) for B's forward to
    start: each thread's first item, by thread name."""
    inside = {name: threading.Event() for name in requests}
    forward = runner.forward_static

    def forward_static(pixels: torch.Tensor, meta: Any) -> Any:
        me = threading.current_thread().name
        inside[me].set()
        if me == "A":
            inside["B"].wait(timeout=1.0)
        return forward(pixels, meta)

    got: dict[str, torch.Tensor] = {}

    def work(name: str) -> None:
        got[name] = runner.run(*requests[name])[0]

    threads = {name: threading.Thread(target=work, args=(name,), name=name) for name in requests}
    with mock.patch.object(runner, "forward_static", forward_static):
        threads["A"].start()
        if not inside["A"].wait(timeout=30):
            raise RuntimeError("thread A never reached the forward")
        threads["B"].start()
        for t in threads.values():
            t.join()
    return got
