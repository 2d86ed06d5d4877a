"""Owned temporary directories: a sweep removes those whose every owner has ended, however it ended, and never
one a live process holds, whoever made it."""
import errno
import os
import signal
import subprocess
import sys
import time

import pytest

from glmvit.cli import owned_dir

PREFIX = "glmvit-test-owned-"
MAKE_AND_WAIT = """
import sys, time
from glmvit.cli import owned_dir
print(owned_dir.make(sys.argv[1], sys.argv[2]), flush=True)
time.sleep(600)
"""
HOLD_AND_WAIT = """
import sys, time
from glmvit.cli import owned_dir
owned_dir.hold(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def child(script, *args):
    return subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)


def killed(process):
    process.send_signal(signal.SIGKILL)
    process.wait(60)


def test_a_live_owners_directory_is_kept_and_a_removed_one_is_gone(tmp_path):
    path = owned_dir.make(str(tmp_path), PREFIX)
    assert os.path.basename(path).startswith(f"{PREFIX}{os.getpid()}-")
    assert owned_dir.sweep(str(tmp_path), PREFIX) == [] and os.path.isdir(path)
    owned_dir.remove(path)
    assert os.listdir(tmp_path) == []


def test_a_directory_is_swept_once_its_maker_and_every_holder_are_killed(tmp_path):
    maker = child(MAKE_AND_WAIT, str(tmp_path), PREFIX)
    holder = None
    try:
        path = maker.stdout.readline().strip()
        (tmp_path / os.path.basename(path) / "frames").write_bytes(b"x")  # what a request in flight left
        holder = child(HOLD_AND_WAIT, path)
        assert holder.stdout.readline().strip() == "held"
        killed(maker)
        assert owned_dir.sweep(str(tmp_path), PREFIX) == [] and os.path.isdir(path)  # its worker lives on
        killed(holder)
        assert owned_dir.sweep(str(tmp_path), PREFIX) == [path] and os.listdir(tmp_path) == []
    finally:
        for process in (maker, holder):
            if process is not None and process.poll() is None:
                killed(process)


def test_a_sweep_leaves_other_names_and_young_staging_directories_alone(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / f".{PREFIX}young").mkdir()
    old = tmp_path / f".{PREFIX}old"
    old.mkdir()
    past = time.time() - 2 * owned_dir.STAGING_AGE_S
    os.utime(old, (past, past))
    assert owned_dir.sweep(str(tmp_path), PREFIX) == [str(old)]
    assert sorted(os.listdir(tmp_path)) == [f".{PREFIX}young", "other"]


def _no_flock(monkeypatch):
    def refuse(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(owned_dir.fcntl, "flock", refuse)


def test_a_filesystem_without_flock_still_gets_a_directory_no_sweep_removes(tmp_path, monkeypatch):
    _no_flock(monkeypatch)  # an NFS mount whose lock daemon is not running, a FUSE filesystem without locks
    path = owned_dir.make(str(tmp_path), PREFIX)  # a decode worker's scratch: the pool must still start
    owned_dir.hold(path)  # as the worker does
    monkeypatch.undo()
    assert owned_dir.sweep(str(tmp_path), PREFIX) == [] and os.path.isdir(path)  # unowned: never swept
    owned_dir.remove(path)
    assert os.listdir(tmp_path) == []


def test_a_hold_that_cannot_lock_closes_what_it_opened(tmp_path, monkeypatch):
    path = owned_dir.make(str(tmp_path), PREFIX)
    try:
        def refuse(fd, operation):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(owned_dir.fcntl, "flock", refuse)
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError):
            owned_dir.hold(path)
        assert len(os.listdir("/proc/self/fd")) == before
    finally:
        monkeypatch.undo()
        owned_dir.remove(path)
