"""Host-side metadata for one batch: everything data-dependent, built in numpy and copied to the device once.

The static forward reads only these tensors, so a CUDA graph captured on one batch replays any other batch
that fits the same :class:`BatchShape`. Layout of the single int32 buffer (``packed``)::

    cu_seqlens [cu_slots] | h_idx [rows] | w_idx [rows] | target_h [rows] | target_w [rows]
    | segment_ids [rows] | token_valid [rows / m²]

``cu_slots`` is segments + 2 rounded up to a multiple of 4, so every section starts on a 16-byte boundary
(rows is a multiple of m² = 4): ``torch.compile`` copies a misaligned input on every call, and these views are
inputs of each compiled block.

The real rows come first, one attention segment per temporal patch; ``cu_seqlens`` then repeats ``num_rows`` in
every unused slot (zero-length segments), so the padded rows ``[num_rows, rows)`` lie outside every segment and
cost the varlen kernels no attention work at all (``attention_work``). Whatever a kernel leaves in a padded row
stays there: every other op is row-local, and the 2×2 downsample merges aligned blocks of m² rows, which never mix
real and padded rows because every frame has a multiple of m² rows. In ``segment_ids`` each padded row has an id of
its own (``n + i`` after the n real segments), so the masked backend lets it attend only to itself: linear work.
``cu_seqlens`` keeps at least one slot more than ``segments`` (always empty), so the layout's size is unchanged.

A *uniform* shape (``BatchShape.uniform``) promises more: every real segment has exactly ``max_seqlen`` = L rows,
and rows is a multiple of L. Real segments are packed from row 0 back to back, so real segment i is rows
[i·L, (i+1)·L) and the padding is whole L-row blocks after them: the (rows / L, L) view of the rows puts every real
segment in one block of its own, which the ``dense`` attention backend runs as one batch entry each.
:func:`build_metadata` refuses a batch that breaks the promise; the packed metadata is the same as without it.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .rotary import rot_pos_ids


@dataclass(frozen=True)
class BatchShape:
    """The static shape a forward runs at: patch rows, attention-segment slots and the max segment length.

    ``uniform``: every real segment has exactly ``max_seqlen`` rows and ``rows`` is a multiple of it (checked here),
    so the rows split into ``rows // max_seqlen`` whole segments (the module docstring).
    """

    rows: int
    segments: int
    max_seqlen: int
    uniform: bool = False

    def __post_init__(self) -> None:
        if self.uniform and (self.max_seqlen < 1 or self.rows % self.max_seqlen):
            raise ValueError(f"a uniform batch shape needs rows ({self.rows}) a multiple of max_seqlen "
                             f"({self.max_seqlen}) ≥ 1")

    def __repr__(self) -> str:
        """The dataclass's repr, ``uniform`` shown only when set (a shape without it prints as it always has)."""
        return (f"BatchShape(rows={self.rows}, segments={self.segments}, max_seqlen={self.max_seqlen}"
                f"{', uniform=True' if self.uniform else ''})")

    @property
    def cu_slots(self) -> int:
        """Length of ``cu_seqlens``: segments + 2, rounded up to a multiple of 4 (16-byte aligned sections)."""
        return -(-(self.segments + 2) // 4) * 4

    def packed_size(self, merge_area: int) -> int:
        return self.cu_slots + 5 * self.rows + self.rows // merge_area


# The most patch rows one batch may have. The packed metadata is int32 and holds row offsets and segment ids up to
# rows + segments ≤ 2·rows (every segment has at least one row), so 2³⁰ rows keeps every value below 2³¹. Checked
# on the exact product t·h·w of every item and on the sum, so nothing wraps in int64 and nothing is allocated
# for a grid no pixels could fill: 2³⁰ rows of 1176 float32 pixels are 5 TB, far past any real batch.
MAX_ROWS = 2**30


def as_grid_array(grid_thw: Any) -> np.ndarray:
    """grid_thw (tensor, array or nested list) as an int64 numpy array of shape [n, 3], validated: positive
    integers whose rows t·h·w, and their sum, are at most :data:`MAX_ROWS`. Errors name the item."""
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.detach().cpu().numpy()
    try:
        grids = np.asarray(grid_thw)
    except (ValueError, TypeError):  # ragged nested lists
        raise ValueError("grid_thw must be an [n, 3] array of integers, got rows of different lengths") from None
    if grids.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if grids.ndim != 2 or grids.shape[1] != 3:
        raise ValueError(f"grid_thw must have shape [n, 3] (rows [t, h, w]), got {tuple(grids.shape)}")
    grids = _exact_entries(grids)
    hw = grids[:, 1] * grids[:, 2]  # each entry ≤ 2³⁰: no product below wraps
    rows = grids[:, 0] * np.minimum(hw, MAX_ROWS + 1)
    over = np.flatnonzero((hw > MAX_ROWS) | (rows > MAX_ROWS))
    if len(over):
        i = int(over[0])
        t, h, w = (int(v) for v in grids[i])
        raise ValueError(f"item {i}: grid [t, h, w] = {[t, h, w]} is t·h·w = {t * h * w:,} patch rows, more than "
                         f"{MAX_ROWS:,} (glmvit.metadata.MAX_ROWS: the metadata is int32)")
    total = int(rows.sum())
    if total > MAX_ROWS:
        raise ValueError(f"grid_thw: Σ t·h·w = {total:,} patch rows, more than {MAX_ROWS:,} "
                         "(glmvit.metadata.MAX_ROWS: the metadata is int32); split the batch")
    return grids


def _exact_entries(grids: np.ndarray) -> np.ndarray:
    """The entries of an [n, 3] array as int64, each an integer in [1, MAX_ROWS], checked before any cast (a float
    or a Python int beyond int64 must not wrap into range); the first bad item is named."""
    kind = grids.dtype.kind
    if kind == "O":  # Python ints too large for int64, or a mix of types
        good = np.array([[_entry_ok(v) for v in row] for row in grids], dtype=bool)
    elif kind in "iuf":
        with np.errstate(invalid="ignore"):
            good = (grids >= 1) & (grids <= MAX_ROWS)
            if kind == "f":
                good &= np.mod(grids, 1) == 0  # NaN and inf fail every comparison
    else:
        raise ValueError(f"grid_thw must hold integers, got dtype {grids.dtype}")
    bad = np.flatnonzero(~good.all(axis=1))
    if len(bad):
        i = int(bad[0])
        shown = [v.item() if isinstance(v, np.generic) else v for v in grids[i]]
        if not all(_entry_ok(v) or (isinstance(v, numbers.Real) and v <= 0) for v in shown):
            raise ValueError(f"item {i}: grid [t, h, w] = {_short(shown)} must hold integers in [1, {MAX_ROWS:,}] "
                             "(glmvit.metadata.MAX_ROWS)")
        raise ValueError(f"item {i}: grid [t, h, w] = {_short(shown)} has a non-positive entry")
    return grids.astype(np.int64)


def _entry_ok(value: Any) -> bool:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_ROWS


def _short(values: list) -> str:
    """A grid row for an error message, each entry at most 24 characters (a 400-digit int stays readable)."""
    return "[" + ", ".join(text if len(text := repr(v)) <= 24 else text[:10] + "…" + text[-6:] for v in values) + "]"


def check_grids(grids: np.ndarray, merge: int) -> None:
    """Every item's h and w divisible by the spatial merge size (``grids`` from :func:`as_grid_array`)."""
    bad = np.flatnonzero((grids[:, 1] % merge) | (grids[:, 2] % merge))
    if len(bad):
        i = int(bad[0])
        h, w = int(grids[i, 1]), int(grids[i, 2])
        raise ValueError(f"item {i}: grid h×w = {h}×{w} is not divisible by the spatial merge size {merge}")


def rows_of(grids: np.ndarray) -> int:
    """Σ t·h·w of ``grids`` from :func:`as_grid_array` (exact: it bounds every product and the sum)."""
    return int((grids[:, 0] * grids[:, 1] * grids[:, 2]).sum()) if len(grids) else 0


def item_row_starts(grids: np.ndarray) -> np.ndarray:
    """[n + 1] int64: where each item's pixel rows start (t·h·w rows per item), and the total last."""
    starts = np.zeros(len(grids) + 1, dtype=np.int64)
    if len(grids):
        np.cumsum(grids[:, 0] * grids[:, 1] * grids[:, 2], out=starts[1:])
    return starts


def items_of_rows(grids: np.ndarray, rows: np.ndarray) -> list[int]:
    """The items (rows of ``grids``) that the pixel rows ``rows`` belong to, sorted, each once."""
    ends = item_row_starts(grids)[1:]
    return sorted(set(np.searchsorted(ends, np.asarray(rows), side="right").tolist()))


def nonfinite_items(pixel_values: torch.Tensor, grids: np.ndarray) -> list[int]:
    """Indices of the items (rows of ``grids``) whose pixel rows hold a NaN or an Inf. Reads the result on the host.

    One pass sums every row (a NaN or Inf makes the sum non-finite); only rows whose sum is not finite, which a
    finite row can also reach by overflow, are then checked value by value.
    """
    suspects = torch.nonzero(~torch.isfinite(pixel_values.sum(dim=1))).flatten()
    if suspects.numel() == 0:
        return []
    bad_rows = suspects[~torch.isfinite(pixel_values[suspects]).all(dim=1)].cpu().numpy()
    return items_of_rows(grids, bad_rows)


@lru_cache(maxsize=4096)
def _frame_block(h: int, w: int, merge: int) -> np.ndarray:
    """[4, h·w] int32: h_idx, w_idx, target_h, target_w of one frame, cached per grid."""
    ids = rot_pos_ids(h, w, merge)
    block = np.empty((4, h * w), dtype=np.int32)
    block[0], block[1] = ids[:, 0], ids[:, 1]
    block[2], block[3] = h, w
    block.flags.writeable = False
    return block


@dataclass
class HostMetadata:
    """A batch's metadata on the host, padded to ``shape``; ``to(device)`` makes the device views."""

    packed: np.ndarray
    shape: BatchShape
    merge_area: int
    grids: np.ndarray
    num_rows: int

    @property
    def cu_seqlens(self) -> np.ndarray:
        return self.packed[: self.shape.cu_slots]

    def to(self, device: torch.device | str = "cpu") -> "EncoderMetadata":
        host = torch.from_numpy(self.packed)
        device = torch.device(device)
        if device.type == "cuda":
            packed = host.pin_memory().to(device, non_blocking=True)
        else:
            packed = host.clone()
        return EncoderMetadata.from_packed(packed, self.shape, self.merge_area, self)


@dataclass
class EncoderMetadata:
    """Device views into one packed int32 tensor, plus the static shape. What ``forward_static`` reads."""

    packed: torch.Tensor
    shape: BatchShape
    cu_seqlens: torch.Tensor
    h_idx: torch.Tensor
    w_idx: torch.Tensor
    target_h: torch.Tensor
    target_w: torch.Tensor
    segment_ids: torch.Tensor
    token_valid: torch.Tensor
    host: HostMetadata | None = None  # the one batch it was built for; None for a runner's buffer (refreshed per batch)
    ragged: torch.Tensor | None = None  # the ``cudnn`` attention's offsets (``glmvit.attention.prepare_attention``)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, shape: BatchShape, merge_area: int,
                    host: HostMetadata | None = None) -> "EncoderMetadata":
        r = shape.rows
        views, start = [], 0
        for size in (shape.cu_slots, r, r, r, r, r, r // merge_area):
            views.append(packed[start : start + size])
            start += size
        cu_seqlens, h_idx, w_idx, target_h, target_w, segment_ids, token_valid = views
        return cls(packed, shape, cu_seqlens, h_idx, w_idx, target_h, target_w, segment_ids, token_valid, host)

    @property
    def max_seqlen(self) -> int:
        return self.shape.max_seqlen


def build_metadata(
    grid_thw: Any,
    merge: int = 2,
    shape: BatchShape | None = None,
    out: np.ndarray | None = None,
) -> HostMetadata:
    """Metadata for the items of ``grid_thw`` (rows [t, h, w], validated here; or an
    :class:`~glmvit.request.EncoderRequest`, validated already: its own merge size is used); padded to ``shape`` if
    given, else exact.

    Every temporal patch of every item is its own attention segment (t segments per item); padded rows lie outside
    every segment (see the module docstring). ``out``: an int32 array of ``shape.packed_size`` to write into (the
    runner's pinned staging buffer) instead of a new one.
    """
    from .request import EncoderRequest

    request = grid_thw if isinstance(grid_thw, EncoderRequest) else EncoderRequest.of(grid_thw, merge=merge)
    grids, merge = request.grids, request.merge
    merge_area = merge * merge
    num_rows = request.rows
    frame_rows = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0]) if len(grids) else np.zeros(0, np.int64)
    if shape is None:
        shape = BatchShape(num_rows, len(frame_rows), int(frame_rows.max()) if len(frame_rows) else 0)
    if num_rows > shape.rows:
        raise ValueError(f"batch has {num_rows} patch rows, more than the shape's {shape.rows}")
    if len(frame_rows) > shape.segments:
        raise ValueError(f"batch has {len(frame_rows)} temporal patches, more than the shape's {shape.segments}")
    if len(frame_rows) and frame_rows.max() > shape.max_seqlen:
        raise ValueError(f"a segment of {frame_rows.max()} rows exceeds max_seqlen {shape.max_seqlen}")
    if shape.uniform and len(frame_rows) and frame_rows.min() < shape.max_seqlen:
        raise ValueError(f"a segment of {frame_rows.min()} rows in a uniform shape of {shape.max_seqlen}-row segments")

    size = shape.packed_size(merge_area)
    if out is None:
        packed = np.zeros(size, dtype=np.int32)
    elif out.shape != (size,) or out.dtype != np.int32:
        raise ValueError(f"out must be int32 of shape ({size},), got {out.dtype} {out.shape}")
    else:
        packed = out
        packed.fill(0)
    r = shape.rows
    base = shape.cu_slots
    cu = packed[:base]
    cu[1 : len(frame_rows) + 1] = np.cumsum(frame_rows)
    cu[len(frame_rows) + 1 :] = num_rows  # unused slots are empty: the padding lies outside every segment
    coords = packed[base : base + 4 * r].reshape(4, r)
    coords[2:, num_rows:] = 1  # padded rows sample a valid 1×1 target
    offset = 0
    for t, h, w in grids:
        block = _frame_block(int(h), int(w), merge)
        n = int(h * w)
        for _ in range(int(t)):
            coords[:, offset : offset + n] = block
            offset += n
    seg = packed[base + 4 * r : base + 5 * r]
    seg[:num_rows] = np.repeat(np.arange(len(frame_rows), dtype=np.int32), frame_rows)
    seg[num_rows:] = np.arange(len(frame_rows), len(frame_rows) + r - num_rows, dtype=np.int32)  # one id per row
    valid = packed[base + 5 * r :]
    valid[: num_rows // merge_area] = 1
    # Uniform: n segments of exactly L rows from row 0, so segment i is rows [i·L, (i+1)·L), one dense block each.
    assert not shape.uniform or num_rows == len(frame_rows) * shape.max_seqlen, "uniform segments tile their rows"
    return HostMetadata(packed, shape, merge_area, grids, num_rows)


def attention_work(meta: HostMetadata) -> int:
    """Σ L² over the segments of ``meta.cu_seqlens``: the scores a varlen kernel computes, padding included."""
    lengths = np.diff(np.asarray(meta.cu_seqlens, dtype=np.int64))
    return int(np.dot(lengths, lengths))
