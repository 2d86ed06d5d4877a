"""Data-parallel demo / benchmark over :mod:`glmvit.parallel`: launch it with torchrun (NCCL on CUDA, gloo on CPU).

Every rank builds the same model (same seed), the same requests and its own graph runner; rank 0 checks request 0
against per-item eager and writes the JSON::

    torchrun --nproc-per-node 2 -m glmvit.cli.dp_bench --modality video --items-per-request 2 \\
        --num-requests 200 --json data/bench/dp_video_2gpu.json
    torchrun --standalone --nproc-per-node 2 -m glmvit.cli.dp_bench --num-requests 20   # CPU, gloo
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..geometry import ItemSpec
from ..graphs import EncoderGraphRunner
from ..packing import BudgetConfig
from ..parallel import DataParallelEncoder, DPStats, balance_items, free_port, patch_counts_of
from ..provenance import collect
from ..timing import summarise
from ..workloads import parse_bucket_config, random_batch, random_mm_workload
from .common import build_model, check_writable, vision_config, write_json


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
    """Where and how a result was produced, with every rank's device (call on all ranks)."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        mine = {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "compute_capability": f"{props.major}.{props.minor}"}
    else:
        mine = {"device": "cpu", "threads": torch.get_num_threads()}
    mine["host"] = socket.gethostname()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    world = os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())
    command = f"torchrun --nproc-per-node {world} -m glmvit.cli.dp_bench " + " ".join(argv)
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None
    return {**collect(device, command), "ranks": everyone, "nccl": nccl}


def demo_requests(args, config, device, dtype):
    """The workload: per request (pixel_values on device, grid_thw), same on every rank (seeded)."""
    buckets = args.bucket_config or ({(224, 224, 1): 1.0} if args.modality == "image" else {(224, 224, 8): 1.0})
    total = args.warmup + args.num_requests
    workload = random_mm_workload(buckets, total, args.items_per_request, range_ratio=args.range_ratio,
                                  seed=args.seed)
    requests = []
    for k, items in enumerate(workload):
        pixels, grid = random_batch([it.grid for it in items], config, seed=args.seed * 100_003 + k)
        requests.append((pixels.to(device, dtype), grid))
    return buckets, requests


def _budget_config(requests: list, merge_area: int) -> BudgetConfig:
    """The bench's default budgets and limits for these requests."""
    specs = [[ItemSpec(int(t * h * w) // merge_area, int(t)) for t, h, w in grid.tolist()] for _, grid in requests]
    return BudgetConfig.for_requests(specs)


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
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m glmvit.cli.dp_bench",
                                     description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--json", metavar="PATH", help="rank 0 writes results and provenance here")
    args = parser.parse_args(argv)
    if args.num_requests < 1 or args.warmup < 0 or args.items_per_request < 1:
        parser.error("--num-requests and --items-per-request must be ≥ 1, --warmup ≥ 0")
    try:
        if args.bucket_config:
            args.bucket_config = parse_bucket_config(args.bucket_config)
        if args.json:
            check_writable(args.json)
    except (ValueError, OSError) as err:
        parser.error(str(err))

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    rank, world, device = init_distributed()
    try:
        full = args.config == "full" or (args.config == "auto" and device.type == "cuda")
        config = vision_config("full" if full else "tiny")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_model(config, device, dtype, seed=args.seed)
        buckets, requests = demo_requests(args, config, device, dtype)
        budget_config = _budget_config(requests, config.merge_area)
        budgets, max_items, max_segments = budget_config.token_budgets, budget_config.max_items, \
            budget_config.max_segments
        runner: EncoderGraphRunner | None = None
        if args.mode == "graph":
            backend = "cuda" if device.type == "cuda" else "emulate"
            runner = EncoderGraphRunner(model, budget_config, backend=backend).capture()
            engine: Any = runner
        else:
            backend, engine = "eager", model
        dp = DataParallelEncoder(engine)
        if rank == 0:
            print(f"glmvit.parallel: {world} rank(s), {dist.get_backend()} on {device.type}, "
                  f"{'GLM-4.1V tower' if full else 'tiny config'} ({dtype}), mode {args.mode} ({backend}); "
                  f"budgets {list(budgets)}, max_items {max_items}, max_segments {max_segments}")

        # -- verify the first request: DP vs per-item eager (tolerance), and per rank vs a local re-run (bitwise)
        first_pixels, first_grid = requests[0]
        outs = dp.run(first_pixels, first_grid)
        sizes = patch_counts_of(first_grid)
        assignment = balance_items(sizes, world)
        row_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        again = dp._encode_local(first_pixels, dp.model.check_inputs(first_pixels, first_grid),
                                 assignment.ranks[rank], row_start)
        exact = all(torch.equal(outs[i], o) for i, o in zip(assignment.ranks[rank], again, strict=False))
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
            dp.run(p, g)

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
            dps = summarise(dp_ms)
            print(f"encoder_forward_ms over {len(dp_ms)} requests ({world} ranks, data parallel): mean "
                  f"{dps['mean_ms']:.3f}  median {dps['median_ms']:.3f}  P99 {dps['p99_ms']:.3f}; "
                  f"mean imbalance {imbalance:.3f}")
            for q, r in enumerate(per_rank):
                print(f"  rank {q}: {r['items']} items, {r['tokens']} tokens; local {r['local_ms_mean']:.3f} ms, "
                      f"gather {r['gather_ms_mean']:.3f} ms per request")
            sps = summarise(single) if single else None
            if sps:
                print(f"encoder_forward_ms single process (rank 0 alone): mean {sps['mean_ms']:.3f}  median "
                      f"{sps['median_ms']:.3f}  P99 {sps['p99_ms']:.3f}; speed-up of the mean "
                      f"{sps['mean_ms'] / dps['mean_ms']:.2f}x")
            if args.json:
                record = {
                    "benchmark": "glmvit.parallel", "world_size": world, "backend": dist.get_backend(),
                    "device": device.type, "config": "glm41v" if full else "tiny", "dtype": str(dtype).split(".")[-1],
                    "mode": args.mode, "runner_backend": backend, "budgets": list(budgets), "max_items": max_items,
                    "max_segments": max_segments,
                    "workload": {"bucket_config": {str(k): v for k, v in buckets.items()},
                                 "items_per_request": args.items_per_request, "range_ratio": args.range_ratio,
                                 "num_requests": args.num_requests, "warmup": args.warmup, "seed": args.seed},
                    "encoder_forward_ms": dps, "single_process_ms": sps,
                    "speedup_mean": sps["mean_ms"] / dps["mean_ms"] if sps else None,
                    "mean_imbalance": imbalance, "per_rank": per_rank, "verification": verification,
                    "provenance": prov,
                }
                write_json(args.json, record)
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
