"""One record run: every recorded GPU result re-measured in two long-lived processes, one per phase.

``python -m glmvit record`` (:mod:`glmvit.cli.record`) starts one process per phase and each runs its jobs in
order, in-process, sharing what a job would otherwise rebuild (:class:`glmvit.cli.session.Session`: the tower, its
transformers twin, the floor's measured rates, the graph runners of jobs that capture identical ones, and
torch.compile's state between jobs that compile only graph runners: :func:`keeps_compiled`). A job is the same
command a reader would type — its flags are in :data:`JOBS`, and its record's provenance names that command — run
through the command's own library function.

- ``measure``: every timing. A cold start first (a compiled ladder captured on empty compile caches), then the
  latency sweeps (eager timed once for both), the benchmarks, the interpolation kernel, the notebooks' timing
  results (:data:`glmvit.lab.NOTEBOOK_RESULTS` with ``profiles=False``) and the served encoder under load (a
  server in this process, one per mode; the load generator in its own process, as a client is).
- ``profile``: everything that attaches a profiler, in a process of its own so that no timing is ever taken after
  CUPTI has attached: a warm start (the same ladder on the caches ``measure`` filled), ``kernels`` (which times its
  replays before it profiles them) and the notebooks' profiling results.
- ``ncu``: Nsight Compute's counters — a diagnostic, run only when named (``--only ncu``), in its own process.

The launch-configuration sweep (``tools/tune_kernels.py``) is an input to the kernels' tables, not a result, and
is never run here. Every job runs inside a fingerprint scope, so its record names the code that ran for it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from ..records import DATA, REPO

PHASES = ("measure", "profile", "ncu")
LADDER = "64,128,256,512,768,1024,1536,2048,3072,4096"
SEED_CONFIG = ("--budgets", "128,256,512,1024,1536,2048", "--max-items", "4", "--max-segments", "32")  # PR 40576
# eager first: the baseline every ratio divides by is timed before the job compiles anything (transformers'
# reduce-overhead compile leaves worker processes and caches behind it)
PEER_MODES = "eager,graph,graph-compiled,transformers,transformers-compiled"
BENCH_MODES = "eager,graph,graph-compiled,transformers"
STARTUP_BUDGETS = (64, 128, 256, 512, 768, 1024)  # the default serving ladder's lower six, as a start compiles them
SPAWNED_AT = "GLMVIT_SPAWNED_AT"  # time.time() when the orchestrator started this phase's process
COLD_START = "startup_cold.json"  # measure's cold start, handed to profile through the run's work directory


@dataclass(frozen=True)
class Job:
    """One result: ``command`` and ``argv`` are what a reader would type (``python -m glmvit COMMAND ARGV``);
    ``outputs`` are its records under data/; ``estimate_s`` plans a run before any record says how long it took."""

    name: str
    phase: str
    command: str
    argv: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    estimate_s: float = 30.0
    modes: tuple[str, ...] = field(default=())  # serve jobs: one server per mode
    # the runners it captures are kept for the later jobs of its phase with the same name (Session.runner): jobs
    # whose graph modes capture identical runners (the same budgets, limits, attention and table)
    shares: str | None = None

    def output_paths(self) -> list[Path]:
        return [DATA / out for out in self.outputs]


def _bench(name: str, workload: str, requests: int, *extra: str, modes: str = BENCH_MODES,
           estimate: float = 15.0, shares: str | None = None) -> Job:
    out = f"bench/{name}.json"
    return Job(name, "measure", "bench", ("--workload", workload, "--num-requests", str(requests), "--modes", modes,
                                          "--warmup", "5", "--quiet", *extra, "--json", f"data/{out}"),
               (out,), estimate, shares=shares)


def _latency(name: str, *extra: str, estimate: float = 30) -> Job:
    out = f"bench/{name}.json"
    return Job(name, "measure", "latency", ("--budgets", LADDER, "--runs", "5", "--warmup", "1", "--quiet", *extra,
                                            "--json", f"data/{out}"), (out,), estimate)


SATURATION_PROMPTS = 1000  # requests of each serve job at rate inf alone (the comment at serve_video8x224)


def _serve(name: str, workload: str, prompts: int, rates: str, modes: tuple[str, ...], estimate: float,
           server: tuple[str, ...] = ()) -> Job:
    # answers in the model's dtype (bfloat16): what an engine consuming embeddings keeps, half float32's bytes;
    # every server has the serving defaults (``server``: flags of the spawned server's that differ): one runner per
    # mode for all of them
    out = f"bench/{name}.json"
    return Job(name, "measure", "bench-serve", ("--workload", workload, "--num-prompts", str(prompts),
                                                "--request-rate", rates, "--response-dtype", "model", *server),
               (out,), estimate, modes, shares="serve")


def _serve_in_process(name: str, workload: str, prompts: int, estimate: float, *extra: str,
                      shares: str | None = "serve") -> Job:
    # the same load as a serve job, graph-compiled, with no HTTP and no decoding: what the scheduler and the encoder
    # alone sustain (bench-serve --in-process), on the session's tower and the runner the serve jobs captured
    out = f"bench/{name}.json"
    return Job(name, "measure", "bench-serve", ("--in-process", "--workload", workload, "--num-prompts", str(prompts),
                                                "--request-rate", "inf", "--response-dtype", "model", *extra, "--json",
                                                f"data/{out}"), (out,), estimate, ("graph-compiled",), shares=shares)


# its capture fails on purpose, which leaves the CUDA generator in capture mode: nothing may run after it
LAST_IN_PHASE = ("03_host_syncs",)


def _notebook_jobs() -> list[Job]:
    from ..lab import NOTEBOOK_RESULTS

    names = sorted(NOTEBOOK_RESULTS, key=lambda n: n in LAST_IN_PHASE)  # stable: the registry's order otherwise
    return [Job(name, "profile" if NOTEBOOK_RESULTS[name].profiles else "measure", "notebook", (name,),
                (f"notebooks/{name}.json",), 15) for name in names]


STATIC_JOBS: tuple[Job, ...] = (  # in the order each phase runs them
    Job("startup_cold", "measure", "startup", (), (), 23),  # no record of its own: 22-24 s on the H200
    # the three jobs that time one 224² image eagerly (a host-bound forward: its time follows the host's launch
    # cost, 6.6-10 µs within run s15_a78d452r1) run close together: the compiled sweep between them reuses the
    # first one's eager runs, and writes the table the benchmarks route by
    _latency("latency", estimate=39),
    _latency("latency_compiled", "--compile", estimate=16),
    # a fixed workload (one shape): 50 requests, then more passes while a median is known worse than ±2 %; a mixed
    # workload: its 300 requests once (another pass over the same requests would narrow the interval without
    # sampling the workload any better). Every graph-compiled capture from here on reuses the regions
    # latency_compiled compiled (KEEP_COMPILED_STATE); the seed's two workloads share their runners (SEED_CONFIG
    # fixes budgets and limits), so they run one after the other
    _bench("img1x224", "img1x224", 50, modes=PEER_MODES, estimate=35),
    _bench("seed_img1x224", "img1x224", 50, *SEED_CONFIG, modes="eager,graph,graph-compiled", estimate=11,
           shares="seed"),
    _bench("seed_video8x224", "video8x224", 50, *SEED_CONFIG, modes="eager,graph,graph-compiled", estimate=4,
           shares="seed"),
    _bench("img8x448", "img8x448", 40, modes=PEER_MODES, estimate=33),
    _bench("mixed_img", "mixed-img", 300, "--max-passes", "1", estimate=48),
    _bench("mixed_av", "mixed-av", 300, "--max-passes", "1", estimate=39),
    _bench("img4x224", "img4x224", 50, estimate=9),
    _bench("video8x224", "video8x224", 50, estimate=10),
    _bench("video2x8x224", "video2x8x224", 50, estimate=9),
    # 100 calls per path: the slowest reference (one grid_sample per item, host-bound) takes ~50 ms a call
    Job("interp", "measure", "bench-interp", ("--runs", "100", "--warmup", "10", "--json",
                                              "data/bench/interp.json"), ("bench/interp.json",), 15),
    # the seed's serve workload (vLLM PR 40576: 8-frame 224² clips, one per request, rate inf) at SATURATION_PROMPTS
    # requests, so that the run's rate nears the steady state's: at 400 (run s29_9873271r1) the first answer came
    # 0.21 s after the first request, and graph-compiled's whole-run rate was 217 items/s against 334 over the middle
    # 80 % of its answers (glmvit.timing.steady_rate, which every run now records beside it). Eager, and the fastest
    # mode (graph alone adds a server start and nothing the two do not bound)
    _serve("serve_video8x224", "video8x224", SATURATION_PROMPTS, "inf", ("eager", "graph-compiled"), 29),
    # the same load on one process (HTTP, decoding and the engine in one), beside the default API servers above:
    # what the HTTP side's processes buy (notebook 11)
    _serve("serve_video8x224_one_process", "video8x224", SATURATION_PROMPTS, "inf", ("graph-compiled",), 20,
           server=("--api-servers", "1")),
    # the same load with the decode processes making the pixel rows (serve --rows host): the A/B that decides
    # --rows' default, this record against serve_video8x224's graph-compiled run of the same record run (the
    # engine process then only copies each request's rows to the GPU, leaving its GIL to the launch thread)
    _serve("serve_video8x224_rows_host", "video8x224", SATURATION_PROMPTS, "inf", ("graph-compiled",), 19,
           server=("--rows", "host")),
    # the same load with no HTTP (the scheduler driven in this process): the serving target's in-process half. Every
    # serve job captures uniform graphs for its workload's segment lengths (bench-serve --uniform-graphs auto, as
    # bench): the clips' frame pairs are 256-row segments, so a batch of sixteen clips (64 segments, 16384 rows) takes
    # the dense attention instead of the ragged kernel auto picks at that many rows (glmvit.uniform)
    _serve_in_process("serve_video8x224_in_process", "video8x224", SATURATION_PROMPTS, 6),
    # the same, with the ragged graphs alone (--uniform-graphs off): the A/B of the uniform graphs, where the encoder
    # is what is measured (over HTTP the host bounds the rate), this record against serve_video8x224_in_process. Its
    # runner is its own (captured here, freed after it: no later job replays ragged graphs alone)
    _serve_in_process("serve_video8x224_in_process_ragged", "video8x224", SATURATION_PROMPTS, 12,
                      "--uniform-graphs", "off", shares=None),
    # the serving target (P99 time to embedding at half the saturated rate ≤ 2× the unloaded median) on one shape,
    # where the unloaded spread is the server's, not the items' sizes' (mixed-av's unloaded P99 is several times its
    # median). A job of its own: a job's rates apply to every mode, and eager needs no sweep; 200 requests keep it
    # short (at ~235 req/s saturated: under a second, 20 % ≈ 4 s, 50 % ≈ 2 s)
    _serve("serve_video8x224_sweep", "video8x224", 200, "inf,20%,50%", ("graph-compiled",), 22),
    # latency against throughput on mixed traffic, graph-compiled: all at once (saturation), then Poisson arrivals
    # at shares of the rate that achieved
    _serve("serve_mixed_av", "mixed-av", 60, "inf,20%,50%,90%", ("graph-compiled",), 26),
    Job("startup_warm", "profile", "startup", (), ("bench/capture.json",), 20),
    # the attention kernels auto chooses among (torch's varlen kernel is in the attention sweep, not here)
    Job("kernels", "profile", "kernels", ("--backends", "auto", "--quiet", "--json",
                                          "data/bench/kernels.json"), ("bench/kernels.json",), 90),
    Job("ncu", "ncu", "ncu", ("--quiet", "--json", "data/bench/ncu.json"), ("bench/ncu.json",), 300),
)


def jobs() -> list[Job]:
    """Every job, phase by phase, in the order it runs: the phase's start first; then, in ``measure``, the notebooks'
    timing results (each compiles what it needs on a fresh compile state: no job before them keeps one), the other
    static jobs and the served encoder (whose load generator runs longest); in ``profile``, the static jobs
    (``kernels`` times its replays before any profiler has attached) before the notebooks' profiling results;
    :data:`LAST_IN_PHASE` ends its phase."""
    notebook = _notebook_jobs()
    ordered: list[Job] = []
    for phase in PHASES:
        mine = [j for j in STATIC_JOBS if j.phase == phase]
        starts = [j for j in mine if j.command == "startup"]
        rest = [j for j in mine if j.command not in ("startup", "bench-serve")]
        serve = [j for j in mine if j.command == "bench-serve"]
        lab = [j for j in notebook if j.phase == phase and j.name not in LAST_IN_PHASE]
        last = [j for j in notebook if j.phase == phase and j.name in LAST_IN_PHASE]
        early, late = ([], lab) if phase == "profile" else (lab, [])
        ordered += starts + early + rest + late + serve + last
    return ordered


# what a job compiles that the next may not reuse: bench's compile mode compiles the whole forward for each shape.
# transformers-compiled keeps nothing in the way: it compiles transformers' code, not glmvit's, and with
# dynamic=False one specialisation per input shape, exactly as its command alone does (its reduce-overhead CUDA
# graphs stay allocated until the phase ends: under 1 GB at 8×448²)
FOREIGN_COMPILES = ("compile",)
# True: torch.compile's state stays between the jobs keeps_compiled allows, so a graph-compiled capture after the
# first one reuses the compiled regions (glmvit.graphs) instead of compiling them again (about 50 s of a record run;
# each record says which jobs compiled the code it replays: runner_source.compiled_after). What it may change: a
# budget whose command alone compiles it for its static shape (the first of its ladder) may replay the
# dynamic-shape code an earlier job compiled. On the H200 at 5cbeb87, one process, graph-compiled medians with
# every budget static (compile_dynamic=False) against torch's default (first budget static, the rest dynamic):
# img1x224 1.690 vs 1.676 ms, img4x224 3.326 vs 3.360, video8x224 3.480 vs 3.395, img8x448 25.64 vs 25.65,
# mixed-img 15.40 vs 15.23: within 2.5 %, either way. False: every job compiles from nothing, as its command
# alone does (a kept compiled runner is then freed after its job: its graphs' kernels live as long as the code)
KEEP_COMPILED_STATE = True


def keeps_compiled(job: Job) -> bool:
    """Whether torch.compile's state may stay after ``job`` for the next (:meth:`Session.end_job
    <glmvit.cli.session.Session.end_job>`): after the latency sweeps, the served encoder and the benchmarks that
    compile no whole forward (:data:`FOREIGN_COMPILES`); not after any other job (a start, a notebook, the kernels:
    what they compile is theirs, or unknown); never without :data:`KEEP_COMPILED_STATE`."""
    if not KEEP_COMPILED_STATE:
        return False
    if job.command in ("latency", "bench-serve"):
        return True
    if job.command == "bench":
        modes = job.argv[job.argv.index("--modes") + 1].split(",") if "--modes" in job.argv else []
        return not set(modes) & set(FOREIGN_COMPILES)
    return False


def command_line(job: Job) -> str:
    if job.command == "notebook":
        return f"python -m glmvit record --only {job.name}  (glmvit.lab.NOTEBOOK_RESULTS[{job.name!r}])"
    if job.command == "startup":
        return f"python -m glmvit record --only {job.name}  (glmvit.cli.recorder.startup)"
    modes = f" --modes {','.join(job.modes)}" if job.modes else ""
    return f"python -m glmvit {job.command} {' '.join(job.argv)}{modes}"


# ---------------------------------------------------------------------------------------------------------------
# Running one job in this process
# ---------------------------------------------------------------------------------------------------------------


def _write(path: Path, record: Any) -> None:
    from .common import write_record

    write_record(path, record)


def run_bench(job: Job, session: Any, workdir: Path) -> None:
    from . import bench

    parser = bench.build_parser()
    args = parser.parse_args(list(job.argv))
    bench.check_args(parser, args)
    record = bench.run_benchmark(args, command_line(job), session)
    bench.print_report(record)
    _write(job.output_paths()[0], record)


def run_latency(job: Job, session: Any, workdir: Path) -> None:
    from . import latency

    args, config = latency.parse(list(job.argv))
    eager = session.shared.setdefault("latency_eager", {})  # both sweeps: the same eager runs
    table = latency.run_sweep(args, config, command_line(job), session, eager)
    latency.print_table(table.model_dump(mode="json")["budgets"])
    _write(job.output_paths()[0], table)


def run_main(job: Job, session: Any, workdir: Path) -> None:
    """A command whose ``main(argv)`` does it all: bench-interp (its own small inputs), kernels (on the session's
    tower and floor)."""
    from . import bench_interp, kernels

    if job.command == "kernels":
        code = kernels.main(list(job.argv), session)
    else:
        code = bench_interp.main(list(job.argv))
    if code != 0:
        raise RuntimeError(f"{job.command} exited non-zero")


def run_notebook(job: Job, session: Any, workdir: Path) -> None:
    from ..lab import NOTEBOOK_RESULTS
    from ..provenance import collect
    from ..records import NotebookResult, make

    result = NOTEBOOK_RESULTS[job.name].compute()
    clash = sorted(set(result) & set(NotebookResult.model_fields))
    if clash:
        raise ValueError(f"result {job.name}: keys {clash} are record fields; rename them")
    _write(job.output_paths()[0], make(NotebookResult, provenance=collect("cuda", command_line(job)), name=job.name,
                                       **result))


def startup(budgets: tuple[int, ...] = STARTUP_BUDGETS) -> dict[str, Any]:
    """One server start in this process: the full tower built with random weights, then a compiled runner for
    ``budgets`` (8 items, 16 segments, compiled in regions) captured; seconds of each, and since the process began
    (``$GLMVIT_SPAWNED_AT``, set by whoever started it)."""
    import torch

    from ..config import VisionConfig
    from ..graphs import EncoderGraphRunner
    from ..packing import BudgetConfig
    from ..random_weights import random_encoder

    start = time.perf_counter()
    model = random_encoder(VisionConfig.glm41v(), "cuda", torch.bfloat16, seed=0)
    torch.cuda.synchronize()
    built = time.perf_counter() - start
    runner = EncoderGraphRunner(model, BudgetConfig(budgets, 8, 16), torch_compile=True)
    start = time.perf_counter()
    runner.capture()
    out = {"capture_s": time.perf_counter() - start, "model_s": built, "attn_backend": model.attention_backend(),
           "budgets": {str(k): v.as_dict() for k, v in runner.captures.items()}}
    spawned = os.environ.get(SPAWNED_AT)
    if spawned:
        out["process_s"] = time.time() - float(spawned)
    return out


def run_startup(job: Job, session: Any, workdir: Path) -> None:
    """The cold start (measure's first job: empty caches) is kept in the work directory; the warm start (profile's
    first, on the caches measure filled) writes the record with both."""
    from ..provenance import collect
    from ..records import StartupRecord, make

    result = startup()
    cold = workdir / COLD_START
    if job.name == "startup_cold":
        cold.write_text(json.dumps({"result": result, "units": _scope_units()}))
        return
    if not cold.exists():
        raise RuntimeError(f"no cold start in {workdir}: run startup_cold (phase measure) in the same run first")
    earlier = json.loads(cold.read_text())
    _extend_scope(earlier.get("units") or {})
    runs = {"blocks-auto-cold": earlier["result"], "blocks-auto-warm": result}
    _write(job.output_paths()[0], make(
        StartupRecord, provenance=collect("cuda", command_line(job)), budgets=list(STARTUP_BUDGETS), runs=runs,
        starts="cold: the first process of a record run, on empty compile caches; warm: the next process, on the "
               "caches the first one filled"))


_SCOPES: list[Any] = []


def _scope_units() -> dict[str, str]:
    scope = _SCOPES[-1] if _SCOPES else None
    units = getattr(scope, "units", None)
    return dict(units()) if callable(units) else {}


def _extend_scope(units: dict[str, str]) -> None:
    scope = _SCOPES[-1] if _SCOPES else None
    if scope is not None and hasattr(scope, "add"):
        scope.add(units)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_serve(job: Job, session: Any, workdir: Path) -> None:
    """Per mode: ``glmvit serve`` in this process (a thread, on the session's model, configured exactly as
    ``bench-serve --spawn`` configures its child), loaded by ``bench-serve --url`` in a process of its own; the
    modes' records merged into one. Every mode's client starts first, at once: their starts (imports, encoding the
    workload's media) overlap each other and the first server's (capture, compilation), before any load is sent;
    each waits for its own server to listen before it sends anything, so a later mode's server never waits for its
    client to start. One-process servers share one decode pool (its processes import torch: seconds each); with
    ``--api-servers N`` the API server processes decode, as ``glmvit serve`` runs them. Every server shares the
    session's floor. A job with ``--in-process`` starts no server: ``bench-serve --in-process`` drives the scheduler
    in this process, on the session's tower, floor and runners, and writes the record itself."""
    from . import bench_serve, serve
    from .common import DTYPES
    from .pixel_rows import no_room
    from .serve_app import ServerThread, default_decode_pool
    from .serve_frontends import STARTUP_TIMEOUT_S

    if "--in-process" in job.argv:  # no server: the scheduler in this process, on the session's tower and runners
        if bench_serve.main([*job.argv, "--modes", ",".join(job.modes)], session) != 0:
            raise RuntimeError(f"[serve] {job.name}: bench-serve --in-process exited non-zero")
        return

    parser = bench_serve.build_parser()
    spawn_argv = [*job.argv, "--spawn", "--modes", ",".join(job.modes)]
    cargs = parser.parse_args(spawn_argv)
    bench_serve.check_args(parser, cargs, spawn_argv)
    workload = bench_serve.build_workload(cargs)
    uniform_graphs = bench_serve.resolve_uniform(cargs, workload)
    parts = []
    decode = None
    served: dict[str, Any] = {}
    clients: dict[str, tuple[str, Path, list[str], subprocess.Popen[bytes]]] = {}
    try:
        for mode in job.modes:
            out = workdir / f"{job.name}_{mode}.json"
            url = f"http://127.0.0.1:{_free_port()}"
            argv = [sys.executable, "-m", "glmvit", "bench-serve", "--url", url, "--wait-s", "900",
                    *bench_serve.client_argv(list(job.argv)), "--json", str(out)]
            print(f"[serve] {mode}: {' '.join(argv[1:])}", flush=True)
            clients[mode] = (url, out, argv, subprocess.Popen(argv, cwd=REPO))
        for mode in job.modes:
            url, out, argv, client = clients[mode]
            server_argv = bench_serve.serve_argv(cargs, mode, workload)[4:]  # after: python -m glmvit serve
            _, sargs = serve.parse_args(server_argv)
            start = time.perf_counter()
            one_process = sargs.api_servers == 1  # else the API server processes decode, each with its own pool
            if not one_process and (why := no_room()):
                raise RuntimeError(f"--api-servers {sargs.api_servers} needs a shared-memory folder: {why}")
            if sargs.rows == "host" and (why := no_room()):  # else every request would hand frames, as device does
                raise RuntimeError(f"--rows host needs a shared-memory folder: {why}")
            this = {"api_servers": sargs.api_servers, "decode_workers": sargs.decode_workers, "rows": sargs.rows,
                    "uniform_graphs": uniform_graphs, "uniform_lengths": list(sargs.uniform_lengths)}
            if served and this != served:  # one record names one server configuration: every mode's
                raise RuntimeError(f"[serve] {mode}: its server's processes {this} differ from the job's earlier "
                                   f"modes' {served}")
            served = this
            if decode is None and one_process:
                decode = default_decode_pool(sargs.decode_workers, serve.decode_queue(sargs),
                                             sargs.decode_timeout).start()
            model = session.model(sargs)
            floor = session.floor(model.device, DTYPES[sargs.dtype], None)
            service = serve.build_service(sargs, f"python -m glmvit serve {' '.join(server_argv)}", model, floor,
                                          decode if one_process else None, session, start_decode=one_process)
            built = time.perf_counter() - start
            server = ServerThread(service, port=int(url.rsplit(":", 1)[1]), serve=serve.serve_function(sargs))
            # N API server processes each import torch before they listen; their decode workers start meanwhile and
            # may still be starting then (/v1/info's ready counts them): the warm-up requests wait for them
            with server.start(timeout=60.0 if one_process else STARTUP_TIMEOUT_S + 30):
                listening = time.perf_counter() - start
                code = client.wait()
                answered = time.perf_counter() - start
            if server.drained is False:
                raise RuntimeError(f"[serve] {mode}: the server's drain did not answer every request in time, or an "
                                   "API server failed (its log lines say which)")
            decoders = f"{decode.ready} decoders ready" if one_process and decode is not None else (
                f"{sargs.api_servers} API server processes")
            print(f"[serve] {mode}: server built {built:.1f} s, listening {listening:.1f} s, client done "
                  f"{answered:.1f} s, server drained {time.perf_counter() - start:.1f} s after this server's start "
                  f"({decoders})", flush=True)
            if code != 0:
                raise subprocess.CalledProcessError(code, argv)
            parts.append(json.loads(out.read_text()))
            del service  # this mode's scheduler (and runner, unless the session keeps it), before the next mode's
            session.collect()
    finally:
        for _, _, _, client in clients.values():  # a failed mode ends the clients still waiting for theirs
            if client.poll() is None:
                client.kill()
                client.wait()
        if decode is not None:
            decode.close(60)
    _write(job.output_paths()[0], merge_serve(parts, job, served))


def merge_serve(parts: list[dict[str, Any]], job: Job, served: dict[str, Any] | None = None) -> Any:
    """One serve record from one client record per mode: their servers, floors and runs together; the code that
    ran is the clients' and this process's (the servers'). ``served``: the servers' own settings (``api_servers``,
    ``decode_workers``, ``rows``, ``uniform_graphs``, ``uniform_lengths``), which the clients, sent at a URL, cannot
    know."""
    from ..records import Fingerprint, ServeRecord, fingerprint_now, make

    first = parts[0]
    body = {k: v for k, v in first.items() if k not in ("kind", "provenance", "fingerprint", "elapsed_s",
                                                         "record_run")}
    body["servers"], body["floor"], body["runs"] = {}, {}, []
    merged: dict[str, dict[str, str]] = {}
    for part in parts:
        body["servers"].update(part["servers"])
        body["floor"].update(part["floor"])
        body["runs"] += part["runs"]
        for key, value in (part.get("fingerprint") or {}).items():
            if isinstance(value, dict):
                merged.setdefault(key, {}).update(value)
    for key, value in fingerprint_now().model_dump().items():
        if isinstance(value, dict):
            merged.setdefault(key, {}).update(value)
    served = served or {}
    many = served.get("api_servers", 1) > 1
    body["settings"] = {**body["settings"], "target": "record", "modes": list(job.modes),
                        "batching": {**body["settings"].get("batching", {}), **served},
                        "servers": "glmvit serve in the record run's process, one per mode, configured as --spawn "
                                   "configures its child" + (f", its HTTP side in {served['api_servers']} API server "
                                                             "processes" if many else "")
                                   + (", its decode processes making the pixel rows (--rows host)"
                                      if served.get("rows") == "host" else "")
                                   + (", uniform graphs for segments of "
                                      + ",".join(map(str, served["uniform_lengths"])) + " rows ("
                                      + ("--uniform-graphs auto: the workload's" if served.get("uniform_graphs")
                                         == "auto" else "--uniform-lengths") + ")"
                                      if served.get("uniform_lengths") else "")
                                   + "; this load generator in a process of its own"}
    provenance = {**first["provenance"], "command": command_line(job)}
    return make(ServeRecord, provenance=provenance, fingerprint=Fingerprint.model_validate(merged), **body)


RUNNERS: dict[str, Callable[[Job, Any, Path], None]] = {
    "bench": run_bench, "latency": run_latency, "bench-interp": run_main, "kernels": run_main,
    "notebook": run_notebook, "startup": run_startup, "bench-serve": run_serve,
}


@contextlib.contextmanager
def _job_scope(session: Any) -> Iterator[None]:
    """A fingerprint scope for one job: what runs in it, and what built the session's shared objects, is the code
    its records name."""
    from .. import fingerprint

    with fingerprint.scope() as scope:
        scope.add(session.setup_units)
        _SCOPES.append(scope)
        try:
            yield
        finally:
            _SCOPES.pop()


def stamp_elapsed(job: Job, seconds: float, since: float) -> list[Path]:
    """Write the job's duration into every record it wrote (those modified since ``since``); returns them."""
    from ..records import Record, load_any, to_json
    from .common import write_atomic

    written = []
    for path in job.output_paths():
        if not path.exists() or path.stat().st_mtime < since:
            continue
        record: Record = load_any(path)
        record.elapsed_s = round(seconds, 1)
        write_atomic(path, to_json(record).encode())
        written.append(path)
    return written


def run_phase(phase: str, names: list[str], workdir: Path, deadline: float | None, go: IO[str] | None = None) -> int:
    """Run the named jobs of ``phase`` here, in plan order. One line per job on stdout —
    ``[done] NAME SECONDS PATH...`` or ``[FAIL] NAME SECONDS`` or ``[later] NAME`` — for the orchestrator; a job
    that fails is reported with its traceback on stderr and the phase goes on. Returns the failures.

    ``go``: after the imports and the session (no GPU work: no CUDA context is made before a job runs), print
    ``[ready] PHASE`` and wait for one line from it: ``go`` runs the jobs, anything else (end of file) runs none. So
    the orchestrator starts every phase's process at once, all import side by side, and each runs its jobs alone.
    ``$GLMVIT_SPAWNED_AT`` then moves on by the wait: what the warm start reports as its process's age is the
    process's own work, as a server started alone does it."""
    import torch

    from .session import Session

    if phase != "ncu" and not torch.cuda.is_available():
        raise SystemExit("recording needs a CUDA GPU (the records are GPU results)")
    session = Session()  # its tower is built by the first job that asks for it, inside that job's scope
    session.end_job()  # what the imports made: frozen out of later collections
    spawned = os.environ.get(SPAWNED_AT)
    age = f": {time.time() - float(spawned):.1f} s after this process was started" if spawned else ""
    print(f"[ready] {phase}{age}", flush=True)
    if go is not None:
        waiting = time.time()
        if go.readline().strip() != "go":
            print(f"[stop] {phase}: not told to go, no job run", flush=True)
            return 0
        if spawned:
            os.environ[SPAWNED_AT] = repr(float(spawned) + time.time() - waiting)
    failures = 0
    planned = [j for j in jobs() if j.phase == phase and j.name in names]
    for i, job in enumerate(planned):
        expected = expected_seconds(job)
        if deadline is not None and time.time() + expected > deadline:
            print(f"[later] {job.name} expected {expected:.0f} s", flush=True)
            continue
        t0, wall0 = time.monotonic(), time.time()
        print(f"[run] {job.name}: {command_line(job)}", flush=True)
        # the runners it captures are kept while a later job shares them; torch.compile's state while it may be
        session.begin_job(job.name, job.shares, frozenset(j.shares for j in planned[i + 1:] if j.shares))
        try:
            if job.command == "ncu":
                subprocess.run([sys.executable, "-m", "glmvit", "ncu", *job.argv], cwd=REPO, check=True)
            else:
                with _job_scope(session):
                    RUNNERS[job.command](job, session, workdir)
        except Exception:  # noqa: BLE001 - one failing job must not lose the others
            traceback.print_exc()
            failures += 1
            print(f"[FAIL] {job.name} {time.monotonic() - t0:.1f}", flush=True)
            session.end_job()
            continue
        seconds = time.monotonic() - t0
        written = stamp_elapsed(job, seconds, wall0 - 1)
        print(f"[done] {job.name} {seconds:.1f} " + " ".join(str(p.relative_to(REPO)) for p in written), flush=True)
        t1 = time.monotonic()
        session.end_job(keep_compiled=keeps_compiled(job))
        print(f"[between] {job.name}: {t1 - t0 - seconds:.1f} s stamping, {time.monotonic() - t1:.1f} s clearing",
              flush=True)
    session.close()  # every kept runner and compiled specialisation freed before the process ends
    return failures


def install_problem(device_index: int = 0) -> str | None:
    """Why this CUDA machine would record a configuration ``make`` does not install on it (None: it would not):
    on a GPU where ``auto`` attends with cuDNN (Hopper or newer), the ``cuda`` extra's cuDNN frontend missing or not
    loading, so that every record would measure the Triton kernel where a full install runs cuDNN's."""
    import torch

    from ..kernels.cudnn_attention import MIN_CAPABILITY, unavailable_reason

    if torch.cuda.get_device_capability(device_index) < MIN_CAPABILITY:
        return None  # auto is triton on this GPU, with or without the extra
    reason = unavailable_reason(device_index, torch.bfloat16, None)
    return None if reason is None else f"{reason}; without it auto runs triton where a full install runs cudnn"


def same_command(recorded: str | None, job: Job) -> bool:
    """Whether a record's provenance command is the job's command now (whatever interpreter ran it: a command run
    through its own ``main`` names ``sys.executable``, the plan names ``python``; wherever it wrote its JSON, which is
    where the record lies, not what it measured)."""
    return _measured(recorded or "") == _measured(command_line(job))


def _measured(command: str) -> list[str]:
    """The part of a glmvit command line that says what it measures: its arguments, less ``--json PATH``."""
    words = command.partition(" -m glmvit ")[2].split()
    return [w for i, w in enumerate(words) if w != "--json" and (i == 0 or words[i - 1] != "--json")]


def expected_seconds(job: Job) -> float:
    """How long the job took last time (its records' ``elapsed_s``) when last time ran the same command
    (:func:`same_command`), else its estimate: a job whose flags changed since is planned by ``estimate_s``."""
    from ..records import load_any

    elapsed = []
    for path in job.output_paths():
        try:
            record = load_any(path)
        except (ValueError, OSError):
            continue
        if record.elapsed_s is not None and same_command(getattr(record.provenance, "command", None), job):
            elapsed.append(record.elapsed_s)
    return max(elapsed, default=job.estimate_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m glmvit.cli.recorder --phase P --jobs a,b --workdir DIR [--deadline UNIX_TIME] [--wait]``: one
    phase's process, started by ``python -m glmvit record`` (``--wait``: :func:`run_phase`'s ``go`` is stdin)."""
    p = argparse.ArgumentParser(prog="python -m glmvit.cli.recorder")
    p.add_argument("--phase", choices=PHASES, required=True)
    p.add_argument("--jobs", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--deadline", type=float, default=None)
    p.add_argument("--wait", action="store_true", help="once ready, run the jobs only when stdin says go")
    args = p.parse_args(argv)
    from .. import fingerprint

    fingerprint.start()  # every job's record names the code units that ran for it
    go = sys.stdin if args.wait else None
    return 1 if run_phase(args.phase, args.jobs.split(","), Path(args.workdir), args.deadline, go) else 0


def fresh_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="glmvit-record-"))


if __name__ == "__main__":
    raise SystemExit(main())
