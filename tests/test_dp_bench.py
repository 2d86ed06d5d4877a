"""The data-parallel tool, ``glmvit.cli.dp_bench``: its argument checks (one line, before any work), its wording, and
whole runs under torchrun (2 gloo ranks) and as ``python -m glmvit dp-bench`` (a world of one, in this process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from glmvit.cli import dp_bench
from glmvit.cli import main as glmvit_main
from glmvit.model import GlmVisionEncoder
from glmvit.parallel import free_port, weights_digest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DP_BENCH_ARGS = ["--device", "cpu", "--num-requests", "3", "--warmup", "1", "--fault-drill", "--timeout", "30"]
GIB = 2**30
NEEDS_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")


# ---------------------------------------------------------------------------------------------------------------
# Arguments: one line each, before the process group, the model or any pixel exists
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def nothing_runs(monkeypatch):
    """Any step past the argument checks fails the test; the host reports 8 GiB (the pixel bound is the same
    everywhere)."""
    def refuse(*args, **kwargs):
        raise AssertionError("work started after a bad argument")

    for name in ("init_distributed", "model_from_args", "random_batch"):
        monkeypatch.setattr(dp_bench, name, refuse)
    monkeypatch.setattr(dp_bench, "device_memory_bytes", lambda device: 8 * GIB)


BAD = [
    (["--num-requests", "1000000"], "argument --num-requests: 1,000,000 is not in [1, 100,000]"),
    (["--num-requests", "0"], "argument --num-requests: 0 is not in"),
    (["--num-requests", "1e3"], "argument --num-requests: '1e3' is not an integer"),
    (["--warmup", "-1"], "argument --warmup: -1 is not in"),
    (["--items-per-request", "0"], "argument --items-per-request: 0 is not in"),
    (["--items-per-request", "100000", "--num-requests", "100"], "103 requests (warm-up included) of up to 100,000 "
                                                                 "items is more than 1,000,000 items"),
    (["--range-ratio", "nan"], "argument --range-ratio: nan is not in [0, 1]"),
    (["--timeout", "inf"], "argument --timeout: inf is not in [1, 86400]"),
    (["--timeout", "nan"], "argument --timeout: nan is not in"),
    (["--timeout", "0"], "argument --timeout: 0 is not in"),
    (["--timeout", "soon"], "argument --timeout: 'soon' is not a number"),
    (["--seed", "-1"], "argument --seed: -1 is not in [0, 4,294,967,295]"),
    (["--modality", "audio"], "argument --modality: invalid choice: 'audio'"),
    (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    (["--bucket-config", "{(224, 224): 1}"], "bucket key must be (height, width, frames)"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--device", "tpu"], "--device 'tpu' is not a device"),
    pytest.param(["--device", "cuda"], "no CUDA GPU is available here", marks=NO_GPU),
    pytest.param(["--device", "cuda:1"], "every rank takes cuda:LOCAL_RANK", marks=NEEDS_GPU),
    (["--weights", "{tmp}/none"], "none: no such checkpoint file or directory (only local checkpoints are read"),
    (["--weights", "{tmp}", "--config", "tiny"], "--config applies to random weights"),
    (["--json", "{tmp}/a-file/out.json"], "out.json: cannot write here"),
    (["--bucket-config", "{(4000, 4000, 1): 1}", "--items-per-request", "22", "--num-requests", "1", "--warmup",
      "0", "--dtype", "bf16"], "request 0 has 133,848 tokens, more than 131,072"),
    (["--bucket-config", "{(448, 448, 1): 1}", "--items-per-request", "8", "--num-requests", "1000",
      "--device", "cpu", "--dtype", "fp32"], "the workload's pixels need 36.0 GiB on every rank, more than 50% of "
                                             "cpu's 8 GiB"),
]


@pytest.mark.parametrize("argv, message", BAD)
def test_every_bad_argument_is_one_line_before_any_work(argv, message, tmp_path, capsys, nothing_runs):
    (tmp_path / "a-file").write_text("")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        glmvit_main(["dp-bench", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"{dp_bench.PROG}: error: ") and "Traceback" not in err, err
    assert message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_the_pixel_bound_counts_the_ranks_sharing_a_cpu(monkeypatch, nothing_runs):
    args = dp_bench.build_parser().parse_args(["--device", "cpu", "--num-requests", "100"])
    dp_bench.resolve_model_args(dp_bench.build_parser(), args)
    pixels = 103 * 2 * 256 * 1176 * 4  # 224² images: 16² patches each, two per request, fp32
    monkeypatch.setattr(dp_bench, "device_memory_bytes", lambda device: 4 * pixels)
    assert len(dp_bench.plan_workload(args).grids) == 103  # half the memory: fits
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="shared by 3 ranks"):  # a sixth each: does not
        dp_bench.plan_workload(args)


def test_words():
    assert [dp_bench.count(n, "rank") for n in (1, 2, 0)] == ["1 rank", "2 ranks", "0 ranks"]
    assert dp_bench.compare_speed(17.0, 10.0) == "speed-up 1.70× (mean)"
    slower = dp_bench.compare_speed(5.9, 10.0)
    assert slower.startswith("slow-down 1.69×") and "speed-up 0.59×" in slower


# ---------------------------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------------------------
def _run_killable(cmd, env, timeout_s):
    """subprocess.run in its own process group: on timeout the launcher AND its workers are killed."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout_s} s") from None
    return proc.returncode, out, err


