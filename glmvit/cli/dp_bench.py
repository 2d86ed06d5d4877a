"""Data-parallel demo / benchmark over :mod:`glmvit.parallel`: launch it with torchrun (NCCL on CUDA, gloo on CPU).

Every rank builds the same model (the same seed, or ``--weights``, in ``--dtype``), the same requests and its own
graph runner; rank 0 checks request 0 against per-item eager and writes the JSON::

    torchrun --nproc-per-node 2 -m glmvit.cli.dp_bench --modality video --items-per-request 2 \\
        --num-requests 200 --fault-drill --json data/bench/dp_video_2gpu.json
    torchrun --standalone --nproc-per-node 2 -m glmvit.cli.dp_bench --num-requests 20   # CPU, gloo
    torchrun --standalone --nproc-per-node 2 -m glmvit.cli.dp_bench --device cpu         # the same on a GPU host

``--timeout`` (seconds, default 300) is the process group's collective timeout: a rank that waits longer than that
for another one fails instead of hanging (gloo raises on the waiting ranks; NCCL's watchdog ends the process).
Every rank must be given the same arguments (``--json`` and the checkpoint's path excepted): the ranks compare them
before any other collective, and a difference stops every rank with one line naming it. A collective that fails (a
rank gone, stuck past ``--timeout``, or out of step) ends the rank with one line and exit status 1, not a traceback.
``--fault-drill`` makes the last rank raise inside its encode on one request: every rank must fail that request
with an error (the last rank its own, the others ``RankFailed``) well within the timeout, and the next request must
give the verified outputs again; the JSON records each rank's error and how long it took.

Every argument is checked before the process group starts, with a one-line error: the workload's grids are drawn
first, and requests, items, tokens per request, the budgets' graph memory and the pixels every rank keeps resident
are bounded before any pixel is generated.

Why one module of this length: set-up, verification, timing, fault drill and report of one torchrun command.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..defaults import dtype_name
from ..deployment import check_budget_fits
from ..encoder import build_encoder
from ..graphs import EncoderGraphRunner
from ..metadata import as_grid_array, item_row_starts
from ..model import GlmVisionEncoder
from ..modes import RunMode
from ..packing import BudgetConfig
from ..parallel import CollectiveError, DataParallelEncoder, DPStats, RankFailed, free_port
from ..provenance import collect, weights_identity
from ..timing import summarise
from ..weights import checkpoint_config
from ..workloads import random_batch, random_mm_workload
from . import USER_ERRORS, one_line
from .common import (
    DTYPES,
    MAX_BUDGET_TOKENS,
    Parser,
    add_model_args,
    bucket_config_arg,
    check_writable,
    describe,
    device_memory_bytes,
    float_in,
    graph_memory_target,
    int_in,
    model_from_args,
    output_path,
    resolve_model_args,
    vision_config,
    write_json,
)

PROG = "torchrun --nproc-per-node N -m glmvit.cli.dp_bench"
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 86_400  # a day: longer is no bound at all
MAX_REQUESTS = 100_000  # timed requests; every request's pixels are generated up front, on every rank
MAX_WARMUP = 10_000
MAX_ITEMS = 1_000_000  # items over the whole workload (warm-up included), bounded before any is drawn
PIXEL_SHARE = 0.5  # of the device's memory the resident pixels may take (a CPU's is shared by its local ranks)
CONFIG_NAMES = {"full": "glm41v", "tiny": "tiny", "checkpoint": "checkpoint"}  # the JSON's "config"
# Arguments the ranks may differ in: rank 0 alone writes --json; a checkpoint's path may differ between hosts (its
# weights are compared, rank against rank, by glmvit.parallel). Every other argument must be the same on every rank.
PER_RANK_ARGS = frozenset({"json", "weights"})


def build_parser() -> Parser:
    p = Parser(prog=PROG, description=(__doc__ or "").split("\n\n")[0])
    w = p.add_argument_group("workload (vLLM random-mm)")
    w.add_argument("--modality", choices=["image", "video"], default="image",
                   help="image: 224² images; video: 224² 8-frame clips (default image)")
    w.add_argument("--bucket-config", type=bucket_config_arg, default=None,
                   help="vLLM random-mm buckets instead, e.g. \"{(224, 224, 1): 0.7, (448, 448, 1): 0.3}\"")
    w.add_argument("--items-per-request", type=int_in(1, MAX_ITEMS), default=2)
    w.add_argument("--range-ratio", type=float_in(0, 1), default=0.0, help="items per request vary by ±ratio (vLLM)")
    w.add_argument("--num-requests", type=int_in(1, MAX_REQUESTS), default=50, help="timed requests (default 50)")
    w.add_argument("--warmup", type=int_in(0, MAX_WARMUP), default=3, help="untimed requests first (default 3)")
    r = p.add_argument_group("run")
    r.add_argument("--mode", choices=[RunMode.GRAPH.value, RunMode.EAGER.value], default="graph",
                   help="graph: EncoderGraphRunner (CUDA graphs on GPU, emulated on CPU); eager: model.forward")
    r.add_argument("--no-baseline", action="store_true",
                   help="skip timing the same requests single-process on rank 0")
    r.add_argument("--timeout", type=float_in(1, MAX_TIMEOUT_S), default=DEFAULT_TIMEOUT_S,
                   help=f"collective timeout in seconds, in [1, {MAX_TIMEOUT_S:,}] (default {DEFAULT_TIMEOUT_S}); "
                        "it also bounds how long the ranks wait for the slowest rank's setup and for rank 0's "
                        "single-process baseline")
    r.add_argument("--fault-drill", action="store_true",
                   help="after timing, the last rank raises inside one request: every rank must fail it "
                        "cleanly within the timeout and encode the next one (recorded in the JSON)")
    add_model_args(p)  # --device: each rank takes cuda:LOCAL_RANK (or the CPU, over gloo)
    p.add_argument("--json", metavar="PATH", type=output_path, help="rank 0 writes results and provenance here")
    return p


@dataclass(frozen=True)
class Workload:
    """The requests' grids (drawn and bounded before any pixel exists) and the runner's budgets for them."""

    buckets: dict
    grids: list[np.ndarray]  # per request (warm-up first), [items, 3] int64
    budget_config: BudgetConfig


def plan_workload(args: argparse.Namespace) -> Workload:
    """Draw the requests' grids and refuse, with a ValueError, what would not fit: too many items, a request beyond
    the largest budget, budgets beyond one H200, or pixels beyond ``PIXEL_SHARE`` of the device's memory."""
    buckets = args.bucket_config or ({(224, 224, 1): 1.0} if args.modality == "image" else {(224, 224, 8): 1.0})
    total = args.warmup + args.num_requests
    most = math.ceil(args.items_per_request * (1 + args.range_ratio))
    if total * most > MAX_ITEMS:
        raise ValueError(f"{total:,} requests (warm-up included) of up to {most:,} items is more than {MAX_ITEMS:,} "
                         "items (every item's pixels are generated before timing)")
    draws = random_mm_workload(buckets, total, args.items_per_request, range_ratio=args.range_ratio, seed=args.seed)
    grids = [np.array([item.grid for item in request], dtype=np.int64).reshape(-1, 3) for request in draws]
    specs = [[item.spec for item in request] for request in draws]
    _check_pixel_memory(args, sum(spec.rows for request in specs for spec in request))
    for k, request in enumerate(specs):
        tokens = sum(spec.tokens for spec in request)
        if tokens > MAX_BUDGET_TOKENS:
            raise ValueError(f"request {k} has {tokens:,} tokens, more than {MAX_BUDGET_TOKENS:,} (a request must "
                             "fit the 128K-token context of GLM-4.6V-Flash): fewer or smaller items")
    config = BudgetConfig.for_requests(specs)
    check_budget_fits(config, dtype_name(args.dtype), graph_memory_target(args.device))
    return Workload(buckets, grids, config)


