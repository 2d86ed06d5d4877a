"""``python -m glmvit record``: re-measure every recorded GPU result on this CUDA machine, at this code, in one call.

One process per phase (:mod:`glmvit.cli.recorder`): ``measure`` takes every timing, then ``profile`` everything that
attaches a profiler, so no timing is ever taken after CUPTI attached. Every phase's process starts at once and
imports and builds its session; the first runs its jobs once all are ready, each later one once the one before it
has ended. Both share one compile-cache directory (``measure`` starts on empty caches: its first job is the cold
start that ``capture.json`` records; ``profile`` starts on the caches ``measure`` filled: the warm start). A
job whose records are all current (:func:`glmvit.records.staleness`) is skipped unless ``--force``; a forced run
skips only what this run id (``$GLMVIT_RECORD_RUN``) already made, so an interrupted run resumes. ``--time-limit``
starts no job that would end after it. Not run unless named: ``ncu`` (``--only ncu``, a diagnostic). Never run here:
``tools/tune_kernels.py``, the launch-configuration sweep the kernels' tables are built from (an input, not a
result). The results are one GPU's (:func:`gpu_problem`): on a GPU other than the one they name, a run re-records them
all or does not start.

    GLMVIT_RECORD_RUN=r1 python -m glmvit record --force --archive records.tgz   # everything, one call
    python -m glmvit record --only img1x224,kernels                               # two results
    python -m glmvit record --dry-run                                             # the plan, nothing run
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path
from typing import Callable

from ..records import REPO, RUN_ENV, load_any, staleness
from .common import Parser, atomic_output, float_in
from .recorder import (
    PHASES,
    SPAWNED_AT,
    Job,
    command_line,
    expected_seconds,
    fresh_workdir,
    install_problem,
    jobs,
    same_command,
)


def job_current(job: Job, run_id: str | None = None, gpu: str | None = None) -> bool:
    """Whether every record of the job exists, is current, was made by the job's command as it is now (the job table's
    other fields, and the rest of the recorder's top-level statements, are not what a record measured:
    :data:`glmvit.fingerprint.PLAN_MODULES`) — given ``run_id``, was made by that run, and given ``gpu`` (this
    machine's, as ``torch.cuda.get_device_name`` names it), was made on that GPU: another GPU's result is re-recorded
    by any run here, so that the results stay one GPU's (:func:`gpu_problem`)."""
    paths = job.output_paths()
    if not paths:  # the cold start writes no record of its own: it runs whenever the warm one does
        return False
    for path in paths:
        try:
            record = load_any(path)
        except (ValueError, OSError):
            return False
        if (staleness(record) or run_id not in (None, record.record_run)
                or gpu not in (None, record.provenance.gpu)
                or not same_command(getattr(record.provenance, "command", None), job)):
            return False
    return True


def this_gpu() -> str | None:
    """This machine's GPU as a record's provenance names it (``torch.cuda.get_device_name``); None without CUDA."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def gpu_problem(chosen: list[Job], device_index: int = 0) -> str | None:
    """Why this CUDA machine must not run ``chosen`` (None: it may). The results are read beside one another (every
    ratio, the README's tables, the notebooks), so they are one GPU's: a run on a GPU other than the one a result
    record names in its provenance re-records that record too, or does not run. Records are named for what they
    measure, not for a GPU (``data/bench/img1x224.json``); their provenance says which. The ``ncu`` diagnostic,
    recorded only on request, names its own GPU and is not held to this."""
    import torch

    name = torch.cuda.get_device_name(device_index)
    if all(j.phase == "ncu" for j in chosen):  # the diagnostic alone writes no result
        return None
    left: list[str] = []
    for job in jobs():
        if job in chosen or job.phase == "ncu":
            continue
        for path in job.output_paths():
            try:
                gpu = load_any(path).provenance.gpu if path.exists() else name
            except (ValueError, OSError):
                continue  # unreadable: re-recorded by the run that finds it stale
            if gpu != name:
                left.append(f"{path.relative_to(path.parents[1])} ({gpu})")
    if not left:
        return None
    more = f" and {len(left) - 2} more" if len(left) > 2 else ""
    return (f"this GPU is {name}, and this run would leave {', '.join(left[:2])}{more} beside its results: one "
            f"GPU's records only; re-record them all here (python -m glmvit record, which "
            "re-records another GPU's results and resumes where a cut-short run stopped) or run on their GPU")


def pack(archive: str, paths: list[Path]) -> None:
    """Every record written so far into the .tgz ``archive``, replacing it whole (never half-written)."""
    with atomic_output(archive) as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        for path in paths:
            tar.add(path, arcname=str(path.relative_to(REPO)))


def choose(selected: list[Job], force: bool, run_id: str, gpu: str | None = None) -> list[Job]:
    """The jobs to run: stale ones or another GPU's (``gpu``: this machine's; None, as on a CPU's dry run: any GPU's
    count) — or, forced, those this run has not made yet; the cold start whenever the warm start runs, since the warm
    start's record holds both."""
    chosen = [j for j in selected if not job_current(j, run_id if force else None, gpu)]
    if any(j.name == "startup_warm" for j in chosen) and not any(j.name == "startup_cold" for j in chosen):
        chosen = [j for j in jobs() if j.name == "startup_cold"] + chosen
    return [j for j in jobs() if j in chosen]  # plan order


def start_phase(phase: str, phase_jobs: list[Job], env: dict[str, str], workdir: Path,
                deadline: float | None) -> subprocess.Popen[str]:
    """The phase's process, started now: it imports and builds its session, says ``[ready]`` and waits for
    :func:`run_phase` to tell it to go (:func:`glmvit.cli.recorder.run_phase`); it does nothing on the GPU before."""
    cmd = [sys.executable, "-m", "glmvit.cli.recorder", "--phase", phase, "--workdir", str(workdir),
           "--jobs", ",".join(j.name for j in phase_jobs), "--wait"]
    if deadline is not None:
        cmd += ["--deadline", repr(deadline)]
    return subprocess.Popen(cmd, cwd=REPO, env={**env, SPAWNED_AT: repr(time.time())}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)


def wait_ready(process: subprocess.Popen[str]) -> None:
    """Echo a started phase's lines up to its ``[ready]`` (its imports and session done), or to its end."""
    assert process.stdout is not None
    for line in process.stdout:
        print(line, end="", flush=True)
        if line.startswith("[ready]"):
            return


def run_phase(process: subprocess.Popen[str], phase_jobs: list[Job],
              on_written: Callable[[list[Path]], None] = lambda paths: None,
              ) -> tuple[list[str], list[str], list[Path], dict[str, float]]:
    """Tell a started phase's process (:func:`start_phase`) to go and follow its lines to its end: (done, failed,
    records written, seconds per job); ``on_written`` gets every record written so far after each job that wrote
    one."""
    done: list[str] = []
    failed: list[str] = []
    written: list[Path] = []
    seconds: dict[str, float] = {}
    assert process.stdin is not None and process.stdout is not None
    try:
        process.stdin.write("go\n")
        process.stdin.close()
    except BrokenPipeError:  # it ended before its turn: what it printed, and its exit status, say why
        pass
    for line in process.stdout:
        print(line, end="", flush=True)
        word, _, rest = line.strip().partition(" ")
        if word in ("[done]", "[FAIL]"):
            name, secs, *paths = rest.split()
            seconds[name] = float(secs)
            (done if word == "[done]" else failed).append(name)
            written += [REPO / p for p in paths]
            if paths:
                on_written(written)
    code = process.wait()
    finished = set(done) | set(failed)
    if code != 0:  # a crash ends the process: whatever it had not finished failed with it
        failed += [j.name for j in phase_jobs if j.name not in finished and j.name not in failed]
    return done, failed, written, seconds


def stop_waiting(processes: list[subprocess.Popen[str]]) -> None:
    """End phase processes never told to go (an earlier phase raised): end of file on stdin ends them; killed if
    they do not end within a minute."""
    for process in processes:
        if process.poll() is not None:
            continue
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def plan_line(chosen: list[Job]) -> str:
    """The seconds the chosen jobs are expected to take (:func:`~glmvit.cli.recorder.expected_seconds`), per phase
    and in all: the jobs' own time, not the processes' start."""
    per_phase = {p: sum(expected_seconds(j) for j in chosen if j.phase == p) for p in PHASES}
    parts = ", ".join(f"{p} ~{s:.0f} s" for p, s in per_phase.items() if any(j.phase == p for j in chosen))
    return f"[plan] {parts}: ~{sum(per_phase.values()):.0f} s of jobs"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m glmvit record", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma list of job names (default: every job but ncu)")
    parser.add_argument("--phases", default="measure,profile", help=f"comma list of {', '.join(PHASES)} "
                        "(default measure,profile)")
    parser.add_argument("--force", action="store_true",
                        help=f"re-run jobs whose records are current, except those this run (${RUN_ENV}) made")
    parser.add_argument("--time-limit", type=float_in(1, 86_400), default=None,
                        help="seconds: start no job expected to end after this (default: no limit)")
    parser.add_argument("--archive", metavar="PATH", help="also pack every record written into this .tgz")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    plan = jobs()
    names = {j.name for j in plan}
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if unknown := sorted(set(phases) - set(PHASES)):
        parser.error(f"unknown phase(s) {', '.join(unknown)}; choose from {', '.join(PHASES)}")
    only = {n.strip() for n in args.only.split(",") if n.strip()} if args.only else None
    if only and (unknown := sorted(only - names)):
        parser.error(f"unknown job(s) {', '.join(unknown)}; `python -m glmvit record --dry-run` lists them")
    selected = [j for j in plan if j.name in only] if only else [j for j in plan if j.phase in phases]
    run_id = os.environ.get(RUN_ENV) or uuid.uuid4().hex[:12]
    chosen = choose(selected, args.force, run_id, this_gpu())
    for job in plan:
        if job in selected or job in chosen:
            what = "run" if job in chosen else "skip (current)"
            print(f"[{job.phase}] {job.name:<28} {what:<15} ~{expected_seconds(job):.0f} s  {command_line(job)}")
    if chosen:
        print(plan_line(chosen))
    if args.dry_run or not chosen:
        print("nothing to run: every selected record is current" if not chosen else "dry run: nothing run")
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.error("recording needs a CUDA GPU (the records are GPU results); --dry-run shows the plan")
    if problem := gpu_problem(chosen):
        parser.error(problem)
    if problem := install_problem():
        parser.error(f"recording needs the cuda extra on this GPU: {problem}")
    workdir = fresh_workdir()
    env = {**os.environ, RUN_ENV: run_id, "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"), "TRITON_CACHE_DIR": str(workdir / "triton")}
    start = time.monotonic()
    deadline = None if args.time_limit is None else time.time() + args.time_limit
    done: list[str] = []
    failed: list[str] = []
    written: list[Path] = []
    seconds: dict[str, float] = {}
    # every phase's process starts now, and the first is told to go once all have imported and built their
    # sessions: while two are alive, nothing but those imports runs beside a job; each later one is told to go when
    # the one before it has ended, so no two phases ever run jobs (or touch the GPU) at once
    phase_jobs = {phase: [j for j in chosen if j.phase == phase] for phase in PHASES}
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        for phase in PHASES:
            if phase_jobs[phase]:
                processes[phase] = start_phase(phase, phase_jobs[phase], env, workdir, deadline)
        for process in processes.values():
            wait_ready(process)
        for phase, process in processes.items():
            t0 = time.monotonic()
            earlier = list(written)

            def packed(new: list[Path], earlier: list[Path] = earlier) -> None:
                if args.archive:
                    pack(args.archive, earlier + new)

            d, f, w, s = run_phase(process, phase_jobs[phase], packed)
            done, failed, written = done + d, failed + f, written + w
            seconds.update(s)
            print(f"[phase] {phase}: {time.monotonic() - t0:.0f} s, {len(d)} done, {len(f)} failed", flush=True)
    finally:
        stop_waiting(list(processes.values()))
        shutil.rmtree(workdir, ignore_errors=True)
    later = [j.name for j in chosen if j.name not in done and j.name not in failed]
    print(f"\nrecord run {run_id}: {len(written)} records written in {time.monotonic() - start:.0f} s; "
          f"{len(failed)} failed {failed or ''}; {len(later)} not started {later or ''}")
    print("seconds per job: " + ", ".join(f"{n} {s:.0f}" for n, s in seconds.items()))
    if args.archive and written:
        print(f"wrote {args.archive} ({len(written)} records)")
    return 1 if failed or later else 0
