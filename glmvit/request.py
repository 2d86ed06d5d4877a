"""One request to the encoder, validated once at the boundary: :class:`EncoderRequest`.

Made only by :meth:`EncoderRequest.of` (the grid checks of :mod:`glmvit.metadata`, and optionally the pixel row
count) or from requests made so already (:meth:`EncoderRequest.select`, :meth:`EncoderRequest.gather`). Every layer
below the boundary (scheduler, runner, eager forward, metadata) takes it as it is and recomputes nothing: each item's
rows, tokens, segments and attention work come from :func:`glmvit.geometry.item_spec`.

:class:`RequestCache` keeps requests by the exact grids they were made from, so a caller that sends the same grid
array again (a stream of equal images) has it validated once, not on every call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from .geometry import MERGE_SIZE, ItemSpec, item_spec
from .metadata import MAX_ROWS, as_grid_array, check_grids


@dataclass(frozen=True, eq=False)
class EncoderRequest:
    """The items of one request: ``grids`` [n, 3] int64 (read-only), ``row_starts`` [n + 1] (where each item's pixel
    rows start, the total last), ``items`` (one :class:`~glmvit.geometry.ItemSpec` per item) at spatial merge size
    ``merge``."""

    grids: np.ndarray
    row_starts: np.ndarray
    items: tuple[ItemSpec, ...]
    merge: int

    @classmethod
    def of(cls, grid_thw: Any, pixel_rows: int | None = None, merge: int = MERGE_SIZE) -> "EncoderRequest":
        """Validate ``grid_thw`` (tensor, array or nested list of [t, h, w] rows: positive integers, rows within
        :data:`~glmvit.metadata.MAX_ROWS`, h and w multiples of ``merge``) and, if given, that ``pixel_rows`` is
        Σ t·h·w. A one-line ValueError naming the first bad item."""
        if isinstance(grid_thw, EncoderRequest):
            raise TypeError("EncoderRequest.of takes grids; this is a request already")
        grids = as_grid_array(grid_thw)
        check_grids(grids, merge)
        request = cls._trusted(grids, merge)
        if pixel_rows is not None:
            request.check_pixel_rows(pixel_rows)
        return request

    @classmethod
    def _trusted(cls, grids: np.ndarray, merge: int) -> "EncoderRequest":
        """A request of grids checked already (by :meth:`of`, or a part of such a request's)."""
        grids = np.array(grids, dtype=np.int64).reshape(-1, 3)
        grids.flags.writeable = False
        items = tuple(item_spec(int(t), int(h), int(w), merge) for t, h, w in grids)
        starts = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([spec.rows for spec in items], out=starts[1:])
        starts.flags.writeable = False
        return cls(grids, starts, items, merge)

    def check_pixel_rows(self, pixel_rows: int) -> None:
        """A ValueError unless ``pixel_rows`` is this request's Σ t·h·w."""
        if pixel_rows != self.rows:
            per_item = [spec.rows for spec in self.items]
            raise ValueError(f"pixel_values has {pixel_rows} rows but grid_thw needs Σ t·h·w = {self.rows} "
                             f"(per item: {per_item})")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def rows(self) -> int:
        """Σ t·h·w: the request's pixel rows."""
        return int(self.row_starts[-1])

    @property
    def total(self) -> ItemSpec:
        """The tokens, segments, rows and work of every item together."""
        return ItemSpec.total(self.items)

    @property
    def item_tokens(self) -> list[int]:
        """Each item's output tokens, in order."""
        return [spec.tokens for spec in self.items]

    def key(self) -> bytes:
        """The grids as bytes: equal for requests of equal layout (a plan cache's key)."""
        return self.grids.tobytes()

    def row_range(self, i: int) -> tuple[int, int]:
        """Item ``i``'s pixel rows [a, b) in the request."""
        return int(self.row_starts[i]), int(self.row_starts[i + 1])

    def select(self, indices: Iterable[int]) -> "EncoderRequest":
        """A request of the items ``indices``, in that order (no re-validation: parts of a valid request are)."""
        idx = list(indices)
        grids = self.grids[idx] if idx else np.zeros((0, 3), dtype=np.int64)
        return EncoderRequest._trusted(grids, self.merge)

    @classmethod
    def gather(cls, parts: Sequence[tuple["EncoderRequest", int]]) -> "EncoderRequest":
        """One request of item ``i`` of each ``(request, i)``, in order: the items of several validated requests
        batched together (they must share a merge size; their rows together are bounded as :meth:`of` bounds)."""
        if not parts:
            raise ValueError("gather needs at least one item")
        merges = {request.merge for request, _ in parts}
        if len(merges) != 1:
            raise ValueError(f"items of different merge sizes {sorted(merges)} cannot share a request")
        rows = sum(request.items[i].rows for request, i in parts)
        if rows > MAX_ROWS:
            raise ValueError(f"gathered items: Σ t·h·w = {rows:,} patch rows, more than {MAX_ROWS:,} "
                             "(glmvit.metadata.MAX_ROWS: the metadata is int32); split the batch")
        return cls._trusted(np.stack([request.grids[i] for request, i in parts]), merges.pop())


def grids_key(grid_thw: Any) -> tuple[str, tuple[int, ...], bytes] | None:
    """An exact key for grids given as an integer numpy array or CPU tensor: dtype, shape and bytes, so equal keys
    are equal grids. None for anything else (nested lists, float grids, requests, and device tensors, whose read
    would wait for the device)."""
    if isinstance(grid_thw, torch.Tensor):
        if grid_thw.device.type != "cpu" or grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex:
            return None
        grid_thw = grid_thw.detach().numpy()
    if not isinstance(grid_thw, np.ndarray) or grid_thw.dtype.kind not in "iu":
        return None
    return grid_thw.dtype.str, grid_thw.shape, grid_thw.tobytes()


class RequestCache:
    """Requests made already, by the exact grids (:func:`grids_key`) they were validated from, at most ``size``
    (emptied when full). ``of(grid_thw, make)``: the request made from equal grids before, else ``make(grid_thw)``
    (which validates, raising for bad grids: those are never kept). Requests are immutable, so one is shared safely.
    Not locked: its owner serialises calls (the graph runner holds its lock)."""

    def __init__(self, size: int = 1024):
        self.size = size
        self._requests: dict[tuple[str, tuple[int, ...], bytes], EncoderRequest] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def of(self, grid_thw: Any, make: Callable[[Any], EncoderRequest]) -> EncoderRequest:
        key = grids_key(grid_thw)
        if key is None:
            return make(grid_thw)
        request = self._requests.get(key)
        if request is None:
            request = make(grid_thw)
            if len(self._requests) >= self.size:
                self._requests.clear()
            self._requests[key] = request
        return request

    def clear(self) -> None:
        self._requests.clear()