def _check_pixel_memory(args: argparse.Namespace, rows: int) -> None:
    """Every rank keeps every request's pixels on its device: refuse more than ``PIXEL_SHARE`` of its memory."""
    device = torch.device(args.device)
    width = (checkpoint_config(args.weights)[0] if args.weights else vision_config(args.config)).patch_dim
    need = rows * width * DTYPES[args.dtype].itemsize
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if device.type == "cpu" else 1
    have = device_memory_bytes(device)
    if need > PIXEL_SHARE * have / sharing:
        raise ValueError(f"the workload's pixels need {need / 2**30:,.1f} GiB on every rank, more than "
                         f"{PIXEL_SHARE:.0%} of {device.type}'s {have / 2**30:,.0f} GiB"
                         + (f" shared by {sharing} ranks" if sharing > 1 else "")
                         + ": fewer or smaller requests")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Workload:
    """Every value checked before any work (one line and exit status 2 for a bad one); returns the workload."""
    resolve_model_args(parser, args)
    if torch.device(args.device).index is not None:
        parser.error(f"--device {args.device}: every rank takes cuda:LOCAL_RANK; pass --device cuda")
    try:
        if args.json:
            check_writable(args.json)
        return plan_workload(args)
    except (ValueError, OSError) as err:
        parser.error(str(err))


