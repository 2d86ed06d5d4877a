"""A module a decode worker preloads in tests/test_decode_pool.py: its warm_worker() notes the worker it ran in."""
import os

WARMED: list[int] = []


def warm_worker() -> None:
    WARMED.append(os.getpid())


def warmed() -> bool:
    """Whether warm_worker() ran once, in this worker, before this task."""
    return WARMED == [os.getpid()]
