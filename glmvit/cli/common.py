"""What every command shares: one-line argument errors, the model its flags describe (defaults from
:mod:`glmvit.defaults`, bounds from :mod:`glmvit.packing`), and output written atomically (JSON with provenance)."""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import stat
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch

from ..config import VisionConfig
from ..costmodel import LatencyTable
from ..defaults import DTYPES, default_device, default_dtype, default_tower, dtype_name, tower_config  # noqa: F401
from ..deployment import H200_BYTES
from ..files import STDOUT, file_kind, is_stdout, read_bounded
from ..model import GlmVisionEncoder
from ..random_weights import random_encoder
from ..recorded import latency_table_from_json
from ..records import Record, to_json
from ..weights import checkpoint_config, missing_checkpoint
from ..workloads import Preset, parse_bucket_config, shown
from .flags import (  # noqa: F401  (re-exported: every command imports them from here)
    DTYPE_NAMES,
    MAX_BUDGET_TOKENS,
    MAX_BUDGETS,
    SEED_MAX,
    Parser,
    add_model_args,
    budgets_arg,
    check_budgets,
    float_in,
    int_in,
    output_path,
    refuse_given_with,
)

# The flags a named preset (--workload) decides: its own fields, so a new field is refused with --workload at once.
PRESET_FLAGS = tuple(f.name for f in dataclasses.fields(Preset) if f.name != "description")
MAX_TABLE_BYTES = 16 << 20  # a latency table is tens of KiB (data/bench/latency.json: 34 KB)


def resolve_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the defaults (:mod:`glmvit.defaults`: device, config, dtype) in place; reject what cannot run
    (parser.error)."""
    if args.device is None:
        args.device = default_device()
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device (use cuda, cuda:N or cpu)")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r}: only cuda and cpu are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA GPU is available here (torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if args.weights and not Path(args.weights).exists():
        parser.error(f"--weights {missing_checkpoint(args.weights)}")
    if args.weights and not (Path(args.weights).is_dir() or Path(args.weights).suffix == ".safetensors"):
        kind = file_kind(os.stat(args.weights).st_mode)
        parser.error(f"--weights {args.weights}: {kind}, not a checkpoint (a directory with config.json and "
                     "*.safetensors, or a .safetensors file)")
    if args.weights and args.config != "auto":
        parser.error("--config applies to random weights; with --weights the checkpoint's config.json decides")
    if args.weights:
        try:
            checkpoint_config(args.weights)  # config.json read and checked now, before any other work
        except (ValueError, OSError) as err:
            parser.error(f"--weights: {err}")
    if args.config == "auto":
        args.config = default_tower(device, bool(args.weights))
    if args.dtype is None:
        args.dtype = default_dtype(device)


def refuse_preset_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """With ``--workload``, a usage error naming every :data:`PRESET_FLAGS` flag given too: the preset sets them, so
    a value given beside it would silently not be what ran. Flags a command does not define are skipped."""
    refuse_given_with(parser, args, "workload", PRESET_FLAGS, "the preset sets them (use --bucket-config instead)")


def bucket_config_arg(text: str) -> dict:
    """An argparse ``type``: a random-mm bucket config ``{(height, width, frames): probability}``."""
    try:
        return parse_bucket_config(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def vision_config(name: str) -> VisionConfig:
    """The config of a random-weights tower flag (:func:`glmvit.defaults.tower_config`)."""
    return tower_config(name)


def model_from_args(args: argparse.Namespace) -> GlmVisionEncoder:
    """The model the resolved flags describe: a checkpoint's tower (its own config) or random weights."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.weights:
        return GlmVisionEncoder.from_pretrained(args.weights, dtype=dtype, device=device)
    return random_encoder(vision_config(args.config), device, dtype, args.seed)


def describe(args: argparse.Namespace) -> str:
    towers = {"full": "GLM-4.1V vision tower", "tiny": "tiny test tower", "checkpoint": "checkpoint's vision tower"}
    tower = towers[args.config]
    weights = f"from {args.weights}" if args.weights else f"random weights (seed {args.seed})"
    return f"{tower}, {args.dtype}, on {args.device}, {weights}"


