"""Notebook 09, section 5, run under ``torchrun -m glmvit.lab.dp_checks`` on two gloo ranks: glmvit's
``DataParallelEncoder.run`` against a gather-only protocol on the same requests. Rank 0 prints every rank's result as
one JSON line: ms per request of each, collectives each made, whether both return the same bits, the check's parts
timed alone, and what each does when rank 1 is handed another request."""
from __future__ import annotations

import json
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import VisionConfig
from ..geometry import grid_specs
from ..graphs import EncoderGraphRunner
from ..packing import BudgetConfig
from ..parallel import DataParallelEncoder, RequestMismatch, request_fingerprint
from ..random_weights import random_encoder
from ..workloads import random_batch

GRIDS = [[4, 16, 16]] * 3  # three 8-frame 224² clips per request, as in the notebook's section 4
REAL_ALL_GATHER = dist.all_gather
COUNTED: dict[str, Any] = {"n": 0, "int64": []}  # every all_gather made, and each small int64 row's length


def counted_all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``dist.all_gather``, counted in :data:`COUNTED` (glmvit.parallel calls it through ``dist``)."""
    COUNTED["n"] += 1
    if tensor.dtype == torch.int64:
        COUNTED["int64"].append(tensor.numel())
    return REAL_ALL_GATHER(parts, tensor, *args, **kwargs)


def gather_only(dp: DataParallelEncoder, pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
    """vLLM's protocol from glmvit's pieces: balance, encode this rank's share, pad, one all_gather, strip,
    reorder; nothing checked."""
    config, rank, world = dp.model.config, dist.get_rank(), dist.get_world_size()
    assignment = dp.assignment(grid)
    tokens = [spec.tokens for spec in grid_specs(grid.tolist(), config.spatial_merge_size)]
    mine = dp.encode_share(pixels, grid, assignment.ranks[rank], check_finite=False)
    send = torch.zeros(max(sum(tokens[i] for i in items) for items in assignment.ranks), config.out_hidden_size)
    if mine:
        send[: sum(o.shape[0] for o in mine)] = torch.cat(mine)
    parts = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(parts, send)
    out: list[torch.Tensor] = [torch.empty(0)] * len(tokens)
    for q, items in enumerate(assignment.ranks):
        start = 0
        for i in items:
            out[i] = parts[q][start : start + tokens[i]]
            start += tokens[i]
    return out


def timed(fn: Callable[..., list[torch.Tensor]], *args: Any) -> tuple[list[torch.Tensor], float, int, list[int]]:
    """fn's output, its ms (after a barrier) and the collectives it made."""
    dist.barrier()
    COUNTED["n"], COUNTED["int64"] = 0, []
    t0 = time.perf_counter()
    out = fn(*args)
    return out, (time.perf_counter() - t0) * 1e3, COUNTED["n"], list(COUNTED["int64"])


def parts_alone(model: Any, requests: list[Any], rows: list[int]) -> dict[str, Any]:
    """The check's parts timed alone: SHA-256 and input check of ten requests, and each int64 exchange glmvit
    sent, at its length, ten times."""
    hash_ms: list[float] = []
    inputs_ms: list[float] = []
    exchange_ms: dict[int, list[float]] = {}
    for pixels, grid in requests[2:12]:
        dist.barrier()
        t0 = time.perf_counter()
        request_fingerprint(pixels, grid.numpy())
        t1 = time.perf_counter()
        model.check_inputs(pixels, grid)  # grids, row count and every row's NaN/Inf (gather-only skips it)
        hash_ms.append((t1 - t0) * 1e3)
        inputs_ms.append((time.perf_counter() - t1) * 1e3)
    for length in rows:
        row, exchange_ms[length] = torch.zeros(length, dtype=torch.int64), []
        for _ in range(10):
            parts = [torch.empty_like(row) for _ in range(dist.get_world_size())]
            dist.barrier()
            t0 = time.perf_counter()
            REAL_ALL_GATHER(parts, row)
            exchange_ms[length].append((time.perf_counter() - t0) * 1e3)
    return {"hash_ms": hash_ms, "inputs_ms": inputs_ms, "exchange_ms": exchange_ms}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = random_encoder(VisionConfig.tiny(), "cpu", torch.float32, seed=0)
    dp = DataParallelEncoder(EncoderGraphRunner(model, BudgetConfig((256, 512, 768), 3, 12), mode="emulate").capture())
    requests = [random_batch(GRIDS, model.config, seed=k) for k in range(24)]
    dist.all_gather = counted_all_gather  # type: ignore[assignment]
    ms: dict[str, list[float]] = {"glmvit": [], "gather-only": []}
    same, check_phase_ms = True, []
    rows: list[int] = []  # the int64 rows glmvit sent, by length
    for k, (pixels, grid) in enumerate(requests):  # the two alternate, request by request; two warm up
        a, t_a, n_a, rows = timed(dp.run, pixels, grid)
        b, t_b, n_b, _ = timed(gather_only, dp, pixels, grid)
        same &= all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        if k >= 2:
            ms["glmvit"].append(t_a)
            ms["gather-only"].append(t_b)
            check_phase_ms.append(dp.stats.last["check_ms"])  # glmvit's own timer: validate, hash, request check
    good = dp.run(*requests[0])  # out of step: rank 1 is handed the next request, rank 0 this one
    given = requests[1] if rank == 1 else requests[0]
    wrong = gather_only(dp, *given)
    try:
        dp.run(*given)
        raised = None
    except RequestMismatch as err:
        raised = str(err)
    result = {"rank": rank, "ms": ms, "collectives": {"glmvit": n_a, "gather-only": n_b}, "bitwise_same": bool(same),
              "pixel_bytes": pixels.numel() * pixels.element_size(), "check_phase_ms": check_phase_ms,
              **parts_alone(model, requests, rows), "glmvit_raised": raised,
              "gather_only_wrong_items": [i for i, (x, y) in enumerate(zip(wrong, good, strict=True))
                                          if not torch.equal(x, y)]}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if rank == 0:
        print(json.dumps(everyone))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
