"""Failure paths end in one line on stderr and a non-zero exit, never a traceback: an unknown command, a checkpoint
that is a device, a URL that does not parse, a file name holding a line break, a spawned server that does not
listen in time, a benchmark whose every request failed."""
import pytest
from test_serve import ServerThread, service_for

from glmvit.cli import main as cli_main
from glmvit.cli.serve_app import HttpLimits

pytestmark = pytest.mark.timeout(120)


def exit_and_err(argv, capsys):
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, code, words", [
    (["frobnicate"], 2, "unknown command frobnicate; the commands: demo, encode"),
    (["encode", "data/images/coffee.jpg", "--weights", "/dev/zero"], 2,
     "--weights /dev/zero: a character device, not a checkpoint"),
    (["encode", "data/images/coffee.jpg", "--weights", "README.md"], 2,
     "--weights README.md: a regular file, not a checkpoint"),
    (["bench-serve", "--url", "http://[::1"], 2, "--url 'http://[::1': not a URL (Invalid IPv6 URL)"),
    (["bench-serve", "--url", "http://127.0.0.1:99999"], 2, "not a URL (Port out of range 0-65535)"),
    (["bench-serve", "--spawn", "--startup-timeout", "1", "--device", "cpu", "--num-prompts", "1"], 1,
     "the spawned server did not start listening within 1 s (--startup-timeout"),
])
def test_a_failure_is_one_line_and_a_non_zero_exit(argv, code, words, capsys):
    got, err = exit_and_err(argv, capsys)
    assert got == code and words in err and err.count("\n") == 1, err


def test_a_line_break_in_a_file_name_stays_inside_its_one_line_error(tmp_path, capsys):
    bad = tmp_path / "a\nb.png"
    bad.write_bytes(b"not a png")
    code, err = exit_and_err(["encode", str(bad)], capsys)
    assert code == 1 and err.count("\n") == 1 and "a\\nb.png" in err, err
    code, err = exit_and_err(["encode", str(tmp_path / "c\rd.png")], capsys)  # a usage error (no such file)
    assert code == 1 and err.count("\n") == 1 and "c\\rd.png" in err, err


def test_a_line_break_in_a_file_name_stays_inside_its_status_line(tmp_path, capsys):
    import shutil

    good = tmp_path / "e\nf.jpg"
    shutil.copy("data/images/coffee.jpg", good)
    assert cli_main(["encode", "--quiet", str(good)]) == 0
    out = capsys.readouterr().out
    assert "e\\nf.jpg: image grid" in out and not any(line.startswith("f.jpg") for line in out.splitlines()), out


def test_bench_serve_exits_non_zero_when_every_request_failed(tiny_model, tmp_path, capsys):
    service = service_for(tiny_model, limits=HttpLimits(max_body_bytes=1024))  # every request: 413
    with ServerThread(service) as server:
        code, err = exit_and_err(["bench-serve", "--url", server.url, "--bucket-config", "{(224, 224, 1): 1.0}",
                                  "--num-prompts", "2", "--warmup-requests", "0", "--device", "cpu",
                                  "--json", str(tmp_path / "x.json")], capsys)
    assert code == 1 and (tmp_path / "x.json").exists()  # the record still says what happened
    assert err.strip().splitlines()[-1].startswith("glmvit bench-serve: error: every request failed in 1 run of 1 "
                                                   "(first error: HTTP 413"), err