def init_distributed(device_type: str, timeout_s: float) -> tuple[int, int, torch.device]:
    """Initialise the default group from torchrun's environment (a 1-rank group without it): nccl on CUDA, gloo on
    the CPU, with ``timeout_s`` as the collective timeout."""
    if "RANK" not in os.environ:  # plain `python -m glmvit dp-bench`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        with collective("start of the process group"):
            dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        with collective("start of the process group"):
            dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Around one collective of this tool: the RuntimeError gloo raises when a rank is gone, stuck past the timeout
    or out of step becomes :class:`~glmvit.parallel.CollectiveError` naming ``what`` (one line), as
    :class:`~glmvit.parallel.DataParallelEncoder`'s own exchanges do."""
    try:
        yield
    except RuntimeError as err:
        rank = f"rank {os.environ.get('RANK', 0)}: "
        raise CollectiveError(f"{rank}the {what} did not complete (a rank is gone, stuck past --timeout, or out of "
                              f"step): {one_line(str(err))}") from err


def check_ranks_agree(args: argparse.Namespace, world: int) -> None:
    """Every rank was given the same arguments (all but ``PER_RANK_ARGS``): one all-gather before any other
    collective, so that ranks given different workloads stop at once, each with the same ValueError naming the first
    argument that differs, instead of timing out in mismatched collectives later."""
    mine = {key: repr(value) for key, value in sorted(vars(args).items()) if key not in PER_RANK_ARGS}
    everyone: list = [None] * world
    with collective("check that the ranks were given the same arguments"):
        dist.all_gather_object(everyone, mine)
    for key in mine:
        values = [theirs.get(key) for theirs in everyone]
        if len(set(values)) > 1:
            each = ", ".join(f"{value} on rank {q}" for q, value in enumerate(values))
            raise ValueError(f"the ranks were given different --{key.replace('_', '-')}: {each} (every rank must be "
                             "given the same arguments)")


def provenance(device: torch.device, argv: list[str]) -> dict:
    """Where and how a result was produced, with every rank's device (call on all ranks)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mine = {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}"}
    else:
        mine = {"device": "cpu", "threads": torch.get_num_threads()}
    mine["host"] = socket.gethostname()
    everyone: list = [None] * dist.get_world_size()
    with collective("all-gather of the ranks' devices"):
        dist.all_gather_object(everyone, mine)
    world = os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())
    command = f"torchrun --nproc-per-node {world} -m glmvit.cli.dp_bench " + " ".join(argv)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None
    gpus = [r["device"] for r in everyone] if device.type == "cuda" else []
    return {**collect(device, command), "ranks": everyone, "gpus": gpus, "nccl": nccl}


def count(n: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def compare_speed(single_ms: float, dp_ms: float) -> str:
    """The data-parallel mean against one process's, in words that stay true when data parallel is slower."""
    ratio = single_ms / dp_ms
    if ratio >= 1:
        return f"speed-up {ratio:.2f}× (mean)"
    return f"slow-down {1 / ratio:.2f}× (mean: data parallel is slower here; speed-up {ratio:.2f}×)"


