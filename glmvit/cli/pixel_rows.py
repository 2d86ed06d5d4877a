"""A tensor handed from a decode worker to the server without a copy through a pipe (a request's uint8 frames, or
its pixel rows made in the worker: ``serve --rows host``).

A worker writes a request's tensor to a file of its own in a directory on ``/dev/shm`` (the
pool's, made by :func:`shared_dir`; memory, not disk) and sends only its name; the server maps the file
(copy-on-write: nothing is copied unless written) and unlinks it at once, so the bytes live exactly as long as the
tensor that views them. Where ``/dev/shm`` is missing or has less than :data:`MIN_FREE` bytes free, or a write
fails (it filled up), the bytes travel through the pipe instead. :func:`remove_shared_dir` removes what
a killed worker may have left. The directory is an owned one (:mod:`glmvit.cli.owned_dir`): a server killed
(SIGKILL) cannot remove it, and the next server's start (:func:`sweep_shared_dirs`) or directory removes it.
"""
from __future__ import annotations

import mmap
import os
import uuid
from dataclasses import dataclass
from typing import Iterable

import torch

from . import owned_dir

SHM = "/dev/shm"
PREFIX = "glmvit-frames-"  # a server's directory of hand-offs under SHM (owned_dir's naming: PREFIX<pid>-<random>)
MIN_FREE = 1 << 30  # /dev/shm must have this much free to be used (a container's default of 64 MiB is not)


def no_room() -> str | None:
    """Why :func:`shared_dir` gives no directory now, in a few words (None: it would give one)."""
    try:
        stat = os.statvfs(SHM)
    except OSError as err:
        return f"{SHM} cannot be read ({err.strerror})"
    free = stat.f_bavail * stat.f_frsize
    if free < MIN_FREE:
        return f"{SHM} has {free >> 20} MiB free, less than {MIN_FREE >> 20} MiB"
    return None


def shared_dir() -> str | None:
    """A new directory on /dev/shm for one server's hand-offs, or None where /dev/shm cannot hold them."""
    try:
        if no_room() is not None:
            return None
        return owned_dir.make(SHM, PREFIX)
    except OSError:
        return None


def remove_shared_dir(folder: str | None) -> None:
    if folder:
        owned_dir.remove(folder)


def sweep_shared_dirs() -> list[str]:
    """Remove the directories (and frames) servers killed before they could remove their own left (the paths)."""
    return owned_dir.sweep(SHM, PREFIX)


@dataclass(frozen=True)
class PixelRows:
    """A tensor's shape and dtype, and its bytes: a file under a shared directory (``path``) or ``data``."""

    shape: tuple[int, ...]
    dtype: str  # torch's name: uint8, float32, bfloat16, ...
    path: str | None = None
    data: bytes | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, folder: str | None) -> "PixelRows":
        """``tensor``'s rows in a new file under ``folder`` (None, or a failed write: as bytes)."""
        tensor = tensor.contiguous()
        raw = tensor.view(torch.uint8).numpy() if tensor.numel() else None
        dtype = str(tensor.dtype).removeprefix("torch.")
        if folder is not None and raw is not None:
            path = os.path.join(folder, uuid.uuid4().hex)
            try:
                with open(path, "wb") as f:
                    raw.tofile(f)
                return cls(tuple(tensor.shape), dtype, path=path)
            except OSError:
                _unlink(path)
        return cls(tuple(tensor.shape), dtype, data=raw.tobytes() if raw is not None else b"")

    @classmethod
    def streamed(cls, chunks: Iterable[torch.Tensor], folder: str) -> "PixelRows | None":
        """``chunks`` (each (n_i, width), one dtype) one after another as one (Σ n_i, width) tensor in a new file
        under ``folder``, each chunk written as it comes: a caller that makes them one at a time never holds the
        whole tensor. None, the file removed, when a write fails (``folder`` full) or there is no chunk: the caller
        hands over something else. Chunks of another width or dtype than the first's raise ValueError."""
        path = os.path.join(folder, uuid.uuid4().hex)
        count, first = 0, None
        try:
            with open(path, "wb") as f:
                for chunk in chunks:
                    if chunk.ndim != 2:
                        raise ValueError(f"a chunk of {tuple(chunk.shape)}: chunks are (rows, width)")
                    first = chunk if first is None else first
                    if chunk.shape[1] != first.shape[1] or chunk.dtype != first.dtype:
                        raise ValueError(f"a chunk of {tuple(chunk.shape)} {chunk.dtype} after chunks of width "
                                         f"{first.shape[1]} in {first.dtype}")
                    chunk.contiguous().view(torch.uint8).numpy().tofile(f)
                    count += chunk.shape[0]
        except OSError:
            first = None
        except BaseException:
            _unlink(path)
            raise
        if first is None:
            _unlink(path)
            return None
        return cls((count, first.shape[1]), str(first.dtype).removeprefix("torch."), path=path)

    def discard(self) -> None:
        """Remove the shared file of rows nobody will take (their request was cancelled)."""
        if self.path is not None:
            _unlink(self.path)

    def tensor(self) -> torch.Tensor:
        """The rows as a tensor (a shared file is mapped, then unlinked: it is gone once the tensor is; a symbolic
        link is refused, OSError)."""
        dtype = getattr(torch, self.dtype)
        if self.path is None:
            buffer = bytearray(self.data or b"")
            return torch.frombuffer(buffer, dtype=dtype).reshape(self.shape) if buffer else \
                torch.empty(self.shape, dtype=dtype)
        try:  # never through a symbolic link: only the file that was written is read
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
        finally:
            os.unlink(self.path)
        return torch.frombuffer(mapped, dtype=dtype).reshape(self.shape)


def _unlink(path: str) -> None:
    """Remove ``path`` if it is there."""
    try:
        os.unlink(path)
    except OSError:
        pass