def _check_drill(drill, world):
    victim = world - 1
    assert drill["ok"] and drill["victim_rank"] == victim and drill["timeout_s"] == 30
    errors = {r["rank"]: (r["error_type"], r["error"]) for r in drill["ranks"]}
    assert errors[victim] == ("RuntimeError", f"fault drill: rank {victim} fails mid-request")
    for q in range(victim):
        assert errors[q][0] == "RankFailed" and f"rank {victim}: RuntimeError: fault drill" in errors[q][1]
    assert all(r["seconds_to_error"] < 30 and r["next_request_ok"] for r in drill["ranks"])


@pytest.mark.timeout(150)
def test_two_gloo_ranks_with_the_fault_drill(tmp_path):
    out = tmp_path / "dp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "glmvit.cli.dp_bench", *DP_BENCH_ARGS, "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    rc, stdout, stderr = _run_killable(cmd, env, timeout_s=120)
    assert rc == 0, stderr[-3000:]
    assert "fault drill: rank 1 raised mid-request" in stdout and "→ OK" in stdout
    assert "glmvit.parallel: 2 ranks over gloo, tiny test tower, fp32, on cpu, random weights (seed 0)" in stdout
    rec = json.loads(out.read_text())
    assert (rec["world_size"], rec["backend"], rec["timeout_s"]) == (2, "gloo", 30)
    assert (rec["config"], rec["dtype"], rec["weights"]) == ("tiny", "float32", {"random_seed": 0})
    assert rec["verification"]["ok"] and rec["encoder_forward_ms"]["mean_ms"] > 0
    _check_drill(rec["fault_drill"], 2)
    for r in rec["per_rank"]:
        shares = r["gather_share_per_request"]
        assert len(shares) == 3 and all(0 < s < 1 for s in shares)
    assert rec["provenance"]["command"].startswith("torchrun --nproc-per-node 2 -m glmvit.cli.dp_bench")
    assert len(rec["provenance"]["ranks"]) == 2


@pytest.fixture
def world_of_one_env(monkeypatch):
    """torchrun's variables for a world of one, undone after the test (nothing leaks into the other tests), and this
    process's thread count given back (the tool sizes its pool for its rank)."""
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    assert not dist.is_initialized()