def check_writable(path: str | Path, created: list[Path] | None = None) -> Path:
    """Fail now, before any work, if ``path`` cannot be written the way :func:`atomic_output` will write it (its
    missing folders are created, and appended to ``created`` when given): for a regular or new file, a file is
    created and removed beside its target."""
    path = Path(path)
    target, existing, direct = _output_target(path)
    if direct:
        if not is_stdout(path) and not os.access(target, os.W_OK):
            raise PermissionError(f"{path}: cannot write here (permission denied)")
        return path
    made: list[Path] = []
    try:
        _make_folders(target.parent, made)
        fd, probe = _create_beside(target, ".probe", None)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        remove_folders(made)
        raise OSError(f"{path}: cannot write here ({err.strerror or err})") from None
    if created is not None:
        created += made
    if existing is not None and not os.access(target, os.W_OK):
        raise PermissionError(f"{path}: cannot write here (the file is read-only)")
    return path


def _make_folders(folder: Path, made: list[Path]) -> None:
    """``mkdir -p folder``, appending each folder it creates (outermost first) to ``made``."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for each in reversed(missing):
        try:
            each.mkdir()
        except FileExistsError:
            continue
        made.append(each)


def remove_folders(folders: list[Path]) -> None:
    """Remove the folders (innermost last in the list) that are still empty, innermost first."""
    for folder in reversed(folders):
        with suppress(OSError):
            folder.rmdir()


@contextmanager
def removed_on_failure(folders: list[Path]) -> Iterator[None]:
    """If the block fails, remove ``folders`` (those :func:`check_writable` created for the outputs) again where
    they are still empty, so that a failed command leaves no trace."""
    try:
        yield
    except BaseException:
        remove_folders(folders)
        raise


def refuse_outputs_over_inputs(parser: argparse.ArgumentParser, outputs: dict[str, str | Path | None],
                               inputs: dict[str, str | Path | None]) -> None:
    """A usage error if an output names an input (writing it would destroy what is being read) or two outputs name
    one file: checked before any work. Keys name the outputs' flags and the inputs ("the --trace input")."""
    given_out = {flag: Path(p).resolve() for flag, p in outputs.items() if p}
    seen: dict[Path, str] = {}
    for flag, path in given_out.items():
        if path in seen:
            parser.error(f"{seen[path]} and {flag} name the same file")
        seen[path] = flag
    for flag, path in given_out.items():
        for in_name, given in inputs.items():
            if given and (path == Path(given).resolve() or _same_file(path, given)):
                parser.error(f"{flag} {outputs[flag]} is {in_name}: writing it would destroy it")


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two existing paths are one file (a hard link: same device and inode); False if either is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@contextmanager
def atomic_output(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new contents into. Standard output (:func:`is_stdout`: ``-``,
    ``/dev/stdout``, the file fd 1 holds), a character or block device or a FIFO (``/dev/null``, a named pipe):
    written in place (a stream cannot be replaced, nor un-written on failure); a FIFO must have a reader within
    FIFO_WAIT_S. Any other file, wherever it is (``/dev/shm`` and ``/proc`` included): a temporary file beside its
    target (the resolved path: a symlink is written through), renamed onto it when the block ends and removed if it
    fails, so there is never a half-written file; it keeps the mode of the file it replaces, or gets the umask's.
    A directory or a socket is refused. OS errors name ``path``.

    A file object, not a path: a library that writes by name may replace what it is given (safetensors'
    ``save_file`` writes a temporary file and renames it, which turned ``/dev/null`` into a regular file). Write
    bytes (e.g. ``safetensors.torch.save``) into it instead.
    """
    path = Path(path)
    target, existing, direct = _output_target(path)
    if direct:
        try:
            with _open_in_place(path, existing) as f:
                yield f
        except OSError as err:
            raise OSError(f"{path}: writing failed ({err.strerror or err})") from None
        return
    try:
        fd, tmp = _create_beside(target, ".tmp", existing)
    except OSError as err:
        raise OSError(f"{path}: cannot write here ({err.strerror or err})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        os.replace(tmp, target)
    except BaseException as err:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise OSError(f"{path}: writing failed ({err.strerror or err}); nothing was written") from None
        raise


FIFO_WAIT_S = 30.0  # how long an output FIFO may go without a reader before writing it fails


def _open_in_place(path: Path, existing: os.stat_result | None) -> BinaryIO:
    """``path`` opened for writing in place: standard output's descriptor (a duplicate, so that closing it keeps
    fd 1 open), a FIFO once a reader has opened it (ENXIO until then: retried up to FIFO_WAIT_S), or the device."""
    if is_stdout(path):
        with suppress(AttributeError, ValueError):
            sys.__stdout__.flush()  # type: ignore[union-attr]
        return os.fdopen(os.dup(1), "wb")
    if existing is not None and stat.S_ISFIFO(existing.st_mode):
        deadline = time.monotonic() + FIFO_WAIT_S
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as err:
                if err.errno != errno.ENXIO or time.monotonic() > deadline:
                    if err.errno == errno.ENXIO:
                        raise OSError(errno.ENXIO, f"no process read the FIFO within {FIFO_WAIT_S:g} s") from None
                    raise
                time.sleep(0.05)
                continue
            os.set_blocking(fd, True)
            return os.fdopen(fd, "wb")
    return open(path, "wb")


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_output`: no half-written regular file on failure."""
    with atomic_output(path) as f:
        f.write(data)


