"""``python -m glmvit record``: re-measure every recorded result on this CUDA machine, at this code, in one run.

Every result in ``data/bench/`` and ``data/notebooks/`` is made by one job below: the same command a reader would
type, run in a fresh process (so each record's provenance names its own command, and one failure cannot spoil the
rest). Jobs run in dependency order — the latency sweeps first, since the benchmarks route and predict with them —
and a job whose records are all current (:func:`glmvit.records.staleness`) is skipped, so the command resumes where
an earlier call stopped. ``--force`` re-runs current jobs too, all but those whose records this run id
(``$GLMVIT_RECORD_RUN``) already made, so a forced re-record of everything also resumes across calls.
``--time-limit`` starts no job that its last recorded duration (``elapsed_s``) says would not finish in time: a
10-minute machine lease does one group per call and the next call continues. Not re-measured here:
``tune_h200.json``, a launch-configuration sweep that is an input to the kernels' tables
(``tools/tune_kernels.py``), not a result of this code.

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python -m glmvit record --time-limit 570 --archive records.tgz
    GLMVIT_RECORD_RUN=all1 python -m glmvit record --force --time-limit 570   # everything; repeat to resume
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..records import DATA, REPO, RUN_ENV, Record, load_any, staleness, to_json
from .common import Parser, atomic_output, float_in, write_atomic

LADDER = "64,128,256,512,768,1024,1536,2048,3072,4096"
SEED_CONFIG = ("--budgets", "128,256,512,1024,1536,2048", "--max-items", "4", "--max-segments", "32")  # PR 40576
GROUPS = ("sweeps", "bench", "serve", "notebooks")


@dataclass(frozen=True)
class Job:
    """One command that writes some records. ``outputs`` are paths under data/ (a notebook job: its ``NN_*``
    records); ``estimate_s`` is the first-time guess of its duration, before any record says how long it took."""

    name: str
    group: str
    argv: tuple[str, ...]
    outputs: tuple[str, ...]
    estimate_s: float
    env: tuple[tuple[str, str], ...] = ()

    def output_paths(self) -> list[Path]:
        if self.group == "notebooks":
            return sorted((DATA / "notebooks").glob(f"{self.name}_*.json"))
        return [DATA / out for out in self.outputs]


# the fixed workloads the peer ratio is taken on: transformers compiled once for their one shape
PEER_MODES = "transformers,transformers-compiled,eager,graph,graph-compiled"


def _bench(name: str, workload: str, requests: int, *extra: str, modes: str = "transformers,eager,graph,"
           "graph-compiled", estimate: float = 45.0) -> Job:
    out = f"bench/{name}_h200.json"
    return Job(name, "bench", ("-m", "glmvit", "bench", "--workload", workload, "--num-requests", str(requests),
                               "--modes", modes, "--warmup", "5", "--quiet", *extra, "--json", f"data/{out}"),
               (out,), estimate)


def _notebook(stem: str, estimate: float) -> Job:
    return Job(stem.split("_")[0], "notebooks",
               ("-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
                "--nbval-cell-timeout=600", f"notebooks/{stem}.ipynb"), (), estimate, (("GLMVIT_RECORD", "1"),))


JOBS: tuple[Job, ...] = (  # in priority order: the sweeps the benchmarks route with, the benchmarks the issues
    # measure against targets, the profiles, the other benchmarks, serving, the notebooks
    Job("latency", "sweeps", ("-m", "glmvit", "latency", "--budgets", LADDER, "--runs", "8", "--warmup", "2",
                              "--quiet", "--json", "data/bench/latency_h200.json"), ("bench/latency_h200.json",), 60),
    Job("latency_compiled", "sweeps", ("-m", "glmvit", "latency", "--compile", "--budgets", LADDER, "--runs", "8",
                                       "--warmup", "2", "--quiet", "--json", "data/bench/latency_compiled_h200.json"),
        ("bench/latency_compiled_h200.json",), 90),
    _bench("img1x224", "img1x224", 200, "--transformers-requests", "20", modes=PEER_MODES, estimate=90),
    _bench("mixed_img", "mixed-img", 300, "--transformers-requests", "40", estimate=70),
    _bench("mixed_av", "mixed-av", 300, "--transformers-requests", "40", estimate=70),
    Job("kernels", "sweeps", ("-m", "glmvit", "kernels", "--quiet", "--json", "data/bench/kernels_h200.json"),
        ("bench/kernels_h200.json",), 120),
    Job("ncu", "sweeps", ("-m", "glmvit", "ncu", "--quiet", "--json", "data/bench/ncu_h200.json"),
        ("bench/ncu_h200.json",), 400),
    Job("capture", "sweeps", ("tools/capture_time.py", "--scopes", "blocks", "--json", "data/bench/capture_h200.json"),
        ("bench/capture_h200.json",), 60),
    Job("interp", "sweeps", ("-m", "glmvit", "bench-interp", "--json", "data/bench/interp_h200.json"),
        ("bench/interp_h200.json",), 30),
    _bench("img4x224", "img4x224", 150, "--transformers-requests", "20"),
    _bench("video8x224", "video8x224", 150, "--transformers-requests", "20"),
    _bench("video2x8x224", "video2x8x224", 150, "--transformers-requests", "20"),
    _bench("img8x448", "img8x448", 80, "--transformers-requests", "10", modes=PEER_MODES, estimate=100),
    _bench("seed_img1x224", "img1x224", 150, *SEED_CONFIG, modes="eager,graph,graph-compiled", estimate=30),
    _bench("seed_video8x224", "video8x224", 150, *SEED_CONFIG, modes="eager,graph,graph-compiled", estimate=30),
    # the seed's serve run (vLLM PR 40576: 8-frame 224² clips, one per request, 100 requests, rate inf), per mode
    Job("serve_video8x224", "serve", ("-m", "glmvit", "bench-serve", "--spawn", "--modes", "eager,graph,graph-compiled",
                                      "--workload", "video8x224", "--num-prompts", "100", "--request-rate", "inf",
                                      "--json", "data/bench/serve_video8x224_h200.json"),
        ("bench/serve_video8x224_h200.json",), 90),
    # latency against throughput on mixed traffic, graph-compiled: Poisson arrivals at rising rates, then all at once
    Job("serve_mixed_av", "serve", ("-m", "glmvit", "bench-serve", "--spawn", "--modes", "graph-compiled",
                                    "--workload", "mixed-av", "--num-prompts", "150", "--request-rate",
                                    "10,50,inf", "--json", "data/bench/serve_mixed_av_h200.json"),
        ("bench/serve_mixed_av_h200.json",), 90),
    *(_notebook(stem, est) for stem, est in (
        ("00_tour", 60), ("02_interpolation_kernel", 40), ("03_cuda_graphs", 40), ("04_static_forward", 40),
        ("06_capture_replay", 60), ("08_benchmark", 90))),
)


def job_status(job: Job, run_id: str | None = None) -> tuple[bool, float]:
    """(whether every record of the job exists and is current — and, given ``run_id``, was made by that run —, its
    expected duration in seconds)."""
    paths = job.output_paths()
    if not paths:
        return False, job.estimate_s
    current, elapsed = True, []
    for path in paths:
        try:
            record = load_any(path)
        except (ValueError, OSError):
            return False, job.estimate_s
        current = current and not staleness(record) and run_id in (None, record.record_run)
        if record.elapsed_s:
            elapsed.append(record.elapsed_s)
    return current, max(elapsed, default=job.estimate_s)


def stamp_elapsed(job: Job, seconds: float, started: float) -> list[Path]:
    """Write the job's duration into every record it wrote (those modified since ``started``); returns them."""
    written = []
    for path in job.output_paths():
        if path.stat().st_mtime < started:
            continue
        record: Record = load_any(path)
        record.elapsed_s = round(seconds, 1)
        write_atomic(path, to_json(record).encode())
        written.append(path)
    return written


