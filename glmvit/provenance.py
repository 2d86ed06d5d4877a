"""Where a recorded result came from: the git commit of this checkout and the GPU driver.

A copy of the working tree sent to another machine may carry no ``.git``, or a stale one that names an older
commit, so ``GLMVIT_GIT_COMMIT``, when set, names the commit and wins over git; ``git_dirty`` is then ``None``
(unknown), never ``False``.
"""
from __future__ import annotations

import os
import shutil
import subprocess

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
