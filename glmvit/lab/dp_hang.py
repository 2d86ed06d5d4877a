"""Notebook 09, exercise 3, run under ``torchrun -m glmvit.lab.dp_hang`` on two gloo ranks: rank 1's encode fails;
glmvit's status exchange tells rank 0 at once, a gather-only rank 0 waits in the gather until its group's timeout,
:data:`TIMEOUT_S` (the gather's group only: the ranks' start-up, on a loaded machine, gets :data:`START_TIMEOUT_S`).
Each rank prints one JSON line."""
from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import VisionConfig
from ..parallel import DataParallelEncoder
from ..random_weights import random_encoder
from ..workloads import random_batch

TIMEOUT_S = 3
START_TIMEOUT_S = 300


class FailingEncoder(DataParallelEncoder):
    """A DataParallelEncoder whose rank 1 raises in its encode."""

    def encode_share(self, *args: Any, **kwargs: Any) -> Any:
        if self.rank == 1:
            raise RuntimeError("rank 1 fails mid-request")
        return super().encode_share(*args, **kwargs)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    gather_group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))
    rank = dist.get_rank()
    model = random_encoder(VisionConfig.tiny(), "cpu", torch.float32, seed=0)
    pixels, grid = random_batch([[1, 8, 8], [1, 8, 8]], model.config, seed=0)
    encoder = FailingEncoder(model)
    dist.barrier()
    t0 = time.perf_counter()
    try:  # glmvit: the status exchange tells every rank
        encoder.run(pixels, grid)
        glmvit_error = None
    except Exception as err:
        glmvit_error = type(err).__name__
    glmvit_s = time.perf_counter() - t0
    dist.barrier()
    t0 = time.perf_counter()
    gather_error = None
    if rank == 0:  # gather-only: rank 0 goes on to the gather
        parts = [torch.empty(4, 64) for _ in range(2)]
        try:
            dist.all_gather(parts, torch.zeros(4, 64), group=gather_group)
        except RuntimeError as err:
            gather_error = type(err).__name__
    else:  # rank 1 failed and never calls it (it stays alive: a rank that exits would close the connection)
        time.sleep(TIMEOUT_S + 3)
    print(json.dumps({"rank": rank, "glmvit_error": glmvit_error, "glmvit_s": glmvit_s, "gather_error": gather_error,
                      "gather_s": time.perf_counter() - t0, "timeout_s": TIMEOUT_S}), flush=True)
    os._exit(0)  # after a timeout the group is broken: leave without tearing it down


if __name__ == "__main__":
    main()
