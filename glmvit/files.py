"""Reading a file a user names (a trace, a latency table, a checkpoint's JSON): a regular file, bounded in size.

:func:`read_bounded` is the one way the package and its tools read such a file whole. A FIFO would block the
read until someone writes to it, and a device such as ``/dev/zero`` never ends: both, and directories and sockets,
are refused before a byte is read (checked with ``stat`` before opening, so opening has no side effect on a device,
and again on the open descriptor, so a file swapped in between is caught). The file is opened non-blocking and
read up to one byte past the limit, so a file that grows while it is read is refused too. Every problem is one
line naming the file: ``FileNotFoundError``, ``PermissionError`` or another ``OSError`` for what the system says,
``ValueError`` for a file of the wrong kind or size.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["read_bounded", "file_kind", "is_stdout", "STDOUT"]

STDOUT = "-"  # an output path that means this process's standard output

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: "a regular file", "a FIFO (named pipe)", "a character device", …"""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_bounded(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of ``path``, a regular file (a symlink to one is followed) of at most ``max_bytes`` bytes.

    ``what`` names the file in errors ("trace", "latency table", …).
    """
    path = Path(path)
    before = _stat(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise _os_error(path, what, err) from None
    with os.fdopen(fd, "rb") as f:
        after = os.fstat(f.fileno())
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise ValueError(f"{path}: the {what} was replaced while it was opened; try again")
        _check(path, what, after, max_bytes)
        try:
            data = f.read(max_bytes + 1)
        except OSError as err:
            raise _os_error(path, what, err) from None
    if len(data) > max_bytes:
        raise ValueError(f"{path}: the {what} grew past {_size(max_bytes)} while it was read")
    return data


def _stat(path: Path, what: str) -> os.stat_result:
    try:
        result = os.stat(path)
    except OSError as err:
        raise _os_error(path, what, err) from None
    _check(path, what, result, None)
    return result


def _check(path: Path, what: str, result: os.stat_result, max_bytes: int | None) -> None:
    if not stat.S_ISREG(result.st_mode):
        raise ValueError(f"{path}: {file_kind(result.st_mode)}, not a regular file: a {what} must be one")
    if max_bytes is not None and result.st_size > max_bytes:
        raise ValueError(f"{path}: {_size(result.st_size)}, larger than any {what} ({_size(max_bytes)} at most)")


def _os_error(path: Path, what: str, err: OSError) -> OSError:
    """The system's error as one line naming the file, of the same class (FileNotFoundError stays one)."""
    if isinstance(err, FileNotFoundError):
        return FileNotFoundError(f"{path}: no such {what}")
    reason = "permission denied" if isinstance(err, PermissionError) else err.strerror or str(err)
    return type(err)(f"{path}: cannot read the {what} ({reason})")


def _size(n: int) -> str:
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def is_stdout(path: str | Path) -> bool:
    """Whether an output ``path`` is this process's standard output: ``-``, or a name of the file descriptor 1
    holds (``/dev/stdout``, ``/proc/self/fd/1``, or the file the shell redirected it to)."""
    if str(path) == STDOUT:
        return True
    try:
        return os.path.samestat(os.stat(path), os.fstat(1))
    except (OSError, ValueError):
        return False