# ---------------------------------------------------------------------------------------------------------------
# Setup
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Bench:
    """Everything the steps share: this rank, its model and engine, the encoder and the requests."""

    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    model: GlmVisionEncoder
    runner: EncoderGraphRunner | None
    runner_mode: str  # cuda (graphs), emulate (CPU stand-in for graphs) or eager
    dp: DataParallelEncoder
    workload: Workload
    requests: list  # per request: (pixel_values on this rank's device, grid_thw as a long tensor)

    @property
    def budget_config(self) -> BudgetConfig:
        return self.workload.budget_config


def setup(args: argparse.Namespace, workload: Workload, rank: int, world: int, device: torch.device) -> Bench:
    """This rank's model (same seed or checkpoint on every rank), engine, encoder and requests (same seeds)."""
    args.device = str(device)  # every rank builds its model on its own device
    model = model_from_args(args)
    requests = []
    for k, grids in enumerate(workload.grids):
        pixels, grid = random_batch(grids, model.config, seed=args.seed * 100_003 + k)
        requests.append((pixels.to(device, model.dtype), grid))
    encoder = build_encoder(model, args.mode, workload.budget_config)
    runner = encoder if isinstance(encoder, EncoderGraphRunner) else None
    runner_mode = runner.mode.value if runner is not None else RunMode.EAGER.value
    bench = Bench(args, rank, world, device, model, runner, runner_mode, DataParallelEncoder(encoder), workload,
                  requests)
    if rank == 0:
        c = workload.budget_config
        print(f"glmvit.parallel: {count(world, 'rank')} over {dist.get_backend()}, {describe(args)}, "
              f"mode {args.mode} ({runner_mode}); budgets {list(c.token_budgets)}, max_items {c.max_items}, "
              f"max_segments {c.max_segments}; collective timeout {args.timeout:g} s")
    return bench


# ---------------------------------------------------------------------------------------------------------------
# Verify the first request
# ---------------------------------------------------------------------------------------------------------------
def _row_start(grid) -> np.ndarray:
    return item_row_starts(as_grid_array(grid))


def _bitwise_vs_local(b: Bench, outs: list[torch.Tensor]) -> bool:
    """Every rank's items equal, bitwise, that rank's batch re-run here alone (agreed across ranks)."""
    pixels, grid = b.requests[0]
    mine = b.dp.assignment(grid).ranks[b.rank]
    again = b.dp.encode_share(pixels, grid, mine)
    exact = all(torch.equal(outs[i], o) for i, o in zip(mine, again, strict=True))
    flag = torch.tensor([int(exact)], device=b.dp.comm_device)
    with collective("verification's agreement"):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _max_diff_vs_eager(b: Bench, outs: list[torch.Tensor]) -> float:
    """max |DP − per-item eager| / max(1, max |eager|) over request 0 (a batch and a single item round differently,
    by ulps of the output's scale), computed on rank 0 and broadcast (every rank returns one verdict)."""
    pixels, grid = b.requests[0]
    start = _row_start(grid)
    max_diff = 0.0
    if b.rank == 0:
        with torch.inference_mode():
            for i, (t, h, w) in enumerate(grid.tolist()):
                ref = b.model(pixels[start[i] : start[i + 1]], torch.tensor([[t, h, w]])).float()
                scale = max(1.0, ref.abs().max().item())
                max_diff = max(max_diff, (outs[i].float() - ref).abs().max().item() / scale)
    diff = torch.tensor([max_diff], dtype=torch.float64, device=b.dp.comm_device)
    with collective("verification's broadcast"):
        dist.broadcast(diff, src=0)
    return float(diff.item())