@pytest.mark.timeout(90)
def test_as_a_glmvit_command_in_a_world_of_one(tmp_path, world_of_one_env, capsys):
    out = tmp_path / "dp1.json"
    assert glmvit_main(["dp-bench", *DP_BENCH_ARGS, "--no-baseline", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["world_size"] == 1 and rec["single_process_ms"] is None
    _check_drill(rec["fault_drill"], 1)
    stdout = capsys.readouterr().out
    assert "verify request 0" in stdout and "glmvit.parallel: 1 rank over gloo" in stdout
    assert "over 3 requests (1 rank, data parallel)" in stdout


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_config):
    """A whole GLM-4V model (tiny) saved by transformers' save_pretrained."""
    from tests.test_weights import hf_full_model

    path = tmp_path_factory.mktemp("ckpt")
    hf_full_model(tiny_config, seed=5).save_pretrained(path)
    return path


@pytest.mark.timeout(90)
def test_weights_and_dtype_are_the_ones_asked_for(checkpoint, tmp_path, world_of_one_env):
    out = tmp_path / "dp.json"
    argv = ["--device", "cpu", "--num-requests", "1", "--warmup", "0", "--no-baseline", "--mode", "eager",
            "--weights", str(checkpoint), "--dtype", "bf16", "--json", str(out)]
    assert glmvit_main(["dp-bench", *argv]) == 0
    rec = json.loads(out.read_text())
    assert (rec["config"], rec["dtype"]) == ("checkpoint", "bfloat16") and rec["verification"]["ok"]
    assert rec["weights"]["path"] == str(checkpoint.resolve())
    loaded = GlmVisionEncoder.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert rec["weights_digest"] == weights_digest(loaded).hex()


def test_a_broken_checkpoint_is_one_line_under_torchrun(checkpoint, tmp_path, world_of_one_env, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    assert dp_bench.script(["--device", "cpu", "--num-requests", "1", "--weights", str(broken)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dp_bench: error: ") and err.count("\n") == 1 and "model.safetensors" in err, err


# ---------------------------------------------------------------------------------------------------------------
# Ranks that disagree or die: one line and a non-zero exit on every rank left
# ---------------------------------------------------------------------------------------------------------------
QUICK_ARGS = ["--device", "cpu", "--warmup", "0", "--no-baseline", "--mode", "eager", "--timeout", "20"]
# A rank that dies where the test says: `python -c DIES_IN step argv...` exits at once on entering that step.
DIES_IN = """
import os, sys
from glmvit.cli import dp_bench
setattr(dp_bench, sys.argv[1], lambda *args, **kwargs: os._exit(9))
sys.exit(dp_bench.script(sys.argv[2:]))
"""


def _two_ranks(commands, timeout_s=60):
    """Start one process per command as ranks 0 and 1 of a gloo group (torchrun's variables, no torchrun: each
    rank's own stderr and exit status); returns [(status, stderr)] per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, *cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env={**env, "RANK": str(q), "LOCAL_RANK": str(q)}, start_new_session=True)
             for q, cmd in enumerate(commands)]
    try:
        errs = [p.communicate(timeout=timeout_s)[1] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"the ranks were still running after {timeout_s} s") from None
    return [(p.returncode, err) for p, err in zip(procs, errs, strict=True)]


@pytest.mark.timeout(90)
def test_ranks_given_different_workloads_stop_at_once_with_one_line():
    ranks = _two_ranks([["-m", "glmvit.cli.dp_bench", *QUICK_ARGS, "--num-requests", str(n)] for n in (2, 3)])
    for status, err in ranks:
        assert status == 1 and err.count("\n") == 1, err
        assert err == ("dp_bench: error: the ranks were given different --num-requests: 2 on rank 0, 3 on rank 1 "
                       "(every rank must be given the same arguments)\n"), err


@pytest.mark.timeout(90)
@pytest.mark.parametrize("step", ["time_data_parallel", "verify_first_request"])
def test_a_rank_whose_peer_dies_mid_run_ends_with_one_line(step):
    """Rank 1 exits on entering ``step``; rank 0 then fails in a collective of the tool's own (the timing barrier)
    or of the data-parallel encoder's (the request's exchange), and says so in one line."""
    argv = [*QUICK_ARGS, "--num-requests", "2"]
    (status, err), (peer_status, _) = _two_ranks([["-m", "glmvit.cli.dp_bench", *argv], ["-c", DIES_IN, step, *argv]])
    assert peer_status == 9
    assert status == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("dp_bench: error: rank 0: ") and "did not complete" in err, err
