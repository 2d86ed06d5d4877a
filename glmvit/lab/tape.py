"""Notebook 03's *tape*: stream capture emulated on the CPU. Under :class:`Tape` every ATen operator of a forward is
recorded with the very tensors it read and wrote; :meth:`Tape.replay` re-runs them, each result landing where the
captured operator wrote. It has none of a graph's speed but breaks as a graph does: a rebound buffer is read stale,
a Python branch is frozen, and an operator whose result the host needs raises :class:`CaptureError`."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class CaptureError(RuntimeError):
    """Raised by the tape where CUDA stream capture would fail."""


# Operators whose result the host needs before it can go on: a GPU -> host copy and a wait (a "host sync").
NEEDS_HOST = {
    torch.ops.aten._local_scalar_dense.default,  # .item(), bool(t), int(t), float(t)
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten.repeat_interleave.Tensor,  # repeat counts given as a tensor: the output size is data
    torch.ops.aten._unique2.default,
}


class Tape(TorchDispatchMode):
    """Emulated stream capture: record each ATen op with the tensors it read and wrote; replay() re-runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []  # (op, args, kwargs, output): the "kernels", "addresses"

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        mask_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if func in NEEDS_HOST or mask_index:
            raise CaptureError(f"{func}: the host needs a value the GPU has not computed yet")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                fresh = func(*args, **kwargs)
                for old, new in zip(tree_leaves(out), tree_leaves(fresh), strict=True):
                    if isinstance(old, torch.Tensor) and old.data_ptr() != new.data_ptr():
                        old.copy_(new)  # the result lands where the captured op wrote


def capture(fn: Callable[..., Any], *static_inputs: torch.Tensor) -> tuple[Tape, Any]:
    """Run fn once under the tape; returns the tape and fn's output (which replay() keeps refreshing)."""
    tape = Tape()
    with torch.no_grad(), tape:
        out = fn(*static_inputs)
    return tape, out
