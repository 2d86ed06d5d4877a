"""A module a decode worker preloads in tests/test_decode_pool.py: its warm_worker() notes the worker it ran in."""
import os

from glmvit import video

WARMED: list[int] = []
FRAME_THREADS: list[bool] = []  # glmvit.video.frame_threads as each warm-up saw it


def warm_worker() -> None:
    WARMED.append(os.getpid())
    FRAME_THREADS.append(video.frame_threads)


def warmed() -> bool:
    """Whether warm_worker() ran once, in this worker, before this task."""
    return WARMED == [os.getpid()]


def warmed_on_one_thread() -> bool:
    """Whether warm_worker() ran with the worker's thread settings (no FFmpeg frame threads), as its tasks run."""
    return FRAME_THREADS == [False]
