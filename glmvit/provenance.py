"""Where a recorded result came from: device, driver, library versions, the git commit, the command and the date.

A copy of the working tree sent to another machine may carry no ``.git``, or a stale one that names an older
commit, so ``GLMVIT_GIT_COMMIT``, when set, names the commit and wins over git; ``git_dirty`` is then ``None``
(unknown), never ``False``.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT_ENV = "GLMVIT_GIT_COMMIT"


def command_output(*args: str) -> str | None:
    """stdout of a command, stripped; None when it is missing or fails."""
    try:
        return subprocess.run(args, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def git_state() -> dict:
    """{"git_commit", "git_dirty", "commit_source"}: from ``GLMVIT_GIT_COMMIT`` when set, else from git."""
    given = os.environ.get(COMMIT_ENV)
    if given:
        return {"git_commit": given, "git_dirty": None, "commit_source": COMMIT_ENV}
    commit = command_output("git", "-C", REPO, "rev-parse", "HEAD")
    if not commit:
        return {"git_commit": None, "git_dirty": None, "commit_source": None}
    dirty = command_output("git", "-C", REPO, "status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(dirty), "commit_source": "git"}


def gpu_driver() -> str | None:
    """The NVIDIA driver version from nvidia-smi (None without it)."""
    if not shutil.which("nvidia-smi"):
        return None
    out = command_output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
    return out.splitlines()[0] if out else None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - a missing or broken optional package is just "not there"
        return None


def collect(device: torch.device | str, command: str | None = None) -> dict[str, Any]:
    """Where and how a result was measured: device, driver, library versions, git commit, command line, date."""
    device = torch.device(device)
    info: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}",
                    multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    driver=gpu_driver(), cuda=torch.version.cuda,
                    # the optional CUDA libraries whose presence changes which kernels run (pyproject's `cuda` extra)
                    cudnn_frontend=_version("cudnn"), nvmath=_version("nvmath"))
    else:
        info.update(gpu=None, cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    info.update(
        torch=torch.__version__, triton=_version("triton"), transformers=_version("transformers"),
        python=platform.python_version(), **git_state(),
        command=command if command is not None else " ".join([sys.executable, *sys.argv]),
        date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    return info


def weights_identity(path: str | Path) -> dict[str, Any]:
    """A cheap identity of a checkpoint: its resolved path, its safetensors files' names and sizes, and one sha256
    over those names and sizes and the bytes of its config.json and index. No weight is read."""
    path = Path(path).resolve()
    directory = path if path.is_dir() else path.parent
    weights = sorted(directory.glob("*.safetensors")) if path.is_dir() else [path]
    small = [f for f in (directory / "config.json", directory / "model.safetensors.index.json") if f.is_file()]
    digest = hashlib.sha256()
    files = []
    for file in weights:
        size = file.stat().st_size
        files.append({"name": file.name, "bytes": size})
        digest.update(f"{file.name}\t{size}\n".encode())
    for file in small:
        digest.update(f"{file.name}\n".encode() + file.read_bytes())
    return {"path": str(path), "files": files, "hashed_json": [f.name for f in small], "sha256": digest.hexdigest()}
