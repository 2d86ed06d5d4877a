"""Data-parallel encoding: every rank gets the whole request, encodes its share, and an all-gather rebuilds it.

This is vLLM's ``mm_encoder_tp_mode="data"`` for the vision tower (prior-art notes §5):

1. :func:`balance_items` — LPT greedy, exactly vLLM's ``get_load_balance_assignment``: sort the items by input
   patch count t·h·w, largest first (ties keep input order), and give each to the currently least-loaded rank
   (ties go to the lowest rank).
2. Every rank selects its items' pixel rows (possibly none) and runs its own :class:`~glmvit.graphs.EncoderGraphRunner`
   (or the eager model) on them. The weights are replicated, so the graphs hold no collectives.
3. One ``all_gather`` *outside* the graphs: each rank concatenates its outputs, pads them to the largest rank's token
   count (a rank without items sends only padding), and after the gather every rank strips the padding and puts the
   items back in input order. Every rank returns the full list.

Works with NCCL (CUDA tensors) and gloo (CPU tensors). Every rank must be given the same request; by default a
small all-gather of (item count, rows, grid CRC, width) checks that before anything else, so a mismatch raises the
same clear error on every rank instead of hanging in the big gather.

Launch the demo / benchmark with torchrun (``--nproc-per-node`` ranks; NCCL on CUDA, gloo on CPU)::

    torchrun --nproc-per-node 2 -m glmvit.parallel --demo --modality video --items-per-request 2 \\
        --num-requests 200 --json data/bench/dp_video_2gpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import numbers
import os
import socket
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .bench import default_budgets, workload_limits
from .graphs import EncoderGraphRunner
from .model import GlmVisionEncoder
from .provenance import git_state, gpu_driver


# ---------------------------------------------------------------------------------------------------------------
# Balancing (pure)
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """Which rank encodes which items: ``ranks[r]`` lists item indices in the order rank r encodes them."""

    ranks: tuple[tuple[int, ...], ...]
    loads: tuple[int, ...]  # Σ patch counts per rank

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def imbalance(self) -> float:
        """max load / mean load: 1.0 is perfect; the slowest rank sets the request's time. 1.0 for an empty request."""
        total = sum(self.loads)
        return max(self.loads) * len(self.loads) / total if total else 1.0

    @property
    def order(self) -> list[int]:
        """vLLM's ``shuffle_indices``: rank 0's items, then rank 1's, … (the layout of the gathered buffer)."""
        return [i for items in self.ranks for i in items]

    @property
    def counts(self) -> list[int]:
        """vLLM's ``gpu_sample_counts``: items per rank."""
        return [len(items) for items in self.ranks]


