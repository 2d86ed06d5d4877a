"""A module whose warm_worker() fails: a decode worker that preloads it still serves (tests/test_decode_pool.py)."""


def warm_worker() -> None:
    raise RuntimeError("no codec here")
