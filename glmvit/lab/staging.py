"""Notebook 06's emulation of the staging-buffer race on the CPU: a stream whose work runs only when someone waits
for it (a GPU as far behind as it can be), an event marking a point in it, and a budget's batches served through
one or more staging buffers, with or without the event guard."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np


class QueuedStream:
    """A CPU stand-in for a CUDA stream: enqueue() returns at once; work runs later, in order, when waited for."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []
        self.enqueued, self.done = 0, 0

    def enqueue(self, work: Callable[[], None]) -> None:
        self.queue.append(work)
        self.enqueued += 1

    def run_until(self, mark: int) -> None:
        while self.done < mark:
            self.queue.pop(0)()
            self.done += 1


class QueuedEvent:
    """A point in a QueuedStream: record() marks what was enqueued so far; synchronize() waits until it has run."""

    def __init__(self, stream: QueuedStream) -> None:
        self.stream, self.mark = stream, 0

    def record(self) -> None:
        self.mark = self.stream.enqueued

    def synchronize(self) -> None:
        self.stream.run_until(self.mark)


def serve(batches: list[np.ndarray], buffers: int, guard: bool) -> tuple[list[list[int]], list[Any], int]:
    """Each batch: fill staging buffer k mod ``buffers``, queue the copy out of it, queue the replay. Returns what each
    replay saw, the log of what happened in the order it happened (lane, batch, value, what), and how often the host
    had to wait."""
    stream = QueuedStream()
    staging = [np.zeros(4, np.int32) for _ in range(buffers)]  # the budget's pinned host buffers
    staged = [QueuedEvent(stream) for _ in range(buffers)]  # one event per buffer
    on_device = np.zeros(4, np.int32)  # its metadata buffer on the GPU
    seen: list[list[int]] = []
    log: list[tuple[str, int, int, str]] = []
    waits = 0

    def copy(k: int, buf: int) -> None:
        on_device[:] = staging[buf]  # the copy reads the staging buffer when it RUNS
        log.append(("GPU", k, int(staging[buf][0]), "copy reads"))

    def replay(k: int) -> None:
        seen.append(on_device.tolist())
        log.append(("GPU", k, int(on_device[0]), "replay sees"))

    for k, meta in enumerate(batches):
        buf = k % buffers
        if guard:
            before = stream.done
            staged[buf].synchronize()  # the copy out of this buffer, `buffers` batches ago, has run
            waits += stream.done > before
        staging[buf][:] = meta
        log.append(("host", k, int(meta[0]), f"fills buffer {buf} with"))
        stream.enqueue(lambda k=k, buf=buf: copy(k, buf))  # type: ignore[misc]
        staged[buf].record()
        stream.enqueue(lambda k=k: replay(k))  # type: ignore[misc]
    stream.run_until(stream.enqueued)
    return seen, log, waits
