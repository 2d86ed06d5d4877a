"""``python -m glmvit record``: the plan of phases and jobs, the orchestrator, and the in-process jobs (on CPU)."""
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from glmvit import fingerprint
from glmvit.__main__ import main
from glmvit.cli import record, recorder
from glmvit.cli.recorder import Job, jobs
from glmvit.cli.session import Session
from glmvit.records import Fingerprint, NotebookResult, load_any, make, staleness
from glmvit.timing import median_ci95, quiet_host, relative_halfwidth


def test_the_plan_times_before_it_profiles_and_starts_cold_then_warm():
    plan = jobs()
    names = [j.name for j in plan]
    phases = [j.phase for j in plan]
    assert phases == sorted(phases, key=recorder.PHASES.index)  # measure, then profile, then ncu
    assert names[0] == "startup_cold" and names[phases.index("profile")] == "startup_warm"
    assert names.index("latency") < names.index("latency_compiled") < names.index("img1x224")  # tables route benches
    assert {j.name for j in plan if j.phase == "ncu"} == {"ncu"}
    assert len(names) == len(set(names))
    from glmvit.lab import NOTEBOOK_RESULTS

    for name, result in NOTEBOOK_RESULTS.items():  # every notebook result is a job, profiling ones apart
        job = next(j for j in plan if j.name == name)
        assert job.phase == ("profile" if result.profiles else "measure")
    assert all(j.phase == "measure" for j in plan if j.command in ("bench", "latency", "bench-serve"))


def test_the_warm_start_brings_the_cold_one_and_a_forced_run_skips_what_it_made(monkeypatch):
    plan = jobs()
    warm = next(j for j in plan if j.name == "startup_warm")
    monkeypatch.setattr(record, "job_current", lambda job, run_id=None, gpu=None: False)
    assert [j.name for j in record.choose([warm], True, "r")] == ["startup_cold", "startup_warm"]
    interp = next(j for j in plan if j.name == "interp")
    provenance = type("P", (), {"command": recorder.command_line(interp), "gpu": "NVIDIA H200"})()
    made = type("R", (), {"record_run": "run-a", "provenance": provenance})()
    monkeypatch.undo()
    monkeypatch.setattr(record, "load_any", lambda path: made)
    monkeypatch.setattr(record, "staleness", lambda rec: [])
    assert record.job_current(interp) and record.job_current(interp, "run-a")
    assert not record.job_current(interp, "run-b")  # current, but not made by this forced run: re-recorded
    assert record.job_current(interp, gpu="NVIDIA H200")
    assert not record.job_current(interp, gpu="NVIDIA H100 80GB HBM3")  # another GPU's result: re-recorded here
    provenance.command = recorder.command_line(interp).replace("--runs 100", "--runs 200")
    assert not record.job_current(interp)  # its code is current, but the job's command changed since
    provenance.command = recorder.command_line(interp).replace("data/bench/interp.json", "/tmp/elsewhere.json")
    assert "/tmp/elsewhere.json" in provenance.command and record.job_current(interp)  # where it wrote is no flag
    provenance.command = recorder.command_line(interp)
    monkeypatch.setattr(record, "staleness", lambda rec: ["glmvit/graphs.py:EncoderGraphRunner.run"])
    assert not record.job_current(interp, "run-a")  # this run's, but its code changed since


def test_dry_run_lists_every_job_and_refuses_unknown_ones(capsys):
    assert main(["record", "--dry-run", "--force"]) == 0
    out = capsys.readouterr().out
    assert "[measure] img1x224" in out and "[profile] kernels" in out and "[ncu]" not in out
    assert "python -m glmvit bench --workload img1x224" in out
    with pytest.raises(SystemExit):
        main(["record", "--only", "nope"])
    with pytest.raises(SystemExit):
        main(["record", "--phases", "nope"])


class FakePhase:
    """A phase process that prints what the recorder prints, and touches nothing; ``events`` logs when each was
    started, told to go and waited for."""

    script: dict[str, list[str]] = {}
    calls: list[list[str]] = []
    events: list[tuple[str, str]] = []

    def __init__(self, cmd, **kwargs):
        self.phase = phase = cmd[cmd.index("--phase") + 1]
        FakePhase.calls.append(cmd)
        FakePhase.events.append(("start", phase))
        self.stdin = FakeStdin(phase)
        self.stdout = io.StringIO("".join(line + "\n" for line in [f"[ready] {phase}", *FakePhase.script[phase]]))
        self.code = 1 if any(line.startswith("[FAIL]") for line in FakePhase.script[phase]) else 0
        self.ended = False

    def wait(self, timeout=None):
        if not self.ended:
            FakePhase.events.append(("ended", self.phase))
            self.ended = True
        return self.code

    def poll(self):
        return self.code if self.ended else None