def _check_world(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size <= 0:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    return int(world_size)


def _check_sizes(patch_counts) -> list[int]:
    sizes = []
    for i, s in enumerate(patch_counts):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise ValueError(f"patch_counts[{i}] must be a non-negative integer, got {s!r}")
        sizes.append(int(s))
    return sizes


def balance_items(patch_counts: Sequence[int], world_size: int) -> Assignment:
    """LPT greedy over ranks, as vLLM's ``get_load_balance_assignment`` (see the module docstring for the rule).

    >>> balance_items([1000, 100, 200, 50], 2).ranks   # vLLM's docstring example
    ((0,), (2, 1, 3))
    """
    world_size = _check_world(world_size)
    sizes = _check_sizes(patch_counts)
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    # sorted(..., reverse=True) is stable: equal sizes keep their input order, as in vLLM.
    for i in sorted(range(len(sizes)), key=lambda j: sizes[j], reverse=True):
        r = min(range(world_size), key=lambda q: loads[q])  # first minimum: ties go to the lowest rank
        ranks[r].append(i)
        loads[r] += sizes[i]
    return Assignment(tuple(tuple(r) for r in ranks), tuple(loads))


def round_robin_items(patch_counts: Sequence[int], world_size: int) -> Assignment:
    """The naive alternative: item i goes to rank i mod world_size (for comparison; not used for encoding)."""
    world_size = _check_world(world_size)
    sizes = _check_sizes(patch_counts)
    ranks = [tuple(range(r, len(sizes), world_size)) for r in range(world_size)]
    return Assignment(tuple(ranks), tuple(sum(sizes[i] for i in items) for items in ranks))


def patch_counts_of(grid_thw) -> list[int]:
    """Input patches t·h·w per item: the load vLLM balances (rows of pixel_values, not output tokens)."""
    from .metadata import as_grid_array

    return [int(t * h * w) for t, h, w in as_grid_array(grid_thw)]


# ---------------------------------------------------------------------------------------------------------------
# The data-parallel encoder
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DPStats:
    """Counters since construction; ``last`` describes the most recent call."""

    calls: int = 0
    items: int = 0
    local_items: int = 0  # items this rank encoded
    local_tokens: int = 0  # output tokens this rank encoded
    local_s: float = 0.0  # select + encode on this rank (synchronised on CUDA)
    gather_s: float = 0.0  # pack + all_gather + unpack; includes waiting for the slowest rank
    check_s: float = 0.0  # the cross-rank input check
    total_s: float = 0.0
    imbalance_sum: float = 0.0
    last: dict = field(default_factory=dict)

    @property
    def mean_imbalance(self) -> float:
        return self.imbalance_sum / self.calls if self.calls else 1.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items()}
        d["mean_imbalance"] = self.mean_imbalance
        return d


def _require_group(group) -> None:
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if not dist.is_initialized():
        raise RuntimeError(
            "data-parallel encoding needs an initialised process group: call "
            "torch.distributed.init_process_group('nccl' on GPUs or 'gloo' on CPU) on every rank first, "
            "or launch with `torchrun --nproc-per-node N -m glmvit.parallel --demo`"
        )