def pack(archive: str, paths: list[Path]) -> None:
    """Every record written so far into the .tgz ``archive``, replacing it whole (never half-written)."""
    with atomic_output(archive) as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
        for path in paths:
            tar.add(path, arcname=str(path.relative_to(REPO)))


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m glmvit record", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--groups", default=",".join(GROUPS), help=f"comma list of {', '.join(GROUPS)} (default all)")
    parser.add_argument("--only", default=None, help="comma list of job names (default every job of the groups)")
    parser.add_argument("--force", action="store_true",
                        help=f"re-run jobs whose records are current, except those this run (${RUN_ENV}) made")
    parser.add_argument("--time-limit", type=float_in(1, 86_400), default=None,
                        help="seconds: start no job expected to end after this (default: no limit)")
    parser.add_argument("--archive", metavar="PATH", help="also pack every record written into this .tgz")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    groups = [g.strip() for g in args.groups.split(",") if g.strip()]
    if unknown := sorted(set(groups) - set(GROUPS)):
        parser.error(f"unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}")
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    if only and (unknown := sorted(only - {j.name for j in JOBS})):
        parser.error(f"unknown job(s) {', '.join(unknown)}; see the JOBS table in glmvit/cli/record.py")
    jobs = [j for j in JOBS if j.group in groups and (only is None or j.name in only)]
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            parser.error("recording needs a CUDA GPU (the records are GPU results); --dry-run shows the plan")
    run_id = os.environ.get(RUN_ENV) or uuid.uuid4().hex[:12]
    env = {**os.environ, RUN_ENV: run_id, "PYTHONUNBUFFERED": "1"}
    start, written, failed, skipped = time.monotonic(), [], [], []
    for job in jobs:
        current, expected = job_status(job, run_id if args.force else None)
        if current:
            print(f"[skip] {job.name}: current" + (f", made by this run ({run_id})" if args.force else ""))
            continue
        left = None if args.time_limit is None else args.time_limit - (time.monotonic() - start)
        if left is not None and expected > left:
            print(f"[later] {job.name}: expected {expected:.0f} s, {max(left, 0):.0f} s left")
            skipped.append(job.name)
            continue
        print(f"[run] {job.name} (expected {expected:.0f} s): python {' '.join(job.argv)}", flush=True)
        if args.dry_run:
            continue
        t0, wall0 = time.monotonic(), time.time()
        timeout = None if left is None else max(left, 1.0)
        try:
            done = subprocess.run([sys.executable, *job.argv], cwd=REPO, env={**env, **dict(job.env)},
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            done = False
        seconds = time.monotonic() - t0
        if not done:
            failed.append(job.name)
            print(f"[FAIL] {job.name} after {seconds:.0f} s", flush=True)
        new = stamp_elapsed(job, seconds, wall0 - 1)
        written += new
        print(f"[done] {job.name}: {seconds:.0f} s, {len(new)} record(s)", flush=True)
        if args.archive and new:  # after every job: a lease that ends mid-run still hands back what was done
            pack(args.archive, written)
    if args.archive and written:
        print(f"wrote {args.archive} ({len(written)} records)")
    print(f"record run {run_id}: {len(written)} written, {len(failed)} failed {failed or ''}, "
          f"{len(skipped)} left for a later call {skipped or ''}")
    return 1 if failed else 0
