"""What the budget explorer's file fields may read and write: anyone who reaches the served page can type a path.

Reads (a trace, a latency table) come only from regular files inside one directory, the :class:`Workspace` (the
directory ``make explorer`` was started in), with no hidden file or folder on the way, one of the field's suffixes
and at most ``MAX_FILE_BYTES``; uploads have the same bound. The export is a bare ``.json`` file name written in that
directory, replacing only an earlier export: never a link, a device, a record or any other file.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..costmodel import LatencyTable
from ..recorded import latency_table_from_json
from ..workloads import MMItem
from .common import write_atomic

WORKSPACE_ENV = "GLMVIT_EXPLORER_DIR"
MAX_FILE_BYTES = 16 * 2**20  # what a file field or an upload may bring in (a 100,000-item trace is ≈ 3 MiB of CSV)
MAX_EXPLORER_ITEMS = 100_000  # every change re-plans the workload, at ≈ 30 µs an item and budget set
EXPORT_KEY = "cudagraph_mm_encoder"  # what marks a file as an earlier export, safe to replace


@dataclass(frozen=True)
class Workspace:
    """The one directory the explorer's file fields may touch: anyone who reaches the served page can type a path.

    Reads: a regular file inside ``root`` (symlinks resolved first), no hidden file or folder on the way, one of
    the field's suffixes, at most ``MAX_FILE_BYTES``. Writes: a bare ``.json`` file name in ``root``, replacing only
    a regular file that is an earlier export."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).resolve())  # what every path is compared with

    @classmethod
    def default(cls) -> Workspace:
        """``$GLMVIT_EXPLORER_DIR`` (``make explorer`` sets it to where it was started), else this directory."""
        return cls(Path(os.environ.get(WORKSPACE_ENV) or Path.cwd()))

    def read(self, text: str, suffixes: Sequence[str], what: str) -> tuple[str, bytes]:
        """(name, bytes) of the file ``text`` names (relative to ``root``, or absolute inside it)."""
        path = self._inside(text, what)
        if path.suffix.lower() not in suffixes:
            raise ValueError(f"{what} {text!r}: must end in {', '.join(suffixes)}")
        return path.name, _read_regular(path, MAX_FILE_BYTES, f"{what} {text!r}")

    def write_export(self, name: str, data: bytes) -> Path:
        """Write ``data`` to ``root / name``, atomically; refuse names with folders and files that are not exports."""
        name = name.strip()
        if not name or Path(name).name != name or name.startswith(".") or not name.lower().endswith(".json"):
            raise ValueError(f"export to {name!r}: give a file name ending in .json, without folders "
                             f"(it is written in {self.root})")
        path = self.root / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise ValueError(f"{path}: exists and is not a regular file (a link, folder or device); not replacing it")
        if mode is not None and not _is_export(path):
            raise ValueError(f"{path}: exists and is not an earlier export; not replacing it")
        write_atomic(path, data)
        return path

    def _inside(self, text: str, what: str) -> Path:
        text = text.strip()
        given = Path(text)
        path = (given if given.is_absolute() else self.root / given).resolve()
        try:
            parts = path.relative_to(self.root).parts
        except ValueError:
            raise ValueError(f"{what} {text!r} is outside {self.root}: the explorer reads and writes only there "
                             "(upload a file from elsewhere)") from None
        if any(part.startswith(".") for part in parts):
            raise ValueError(f"{what} {text!r}: hidden files and folders are off limits")
        return path


def _read_regular(path: Path, limit: int, what: str) -> bytes:
    """At most ``limit`` bytes of a regular file (never a FIFO or a device, whatever it was swapped for)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as err:
        raise ValueError(f"{what}: cannot read it ({err.strerror or err})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{what}: not a regular file")
        data = f.read(limit + 1) if info.st_size <= limit else b""
    if info.st_size > limit or len(data) > limit:
        raise ValueError(f"{what}: larger than {limit >> 20} MiB")
    return data


def _is_export(path: Path) -> bool:
    try:
        data = json.loads(_read_regular(path, 2**16, str(path)))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and EXPORT_KEY in data


def bounded(requests: list[list[MMItem]], name: str) -> list[list[MMItem]]:
    """``requests`` if they have at most ``MAX_EXPLORER_ITEMS`` items; else a ValueError naming ``name``."""
    items = sum(map(len, requests))
    if items > MAX_EXPLORER_ITEMS:
        raise ValueError(f"{name}: {items:,} items; the explorer re-plans on every change and takes at most "
                         f"{MAX_EXPLORER_ITEMS:,} (python -m glmvit plan --trace takes the whole trace)")
    return requests


def table_from_bytes(data: bytes, name: str) -> LatencyTable:
    """A latency table from a file's bytes (an upload or a workspace file), as ``load_latency_table`` reads one: a
    recorded sweep (``"kind": "latency"``) or a plain ``{"budgets": [...]}``; a ValueError naming ``name`` otherwise."""
    try:
        return latency_table_from_json(json.loads(data), name)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"{name}: not a latency table (make one with python -m glmvit latency --json PATH): "
                         f"{err}") from None


def upload_bytes(upload: Any) -> bytes:
    """An ipywidgets upload's content, refused past ``MAX_FILE_BYTES``."""
    data = bytes(upload["content"])
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{upload['name']}: larger than {MAX_FILE_BYTES >> 20} MiB")
    return data
