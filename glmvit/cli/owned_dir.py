"""Temporary directories that outlive no owner: a server's folder of shared-memory frames, a decode worker's
scratch. A process removes its own when it ends cleanly; one killed (SIGKILL, the OOM killer) cannot, so the next
directory of the same prefix made under the same parent sweeps up every one whose owners have all ended.

Ownership is a shared ``flock`` on the directory, held for the life of each process that uses it (:func:`make`
takes one, :func:`hold` takes one in another process handed the path): the kernel drops it when the process ends,
however it ends. :func:`sweep` removes a directory of the prefix only when it can take the exclusive lock, i.e.
when no process holds it. No pid is read, so neither a reused pid nor a parent shared across pid namespaces
(``/dev/shm`` of containers run with ``--ipc=host``) can make it remove a live one. A directory is made under a
hidden staging name, locked, then renamed to its own name, so a sweep never meets one not yet locked (a staging
directory is swept only once it is a minute old). Only directories of this user's are swept. On a filesystem that
refuses ``flock`` (NFS without its lock daemon, some FUSE mounts) a directory is still made, unowned: named
``unowned-<prefix>…`` so that no sweep ever matches it, it is removed only by :func:`remove`, as a plain temporary
directory is.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import tempfile
import threading
import time
import uuid

STAGING_AGE_S = 60.0  # a staging directory this old, unlocked, was left by a process killed while it made one
_held: dict[str, int] = {}  # path → the open descriptor whose lock says this process owns it
_lock = threading.Lock()
UNOWNED = "unowned-"  # the name's start for a directory on a filesystem without flock: outside every sweep
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}  # flock unsupported here


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def make(parent: str, prefix: str) -> str:
    """A new directory ``parent/prefix<pid>-<random>``, owned by this process until :func:`remove` (or its end);
    the directories of ``prefix`` no live process owns are swept first. OSError if it cannot be made."""
    sweep(parent, prefix)
    staging = tempfile.mkdtemp(prefix=f".{prefix}", dir=parent)
    try:
        fd = _open_dir(staging)
    except OSError:
        os.rmdir(staging)
        raise
    try:
        owned = _lock_shared(fd)
        name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex}"
        path = os.path.join(parent, name if owned else UNOWNED + name)
        os.rename(staging, path)
    except BaseException:
        os.close(fd)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if not owned:
        os.close(fd)
        return path
    with _lock:
        _held[path] = fd
    return path


def _lock_shared(fd: int) -> bool:
    """Take a shared flock on ``fd``: True, or False where its filesystem has no flock (any other error raises)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as err:
        if err.errno in _NO_LOCKS:
            return False
        raise
    return True


def hold(path: str) -> None:
    """Own ``path`` (made by another process's :func:`make`) too, until :func:`remove` or this process's end (on a
    filesystem without flock: nothing to own, nothing done)."""
    fd = _open_dir(path)
    try:
        owned = _lock_shared(fd)
    except BaseException:
        os.close(fd)
        raise
    if not owned:
        os.close(fd)
        return
    with _lock:
        old = _held.pop(path, None)
        _held[path] = fd
    if old is not None:
        os.close(old)


def remove(path: str) -> None:
    """Remove ``path`` and everything in it, and give up this process's hold on it (if any)."""
    shutil.rmtree(path, ignore_errors=True)
    with _lock:
        fd = _held.pop(path, None)
    if fd is not None:
        os.close(fd)


def sweep(parent: str, prefix: str) -> list[str]:
    """Remove the directories of ``prefix`` under ``parent`` that no live process owns; the paths removed."""
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        staging = entry.name.startswith(f".{prefix}")
        if not (staging or entry.name.startswith(prefix)):
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                continue
            if staging and time.time() - info.st_mtime < STAGING_AGE_S:
                continue
            fd = _open_dir(entry.path)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live process holds it
            os.close(fd)
            continue
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
        finally:
            os.close(fd)
    return removed


__all__ = ["make", "hold", "remove", "sweep"]
