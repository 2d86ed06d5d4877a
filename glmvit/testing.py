"""For tests only: a guard that makes host-reading Tensor methods raise inside a block."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def forbid_host_syncs() -> Iterator[None]:
    """Make every Tensor method that reads device data on the host raise while the block runs (a CPU check).

    It patches these Tensor methods only: ``x[mask]``, ``torch.nonzero``, ``repeat_interleave`` with a tensor,
    ``masked_select``, ``unique`` and ``.to("cpu")`` go through other paths. On CUDA,
    ``torch.cuda.set_sync_debug_mode("error")`` is the stronger check, though not a complete one either (torch's
    docstring: "not all synchronizing operations will trigger warning or error").
    """
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def forbidden(name: str) -> Callable[..., Any]:
        def raise_(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host sync: Tensor.{name}() called inside a graph-safe region")

        return raise_

    try:
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, forbidden(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
