"""How long this thread has spent decoding media — files into pixels — so that a caller can split its time into
decoding and the rest: read :func:`seconds` before and after, and take the difference.

The decoders count themselves (:func:`counting` around a picture's decode, :func:`counted` around a video's frame
reader, its colour conversion included); nothing else does, and no count nests in another."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
_thread = threading.local()


def seconds() -> float:
    """Seconds this thread has spent decoding so far."""
    return float(getattr(_thread, "total", 0.0))


@contextmanager
def counting() -> Iterator[None]:
    """Count the time inside as decoding (whether it ends or raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _thread.total = seconds() + time.perf_counter() - start


def counted(items: Iterator[T]) -> Iterator[T]:
    """``items`` as they come, the time spent producing each counted as decoding; closing this closes ``items``."""
    try:
        while True:
            with counting():
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()