def verify_first_request(b: Bench) -> tuple[dict, list[torch.Tensor]]:
    """DP vs per-item eager (tolerance) and per rank vs a local re-run (bitwise); returns the verdict and outputs."""
    pixels, grid = b.requests[0]
    outs = b.dp.run(pixels, grid)
    exact = _bitwise_vs_local(b, outs)
    max_diff = _max_diff_vs_eager(b, outs)
    tol = 1e-4 if b.model.dtype == torch.float32 else 2**-6  # of the output's scale: fp32 reordered sums; 2 bf16
    # ulps (fp16's are finer)
    ok = exact and max_diff <= tol and len(outs) == len(grid)
    if b.rank == 0:
        counts = b.dp.assignment(grid).counts
        print(f"verify request 0 ({len(grid)} items, per rank {counts}): per-rank batches bitwise "
              f"{'equal' if exact else 'DIFFERENT'}; max |DP − per-item eager| / scale = {max_diff:.3g} "
              f"(tolerance {tol}) → {'OK' if ok else 'FAILED'}")
    verdict = {"items": len(grid), "exact_vs_same_batch_per_rank": exact, "max_rel_diff_vs_per_item_eager": max_diff,
               "tolerance": tol, "ok": ok}
    return verdict, outs


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------
def _time_requests(fn, requests, device) -> list[float]:
    """ms per request: all ranks start together (barrier), the clock stops when this rank has the full result."""
    out = []
    for pixels, grid in requests:
        with collective("barrier before a timed request"):
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(pixels, grid)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _rank_summary(stats: DPStats, calls: list[dict]) -> dict:
    """This rank's share of the work and where its time went, per request on average; the all-gather's share of each
    request (``gather_share_per_request``: output gather / whole call, after every rank has finished encoding)."""
    n = stats.calls
    share = [c["gather_ms"] / c["total_ms"] for c in calls]
    return {"items": stats.local_items, "tokens": stats.local_tokens,
            "check_ms_mean": stats.check_s * 1e3 / n, "local_ms_mean": stats.local_s * 1e3 / n,
            "sync_ms_mean": stats.sync_s * 1e3 / n, "gather_ms_mean": stats.gather_s * 1e3 / n,
            "gather_share_mean": float(np.mean(share)), "gather_share_p99": float(np.percentile(share, 99)),
            "gather_share_per_request": share}


def time_data_parallel(b: Bench) -> dict:
    """Warm up, then time every request through the data-parallel encoder; the request's time is the slowest rank's."""
    calls: list[dict] = []

    def dp_call(pixels, grid):
        b.dp.run(pixels, grid)
        calls.append(b.dp.stats.last)

    _time_requests(dp_call, b.requests[: b.args.warmup], b.device)
    b.dp.stats, calls[:] = DPStats(), []
    local_ms = _time_requests(dp_call, b.requests[b.args.warmup :], b.device)
    worst = torch.tensor(local_ms, dtype=torch.float64, device=b.dp.comm_device)
    with collective("all-reduce of the request times"):
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the ranks finish the gather together: the request is the max
    per_rank: list = [None] * b.world
    with collective("all-gather of the ranks' summaries"):
        dist.all_gather_object(per_rank, _rank_summary(b.dp.stats, calls))
    return {"dp_ms": worst.tolist(), "per_rank": per_rank, "mean_imbalance": b.dp.stats.mean_imbalance}


