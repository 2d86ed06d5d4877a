"""Where the commands' outputs go: standard output holds the output alone (status text goes to stderr), only
devices and FIFOs are written in place (a regular file anywhere is replaced whole, or not at all), a failed command
leaves no folder it made, and an output path that cannot be one is refused in one line."""
import json
import os
from pathlib import Path

import pytest
import safetensors.torch

from glmvit.cli import common
from glmvit.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
COFFEE = str(ROOT / "data" / "images" / "coffee.jpg")
PLAN = ["plan", "--bucket-config", "{(224, 224, 1): 1.0}", "--num-requests", "5"]


def exit_code(argv):
    try:
        return cli_main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("name", ["-", "/dev/stdout"])
def test_an_output_on_stdout_holds_the_output_alone(name, tmp_path, monkeypatch, capfdbinary):
    monkeypatch.chdir(tmp_path)  # a "-" taken for a file name would land here
    assert cli_main(["encode", COFFEE, "--quiet", "--out", name]) == 0
    out, err = capfdbinary.readouterr()
    assert safetensors.torch.load(out)["item_0"].shape[0] > 0
    assert b"glmvit encode:" in err and b"saved 1 embedding" in err
    assert cli_main([*PLAN, "--json", name]) == 0
    out, err = capfdbinary.readouterr()
    assert json.loads(out)["requests"] == 5, out[:200]
    assert b"5 requests" in err
    assert list(tmp_path.iterdir()) == []


def test_a_regular_file_under_dev_is_replaced_whole_or_not_at_all(tmp_path):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm here")
    folder = shm / f"glmvit-test-{os.getpid()}"
    folder.mkdir()
    try:
        precious = folder / "precious.safetensors"
        precious.write_bytes(b"the user's file")
        with pytest.raises(OSError, match="precious.safetensors: writing failed .*nothing was written"):
            with common.atomic_output(precious) as f:
                f.write(b"partial")
                raise OSError(28, "No space left on device")
        assert precious.read_bytes() == b"the user's file"
        inode = precious.stat().st_ino
        common.write_atomic(precious, b"new")
        assert precious.read_bytes() == b"new" and precious.stat().st_ino != inode  # renamed onto, not rewritten
    finally:
        for each in folder.iterdir():
            each.unlink()
        folder.rmdir()


def test_a_failed_encode_removes_the_folders_it_made(tmp_path, monkeypatch, capsys):
    from glmvit.cli import encode

    def fail(path, kind, **found):
        raise ValueError(f"{path}: cannot decode it")

    monkeypatch.setattr(encode, "load", fail)
    out = tmp_path / "new" / "deeper" / "emb.safetensors"
    assert exit_code(["encode", COFFEE, "--quiet", "--out", str(out), "--json", str(tmp_path / "kept.json")]) == 1
    assert "cannot decode it" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, flag", [(["encode", COFFEE], "--out"), (["encode", COFFEE], "--json"),
                                           (PLAN, "--export"), (PLAN, "--json")])
def test_an_empty_output_path_is_refused_in_one_line(command, flag, capsys):
    assert exit_code([*command, flag, ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag}: an empty path" in err, err


def test_a_fifo_nobody_reads_fails_in_one_line_instead_of_hanging(tmp_path, monkeypatch, capsys):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    monkeypatch.setattr(common, "FIFO_WAIT_S", 0.2)
    assert exit_code([*PLAN, "--json", str(fifo)]) == 1
    err = capsys.readouterr().err
    last = err.splitlines()[-1]  # after the warnings about the recorded latency table
    assert last.startswith("glmvit plan: error: ") and "no process read the FIFO within 0.2 s" in last, err
