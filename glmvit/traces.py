"""Workloads from traces: the item sizes a deployment really sees, read from CSV, JSON or JSON Lines.

One record per item, with the fields

- ``height``, ``width``: the picture's size in pixels before resizing (required);
- ``frames``: frames the encoder receives, after the processor's sampling (default 1: an image; a video of F
  frames has grid t = ceil(F / 2));
- ``request``: which request the item belongs to (optional). Items with the same value form one request, in the
  order the values first appear; without the field every record is a request of its own.

Formats, by suffix: ``.csv`` (a header row naming the fields; other columns are ignored), ``.json`` (an array of
objects) and ``.jsonl`` (one object per line). For example::

    request,height,width,frames
    r1,1080,1920,1
    r1,720,1280,16
    r2,224,224,1

Every problem is a ValueError naming the file and the line (CSV, JSON Lines) or record (JSON).
"""
from __future__ import annotations

import csv
import io
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping

from .files import read_bounded
from .geometry import MAX_SIDE
from .workloads import MMItem, make_item, shown

FIELDS = ("height", "width", "frames", "request")
SUFFIXES = (".csv", ".json", ".jsonl")
MAX_TRACE_BYTES = 256 * 2**20  # a trace larger than this is a log to sample from, not a workload to plan
MAX_TRACE_ITEMS = 2_000_000  # planning is pure Python at ≈ 30 µs an item: a minute for this many
MAX_FRAMES = 640  # GLM-4.6V's sampler extracts at most 640 frames a video (GLM-4.1V's: 600, 300 s at 2 fps)


def load_trace(path: str | Path) -> list[list[MMItem]]:
    """The requests of a trace file (see the module docstring for the format)."""
    path = Path(path)
    if path.suffix.lower() not in SUFFIXES:
        raise ValueError(f"{path}: a trace must be {', '.join(SUFFIXES)}, got {path.suffix or 'no suffix'!r}")
    return parse_trace(read_bounded(path, MAX_TRACE_BYTES, "trace file"), path.name)


def parse_trace(data: bytes, name: str) -> list[list[MMItem]]:
    """The requests of a trace given as bytes; ``name``'s suffix says the format and errors name it."""
    suffix = Path(name).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{name}: a trace must be {', '.join(SUFFIXES)}, got {suffix or 'no suffix'!r}")
    if len(data) > MAX_TRACE_BYTES:
        raise ValueError(f"{name}: larger than {MAX_TRACE_BYTES >> 20} MiB; sample it first")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    records = {".csv": _csv_records, ".json": _json_records, ".jsonl": _jsonl_records}[suffix](text, name)
    requests: dict[tuple[str, Any], list[MMItem]] = {}
    for count, (where, record) in enumerate(records, start=1):
        if count > MAX_TRACE_ITEMS:
            raise ValueError(f"{name}: more than {MAX_TRACE_ITEMS:,} items; sample it first")
        item = _item(record, where)
        key = ("request", _request_id(record["request"], where)) if "request" in record else ("record", count)
        requests.setdefault(key, []).append(item)
    if not requests:
        raise ValueError(f"{name}: no items")
    return list(requests.values())


def _csv_records(text: str, name: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    reader = csv.DictReader(io.StringIO(text))
    columns = [c.strip() for c in reader.fieldnames or []]
    missing = [f for f in ("height", "width") if f not in columns]
    if missing:
        raise ValueError(f"{name} line 1: the header must name height and width (found {columns or 'nothing'}); "
                         f"missing {', '.join(missing)}")
    reader.fieldnames = columns
    try:
        for row in reader:
            where = f"{name} line {reader.line_num}"
            if None in row:
                raise ValueError(f"{where}: more values than header columns")
            yield where, {k: v.strip() for k, v in row.items() if k in FIELDS and v is not None}
    except csv.Error as err:
        raise ValueError(f"{name} line {reader.line_num}: {err}") from None


def _json_records(text: str, name: str) -> Iterator[tuple[str, Any]]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ValueError(f"{name}: not valid JSON ({err})") from None
    if not isinstance(data, list):
        raise ValueError(f"{name}: expected a JSON array of item objects, got {type(data).__name__}")
    for i, record in enumerate(data, start=1):
        yield f"{name} record {i}", record


def _jsonl_records(text: str, name: str) -> Iterator[tuple[str, Any]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            yield where, json.loads(line)
        except (ValueError, RecursionError) as err:
            raise ValueError(f"{where}: not valid JSON ({err})") from None


def _request_id(value: Any, where: str) -> str:
    if value == "" or isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{where}: request must be a non-empty string or an integer, got {shown(value)}")
    return str(value)


def _item(record: Any, where: str) -> MMItem:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected an object with height, width (frames, request), got {shown(record)}")
    height, width = (_count(record, key, where, MAX_SIDE) for key in ("height", "width"))
    frames = _count(record, "frames", where, MAX_FRAMES) if record.get("frames") not in (None, "") else 1
    try:
        return _make_item(height, width, frames)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _count(record: Mapping[str, Any], key: str, where: str, limit: int) -> int:
    """A positive integer field up to ``limit``: an int in JSON, ASCII digits in CSV."""
    value = record.get(key)
    if value is None or value == "":
        raise ValueError(f"{where}: {key} is missing")
    if isinstance(value, str) and value.isascii() and value.isdigit():
        if len(value.lstrip("0")) > len(str(limit)):
            raise ValueError(f"{where}: {key} {shown(value, 27)} is larger than {limit:,}")
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: {key} must be a positive integer, got {shown(value)}")
    if value > limit:
        what = "GLM-4V's samplers ever give" if key == "frames" else "any decoder gives (geometry.MAX_SIDE)"
        raise ValueError(f"{where}: {key} {shown(value, 27)} is more than {what} ({limit:,})")
    return value


@lru_cache(maxsize=4096)
def _make_item(height: int, width: int, frames: int) -> MMItem:
    """Traces repeat a few sizes: resize each once."""
    return make_item(height, width, frames)