def _output_target(path: Path) -> tuple[Path, os.stat_result | None, bool]:
    """(the file to write, its stat if it exists, whether to write it in place) for an output ``path``."""
    if str(path) == STDOUT:
        return path, None, True
    try:
        existing = os.stat(path)  # follows links, /dev/stdout's too
    except FileNotFoundError:  # a new file, or a dangling symlink: created at its target
        return Path(os.path.realpath(path)), None, False
    except OSError as err:
        raise OSError(f"{path}: cannot write here ({err.strerror or err})") from None
    mode = existing.st_mode
    if is_stdout(path):  # a stream, whatever it is: the shell's redirection, a pipe, a terminal
        return path, existing, True
    if stat.S_ISREG(mode):  # wherever it is (/dev/shm, /proc): a failed write must leave the old file
        return Path(os.path.realpath(path)), existing, False
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path}: is a directory, not an output file")
    if not (stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode)):
        raise OSError(f"{path}: {file_kind(mode)}; outputs go to regular files, devices (/dev/null), FIFOs or "
                      "standard output (-)")
    return path, existing, True


def _create_beside(target: Path, suffix: str, existing: os.stat_result | None) -> tuple[int, Path]:
    """A new empty file ``.NAME.XXXXXXXX<suffix>`` beside ``target``: mode 0666 less the umask (the kernel applies
    it), or the mode (and, where allowed, the owner) of ``existing``, set before anything is written."""
    for _ in range(100):
        tmp = target.with_name(f".{target.name}.{os.urandom(4).hex()}{suffix}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        if existing is not None:
            try:
                with suppress(PermissionError):  # first: a change of owner clears set-id bits
                    os.fchown(fd, existing.st_uid, existing.st_gid)
                os.fchmod(fd, stat.S_IMODE(existing.st_mode))
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
        return fd, tmp
    raise FileExistsError(f"{target.parent}: no free temporary file name")


def read_latency_table(path: str | Path) -> LatencyTable:
    """A latency table file (``python -m glmvit latency --json``), read through :func:`glmvit.files.read_bounded`:
    every problem is a ValueError naming the file."""
    try:
        raw = read_bounded(path, MAX_TABLE_BYTES, "latency table")
    except FileNotFoundError:
        raise ValueError(f"{path}: cannot read the latency table (no such file)") from None
    except OSError as err:
        raise ValueError(str(err)) from None
    try:
        return latency_table_from_json(json.loads(raw), str(path))
    except (ValueError, RecursionError, AttributeError) as err:
        raise ValueError(f"{path}: not a latency table (make one with python -m glmvit latency --json PATH): "
                         f"{shown(err, 200)}") from None


def write_json(path: str | Path, data: Any) -> None:
    """JSON (indent 1) written atomically; prints where it went."""
    write_atomic(check_writable(path), (json.dumps(data, indent=1) + "\n").encode())
    if not is_stdout(path):
        print(f"wrote {path}")



def plural(count: int, noun: str, plural_form: str | None = None) -> str:
    """``"1 replay"``, ``"3 replays"``: a count and its noun, in the right number."""
    return f"{count:,} {noun if count == 1 else plural_form or noun + 's'}"


def device_memory_bytes(device: torch.device | str) -> int:
    """Memory of ``device``: the GPU's total memory, or the host's physical memory for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_memory_bytes(device: torch.device | str) -> int:
    """Memory ``device`` has free for new work now: the GPU's free memory (``torch.cuda.mem_get_info``), or the
    host's available memory for the CPU (``MemAvailable`` of /proc/meminfo; elsewhere its free pages)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def graph_memory_target(device: torch.device | str) -> int:
    """The memory a budget set must fit: this GPU's on CUDA; elsewhere one H200's, the GPU the tools plan for."""
    device = torch.device(device)
    return device_memory_bytes(device) if device.type == "cuda" else H200_BYTES


def write_record(path: str | Path, record: Record) -> None:
    """A typed record (:mod:`glmvit.records`) written atomically; prints where it went."""
    write_atomic(check_writable(path), to_json(record).encode())
    if not is_stdout(path):
        print(f"wrote {path}")