def _time_alone(b: Bench) -> list[float]:
    """ms per request for this rank's engine alone (graph runner or eager), after the warm-up requests."""
    def call(pixels, grid):
        return b.runner.run(pixels, grid) if b.runner is not None else b.model(pixels, grid)

    out = []
    with torch.inference_mode():
        for pixels, grid in b.requests[: b.args.warmup]:
            call(pixels, grid)
        for pixels, grid in b.requests[b.args.warmup :]:
            if b.device.type == "cuda":
                torch.cuda.synchronize(b.device)
            t0 = time.perf_counter()
            call(pixels, grid)
            if b.device.type == "cuda":
                torch.cuda.synchronize(b.device)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def time_single_process(b: Bench) -> list[float] | None:
    """The same requests on rank 0 alone, the other ranks waiting at a barrier (None with --no-baseline)."""
    if b.args.no_baseline:
        return None
    single = _time_alone(b) if b.rank == 0 else None
    with collective("barrier after the single-process baseline"):
        dist.barrier()
    return single


# ---------------------------------------------------------------------------------------------------------------
# Fault drill
# ---------------------------------------------------------------------------------------------------------------
class _FaultyEncoder(DataParallelEncoder):
    """The drill's injected fault: ``victim``'s encode raises, as a failing kernel or an out-of-memory would."""

    def __init__(self, engine, victim: int):
        super().__init__(engine)
        self.victim = victim

    def encode_share(self, *args, **kwargs):
        if self.rank == self.victim:
            raise RuntimeError(f"fault drill: rank {self.rank} fails mid-request")
        return super().encode_share(*args, **kwargs)


def _drill_verdict(record: dict, victim: int, timeout_s: float) -> bool:
    expected = "RuntimeError" if record["rank"] == victim else RankFailed.__name__
    return (record["error_type"] == expected and "fault drill" in record["error"]
            and record["seconds_to_error"] < timeout_s and record["next_request_ok"])