class FakeStdin:
    def __init__(self, phase):
        self.phase, self.closed = phase, False

    def write(self, text):
        FakePhase.events.append((text.strip(), self.phase))

    def close(self):
        self.closed = True


def test_the_orchestrator_runs_each_phase_once_and_packs_what_they_wrote(tmp_path, monkeypatch, capsys):
    archive = tmp_path / "records.tgz"
    FakePhase.calls, FakePhase.events = [], []
    FakePhase.script = {
        "measure": ["[run] latency: ...", "[done] latency 12.5 data/bench/latency.json",
                    "[done] startup_cold 20.0 "],
        "profile": ["[done] startup_warm 9.0 data/bench/capture.json", "[FAIL] kernels 3.0"],
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(record, "install_problem", lambda: None)  # a CPU machine posing as one with CUDA
    monkeypatch.setattr(record, "gpu_problem", lambda chosen: None)  # ... the records' GPU
    monkeypatch.setattr(record, "this_gpu", lambda: "NVIDIA H200")
    monkeypatch.setattr(record.subprocess, "Popen", FakePhase)
    monkeypatch.setattr(record, "job_current", lambda job, run_id=None, gpu=None: False)
    code = main(["record", "--only", "latency,startup_warm,kernels", "--archive", str(archive)])
    assert code == 1  # kernels failed
    assert [c[c.index("--phase") + 1] for c in FakePhase.calls] == ["measure", "profile"]  # one process a phase
    # both start at once and import side by side; measure goes once both are ready, profile once measure has ended
    assert FakePhase.events == [("start", "measure"), ("start", "profile"), ("go", "measure"), ("ended", "measure"),
                                ("go", "profile"), ("ended", "profile")]
    measure_jobs = FakePhase.calls[0][FakePhase.calls[0].index("--jobs") + 1].split(",")
    assert measure_jobs == ["startup_cold", "latency"]
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["data/bench/latency.json", "data/bench/capture.json"]
    out = capsys.readouterr().out
    assert out.index("[ready] measure") < out.index("[ready] profile") < out.index("[run] latency")
    assert "1 failed ['kernels']" in out and "seconds per job: latency 12, startup_cold 20" in out


def test_an_interrupted_run_ends_the_phases_it_never_told_to_go(tmp_path, monkeypatch):
    FakePhase.calls, FakePhase.events = [], []
    FakePhase.script = {"measure": ["[done] latency 1.0 "], "profile": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(record, "install_problem", lambda: None)  # a CPU machine posing as one with CUDA
    monkeypatch.setattr(record, "gpu_problem", lambda chosen: None)  # ... the records' GPU
    monkeypatch.setattr(record, "this_gpu", lambda: "NVIDIA H200")
    monkeypatch.setattr(record.subprocess, "Popen", FakePhase)
    monkeypatch.setattr(record, "job_current", lambda job, run_id=None, gpu=None: False)

    def interrupted(process, phase_jobs, on_written):
        raise KeyboardInterrupt

    monkeypatch.setattr(record, "run_phase", interrupted)
    with pytest.raises(KeyboardInterrupt):
        record.main(["--only", "latency,kernels"])
    assert ("go", "profile") not in FakePhase.events and ("ended", "profile") in FakePhase.events


def test_a_waiting_phase_builds_its_session_without_the_gpu_and_runs_only_when_told(tmp_path, monkeypatch, capsys):
    """A phase's process imports and builds its session while the phase before it runs: nothing it does before it
    is told to go may touch the GPU (no CUDA context, no synchronize), and end of file runs nothing."""
    ran, cuda = [], []
    monkeypatch.setitem(recorder.RUNNERS, "bench-interp", lambda job, session, workdir: ran.append(job.name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: cuda.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cuda.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "init", lambda: cuda.append("init"))
    monkeypatch.setattr(recorder, "stamp_elapsed", lambda job, seconds, since: [])
    before = []

    class Go:
        def __init__(self, line):
            self.line = line

        def readline(self):
            before.append((list(ran), list(cuda), capsys.readouterr().out))
            return self.line

    assert recorder.run_phase("measure", ["interp"], tmp_path, None, Go("")) == 0
    assert ran == [] and "[ready] measure" in before[0][2]
    assert recorder.run_phase("measure", ["interp"], tmp_path, None, Go("go\n")) == 0
    assert before[1][:2] == ([], []) and ran == ["interp"] and cuda == []


def _job(name, command, argv, out):
    return Job(name, "measure", command, (*argv, "--json", str(out)), (str(out),))


def test_a_bench_job_runs_in_process_on_the_sessions_model_and_times_every_request(tmp_path):
    session = Session()
    out = tmp_path / "bench.json"
    job = _job("b", "bench", ("--workload", "img1x224", "--num-requests", "4", "--modes", "eager,graph", "--warmup",
                              "1", "--quiet", "--max-passes", "2", "--precision", "0"), out)
    recorder.run_bench(job, session, tmp_path)
    data = json.loads(out.read_text())
    for mode in data["modes"].values():
        assert mode["requests"] == 4 and mode["passes"] == 2 and mode["timed_requests"] == 8
        lo, hi = mode["median_ci95_ms"]
        assert lo <= mode["median_ms"] <= hi
    assert data["provenance"]["command"].startswith("python -m glmvit bench --workload img1x224")
    assert len(session._models) == 1  # noqa: SLF001 - the model is the session's, built once


def test_an_in_process_serve_job_drives_the_scheduler_on_the_sessions_model_and_writes_its_record(tmp_path):
    """bench-serve --in-process inside a record run: no server, the session's tower (built once, shared with the
    other jobs) and a runner the session lends, every request answered, the record written by the command."""
    session = Session()
    job = next(j for j in jobs() if j.command == "bench-serve" and "--in-process" in j.argv)
    out = tmp_path / "serve.json"
    argv = list(job.argv)
    for flag, value in (("--json", str(out)), ("--workload", "img1x224"), ("--num-prompts", "6")):
        argv[argv.index(flag) + 1] = value
    job = Job(job.name, job.phase, job.command, (*argv, "--warmup-requests", "1"), (str(out),), 1.0, ("graph",),
              shares="serve")
    session.begin_job(job.name, job.shares, frozenset({"serve"}))
    recorder.run_serve(job, session, tmp_path)
    data = json.loads(out.read_text())
    assert data["settings"]["target"] == "in-process" and data["settings"]["body"] == "pixels"
    (run,) = data["runs"]
    assert run["requests"] == run["successful"] == 6 and run["failed"] == run["refused"] == 0
    assert len(session._models) == 1 and session.kept_runners()  # noqa: SLF001 - the session's model and runner
    session.close()


def test_the_two_latency_sweeps_share_their_eager_runs(tmp_path):
    session = Session()
    argv = ("--budgets", "16,32", "--runs", "2", "--warmup", "0", "--quiet")
    for name in ("a", "b"):
        recorder.run_latency(_job(name, "latency", argv, tmp_path / f"{name}.json"), session, tmp_path)
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    eager = [[(lay["eager_ms"], lay["eager_p99_ms"]) for lay in row["layouts"]] for row in a["budgets"]]
    assert eager == [[(lay["eager_ms"], lay["eager_p99_ms"]) for lay in row["layouts"]] for row in b["budgets"]]
    # one eager timing per distinct batch: the same forward whatever budget lists it
    grids = {tuple(map(tuple, lay["grids"])) for row in a["budgets"] for lay in row["layouts"]}
    assert set(session.shared["latency_eager"]) == grids


def test_serve_records_of_each_mode_merge_into_one():
    from glmvit.provenance import collect
    from glmvit.records import ServeRecord, make

    def part(mode, unit):
        rec = make(ServeRecord, provenance=collect("cpu", "python -m glmvit bench-serve --url x"),
                   settings={"target": "url", "workload": "video8x224"}, runs=[{"mode": mode, "rate": "inf"}],
                   servers={mode: {"mode": mode}}, floor={mode: None})
        return json.loads(rec.model_dump_json())

    job = Job("serve_x", "measure", "bench-serve", ("--workload", "video8x224"), (), modes=("eager", "graph"))
    merged = recorder.merge_serve([part("eager", "a"), part("graph", "b")], job)
    assert [r["mode"] for r in merged.runs] == ["eager", "graph"] and set(merged.servers) == {"eager", "graph"}
    assert merged.settings["modes"] == ["eager", "graph"] and merged.settings["target"] == "record"
    assert merged.provenance.command.startswith("python -m glmvit bench-serve --workload video8x224")


def test_the_medians_interval_is_distribution_free_and_narrows_with_more_samples():
    rng = np.random.default_rng(0)
    small, large = rng.lognormal(size=50), rng.lognormal(size=5000)
    for sample in (small, large):
        lo, hi = median_ci95(sample)
        assert lo <= np.median(sample) <= hi
    assert relative_halfwidth(large) < relative_halfwidth(small) / 5  # ~1/√n: 10× the samples, ~3× narrower each way
    assert relative_halfwidth([3.0] * 10) == 0
    # for n = 100: the values at 0-based positions floor(50 − 9.8) = 40 and ceil(50 + 9.8) = 60 (n/2 ∓ 1.96·√n/2)
    assert median_ci95(list(range(100))) == (40.0, 60.0)


def test_a_quiet_host_restores_the_collector_and_the_cpus():
    import gc
    import os

    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with quiet_host():
        assert not gc.isenabled()
    assert gc.isenabled()
    if before is not None:
        assert os.sched_getaffinity(0) == before


def test_a_quiet_host_leaves_the_cpu_to_the_scheduler(monkeypatch):
    """Pinning the timed thread to the CPU that ran a short loop fastest made an eager forward slower on
    the H200 machine than leaving it free: a quiet host turns the collector off and never moves the thread."""
    import os

    from glmvit import timing

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity here")
    moves: list[set[int]] = []
    monkeypatch.setattr(os, "sched_setaffinity",
                        lambda pid, cpus: moves.append(set(cpus)))
    with quiet_host():
        timing.time_passes(lambda j: j, 3, "cpu", max_passes=1)
        timing.time_until_steady(lambda: None, "cpu", 2, min_runs=2, spread=10.0)
    assert moves == []


def test_stamp_elapsed_writes_only_what_the_job_wrote(tmp_path):
    from glmvit.provenance import collect
    from glmvit.records import InterpRecord, load_any, make, to_json

    path = tmp_path / "r.json"
    path.write_text(to_json(make(InterpRecord, provenance=collect("cpu", "x"), results=[])))
    job = Job("j", "measure", "bench-interp", (), (str(path),))
    assert recorder.stamp_elapsed(job, 3.21, path.stat().st_mtime + 10) == []  # older than the job: untouched
    assert recorder.stamp_elapsed(job, 3.21, 0) == [Path(path)]
    assert load_any(path).elapsed_s == 3.2


class _Clock:
    """A fake perf_counter that advances only when the timed call runs: call k takes durations[k] seconds."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def __call__(self):
        return self.now

    def run(self):
        self.now += self.durations[self.calls]
        self.calls += 1


def test_timing_until_steady_stops_once_the_runs_agree_and_runs_on_while_they_do_not(monkeypatch):
    from glmvit import timing

    steady = _Clock([0.010, 0.0101, 0.0100, 0.5, 0.5])  # three runs within 2 %: the fourth never runs
    monkeypatch.setattr(timing.time, "perf_counter", steady)
    assert len(timing.time_until_steady(steady.run, "cpu", max_runs=5)) == 3 and steady.calls == 3
    noisy = _Clock([0.010, 0.020, 0.010, 0.020, 0.010, 0.5])  # never within 2 %: stops at max_runs
    monkeypatch.setattr(timing.time, "perf_counter", noisy)
    assert timing.time_until_steady(noisy.run, "cpu", max_runs=5) == pytest.approx([10, 20, 10, 20, 10])
    late = _Clock([0.010, 0.030, 0.0101, 0.0100, 0.010])  # an outlier first: it keeps the spread wide to the cap
    monkeypatch.setattr(timing.time, "perf_counter", late)
    assert len(timing.time_until_steady(late.run, "cpu", max_runs=5, warmup=0)) == 5
    with pytest.raises(ValueError, match="min_runs"):
        timing.time_until_steady(steady.run, "cpu", max_runs=2, min_runs=3)


def test_the_serving_target_is_swept_on_the_one_shape_workload_in_bounded_time():
    """P99 time to embedding at half the saturated rate against the unloaded median means something only where items
    are alike: the one-shape workload gets a sweep, graph-compiled alone, whose finite rates at the saturated rate
    last recorded take well under half a minute; the README lists every serve job's record."""
    from glmvit.records import DATA, ServeRecord, load
    from tools.readme_results import SERVE_RECORDS

    serve = [j for j in jobs() if j.command == "bench-serve"]
    assert set(SERVE_RECORDS) == {j.name for j in serve}
    served = [j for j in serve if "--in-process" not in j.argv]  # flags with values only, below
    sweeps = [j for j in served if dict(zip(j.argv[::2], j.argv[1::2], strict=True))["--workload"] == "video8x224"
              and "50%" in dict(zip(j.argv[::2], j.argv[1::2], strict=True))["--request-rate"].split(",")]
    assert len(sweeps) == 1 and sweeps[0].modes == ("graph-compiled",)
    argv = dict(zip(sweeps[0].argv[::2], sweeps[0].argv[1::2], strict=True))
    rates = argv["--request-rate"].split(",")
    assert rates[0] == "inf" and any(float(r.rstrip("%")) < 50 for r in rates[1:])  # an unloaded run to compare
    saturated = next(r["requests_per_s"] for r in load(DATA / "bench/serve_video8x224.json", ServeRecord).runs
                     if r["mode"] == "graph-compiled")
    seconds = sum(int(argv["--num-prompts"]) / (float(r.rstrip("%")) / 100 * saturated) for r in rates[1:])
    assert seconds < 20, seconds


def test_the_plan_uses_a_jobs_last_time_only_when_that_run_was_the_same_command(monkeypatch):
    """A job's last ``elapsed_s`` plans it only while its command is the one that ran then (the interpreter that
    ran it aside): a job whose flags changed since is planned by its estimate. A job that took 0.0 s took that."""
    job = next(j for j in jobs() if j.name == "interp")
    same = f"/opt/venv/bin/python3 -m glmvit {recorder.command_line(job).split(' -m glmvit ', 1)[1]}"
    made = {"command": same, "elapsed_s": 9.4}

    def load(path):
        return type("R", (), {"elapsed_s": made["elapsed_s"],
                              "provenance": type("P", (), {"command": made["command"]})()})()

    monkeypatch.setattr("glmvit.records.load_any", load)
    assert recorder.expected_seconds(job) == 9.4
    made["elapsed_s"] = 0.0
    assert recorder.expected_seconds(job) == 0.0
    made["command"] = same.replace("--runs 100", "--runs 200")
    assert recorder.expected_seconds(job) == job.estimate_s


def test_dry_run_predicts_each_phase_and_the_whole_run(monkeypatch, capsys):
    monkeypatch.setattr(record, "expected_seconds", lambda job: 2.0 if job.phase == "measure" else 3.0)
    assert main(["record", "--dry-run", "--force"]) == 0
    out = capsys.readouterr().out
    plan = [j for j in jobs() if j.phase in ("measure", "profile")]
    measure = 2 * sum(j.phase == "measure" for j in plan)
    profile = 3 * sum(j.phase == "profile" for j in plan)
    assert f"[plan] measure ~{measure} s, profile ~{profile} s: ~{measure + profile} s of jobs" in out


def test_a_serve_job_starts_every_modes_client_before_its_first_server(tmp_path, monkeypatch):
    """A later mode's load generator imports beside the first one's, not after the first mode has been served:
    no server waits for its client to start. Each client is waited for by its own mode, and a failed mode ends the
    clients still waiting."""
    from glmvit.cli import bench_serve, serve, serve_app, serve_frontends

    events = []

    class Client:
        def __init__(self, argv, cwd=None):
            clients.append(argv)
            self.url, self.out = argv[argv.index("--url") + 1], Path(argv[argv.index("--json") + 1])
            self.mode, self.code = None, None
            events.append(("client", self.url))

        def wait(self, timeout=None):
            if self.code is None:
                self.code = 0
                self.out.write_text(json.dumps({"url": self.url}))
                events.append(("answered", self.url))
            return self.code

        def poll(self):
            return self.code

        def kill(self):
            self.code = -9
            events.append(("killed", self.url))

    class Thread:
        drained = True

        def __init__(self, service, port, serve=None):
            self.port = port
            served.append(serve)

        def start(self, timeout):
            timeouts.append(timeout)
            return self

        def __enter__(self):
            events.append(("listening", f"http://127.0.0.1:{self.port}"))

        def __exit__(self, *exc):
            return False

    class Pool:
        ready = 0

        def start(self):
            events.append(("pool started", None))
            return self

        def close(self, timeout=None):
            events.append(("closed", None))

    session = type("S", (), {"model": lambda self, args: type("M", (), {"device": "cpu"})(),
                             "floor": lambda self, *a: {}, "collect": staticmethod(lambda: None)})()
    monkeypatch.setattr(recorder.subprocess, "Popen", Client)
    monkeypatch.setattr(serve_app, "ServerThread", Thread)
    monkeypatch.setattr(serve_app, "default_decode_pool", lambda *a: Pool())
    served, built, timeouts, clients = [], [], [], []

    def build_service(args, command, model, floor, decode, session, start_decode=True):
        events.append(("built", args.mode))
        built.append((decode is not None, start_decode))

    monkeypatch.setattr(serve, "build_service", build_service)
    written = []
    monkeypatch.setattr(recorder, "merge_serve", lambda parts, job, served: parts)
    monkeypatch.setattr(recorder, "_write", lambda path, parts: written.append(parts))
    # --api-servers 1 (the default on a host of fewer than 8 CPUs): one process, the record's shared decode pool
    job = Job("serve_x", "measure", "bench-serve", ("--workload", "img1x224", "--num-prompts", "2", "--api-servers",
                                                    "1"), ("bench/serve_x.json",), modes=("eager", "graph"))
    recorder.run_serve(job, session, tmp_path)
    kinds = [kind for kind, _ in events]
    assert kinds == ["client", "client", "pool started", "built", "listening", "answered", "built", "listening",
                     "answered", "closed"]
    urls = [url for kind, url in events if kind == "client"]
    assert [url for kind, url in events if kind == "listening"] == urls  # each mode's server at its client's URL
    assert written == [[{"url": u} for u in urls]]
    assert served == [serve_app.run_server] * 2 and built == [(True, True)] * 2  # one process, the shared pool

    # --api-servers 2: the servers the record runs are what `glmvit serve --api-servers 2` runs: API server
    # processes with their own decode pools (the record's shared pool is never made)
    events.clear()
    served.clear()
    built.clear()
    many = Job("serve_x", "measure", "bench-serve", ("--workload", "img1x224", "--num-prompts", "2",
                                                     "--api-servers", "2"), ("bench/serve_x.json",), modes=("graph",))
    recorder.run_serve(many, session, tmp_path)
    assert [kind for kind, _ in events] == ["client", "built", "listening", "answered"]
    assert served[0].func is serve_frontends.run_frontends and served[0].keywords["count"] == 2
    assert built == [(False, False)] and timeouts[-1] > 60  # N processes import torch before they listen
    # the load generator is sent at the server's URL: the server-only flags stay with the server, and what it is
    # given passes bench-serve's own checks
    client = clients[-1][clients[-1].index("bench-serve") + 1:]
    assert "--api-servers" not in client
    parser = bench_serve.build_parser()
    bench_serve.check_args(parser, parser.parse_args(client), client)

    events.clear()
    monkeypatch.setattr(serve, "build_service", lambda args, *a, **k: (_ for _ in ()).throw(RuntimeError("no graphs")))
    with pytest.raises(RuntimeError, match="no graphs"):
        recorder.run_serve(job, session, tmp_path)
    assert sorted(kind for kind, _ in events) == ["client", "client", "closed", "killed", "killed", "pool started"]

    # one record names one server configuration: a mode whose server ran other processes than an earlier mode's
    # is refused, not recorded as the last mode's
    monkeypatch.setattr(serve, "build_service", build_service)
    real = bench_serve.serve_argv
    monkeypatch.setattr(bench_serve, "serve_argv", lambda args, mode, workload: [
        *real(args, mode, workload), "--decode-workers", "1" if mode == "eager" else "2"])
    with pytest.raises(RuntimeError, match="graph: its server's processes"):
        recorder.run_serve(job, session, tmp_path)


@pytest.fixture(scope="module")
def planned():
    """A record of a run of the recorder's code: a job's command line, through a function of the recorder."""
    was = fingerprint.tracking()
    assert fingerprint.start(force=True)
    try:
        with fingerprint.scope() as scope:
            recorder.command_line(recorder.jobs()[1])
    finally:
        if not was:
            fingerprint.stop()
    return make(NotebookResult, provenance={}, name="p", fingerprint=Fingerprint(units=scope.units()))


def test_the_recorders_job_table_is_a_plan_its_functions_are_code(planned, tmp_path):
    """Editing a job's time estimate (a top-level statement of the recorder) leaves the record current, also one
    made before the rule that still names such a statement; editing a recorder function that ran stales it."""
    copy = tmp_path / "glmvit"
    shutil.copytree(fingerprint.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert any(label.startswith("glmvit/cli/recorder.py:command_line") for label in planned.fingerprint.units)
    assert not any(fingerprint.plan_statement(label) for label in planned.fingerprint.units)
    _edit(copy / "cli" / "recorder.py", 'Job("startup_cold", "measure", "startup", (), (), 23)',
          'Job("startup_cold", "measure", "startup", (), (), 25)')
    assert staleness(planned, package=copy) == []
    older = planned.model_copy(update={"fingerprint": Fingerprint(
        units={**planned.fingerprint.units, "glmvit/cli/recorder.py:<module stmt 24>": "0" * 16,
               "glmvit/cli/recorder.py:<class Job>": "1" * 16})})
    assert staleness(older, package=copy) == []
    _edit(copy / "cli" / "recorder.py", 'return f"python -m glmvit {job.command} ',
          'return f"python -m glmvit  {job.command} ')
    assert staleness(planned, package=copy) == ["glmvit/cli/recorder.py:command_line"]



def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{path.name}: {old!r} found {text.count(old)} times"
    path.write_text(text.replace(old, new))


def test_jobs_that_share_a_runner_capture_it_once_and_its_last_user_frees_it(tmp_path, monkeypatch):
    import gc
    import weakref

    from glmvit.cli import bench

    built = []

    def counting(*args, **kwargs):
        built.append(args[1])
        return real(*args, **kwargs)

    real = bench.build_encoder
    monkeypatch.setattr(bench, "build_encoder", counting)
    session = Session()
    common = ("--workload", "img1x224", "--num-requests", "2", "--modes", "eager,graph", "--warmup", "0", "--quiet",
              "--max-passes", "1")
    plan = [("a", common, {"s"}), ("b", common, {"s"}), ("c", (*common, "--max-segments", "2"), set())]
    records, kept = {}, None
    for name, argv, later in plan:
        session.begin_job(name, "s", frozenset(later))
        recorder.run_bench(_job(name, "bench", argv, tmp_path / f"{name}.json"), session, tmp_path)
        records[name] = json.loads((tmp_path / f"{name}.json").read_text())["modes"]["graph-emulated"]
        if kept is None:
            kept = weakref.ref(next(iter(session.kept_runners().values())).runner)
        session.end_job(keep_compiled=True)
        assert bool(session.kept_runners()) == bool(later)
    assert len(built) == 2  # a captured, b took a's, c (other limits) captured its own
    a, b, c = (records[n]["runner_source"] for n in "abc")
    assert (a["captured_by"], a["reused"]) == ("a", False) and (b["captured_by"], b["reused"]) == ("a", True)
    assert (c["captured_by"], c["reused"]) == ("c", False)
    assert records["b"]["capture_s"] == records["a"]["capture_s"] == a["capture_s"] == b["capture_s"]
    assert records["b"]["runner"]["runs"] == 2  # its own requests only: the counters start at zero for each job
    gc.collect()
    assert kept() is None  # freed once its last user ended


class FakeRunner:
    def __init__(self, compiled):
        self.compiled, self.label = compiled, "graph-compiled" if compiled else "graph"
        self.stats = type("Stats", (), {"reset": lambda self: None})()


def test_compiled_state_stays_only_between_jobs_that_keep_it_and_never_outlives_a_kept_compiled_runner(monkeypatch):
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    session = Session()
    session.begin_job("a", "s", frozenset({"s"}))
    _, source = session.runner(("k",), lambda: FakeRunner(True), torch.device("cpu"))
    assert source["compiled_after"] == [] and source["reused"] is False
    session.end_job(keep_compiled=True)
    assert resets == [] and session.kept_runners()
    session.begin_job("b", None, frozenset({"s"}))
    _, source = session.runner(("other",), lambda: FakeRunner(True), torch.device("cpu"))
    assert source["compiled_after"] == ["a"]  # found a's compiled code: the record says so
    _, source = session.runner(("k",), lambda: pytest.fail("kept: not captured again"), torch.device("cpu"))
    assert source["reused"] and source["captured_by"] == "a"
    session.end_job(keep_compiled=False)  # b compiled something else: cleared, and the compiled runner with it
    assert resets == [1] and not session.kept_runners()
    session.begin_job("c", "s", frozenset())
    _, source = session.runner(("k",), lambda: FakeRunner(True), torch.device("cpu"))
    assert source["captured_by"] == "c" and source["compiled_after"] == []
    session.close()
    assert resets == [1, 1] and not session.kept_runners()


def test_the_plan_shares_runners_only_between_jobs_that_capture_the_same_ones_and_keeps_compiled_code_safely(
        monkeypatch):
    plan = [j for j in jobs() if j.phase == "measure"]
    names = [j.name for j in plan]
    assert names.index("seed_video8x224") == names.index("seed_img1x224") + 1

    def runner_flags(job):
        argv = list(job.argv)
        flags = ("--budgets", "--max-items", "--max-segments", "--attn-backend", "--tables", "--config", "--dtype")
        return {f: argv[argv.index(f) + 1] for f in flags if f in argv}

    groups = {}
    for job in plan:
        if job.shares:
            groups.setdefault(job.shares, []).append(job)
    assert set(groups) == {"seed", "serve"}
    seed = groups["seed"]
    assert runner_flags(seed[0]) == runner_flags(seed[1]) and {"--budgets", "--max-items", "--max-segments"} <= set(
        runner_flags(seed[0]))  # the limits given: whatever the workload, the same runners
    assert all(runner_flags(j) == {} for j in groups["serve"])  # the serving defaults, every one
    assert recorder.KEEP_COMPILED_STATE  # the default: compiled regions are reused from job to job
    keeps = {j.name: recorder.keeps_compiled(j) for j in jobs()}
    assert keeps["img1x224"] and keeps["img8x448"]  # transformers-compiled compiles transformers' code, static
    assert keeps["mixed_img"] and keeps["latency_compiled"] and keeps["serve_mixed_av"]
    assert not keeps["startup_cold"] and not keeps["kernels"]
    assert not any(keeps[j.name] for j in plan if j.command == "notebook")  # what a notebook compiles is its own
    whole = recorder.Job("w", "measure", "bench", ("--workload", "img1x224", "--modes", "eager,compile"))
    assert not recorder.keeps_compiled(whole)  # a whole forward compiled per shape: cleared after its job
    # every notebook result that times runs before the first job that keeps compiled code: it compiles from nothing
    first_keep = min(names.index(n) for n, kept in keeps.items() if kept and n in names)
    assert all(names.index(j.name) < first_keep for j in plan if j.command == "notebook"
               and j.name not in recorder.LAST_IN_PHASE)
    profile = [j.name for j in jobs() if j.phase == "profile"]
    assert profile[:2] == ["startup_warm", "kernels"]  # kernels times its replays before any profiler attaches
    for shares, members in groups.items():  # nothing between two sharers clears the compiled state under them
        first, last = names.index(members[0].name), names.index(members[-1].name)
        assert all(keeps[n] for n in names[first:last]), shares


def test_a_served_mode_takes_the_runner_an_earlier_server_captured(tmp_path):
    from glmvit.cli import serve

    session = Session()
    parser = serve.build_parser()
    args = parser.parse_args(["--mode", "graph", "--device", "cpu", "--config", "tiny", "--budgets", "16,32",
                              "--quiet"])
    from glmvit.cli.common import resolve_model_args

    resolve_model_args(parser, args)
    model = session.model(args)
    session.begin_job("first", "serve", frozenset({"serve"}))
    _, runner = serve.make_scheduler(model, "graph", args, session=session)
    source = session.source_of(runner)
    session.end_job(keep_compiled=True)
    session.begin_job("second", "serve", frozenset())
    _, again = serve.make_scheduler(model, "graph", args, session=session)
    source2 = session.source_of(again)
    assert again is runner and source2["reused"] and source2["captured_by"] == "first" and not source["reused"]
    session.end_job(keep_compiled=True)
    assert not session.kept_runners()


def test_without_kept_compiled_state_every_job_compiles_from_nothing(monkeypatch):
    monkeypatch.setattr(recorder, "KEEP_COMPILED_STATE", False)
    assert not any(recorder.keeps_compiled(j) for j in jobs())


def refusal(monkeypatch, capsys) -> str:
    """The one line a record run stops with before any job (exit status 2), no phase started."""
    monkeypatch.setattr(record, "job_current", lambda job, run_id=None, gpu=None: False)
    monkeypatch.setattr(record.subprocess, "Popen", lambda *a, **k: pytest.fail("a phase started"))
    with pytest.raises(SystemExit) as stop:
        record.main(["--only", "latency"])
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def committed_gpu() -> str:
    """The one GPU the committed results name (the ncu diagnostic aside)."""
    committed = {load_any(p).provenance.gpu for j in recorder.jobs() if j.phase != "ncu" for p in j.output_paths()
                 if p.exists()}
    assert len(committed) == 1, f"the committed results name several GPUs: {committed}"
    return committed.pop()


def test_a_record_on_another_gpu_must_re_record_every_result(monkeypatch, capsys):
    """The results are one GPU's: a partial run on a GPU other than the one the committed records name stops before
    any job, naming that GPU and a record it would leave behind; a run of every job may, and so may a partial run on
    the records' own GPU. The ncu diagnostic, recorded on request, is not held to it."""
    ours = committed_gpu()
    other = "NVIDIA H100 80GB HBM3" if ours != "NVIDIA H100 80GB HBM3" else "NVIDIA H200"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: other)
    err = refusal(monkeypatch, capsys)  # --only latency
    assert other in err and ours in err and "python -m glmvit record," in err
    every = [j for j in recorder.jobs() if j.phase != "ncu"]
    assert record.gpu_problem(every) is None
    assert record.gpu_problem([j for j in recorder.jobs() if j.phase == "ncu"]) is None  # the diagnostic alone
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: ours)
    assert record.gpu_problem([j for j in every if j.name == "latency"]) is None


def test_a_record_refuses_a_hopper_gpu_without_the_cuda_extra(monkeypatch, capsys):
    """auto attends with cuDNN on Hopper only through the cuda extra: records made without it would measure Triton
    where a full install runs cuDNN, so the run stops before any job, naming the extra."""
    from glmvit.kernels import cudnn_attention

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: committed_gpu())  # a Hopper: H100 or H200
    monkeypatch.setattr(cudnn_attention, "frontend_installed", lambda: False)
    err = refusal(monkeypatch, capsys)
    assert "cuda extra" in err and "glmvit[cuda]" in err and "triton" in err
    # before Hopper auto is triton with or without the extra: nothing to refuse
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 9))
    assert recorder.install_problem() is None


def test_a_serve_record_says_how_many_api_server_processes_served():
    """The clients are sent at a URL, so their records cannot know the server's processes: the merged record takes
    them from the servers the record run built (and says one process where there was one)."""
    part = json.loads((recorder.REPO / "data" / "bench" / "serve_video8x224.json").read_text())
    job = Job("serve_x", "measure", "bench-serve", ("--workload", "video8x224"), ("bench/serve_x.json",),
              modes=tuple(part["settings"]["modes"]))
    many = recorder.merge_serve([part], job, {"api_servers": 4, "decode_workers": 12})
    settings = many.settings if isinstance(many.settings, dict) else many.settings.model_dump()
    assert settings["batching"]["api_servers"] == 4 and settings["batching"]["decode_workers"] == 12
    assert "4 API server processes" in settings["servers"]
    one = recorder.merge_serve([part], job, {"api_servers": 1, "decode_workers": 12})
    settings = one.settings if isinstance(one.settings, dict) else one.settings.model_dump()
    assert settings["batching"]["api_servers"] == 1 and "API server" not in settings["servers"]
