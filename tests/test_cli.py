"""The command line: the demo (main job), encode and plan run on CPU and say what they did; every bad invocation
of every command is one line on stderr and a non-zero exit, before any work."""
import hashlib
import importlib
import importlib.util
import json
import os
import re
import socket
import stat
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import glmvit.cli.bench
import glmvit.cli.common
import glmvit.cli.encode
import glmvit.cli.plan
import glmvit.encoder
from glmvit import GlmVisionEncoder
from glmvit.__main__ import main
from glmvit.modes import RunMode
from tests.test_processing import png_claiming


def test_demo_encodes_every_sample_item(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for name in ("astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg", "clip.gif"):
        assert name in out
    assert "emulated (no CUDA graphs on CPU)" in out
    diff = float(out.rsplit("max |runner − eager| = ", 1)[1].split()[0])
    assert diff < 1e-4
    assert "eager ms: the median of 3 calls per item, after 2 warm-up calls of its shape" in out


def test_encode_saves_embeddings_with_what_made_them(tmp_path, capsys):
    dest, summary = tmp_path / "emb.safetensors", tmp_path / "emb.json"
    assert main(["encode", "data/images/coffee.jpg", "data/clip.gif", "--out", str(dest), "--json", str(summary),
                 "--quiet"]) == 0
    saved = load_file(str(dest))
    assert set(saved) == {"item_0", "item_1"} and saved["item_0"].shape[1] == 64
    assert "video grid" in capsys.readouterr().out
    with safe_open(str(dest), "pt") as f:
        meta = {k: json.loads(v) for k, v in f.metadata().items()}
    image, video = meta["item_0"], meta["item_1"]
    assert image["source"] == os.path.abspath("data/images/coffee.jpg") and image["kind"] == "image"
    assert image["sha256"] == hashlib.sha256(open("data/images/coffee.jpg", "rb").read()).hexdigest()
    assert image["timestamps"] is None and image["tokens"] == saved["item_0"].shape[0]
    t, h, w = video["grid_thw"]
    assert video["kind"] == "video" and len(video["timestamps"]) == t and t * h * w // 4 == saved["item_1"].shape[0]
    assert video["frame_indices"] and len(video["frame_indices"]) == 2 * video["grid_thw"][0]  # pairs of frames
    assert meta["dtype"] == "float32" and meta["vision_config"]["hidden_size"] == 64
    assert meta["weights"] == {"random": True, "seed": 0} and "torch" in meta["provenance"]
    report = json.loads(summary.read_text())
    assert report["items"] == [image, video] and report["out"] == str(dest)


def test_encode_records_the_checkpoints_identity(checkpoint, tmp_path):
    dest = tmp_path / "emb.safetensors"
    assert main(["encode", "data/images/coffee.jpg", "--weights", str(checkpoint), "--device", "cpu",
                 "--out", str(dest)]) == 0
    with safe_open(str(dest), "pt") as f:
        weights = json.loads(f.metadata()["weights"])
    shards = sorted(checkpoint.glob("*.safetensors"))
    assert weights["path"] == str(checkpoint.resolve()) and len(shards) > 1
    assert [f["name"] for f in weights["files"]] == [p.name for p in shards]
    assert weights["hashed_json"] == ["config.json", "model.safetensors.index.json"] and len(weights["sha256"]) == 64


@pytest.fixture
def no_model(monkeypatch):
    """Any model being built is a failure: the check must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started before the arguments were checked")

    monkeypatch.setattr(glmvit.cli.common, "random_encoder", refuse)
    monkeypatch.setattr(GlmVisionEncoder, "from_pretrained", refuse)
    monkeypatch.setattr(glmvit.cli.plan, "evaluate_budgets", refuse)
    monkeypatch.setattr(glmvit.cli.bench, "run_benchmark", refuse)


def bad_files(tmp_path):
    """One file per way a user's file can be wrong, and the message naming it."""
    jpeg = open("data/images/coffee.jpg", "rb").read()
    png = tmp_path / "good.png"
    Image.open("data/images/coffee.jpg").save(png)
    (tmp_path / "folder.jpg").mkdir()
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (tmp_path / "truncated.png").write_bytes(png.read_bytes()[:2000])
    (tmp_path / "text.gif").write_text("GIF? no, just text")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    Image.new("RGB", (6000, 20)).save(tmp_path / "sliver.png")
    return {"missing.jpg": "missing.jpg: no such file", "folder.jpg": "folder.jpg: not a regular file",
            "empty.png": "empty.png: empty file", "truncated.jpg": "truncated.jpg: cannot decode it",
            "truncated.png": "truncated.png: cannot decode it",
            "text.gif": "text.gif: not an image or animation that PIL can decode",
            "notes.txt": "notes.txt: unsupported file type '.txt'",
            "clip.mp4": "clip.mp4: cannot decode it" if importlib.util.find_spec("av") else "pip install av",
            "sliver.png": "sliver.png: aspect ratio"}


@pytest.mark.parametrize("name", ["missing.jpg", "folder.jpg", "empty.png", "truncated.jpg", "truncated.png",
                                  "text.gif", "notes.txt", "clip.mp4", "sliver.png"])
def test_encode_checks_every_file_before_loading_the_model(name, tmp_path, capsys, no_model):
    message = bad_files(tmp_path)[name]
    out = tmp_path / "emb.safetensors"
    assert main(["encode", "data/images/coffee.jpg", str(tmp_path / name), "--out", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file whatever its mode")
def test_encode_names_an_unreadable_file(tmp_path, capsys, no_model):
    path = tmp_path / "secret.jpg"
    path.write_bytes(open("data/images/coffee.jpg", "rb").read())
    path.chmod(0)
    assert main(["encode", str(path)]) == 1
    assert "secret.jpg: cannot read it (permission denied)" in capsys.readouterr().err


def test_encode_failing_midway_writes_nothing(tmp_path, capsys, monkeypatch):
    load = glmvit.cli.encode.load

    def fail_on_the_clip(path, kind, **found):
        if kind == "video":
            raise OSError("disk vanished")
        return load(path, kind, **found)

    monkeypatch.setattr(glmvit.cli.encode, "load", fail_on_the_clip)
    out, summary = tmp_path / "emb.safetensors", tmp_path / "emb.json"
    assert main(["encode", "data/images/coffee.jpg", "data/clip.gif", "--out", str(out), "--json", str(summary),
                 "--quiet"]) == 1
    assert "disk vanished" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no output, no temporary file


def test_encode_checks_the_output_before_any_work(tmp_path, capsys, no_model):
    out = tmp_path / "is-a-folder.safetensors"
    out.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["encode", "data/images/coffee.jpg", "--out", str(out)])
    assert exc.value.code == 2 and "is a directory" in capsys.readouterr().err


def test_plan_compares_packers(capsys):
    assert main(["plan", "--num-requests", "20", "--items-per-request", "3", "--range-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "vllm" in out and "ffd" in out


def test_unknown_command_exits_with_one_line(capsys, monkeypatch):
    assert main(["fly"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command fly; the commands: demo" in err
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal's width, hyphenated names included
    with pytest.raises(SystemExit) as exc:  # the usage, on request: a success, listing every command
        main(["--help"])
    from glmvit.cli import COMMANDS

    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage:")
    assert all(f"{name}:" in out for name in COMMANDS), out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_config):
    """A whole GLM-4V model (tiny) saved by transformers' save_pretrained: what a user points --weights at."""
    from tests.test_weights import hf_full_model

    path = tmp_path_factory.mktemp("ckpt")
    hf_full_model(tiny_config, seed=5).save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.mark.parametrize("command", [["demo"], ["encode", "data/images/coffee.jpg"],
                                     ["bench", "--num-requests", "1", "--warmup", "0", "--modes", "eager", "--quiet"]])
def test_weights_take_the_checkpoints_own_config_on_cpu(command, checkpoint, capsys):
    """--weights on a CPU used to build the tiny config and fail on shapes: the checkpoint's config.json decides."""
    assert main([*command, "--weights", str(checkpoint), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and ("checkpoint" in out or "grid" in out or "eager" in out)


def test_config_with_weights_is_refused_in_one_line(checkpoint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--weights", str(checkpoint), "--config", "tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--config applies to random weights" in err, err


NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
UNWRITABLE = "{tmp}/a-file/out.json"  # a path below a regular file: no folder can be made there
HUGE = "64,1000000000"
BAD_INVOCATIONS = [
    # (argv, what the one line must say); {tmp} is a fresh folder holding a regular file "a-file"
    (["demo", "--seed", "-1"], "argument --seed: -1 is not in [0, 4,294,967,295]"),
    (["demo", "--seed", "1.5"], "argument --seed: '1.5' is not an integer"),
    (["demo", "--device", "bogus"], "--device 'bogus' is not a device"),
    (["demo", "--device", "mps"], "only cuda and cpu are supported"),
    pytest.param(["demo", "--device", "cuda"], "no CUDA GPU is available here", marks=NO_GPU),
    (["demo", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["demo", "--weights", "{tmp}/no-checkpoint"], "no-checkpoint: no such checkpoint file or directory (only local"),
    (["demo", "--data", "{tmp}"], "expected images/*.jpg and clip.gif"),
    (["encode"], "the following arguments are required: files"),
    (["encode", "data/images/coffee.jpg", "--out", UNWRITABLE], "out.json: cannot write here"),
    (["encode", "data/images/coffee.jpg", "--json", UNWRITABLE], "out.json: cannot write here"),
    (["encode", "data/images/coffee.jpg", "--out", "{tmp}/x", "--json", "{tmp}/x"], "name the same file"),
    (["encode", "{tmp}/a-file"], "a-file: unsupported file type '(no suffix)'"),
    (["plan", "--seed", "-1"], "argument --seed: -1 is not in"),
    (["plan", "--range-ratio", "-1"], "argument --range-ratio: -1 is not in [0, 1]"),
    (["plan", "--range-ratio", "nan"], "argument --range-ratio: nan is not in [0, 1]"),
    (["plan", "--num-requests", "1e8"], "argument --num-requests: '1e8' is not an integer"),
    (["plan", "--num-requests", "100000000"], "argument --num-requests: 100,000,000 is not in [1, 1,000,000]"),
    (["plan", "--num-requests", "0"], "argument --num-requests: 0 is not in"),
    (["plan", "--num-requests", "1000", "--items-per-request", "100000"], "more than 10,000,000 items"),
    (["plan", "--budgets", HUGE], "budget 1,000,000,000 is not in [1, 131,072] tokens"),
    (["plan", "--budgets", "64,abc"], "budget 'abc' is not an integer"),
    (["plan", "--budgets", ",".join(str(64 * k) for k in range(1, 66))], "65 budgets: at most 64"),
    (["plan", "--budgets", ",".join(str(131072 - k) for k in range(64))], "GiB of one H200"),
    (["plan", "--compare", "0,64"], "argument --compare: budget 0 is not in"),
    (["plan", "--max-items", "0"], "argument --max-items: 0 is not"),
    (["plan", "--max-items", "100", "--budgets", "64,128"], "max_items=100 exceeds the smallest budget 64"),
    (["plan", "--max-segments", "100000"], "max_segments=100,000 exceeds the largest budget 8,192"),
    (["plan", "--trace", "{tmp}/missing.csv"], "missing.csv: no such trace file"),
    (["plan", "--trace", "{tmp}/a-file"], "a trace must be .csv, .json, .jsonl"),
    (["plan", "--trace", "{tmp}/t.csv", "--seed", "3"], "--seed with --trace: a trace has its own requests"),
    (["plan", "--workload", "mixed-av", "--items-per-request", "2"], "--items-per-request with --workload"),
    (["plan", "--workload", "nope"], "argument --workload: invalid choice: 'nope'"),
    (["plan", "--bucket-config", "{(224, 224): 1}"], "bucket key must be (height, width, frames)"),
    (["plan", "--system", "best"], "argument --system: invalid choice"),
    (["plan", "--mode", "bogus"], "argument --mode: invalid choice: 'bogus'"),
    (["plan", "--per", "step", "--step-tokens", "0"], "argument --step-tokens: 0 is not in [1, 131,072]"),
    (["plan", "--latency-table", "data/bench/img1x224.json"], "a 'bench' record, not the 'latency' record"),
    (["plan", "--latency-table", "data/bench/latency.json", "--mode", "graph-compiled"],
     "measured graph, not --mode graph-compiled"),
    (["bench", "--tables", "compiled=x"], "expected auto, off or MODE=PATH with MODE one of graph-compiled, graph"),
    (["bench", "--tables", "graph=data/bench/latency_compiled.json"], "measured graph-compiled, not graph"),
    (["record", "--phases", "nope"], "unknown phase(s) nope"),
    (["record", "--only", "nope", "--dry-run"], "unknown job(s) nope"),
    (["record", "--time-limit", "inf"], "argument --time-limit: inf is not in [1, 86400]"),
    (["records", "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--latency-table", "{tmp}/a-file"], "a-file: not a latency table"),
    (["plan", "--latency-table", "{tmp}/none.json"], "none.json: cannot read the latency table (no such file)"),
    (["plan", "--export", UNWRITABLE], "out.json: cannot write here"),
    (["plan", "--json", UNWRITABLE], "out.json: cannot write here"),
    (["plan", "--export", "{tmp}/x", "--json", "{tmp}/x"], "--export and --json name the same file"),
    (["plan", "--trace", "{tmp}/t.csv", "--json", "{tmp}/t.csv"], "is the --trace input: writing it would destroy it"),
    (["plan", "--latency-table", "{tmp}/a-file", "--export", "{tmp}/a-file"], "is the --latency-table input"),
    (["bench", "--seed", "-1"], "argument --seed: -1 is not in"),
    (["bench", "--range-ratio", "-1"], "argument --range-ratio: -1 is not in [0, 1]"),
    (["bench", "--transformers-requests", "-1"], "argument --transformers-requests: -1 is not in"),
    (["bench", "--matmul-size", "-1"], "argument --matmul-size: -1 is not in"),
    (["bench", "--matmul-size", "8192", "--device", "cpu"], "--matmul-size 8,192: at most 4,096 on cpu"),
    (["bench", "--device", "bogus"], "--device 'bogus' is not a device"),
    (["bench", "--budgets", HUGE], "budget 1,000,000,000 is not in [1, 131,072] tokens"),
    (["bench", "--num-requests", "1e8"], "argument --num-requests: '1e8' is not an integer"),
    (["bench", "--num-requests", "1000000"], "argument --num-requests: 1,000,000 is not in [1, 100,000]"),
    (["bench", "--items-per-request", "100000", "--num-requests", "100"], "more than 1,000,000 items"),
    (["bench", "--workload", "img8x448", "--num-requests", "100000", "--device", "cpu"], "the workload's pixels"),
    (["bench", "--max-items", "100", "--budgets", "64,128"], "max_items=100 exceeds the smallest budget 64"),
    (["bench", "--threads", "0"], "argument --threads: 0 is not in"),
    (["bench", "--warmup", "-1"], "argument --warmup: -1 is not in"),
    (["bench", "--modes", "eager,fast"], "unknown mode 'fast'"),
    (["bench-serve", "--in-process", "--modes", ""], "--modes names no mode"),  # was the default, silently
    (["bench-serve", "--in-process", "--modes", " , "], "--modes names no mode"),
    (["bench-serve", "--url", "http://127.0.0.1:9", "--modes", ""], "--modes applies to --spawn and --in-process"),
    (["bench", "--attn-backend", "nope"], "unknown attention backend 'nope'"),
    (["bench", "--json", UNWRITABLE], "out.json: cannot write here"),
    (["bench", "--tables", "graph={tmp}/a-file"], "a-file: not a latency table"),
    (["bench", "--workload", "img8x448", "--items-per-request", "100", "--device", "cpu"],
     "--items-per-request with --workload"),
    (["bench", "--workload", "img1x224", "--bucket-config", "{(448, 448, 1): 1.0}", "--device", "cpu"],
     "--bucket-config with --workload"),
    (["latency", "--runs", "0"], "argument --runs: 0 is not in"),
    (["latency", "--warmup", "-1"], "argument --warmup: -1 is not in"),
    (["latency", "--budgets", "64"], "--budgets needs at least two budgets"),
    (["latency", "--budgets", HUGE], "budget 1,000,000,000 is not in [1, 131,072] tokens"),
    (["latency", "--max-items", "0"], "argument --max-items: 0 is not"),
    (["latency", "--seed", "-1"], "argument --seed: -1 is not in"),
    (["latency", "--device", "bogus"], "--device 'bogus' is not a device"),
    (["latency", "--json", UNWRITABLE], "out.json: cannot write here"),
    (["kernels", "--layouts", "1x224,1x999"], "unknown layout or part ['1x999']"),
    (["kernels", "--parts", "gemm,speed"], "unknown layout or part ['speed']"),
    pytest.param(["kernels"], "this machine has no CUDA device", marks=NO_GPU),
    # hostile files and sizes (issue 29): {tmp} also holds the files of hostile_files()
    (["plan", "--trace", "{tmp}/fifo.json"], "fifo.json: a FIFO (named pipe), not a regular file"),
    (["plan", "--trace", "{tmp}/zero.csv"], "zero.csv: a character device, not a regular file"),
    (["plan", "--trace", "{tmp}/sparse.csv"], "sparse.csv: 257.0 MiB, larger than any trace file"),
    (["plan", "--trace", "{tmp}/huge.json"], "huge.json record 1: height 1000000000000"),
    (["plan", "--trace", "{tmp}/huge.csv"], "huge.csv line 2: height '100000000000"),
    (["plan", "--latency-table", "{tmp}/fifo.json"], "fifo.json: a FIFO (named pipe), not a regular file"),
    (["plan", "--latency-table", "{tmp}/zero.json"], "zero.json: a character device, not a regular file"),
    (["plan", "--latency-table", "{tmp}/sparse.json"], "sparse.json: 257.0 MiB, larger than any latency table"),
    (["plan", "--latency-table", "{tmp}/deep.json"], "deep.json: not a latency table"),
    (["bench", "--tables", "graph={tmp}/fifo.json"], "fifo.json: a FIFO (named pipe), not a regular file"),
    (["bench", "--tables", "graph={tmp}/zero.json"], "zero.json: a character device, not a regular file"),
    (["plan", "--budgets", "1" + "0" * 5000], "budget 100000000000… (5,001 digits) is far larger than any"),
    (["plan", "--budgets=" + "-" * 3000 + "1"], "is not an integer"),
    (["plan", "--budgets", "64,²"], "budget '²' is not an integer"),
    (["plan", "--seed", "1" + "0" * 5000], "(5,001 digits) is far out of range"),
    (["plan", "--range-ratio", "1" + "0" * 5000], "(5,001 characters) is not in [0, 1]"),
    (["plan", "--bucket-config", "{(1" + "0" * 400 + ", 224, 1): 1}"], "a side is larger than 2,147,483,647"),
    (["plan", "--bucket-config", "{(224, 224, 1" + "0" * 400 + "): 1}"], "frames must be in [1, 16,777,216]"),
    (["plan", "--bucket-config", "{(" + "-" * 3000 + "1, 224, 1): 1}"], "nested too deeply"),
    (["plan", "--bucket-config", "(" * 3000], "too many nested parentheses"),
    (["plan", "--bucket-config", "{(224, 224, 1): 1e400}"], "probability must be a finite number ≥ 0, got inf"),
    (["plan", "--bucket-config", "{(224, 224, 1): 1" + "0" * 400 + "}"], "probability must be a finite number"),
    (["plan", "--bucket-config", "{(224, 224, 1): 1" + "0" * 5000 + "}"], "could not parse bucket_config"),
    (["plan", "--json", "{tmp}/sock"], "sock: a socket; outputs go to regular files"),
    (["encode", "{tmp}/huge.png"], "huge.png: 12000×12000 is 144,000,000 pixels, more than max_frame_pixels"),
    (["encode", "{tmp}/fifo.json"], "fifo.json: not a regular file"),
    (["demo", "--weights", "zai-org/GLM-4.1V-9B-Thinking"],
     "only local checkpoints are read, nothing is downloaded; fetch it with: huggingface-cli download "
     "zai-org/GLM-4.1V-9B-Thinking --local-dir DIR"),
    (["demo", "--weights", "{tmp}/ck"], "ck/config.json: VisionConfig.hidden_size 1099511627776 is implausible"),
]


def hostile_files(tmp):
    """What a hostile user points the tools at: a FIFO (a read would block), /dev/zero (never ends), sparse files
    past the size limits, 400-digit sizes, JSON nested past the recursion limit, a 60-byte PNG stating 12000²
    pixels, a socket, and a checkpoint config with hidden_size 2⁴⁰."""
    os.mkfifo(tmp / "fifo.json")
    for name in ("zero.csv", "zero.json"):
        (tmp / name).symlink_to("/dev/zero")
    for name in ("sparse.csv", "sparse.json"):
        with open(tmp / name, "wb") as f:
            f.truncate(257 << 20)  # no blocks on disk
    (tmp / "huge.json").write_text(json.dumps([{"height": 10**400, "width": 224}]))
    (tmp / "huge.csv").write_text(f"height,width\n{10**400},224\n")
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "huge.png").write_bytes(png_claiming(12000, 12000))
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp / "sock"))
    server.close()
    (tmp / "ck").mkdir()
    (tmp / "ck" / "config.json").write_text(json.dumps({"model_type": "glm4v_vision", "depth": 2,
                                                        "hidden_size": 2**40, "num_heads": 16}))




@pytest.mark.parametrize("argv, message", BAD_INVOCATIONS)
@pytest.mark.timeout(60)
def test_every_bad_invocation_is_one_line_before_any_work(argv, message, tmp_path, capsys, no_model):
    (tmp_path / "a-file").write_text("not what was asked for")
    (tmp_path / "t.csv").write_text("height,width\n224,224\n")
    hostile_files(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert code not in (0, None)
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    assert message in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, nothing left
    assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo.json").st_mode)


# Values for every field a preset sets: a new Preset field must be added here (and is then refused with --workload).
PRESET_VALUES = {"bucket_config": "{(448, 448, 1): 1.0}", "items_per_request": "2", "range_ratio": "0.5",
                 "limit_per_request": "2"}
PRESET_COMMANDS = {"plan": [], "bench": [], "bench-serve": ["--url", "http://127.0.0.1:9"]}


@pytest.mark.parametrize("command", PRESET_COMMANDS)
def test_every_command_refuses_each_flag_a_preset_sets(command, capsys):
    from glmvit.cli import COMMANDS
    from glmvit.cli.common import PRESET_FLAGS

    assert set(PRESET_FLAGS) == set(PRESET_VALUES)
    parser = importlib.import_module(COMMANDS[command][0]).build_parser()
    dests = {a.dest for a in parser._actions}
    names = [n for n in PRESET_FLAGS if n in dests]
    assert {"items_per_request", "range_ratio"} <= set(names)
    for name in names:
        flag = f"--{name.replace('_', '-')}"
        try:
            code = main([command, "--workload", "img1x224", flag, PRESET_VALUES[name], *PRESET_COMMANDS[command]])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (flag, err)
        assert flag in err and "--workload" in err, err


def test_refuse_given_with_names_only_the_flags_given(capsys):
    import argparse

    from glmvit.cli.flags import Parser, refuse_given_with

    parser = Parser(prog="p")
    args = argparse.Namespace(trace="t.csv", seed=3, num_requests=None)
    refuse_given_with(parser, argparse.Namespace(trace=None, seed=3), "trace", ("seed",), "why")  # no --trace: fine
    with pytest.raises(SystemExit) as exc:
        refuse_given_with(parser, args, "trace", ("seed", "num_requests", "not_a_flag"), "a trace has its own")
    assert exc.value.code == 2
    assert capsys.readouterr().err == "p: error: --seed with --trace: a trace has its own (see --help)\n"


# --- outputs are written through, never replacing what is not a regular file -----------------------------------------


def test_outputs_keep_the_umask_and_the_mode_of_what_they_replace(tmp_path):
    old = os.umask(0o027)
    try:
        glmvit.cli.common.write_json(tmp_path / "new.json", 1)
        existing = tmp_path / "private.json"
        existing.write_text("old")
        existing.chmod(0o600)
        glmvit.cli.common.write_json(existing, 2)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o640  # 0666 less the umask, as open() gives
    assert stat.S_IMODE(os.stat(existing).st_mode) == 0o600 and existing.read_text() == "2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "private.json"]  # no temporary file left


def test_plan_writes_into_a_fifo_without_replacing_it(tmp_path, capsys):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()), daemon=True)
    reader.start()  # a FIFO's writer waits for its reader: the tool writes in place, as a shell redirection does
    assert main(["plan", "--num-requests", "2", "--json", str(fifo)]) == 0
    reader.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert received and json.loads(received[0])["report"] == "glmvit plan"


def test_encode_reads_one_file_at_a_time_and_says_its_weights_are_random(tmp_path, monkeypatch, capsys):
    """Each file is read just before it is encoded, never all first (20 small PNGs used to hold 2.95 GB)."""
    events = []
    load, forward = glmvit.cli.encode.load, GlmVisionEncoder.forward
    monkeypatch.setattr(glmvit.cli.encode, "load",
                        lambda path, kind, **found: events.append("read") or load(path, kind, **found))
    monkeypatch.setattr(GlmVisionEncoder, "forward",
                        lambda self, *a, **k: events.append("encode") or forward(self, *a, **k))
    files = ["data/images/coffee.jpg", "data/clip.gif", "data/images/rocket.jpg"]
    assert main(["encode", *files, "--quiet"]) == 0
    assert events == ["read", "encode"] * 3
    out = capsys.readouterr().out
    assert "random weights (seed 0)" in out and "--weights DIR loads a checkpoint" in out


def test_counts_have_the_right_number():
    assert [glmvit.cli.common.plural(n, "replay") for n in (0, 1, 2)] == ["0 replays", "1 replay", "2 replays"]


def test_encode_out_writes_into_devices_and_fifos_and_keeps_the_umask(tmp_path, capsys):
    """safetensors' save_file writes a temporary file and renames it onto its target: given a device node it made
    it a regular file (so --out /dev/null, as root, replaced the system's). encode writes the bytes itself."""
    fifo, new = tmp_path / "emb.fifo", tmp_path / "new.safetensors"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    old = os.umask(0o022)
    try:
        assert main(["encode", "data/images/coffee.jpg", "--out", str(fifo), "--quiet"]) == 0
        assert main(["encode", "data/images/coffee.jpg", "--out", str(new), "--quiet"]) == 0
    finally:
        os.umask(old)
    reader.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and received
    assert torch.equal(safetensors.torch.load(received[0])["item_0"], load_file(str(new))["item_0"])
    assert stat.S_IMODE(os.stat(new).st_mode) == 0o644
    null = tmp_path / "null"
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's device, made here
    except OSError as err:
        pytest.skip(f"cannot make a device node here ({err})")
    assert main(["encode", "data/images/coffee.jpg", "--out", str(null), "--quiet"]) == 0
    assert stat.S_ISCHR(os.lstat(null).st_mode), "the device node was replaced by a regular file"


# --- defects the hostile pass of 2026-12-01 found (fixed with the re-record they waited for) -------------------------
ROOT = Path(__file__).resolve().parents[1]


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_encode_refuses_to_write_over_its_own_input(tmp_path):
    image = tmp_path / "x.png"
    Image.new("RGB", (64, 64), (10, 20, 30)).save(image)
    before = image.read_bytes()
    code = exit_code(["encode", "--config", "tiny", "--device", "cpu", str(image), "--out", str(image)])
    assert code == 2 and image.read_bytes() == before


def test_a_truncated_animated_gif_is_one_line_naming_the_file(tmp_path, capsys):
    rng = np.random.default_rng(0)
    frames = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(5)]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:], duration=100)
    data = (tmp_path / "a.gif").read_bytes()
    (tmp_path / "t.gif").write_bytes(data[: len(data) * 2 // 3])
    code = exit_code(["encode", "--config", "tiny", "--device", "cpu", str(tmp_path / "t.gif")])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and "t.gif: cannot decode it" in err, err  # a bad input: 1


def test_a_latency_sweep_missing_a_field_is_a_value_error():
    from glmvit.recorded import latency_table_from_json

    sweep = json.loads((ROOT / "data" / "bench" / "latency_compiled.json").read_text())
    del sweep["budgets"][0]["layouts"][0]["graph_p99_ms"]
    with pytest.raises(ValueError, match="broken.json: not a valid latency record .*graph_p99_ms"):
        latency_table_from_json(sweep, "broken.json")


@pytest.mark.parametrize("where, value", [("real_tokens", "many"), ("graph_ms", None), ("eager_ms", -1.0),
                                          ("segment_rows2", 1e400), ("graph_p99_ms", float("nan"))])
def test_a_latency_sweep_with_a_mistyped_field_is_a_value_error_naming_it(where, value):
    from glmvit.recorded import latency_table_from_json

    sweep = json.loads((ROOT / "data" / "bench" / "latency_compiled.json").read_text())
    sweep["budgets"][1]["layouts"][0][where] = value
    with pytest.raises(ValueError, match=f"broken.json: .*budgets.1.layouts.0.{where}"):
        latency_table_from_json(sweep, "broken.json")
    sweep = json.loads((ROOT / "data" / "bench" / "latency_compiled.json").read_text())
    sweep["budgets"][1]["layouts"] = []
    with pytest.raises(ValueError, match="broken.json: .*budgets.1.layouts"):
        latency_table_from_json(sweep, "broken.json")


def test_bench_interp_bad_runs_is_one_line(capsys):
    assert exit_code(["bench-interp", "--runs", "abc"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--runs" in err, err


@pytest.fixture
def sigint_default():
    """SIGINT handled as in an interactive shell, for the tests of the Ctrl-C path and the processes they start: a
    test run started in the background (``make test &``) inherits SIGINT ignored, and a child would inherit that
    too (an ignored signal survives exec; a handled one is reset to the default there)."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_is_one_line_and_status_130_with_nothing_written(tmp_path, capsys, monkeypatch):
    import glmvit.cli.encode as encode

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(encode, "load", interrupted)  # as if Ctrl-C came while the first file decodes
    out = tmp_path / "e.safetensors"
    code = exit_code(["encode", "--config", "tiny", "--device", "cpu", "data/images/coffee.jpg", "--out", str(out)])
    assert code == 130 and capsys.readouterr().err == "glmvit encode: interrupted\n"
    assert not out.exists() and not list(tmp_path.iterdir())


# --- a second hostile pass (2026-12-01): lax numbers in latency tables, cut animations, Ctrl-C in imports, links


@pytest.mark.parametrize("edit, where", [
    (lambda s: s["budgets"][0].__setitem__("tokens", True), "budgets.0.tokens"),
    (lambda s: s["budgets"][0]["layouts"][0].__setitem__("real_tokens", "64"), "budgets.0.layouts.0.real_tokens"),
    (lambda s: s["budgets"][0]["layouts"][0].__setitem__("graph_ms", "1.5"), "budgets.0.layouts.0.graph_ms"),
    (lambda s: s.__setitem__("compiled", "yes"), "compiled"),
    (lambda s: s["budgets"][0]["layouts"][0].__setitem__("segment_rows2", 10**400), "layouts.0.segment_rows2"),
    (lambda s: s["budgets"][0].__setitem__("tokens", 64.7), "budgets.0.tokens"),
    (lambda s: s["budgets"][0]["layouts"][0].__setitem__("graph_p99_ms", 0.001), "graph_p99_ms 0.001 is below"),
    (lambda s: s.__setitem__("max_items", 0), "max_items"),
    (lambda s: s["budgets"][0]["layouts"][0].__setitem__("graph_ms", 1.7e308), "budgets.0.layouts.0.graph_ms"),
    (lambda s: s["budgets"][0]["layouts"][0].__setitem__("real_tokens", 2**20), "holds 1048576 real tokens"),
    (lambda s: next(iter(s["capture"].values())).__setitem__("seconds", 10**400), ".seconds"),
    (lambda s: next(iter(s["capture"].values())).__setitem__("seconds", True), ".seconds"),
])
def test_a_latency_sweep_takes_no_lax_number_and_no_p99_below_its_median(edit, where):
    from glmvit.recorded import latency_table_from_json

    sweep = json.loads((ROOT / "data" / "bench" / "latency_compiled.json").read_text())
    edit(sweep)
    with pytest.raises(ValueError, match=re.escape(where)):
        latency_table_from_json(sweep, "lax.json")


def test_the_sweep_schema_bounds_tokens_as_the_table_does():
    from pydantic import ValidationError

    from glmvit.costmodel import MAX_TABLE_TOKENS
    from glmvit.records import LatencyBudget

    layout = {"name": "full", "segment_rows2": 0, "graph_ms": 1.0, "eager_ms": 1.0, "graph_p99_ms": 1.0,
              "eager_p99_ms": 1.0}
    for tokens, ok in ((MAX_TABLE_TOKENS, True), (MAX_TABLE_TOKENS + 1, False)):
        budget = {"tokens": tokens, "graph_ms": 1.0, "eager_ms": 1.0, "layouts": [{**layout, "real_tokens": tokens}]}
        try:
            LatencyBudget.model_validate(budget)
            assert ok, tokens
        except ValidationError:
            assert not ok, tokens


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_while_a_command_imports_is_one_line(capsys, monkeypatch):
    import glmvit.cli as cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    try:
        code = cli.main(["encode", "x.png"])
    except KeyboardInterrupt:  # the defect: torch's import, outside the handler, is where Ctrl-C often lands
        code = None
    assert code == 130 and capsys.readouterr().err == "glmvit encode: interrupted\n"
    import signal

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # an in-process caller gets it back


def test_a_gif_is_read_block_by_block_as_the_format_says(tmp_path):
    """An empty extension (a comment with no data) is valid and reads as PIL reads it; a byte that starts no
    block is corruption, refused in one line, where PIL would skip it and could lose its place."""
    from glmvit.cli.encode import check_file

    frames = [Image.new("RGB", (32, 32), (40 * k, 0, 0)) for k in range(3)]
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:], duration=40)
    data = (tmp_path / "a.gif").read_bytes()
    table = 3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0  # the global colour table after the header
    (tmp_path / "comment.gif").write_bytes(data[: 13 + table] + b"!\xfe\x00" + data[13 + table :])
    (tmp_path / "stray.gif").write_bytes(data[: 13 + table] + b"\x07" + data[13 + table :])
    assert check_file(tmp_path / "comment.gif").kind == "video" and Image.open(tmp_path / "comment.gif").n_frames == 3
    with pytest.raises(ValueError, match="byte 0x07 at offset .* starts no GIF block"):
        check_file(tmp_path / "stray.gif")


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_during_torchs_import_in_a_real_process_is_one_line(tmp_path):
    """``python -m glmvit`` with SIGINT sent while torch is being imported (its library is mapped into the
    process, the command is not yet running): one line and exit 130. ``import glmvit`` itself imports nothing
    heavy, so the handler is in place before torch's import begins."""
    import signal
    import subprocess
    import sys
    import time

    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    proc = subprocess.Popen([sys.executable, "-m", "glmvit", "encode", "--config", "tiny", "--device", "cpu",
                             str(tmp_path / "a.png")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.monotonic() + 120
    while proc.poll() is None and "libtorch" not in maps.read_text() and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "glmvit encode: interrupted\n")


@pytest.mark.usefixtures("sigint_default")
@pytest.mark.parametrize("module", ["numpy.lib", "datetime"])
def test_ctrl_c_while_numpy_loads_is_one_line_not_swallowed(tmp_path, module):
    """torch's C extension imports numpy itself and carries on past a KeyboardInterrupt (numpy then half-loaded,
    the Ctrl-C lost): the command imports numpy first, inside its handler. numpy's own C extension turns a Ctrl-C
    during its import of datetime into an ImportError: the handler remembers the SIGINT. A sitecustomize sends the
    SIGINT the moment ``module`` is looked up, so the test does not depend on timing."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal, sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Interrupt())\n")
    Image.new("RGB", (64, 64)).save(tmp_path / "a.png")
    done = subprocess.run([sys.executable, "-m", "glmvit", "encode", "--config", "tiny", "--device", "cpu",
                           str(tmp_path / "a.png")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert (done.returncode, done.stderr) == (130, "glmvit encode: interrupted\n")


@pytest.mark.parametrize("suffix", [".gif", ".webp"])
def test_every_cut_of_an_animation_is_refused_in_one_line(tmp_path, suffix):
    """A cut animation is refused whole, never encoded as the frames PIL can still read (a wrong grid, no word):
    a GIF ends in its trailer, a WebP's RIFF header states its length. PIL's own errors at some cuts (struct.error
    counting a GIF's frames) are one line too, never a traceback in encode or a 500 in serve."""
    from glmvit.cli.encode import check_file

    rng = np.random.default_rng(1)
    frames = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(30)]
    frames[0].save(tmp_path / f"long{suffix}", save_all=True, append_images=frames[1:], duration=40)
    data = (tmp_path / f"long{suffix}").read_bytes()
    assert check_file(tmp_path / f"long{suffix}").kind == "video"
    cut = tmp_path / f"cut{suffix}"
    for k in range(1, len(data), max(1, len(data) // 400)):
        cut.write_bytes(data[:k])
        with pytest.raises(ValueError, match=re.escape(str(cut))):
            check_file(cut)


@pytest.mark.parametrize("budget", [{"tokens": 1e400}, {"tokens": 64.7}])
def test_a_plain_latency_table_refuses_a_budget_that_is_not_an_integer(budget):
    from glmvit.recorded import latency_table_from_json

    sweep = json.loads((ROOT / "data" / "bench" / "latency_compiled.json").read_text())
    plain = {"budgets": [{**b, **(budget if i == 0 else {})} for i, b in enumerate(sweep["budgets"])]}
    with pytest.raises(ValueError):
        latency_table_from_json(plain, "plain.json")


def test_an_output_that_is_a_hard_link_to_an_input_is_refused(tmp_path):
    image = tmp_path / "a.png"
    Image.new("RGB", (64, 64), (10, 20, 30)).save(image)
    os.link(image, tmp_path / "b.png")
    code = exit_code(["encode", "--config", "tiny", "--device", "cpu", str(image), "--out", str(tmp_path / "b.png")])
    assert code == 2


@pytest.mark.usefixtures("sigint_default")
def test_ctrl_c_inside_one_long_torch_op_stops_the_command_promptly(tmp_path):
    """A SIGINT that lands inside one long C call (a torch op of minutes, where Python cannot run its handler until
    the call returns) still ends ``python -m glmvit latency`` within the grace: one line, status 130. The command's
    sweep is replaced by one large single-threaded matmul, announced on stderr just before it starts."""
    import signal
    import subprocess
    import sys
    import time

    from glmvit.cli import CTRL_C_GRACE_S

    (tmp_path / "slow_latency.py").write_text(
        "import runpy, sys, torch\n"
        "import glmvit.cli.latency as latency\n"
        "torch.set_num_threads(1)\n"
        "def measure(*args, **kwargs):\n"
        "    a = torch.ones(10240, 10240)\n"
        "    print('long op', file=sys.stderr, flush=True)\n"
        "    torch.mm(a, a)\n"
        "    raise SystemExit('the op ended')\n"
        "latency.measure = measure\n"
        "sys.argv = ['glmvit', 'latency', '--device', 'cpu', '--budgets', '16,64', '--runs', '1', '--quiet']\n"
        "runpy.run_module('glmvit', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "slow_latency.py")], stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stderr is not None and proc.stderr.readline() == "long op\n"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=CTRL_C_GRACE_S + 8)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    assert (proc.returncode, proc.stderr.read()) == (130, "glmvit latency: interrupted\n") and took < CTRL_C_GRACE_S + 8


def test_latency_refuses_budgets_past_the_devices_free_memory(monkeypatch, capsys):
    """The estimate is the tower, dtype and attention the sweep will run, against what the device has free now;
    refused before the model is built."""
    import glmvit.cli.latency as latency

    argv = ["--device", "cpu", "--budgets", "64,131072", "--runs", "1", "--warmup", "0", "--quiet"]
    monkeypatch.setattr(glmvit.cli.common, "free_memory_bytes", lambda device: 2 << 30)
    monkeypatch.setattr(latency, "run_sweep", lambda *args: pytest.fail("the sweep started"))
    with pytest.raises(SystemExit) as exit_:
        latency.main(argv)
    err = capsys.readouterr().err
    error = err.splitlines()[-1]  # after parse's warning that a large CPU sweep takes long
    assert exit_.value.code == 2 and error.startswith("python -m glmvit latency: error: budgets up to 131,072 ")
    assert "more than the 2.0 GiB free on cpu now" in error and "Traceback" not in err
    args, config = latency.parse(argv)
    monkeypatch.setattr(glmvit.cli.common, "free_memory_bytes", lambda device: 64 << 30)
    latency.check_fits_now(args, config)  # the tiny tower's few GiB fit


def test_a_jpeg_with_corrupt_exif_encodes_without_pils_warnings(tmp_path):
    """A JPEG whose EXIF block is cut short still decodes, orientation applied where it can be read, and PIL's
    warnings about the block stay out of the command's output."""
    import subprocess
    import sys

    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90°: a 32×24 picture is 24 wide, 32 high once turned
    exif[0x010E] = "x" * 200  # a description whose data the cut loses
    Image.new("RGB", (224, 112), (200, 10, 10)).save(tmp_path / "cut.jpg", exif=exif.tobytes()[:40])
    done = subprocess.run([sys.executable, "-m", "glmvit", "encode", "--device", "cpu", "--config", "tiny",
                           str(tmp_path / "cut.jpg")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "cut.jpg: image grid [1, 16, 8]" in done.stdout  # 112 wide, 224 high: turned


def test_progress_bars_reach_a_non_terminal_stderr_as_lines_not_redraws(tmp_path):
    """stderr a pipe (a log): each bar arrives once, in its final state, with no carriage returns."""
    import subprocess
    import sys

    for name in ("a.png", "b.png"):
        Image.new("RGB", (64, 64)).save(tmp_path / name)
    done = subprocess.run([sys.executable, "-m", "glmvit", "encode", "--device", "cpu", "--config", "tiny",
                           str(tmp_path / "a.png"), str(tmp_path / "b.png")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "\r" not in done.stderr
    assert [line.split(":")[0] for line in done.stderr.splitlines()] == ["checking", "encoding"]
    assert all("100%" in line for line in done.stderr.splitlines())


def test_a_line_stream_keeps_each_lines_last_redraw():
    import io

    from glmvit.cli import LineStream

    out = io.StringIO()
    lines = LineStream(out)
    lines.write("\rbar 0%")
    lines.write("\rbar 50%\rbar 100%")
    lines.write("\nerror: x\n\rpart")
    lines.finish()
    assert out.getvalue() == "bar 100%\nerror: x\npart\n"


def test_demo_help_answers_without_importing_torch():
    """The demo parses its flags (the shared model flags included, from glmvit.cli.flags) before torch's import."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "glmvit", "demo", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert done.returncode == 0 and "--device" in done.stdout and "--weights" in done.stdout
    assert "glmvit.cli.flags" in imported and not {m for m in imported if m.split(".")[0] == "torch"}


def test_the_flags_module_names_every_dtype_the_commands_map():
    from glmvit.cli.common import DTYPES
    from glmvit.cli.flags import DTYPE_NAMES

    assert tuple(sorted(DTYPES)) == DTYPE_NAMES


def test_the_demo_says_emulation_is_a_correctness_check_and_what_to_run_next(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "not a speed claim" in out and "make demo on a CUDA machine" in out and "python -m glmvit bench" in out


def test_a_command_with_standard_error_closed_still_exits_with_its_status():
    """stderr closed (``2>&-``: Python's sys.stderr is None) is left as it is, not wrapped: a usage error still
    exits 2 and a run 0, with nothing to say them on."""
    import subprocess
    import sys

    done = subprocess.run(["bash", "-c", f"'{sys.executable}' -m glmvit latency --budgets 0,1 2>&-"], cwd=ROOT,
                          capture_output=True, timeout=120)
    assert done.returncode == 2


def test_encode_probes_each_video_once_and_every_run_afresh(tmp_path, monkeypatch):
    """A video's check and its sampling share one probe (its answer is carried from check_file to load); a second
    run reads the file again."""
    import shutil

    import glmvit.video

    walks = []
    real = glmvit.video._probe
    monkeypatch.setattr(glmvit.video, "_probe", lambda p, m: walks.append(p) or real(p, m))
    clip = tmp_path / "clip.gif"
    shutil.copy(ROOT / "data" / "clip.gif", clip)
    for run in (1, 2):
        assert main(["encode", str(clip), "--quiet"]) == 0
        assert walks == [clip] * run


# ---- every command's encoder ----------------------------------------------------------------------------------
class _Built(BaseException):
    """Stops a command at its encoder (a BaseException: no command mistakes it for its own error)."""


def _spy(monkeypatch, modules, calls):
    def fake(model, mode, budgets, **kwargs):
        calls.append((RunMode.parse(mode), kwargs.get("attention"), model.attn_backend))
        raise _Built

    for module in modules:
        monkeypatch.setattr(module, "build_encoder", fake)


@pytest.mark.parametrize("command", ["serve", "bench", "latency", "demo"])
def test_every_command_builds_its_encoder_with_build_encoder(command, monkeypatch, capsys):
    """Each command's smallest CPU path reaches build_encoder, given the flags' attention backend, and leaves the
    model's own backend unset."""
    from glmvit.cli import bench, demo, latency, serve
    from glmvit.cli.common import resolve_model_args

    calls: list = []
    _spy(monkeypatch, [glmvit.encoder, serve, bench, latency], calls)
    cpu = ["--device", "cpu", "--config", "tiny", "--quiet"]
    with pytest.raises(_Built):
        if command == "serve":
            parser = serve.build_parser()
            args = parser.parse_args([*cpu, "--budgets", "32", "--no-measure-floor", "--attn-backend", "segments"])
            resolve_model_args(parser, args)
            serve.build_service(args, "test")
        elif command == "bench":
            bench.main([*cpu, "--num-requests", "1", "--warmup", "1", "--threads", "1", "--modes", "graph",
                        "--attn-backend", "segments"])
        elif command == "latency":
            latency.main([*cpu, "--warmup", "0", "--runs", "1", "--budgets", "16,32"])
        else:
            demo.main(["--device", "cpu"])
    expected = {"serve": (RunMode.GRAPH, "segments"), "bench": (RunMode.GRAPH, "segments"),
                "latency": (RunMode.GRAPH, None), "demo": (RunMode.GRAPH, None)}[command]
    assert [c[:2] for c in calls] == [expected]
    assert calls[0][2] is None  # nothing set the model's backend on the way


def test_bench_serve_runs_each_mode_once():
    """``--modes eager,graph,eager`` runs eager once: a record holds one result a mode, and the second run overwrote
    the first after spending its time."""
    from glmvit.cli import bench_serve

    argv = ["--in-process", "--device", "cpu", "--modes", "eager,graph,eager"]
    parser = bench_serve.build_parser()
    args = parser.parse_args(argv)
    bench_serve.check_args(parser, args, argv)
    assert args.modes == ["eager", "graph"]


@pytest.mark.parametrize("command", ["bench", "serve", "bench-serve"])
def test_the_cpu_commands_run_where_triton_is_not_installed(command):
    """Triton is an optional extra (``kernels``): the commands a CPU machine runs import glmvit's Triton kernels only
    where they launch one. Here ``import triton`` fails outright, and each command's parser still answers."""
    import subprocess
    import sys

    blocked = ("import sys, runpy; sys.modules['triton'] = None; sys.argv = ['glmvit', " + repr(command)
               + ", '--help']; runpy.run_module('glmvit', run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def test_the_kernels_profile_expands_auto_to_the_kernels_auto_chooses_among_here():
    from glmvit.cli.kernels import auto_kernels
    from glmvit.kernels.fa4_attention import loads

    here = ["cudnn", "triton"] + (["fa4"] if loads() else [])
    assert auto_kernels("auto") == here and auto_kernels("varlen, auto") == ["varlen", *here]
    assert auto_kernels("triton,cudnn") == ["triton", "cudnn"]  # no auto: the list as given
    assert auto_kernels("triton, auto") == ["triton", "cudnn", *here[2:]]  # each kernel profiled once