def fault_drill(b: Bench, first_outs: list[torch.Tensor]) -> dict:
    """The last rank raises inside request 0; every rank must fail it within the timeout, then encode request 0
    again through the normal encoder with the verified outputs, bit for bit."""
    victim = b.world - 1
    pixels, grid = b.requests[0]
    with collective("barrier before the fault drill"):
        dist.barrier()
    t0 = time.perf_counter()
    try:
        _FaultyEncoder(b.dp.encoder, victim).run(pixels, grid)
        error: Exception | None = None
    except Exception as err:  # what a caller would catch; the verdict says whether it was the right one
        error = err
    record = {"rank": b.rank, "seconds_to_error": time.perf_counter() - t0,
              "error_type": type(error).__name__ if error else None, "error": str(error) if error else None}
    outs = b.dp.run(pixels, grid)
    record["next_request_ok"] = len(outs) == len(first_outs) and all(
        torch.equal(a, c) for a, c in zip(outs, first_outs, strict=True))
    ranks: list = [None] * b.world
    with collective("all-gather of the fault drill's records"):
        dist.all_gather_object(ranks, record)
    ok = all(_drill_verdict(r, victim, b.args.timeout) for r in ranks)
    if b.rank == 0:
        slowest = max(r["seconds_to_error"] for r in ranks)
        print(f"fault drill: rank {victim} raised mid-request; every rank failed it within {slowest * 1e3:.1f} ms "
              f"(timeout {b.args.timeout:g} s) and the next request {'matched' if ok else 'FAILED'} → "
              f"{'OK' if ok else 'FAILED'}")
    return {"victim_rank": victim, "timeout_s": b.args.timeout, "ranks": ranks, "ok": ok}


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------
def report(b: Bench, results: dict, argv: list[str]) -> None:
    """Print the summary on rank 0 and write the JSON there (call on every rank: provenance is collective)."""
    prov = provenance(b.device, argv)
    if b.rank != 0:
        return
    dp, single = results["dp"], results["single_ms"]
    dps = summarise(dp["dp_ms"])
    print(f"encoder_forward_ms over {count(len(dp['dp_ms']), 'request')} ({count(b.world, 'rank')}, data "
          f"parallel): mean {dps['mean_ms']:.3f}  median {dps['median_ms']:.3f}  P99 {dps['p99_ms']:.3f}; "
          f"mean imbalance {dp['mean_imbalance']:.3f}")
    for q, r in enumerate(dp["per_rank"]):
        print(f"  rank {q}: {count(r['items'], 'item')}, {count(r['tokens'], 'token')}; per request: check "
              f"{r['check_ms_mean']:.3f} ms, local {r['local_ms_mean']:.3f} ms, wait for the slowest "
              f"{r['sync_ms_mean']:.3f} ms, gather {r['gather_ms_mean']:.3f} ms ({100 * r['gather_share_mean']:.1f}% "
              f"of the call, P99 {100 * r['gather_share_p99']:.1f}%)")
    sps = summarise(single) if single else None
    if sps:
        print(f"encoder_forward_ms single process (rank 0 alone): mean {sps['mean_ms']:.3f}  median "
              f"{sps['median_ms']:.3f}  P99 {sps['p99_ms']:.3f}; "
              f"{compare_speed(sps['mean_ms'], dps['mean_ms'])}")
    if b.args.json:
        args = b.args
        write_json(args.json, {
            "benchmark": "glmvit.parallel", "world_size": b.world, "backend": dist.get_backend(),
            "device": b.device.type, "config": CONFIG_NAMES[args.config], "dtype": str(b.model.dtype).split(".")[-1],
            "weights": weights_identity(args.weights) if args.weights else {"random_seed": args.seed},
            "weights_digest": b.dp.model_digest,  # glmvit.parallel.weights_digest, hex
            "mode": args.mode, "runner_mode": b.runner_mode, "budgets": list(b.budget_config.token_budgets),
            "max_items": b.budget_config.max_items, "max_segments": b.budget_config.max_segments,
            "timeout_s": args.timeout,
            "workload": {"bucket_config": {str(k): v for k, v in b.workload.buckets.items()},
                         "items_per_request": args.items_per_request, "range_ratio": args.range_ratio,
                         "num_requests": args.num_requests, "warmup": args.warmup, "seed": args.seed},
            "encoder_forward_ms": dps, "single_process_ms": sps,
            "speedup_mean": sps["mean_ms"] / dps["mean_ms"] if sps else None,
            "mean_imbalance": dp["mean_imbalance"], "per_rank": dp["per_rank"],
            "verification": results["verification"], "fault_drill": results["fault_drill"],
            "provenance": prov,
        })


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    workload = check_args(parser, args)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    try:
        return run(args, workload, argv)
    except CollectiveError as err:  # a rank gone, stuck or out of step: this rank's one line (an OSError)
        raise ConnectionError(str(err)) from err


def run(args: argparse.Namespace, workload: Workload, argv: list[str]) -> int:
    """Every step on this rank, between starting the process group and destroying it; exit status 0 when the
    verification (and the fault drill) passed."""
    rank, world, device = init_distributed(torch.device(args.device).type, args.timeout)
    try:
        check_ranks_agree(args, world)
        b = setup(args, workload, rank, world, device)
        verification, first_outs = verify_first_request(b)
        results: dict[str, Any] = {"verification": verification, "dp": time_data_parallel(b),
                                   "single_ms": time_single_process(b)}
        drill = fault_drill(b, first_outs) if args.fault_drill else None
        results["fault_drill"] = drill
        report(b, results, argv)
        return 0 if verification["ok"] and (drill is None or drill["ok"]) else 1
    finally:
        dist.destroy_process_group()


def script(argv: list[str] | None = None) -> int:
    """``torchrun -m glmvit.cli.dp_bench``: :func:`main` with bad input or files as one line (as ``python -m
    glmvit dp-bench`` does; ``GLMVIT_DEBUG=1`` shows the traceback)."""
    try:
        return main(argv)
    except USER_ERRORS as err:
        if os.environ.get("GLMVIT_DEBUG"):
            raise
        print(f"dp_bench: error: {one_line(str(err))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(script())