def _comm_device(group) -> torch.device:
    """Where collective tensors live: the current CUDA device for NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def request_signature(pixel_values: torch.Tensor, grids: np.ndarray) -> list[int]:
    """Cheap fingerprint of a request that every rank must agree on: items, rows, CRC-32 of grid_thw, row width."""
    crc = zlib.crc32(np.ascontiguousarray(grids, dtype=np.int64).tobytes())
    return [len(grids), int(pixel_values.shape[0]), crc, int(pixel_values.shape[1]) if pixel_values.ndim == 2 else -1]


class DataParallelEncoder:
    """Encode a request across the ranks of ``group`` (default: the world); see the module docstring.

    ``encoder_or_runner`` is an :class:`~glmvit.graphs.EncoderGraphRunner` (captured) or a
    :class:`~glmvit.model.GlmVisionEncoder` (eager). Every rank must construct one with the same weights.
    ``check_inputs``: all-gather a request fingerprint first and raise on disagreement (one tiny extra collective).
    """

    def __init__(self, encoder_or_runner, group=None, check_inputs: bool = True):
        _require_group(group)
        if isinstance(encoder_or_runner, EncoderGraphRunner):
            self.runner, self.model = encoder_or_runner, encoder_or_runner.model
        elif isinstance(encoder_or_runner, GlmVisionEncoder):
            self.runner, self.model = None, encoder_or_runner
        else:
            raise TypeError(f"expected an EncoderGraphRunner or a GlmVisionEncoder, got {type(encoder_or_runner).__name__}")
        self.group = group
        self.check_inputs = check_inputs
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.comm_device = _comm_device(group)
        self.stats = DPStats()

    # ---- pieces --------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.model.device.type == "cuda" or self.comm_device.type == "cuda":
            torch.cuda.current_stream().synchronize()

    def _check(self, pixel_values: torch.Tensor, grids: np.ndarray) -> None:
        mine = torch.tensor(request_signature(pixel_values, grids), dtype=torch.int64, device=self.comm_device)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(everyone, mine, group=self.group)
        rows = [t.tolist() for t in everyone]
        if any(r != rows[0] for r in rows):
            table = "; ".join(f"rank {q}: items={r[0]} rows={r[1]} grid_crc={r[2]:#010x} width={r[3]}"
                              for q, r in enumerate(rows))
            raise ValueError("data-parallel encoding needs the same request (pixel_values, grid_thw) on every rank, "
                             f"but the ranks disagree: {table}")

    def _encode_local(self, pixel_values: torch.Tensor, grids: np.ndarray, items: Sequence[int],
                      row_start: np.ndarray) -> list[torch.Tensor]:
        if not items:
            return []
        local = torch.cat([pixel_values[row_start[i] : row_start[i + 1]] for i in items]).to(self.model.device)
        if self.runner is not None:
            return self.runner.run(local, grids[list(items)])
        with torch.inference_mode():
            out = self.model(local, grids[list(items)])
        m2 = self.model.config.merge_area
        return list(out.split([int(row_start[i + 1] - row_start[i]) // m2 for i in items]))

    def _gather(self, local_outs: list[torch.Tensor], assignment: Assignment, tokens: list[int]) -> list[torch.Tensor]:
        """Pad to the largest rank, all-gather, strip padding, reorder to input order."""
        width = self.model.config.out_hidden_size
        dtype = self.model.dtype
        rank_tokens = [sum(tokens[i] for i in items) for items in assignment.ranks]
        pad_to = max(rank_tokens)
        send = torch.zeros(pad_to, width, dtype=dtype, device=self.comm_device)
        offset = 0
        for out in local_outs:
            send[offset : offset + out.shape[0]].copy_(out)
            offset += out.shape[0]
        if offset != rank_tokens[self.rank]:
            raise RuntimeError(f"rank {self.rank}: encoded {offset} tokens but the assignment expects "
                               f"{rank_tokens[self.rank]}")
        # gloo does not reduce anything here, it only moves bytes: ship 2-byte floats as int16 (bf16-safe, bitwise).
        wire = send.view(torch.int16) if self.backend != "nccl" and send.element_size() == 2 else send
        if self.backend == "nccl":
            gathered = torch.empty(self.world_size * pad_to, width, dtype=wire.dtype, device=wire.device)
            dist.all_gather_into_tensor(gathered, wire, group=self.group)
            parts = list(gathered.view(self.world_size, pad_to, width))
        else:
            parts = [torch.empty_like(wire) for _ in range(self.world_size)]
            dist.all_gather(parts, wire, group=self.group)
        if wire is not send:
            parts = [p.view(dtype) for p in parts]
        results: list[torch.Tensor | None] = [None] * len(tokens)
        for q, items in enumerate(assignment.ranks):
            part = parts[q].to(self.model.device) if parts[q].device != self.model.device else parts[q]
            start = 0
            for i in items:
                results[i] = part[start : start + tokens[i]]
                start += tokens[i]
        return results

    # ---- the call ------------------------------------------------------------------------------------------
    def run(self, pixel_values: torch.Tensor, grid_thw, check: bool | None = None) -> list[torch.Tensor]:
        """The full request's per-item outputs [tokens_i, out_hidden_size], in input order, on every rank.

        Returned tensors are views of one freshly allocated gather buffer (never of a graph's static buffer).
        """
        start = time.perf_counter()
        grids = self.model.check_inputs(pixel_values, grid_thw)
        check = self.check_inputs if check is None else check
        if check:
            self._check(pixel_values, grids)
        t_checked = time.perf_counter()
        sizes = [int(t * h * w) for t, h, w in grids]
        m2 = self.model.config.merge_area
        tokens = [s // m2 for s in sizes]
        assignment = balance_items(sizes, self.world_size)
        mine = assignment.ranks[self.rank]
        if not sizes:  # every rank sees the same empty request: nothing to gather
            results: list[torch.Tensor] = []
            local_s = gather_s = 0.0
        else:
            row_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            local_outs = self._encode_local(pixel_values, grids, mine, row_start)
            self._sync()
            t_local = time.perf_counter()
            results = self._gather(local_outs, assignment, tokens)
            self._sync()
            local_s, gather_s = t_local - t_checked, time.perf_counter() - t_local
        s = self.stats
        s.calls += 1
        s.items += len(sizes)
        s.local_items += len(mine)
        s.local_tokens += sum(tokens[i] for i in mine)
        s.local_s += local_s
        s.gather_s += gather_s
        s.check_s += t_checked - start
        s.imbalance_sum += assignment.imbalance
        s.total_s += time.perf_counter() - start
        s.last = {
            "rank": self.rank,
            "items_per_rank": assignment.counts,
            "tokens_per_rank": [sum(tokens[i] for i in items) for items in assignment.ranks],
            "patches_per_rank": list(assignment.loads),
            "imbalance": assignment.imbalance,
            "local_ms": local_s * 1e3,
            "gather_ms": gather_s * 1e3,
        }
        return results

    __call__ = run


def encode_data_parallel(runner_or_model, pixel_values: torch.Tensor, grid_thw, group=None,
                         check_inputs: bool = True) -> list[torch.Tensor]:
    """One-shot :meth:`DataParallelEncoder.run` (build a :class:`DataParallelEncoder` once to keep its stats)."""
    return DataParallelEncoder(runner_or_model, group=group, check_inputs=check_inputs).run(pixel_values, grid_thw)


# ---------------------------------------------------------------------------------------------------------------
# torchrun demo / benchmark
# ---------------------------------------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for single-host rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, torch.device]:
    """Initialise the default group from torchrun's environment (a 1-rank group without it): nccl on CUDA, else gloo."""
    if "RANK" not in os.environ:  # plain `python -m glmvit.parallel --demo`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def provenance(device: torch.device, argv: list[str]) -> dict:
    """Where and how a result was produced (gathered from every rank; call on all ranks)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mine = {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}"}
    else:
        mine = {"device": "cpu", "threads": torch.get_num_threads()}
    mine["host"] = socket.gethostname()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    driver = gpu_driver() if device.type == "cuda" else None
    world = dist.get_world_size()
    return {
        "ranks": everyone,
        "gpus": [r["device"] for r in everyone] if device.type == "cuda" else [],
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        **git_state(),
        "command": f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)} -m glmvit.parallel "
                   + " ".join(argv),
        "argv": [sys.executable, *sys.argv],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _summary(ms: list[float]) -> dict:
    a = np.asarray(ms, dtype=np.float64)
    return {"n": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
            "p99": float(np.percentile(a, 99)), "std": float(a.std()), "min": float(a.min()), "max": float(a.max())}


def demo_requests(args, config, device, dtype):
    """The workload: per request (pixel_values on device, grid_thw), same on every rank (seeded)."""
    from .budget import random_mm_workload
    from .testing import random_batch

    buckets = args.bucket_config or ({(224, 224, 1): 1.0} if args.modality == "image" else {(224, 224, 8): 1.0})
    total = args.warmup + args.num_requests
    workload = random_mm_workload(buckets, total, args.items_per_request, range_ratio=args.range_ratio,
                                  seed=args.seed)
    requests = []
    for k, items in enumerate(workload):
        pixels, grid = random_batch([it.grid for it in items], config, seed=args.seed * 100_003 + k)
        requests.append((pixels.to(device, dtype), grid))
    return buckets, requests


def _budgets_for(requests, merge_area: int) -> tuple[tuple[int, ...], int, int]:
    """The bench's defaults: powers of two from 64 up to the largest request; max items / frames of any request."""
    grids = [g for _, g in requests]
    budgets = default_budgets(grids, merge_area)
    return (budgets, *workload_limits(grids, budgets[0]))


def _time_requests(fn, requests, device) -> list[float]:
    """ms per request: all ranks start together (barrier), the clock stops when this rank has the full result."""
    out = []
    for pixels, grid in requests:
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn(pixels, grid)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m glmvit.parallel",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", action="store_true", help="run the data-parallel demo / benchmark")
    parser.add_argument("--modality", choices=["image", "video"], default="image",
                        help="image: 224² images; video: 224² 8-frame clips (default image)")
    parser.add_argument("--bucket-config", type=str, default=None,
                        help="vLLM random-mm buckets instead, e.g. \"{(224, 224, 1): 0.7, (448, 448, 1): 0.3}\"")
    parser.add_argument("--items-per-request", type=int, default=2)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="items per request vary by ±ratio (vLLM)")
    parser.add_argument("--num-requests", type=int, default=50, help="timed requests (default 50)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed requests first (default 3)")
    parser.add_argument("--mode", choices=["graph", "eager"], default="graph",
                        help="graph: EncoderGraphRunner (CUDA graphs on GPU, emulated on CPU); eager: model.forward")
    parser.add_argument("--config", choices=["auto", "tiny", "full"], default="auto",
                        help="auto: full GLM-4.1V tower in bf16 on CUDA, tiny in fp32 on CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip timing the same requests single-process on rank 0")
    parser.add_argument("--check-every-request", action="store_true",
                        help="keep the cross-rank input check on while timing (one extra tiny collective)")
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes results and provenance here")
    args = parser.parse_args(argv)
    if not args.demo:
        parser.print_help()
        return 2
    if args.num_requests < 1 or args.warmup < 0 or args.items_per_request < 1:
        parser.error("--num-requests and --items-per-request must be ≥ 1, --warmup ≥ 0")
    if args.bucket_config:
        from .budget import parse_bucket_config

        args.bucket_config = parse_bucket_config(args.bucket_config)

    from .budget import BudgetConfig
    from .config import VisionConfig
    from .demo import build_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    rank, world, device = init_distributed()
    try:
        full = args.config == "full" or (args.config == "auto" and device.type == "cuda")
        config = VisionConfig.glm41v() if full else VisionConfig.tiny()
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_model(config, device, dtype, None, seed=args.seed)
        buckets, requests = demo_requests(args, config, device, dtype)
        budgets, max_items, max_frames = _budgets_for(requests, config.merge_area)
        if args.mode == "graph":
            backend = "cuda" if device.type == "cuda" else "emulate"
            runner = EncoderGraphRunner(model, BudgetConfig(budgets, max_items=max_items, max_frames=max_frames),
                                        backend=backend, progress=False).capture()
            engine = runner
        else:
            backend, runner, engine = "eager", None, model
        dp = DataParallelEncoder(engine)
        if rank == 0:
            print(f"glmvit.parallel: {world} rank(s), {dist.get_backend()} on {device.type}, "
                  f"{'GLM-4.1V tower' if full else 'tiny config'} ({dtype}), mode {args.mode} ({backend}); "
                  f"budgets {list(budgets)}, max_items {max_items}, max_frames {max_frames}")

        # -- verify the first request: DP vs per-item eager (tolerance), and per rank vs a local re-run (bitwise)
        first_pixels, first_grid = requests[0]
        outs = dp.run(first_pixels, first_grid, check=True)
        sizes = patch_counts_of(first_grid)
        assignment = balance_items(sizes, world)
        row_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        again = dp._encode_local(first_pixels, dp.model.check_inputs(first_pixels, first_grid),
                                 assignment.ranks[rank], row_start)
        exact = all(torch.equal(outs[i], o) for i, o in zip(assignment.ranks[rank], again))
        flag = torch.tensor([int(exact)], device=dp.comm_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        exact_all = bool(flag.item())
        tol = 1e-5 if dtype == torch.float32 else 0.016
        max_diff = 0.0
        if rank == 0:
            with torch.inference_mode():
                for i, (t, h, w) in enumerate(first_grid.tolist()):
                    ref = model(first_pixels[row_start[i] : row_start[i + 1]], torch.tensor([[t, h, w]]))
                    max_diff = max(max_diff, (outs[i].float() - ref.float()).abs().max().item())
        diff = torch.tensor([max_diff], dtype=torch.float64, device=dp.comm_device)
        dist.broadcast(diff, src=0)  # every rank returns the same verdict
        max_diff = float(diff.item())
        ok = exact_all and max_diff <= tol and len(outs) == len(sizes)
        verification = {"items": len(sizes), "exact_vs_same_batch_per_rank": exact_all,
                        "max_abs_diff_vs_per_item_eager": max_diff, "tolerance": tol, "ok": ok}
        if rank == 0:
            print(f"verify request 0 ({len(sizes)} items, per rank {assignment.counts}): per-rank batches bitwise "
                  f"{'equal' if exact_all else 'DIFFERENT'}; max |DP − per-item eager| = {max_diff:.3g} "
                  f"(tolerance {tol}) → {'OK' if ok else 'FAILED'}")

        # -- time the data-parallel path
        def dp_call(p, g):
            dp.run(p, g, check=args.check_every_request)

        _time_requests(dp_call, requests[: args.warmup], device)
        dp.stats = DPStats()
        local_ms = _time_requests(dp_call, requests[args.warmup :], device)
        # the request is done when the slowest rank has it (they finish the gather together; take the max)
        worst = torch.tensor(local_ms, dtype=torch.float64, device=dp.comm_device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        dp_ms = worst.tolist()
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, {"items": dp.stats.local_items, "tokens": dp.stats.local_tokens,
                                          "local_ms_mean": dp.stats.local_s * 1e3 / dp.stats.calls,
                                          "gather_ms_mean": dp.stats.gather_s * 1e3 / dp.stats.calls})
        imbalance = dp.stats.mean_imbalance

        # -- the same requests single-process on rank 0 (others wait)
        single = None
        if not args.no_baseline:
            if rank == 0:
                def single_call(p, g):
                    if runner is not None:
                        runner.run(p, g)
                    else:
                        model(p, g)

                with torch.inference_mode():
                    for p, g in requests[: args.warmup]:
                        single_call(p, g)
                    single = []
                    for p, g in requests[args.warmup :]:
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        t0 = time.perf_counter()
                        single_call(p, g)
                        if device.type == "cuda":
                            torch.cuda.synchronize(device)
                        single.append((time.perf_counter() - t0) * 1e3)
            dist.barrier()

        prov = provenance(device, argv)
        if rank == 0:
            dps = _summary(dp_ms)
            print(f"encoder_forward_ms over {dps['n']} requests ({world} ranks, data parallel): mean {dps['mean']:.3f}"
                  f"  median {dps['median']:.3f}  P99 {dps['p99']:.3f}; mean imbalance {imbalance:.3f}")
            for q, r in enumerate(per_rank):
                print(f"  rank {q}: {r['items']} items, {r['tokens']} tokens; local {r['local_ms_mean']:.3f} ms, "
                      f"gather {r['gather_ms_mean']:.3f} ms per request")
            sps = _summary(single) if single else None
            if sps:
                print(f"encoder_forward_ms single process (rank 0 alone): mean {sps['mean']:.3f}  median "
                      f"{sps['median']:.3f}  P99 {sps['p99']:.3f}; speed-up of the mean {sps['mean'] / dps['mean']:.2f}x")
            if args.json:
                record = {
                    "benchmark": "glmvit.parallel", "world_size": world, "backend": dist.get_backend(),
                    "device": device.type, "config": "glm41v" if full else "tiny", "dtype": str(dtype).split(".")[-1],
                    "mode": args.mode, "runner_backend": backend, "budgets": list(budgets), "max_items": max_items,
                    "max_frames": max_frames,
                    "workload": {"bucket_config": {str(k): v for k, v in buckets.items()},
                                 "items_per_request": args.items_per_request, "range_ratio": args.range_ratio,
                                 "num_requests": args.num_requests, "warmup": args.warmup, "seed": args.seed},
                    "check_every_request": args.check_every_request,
                    "encoder_forward_ms": dps, "single_process_ms": sps,
                    "speedup_mean": sps["mean"] / dps["mean"] if sps else None,
                    "mean_imbalance": imbalance, "per_rank": per_rank, "verification": verification,
                    "provenance": prov,
                }
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump(record, f, indent=2)
                print(f"wrote {args.json}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
