"""Data-parallel encoding: every rank gets the whole request, encodes its share, and an all-gather rebuilds it.

This is vLLM's ``mm_encoder_tp_mode="data"`` for the vision tower (vLLM's ``run_dp_sharded_mrope_vision_model``):

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

The demo / benchmark on top of this is :mod:`glmvit.cli.dp_bench` (launched with torchrun).
"""
from __future__ import annotations

import numbers
import socket
import time
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .graphs import EncoderGraphRunner
from .metadata import as_grid_array
from .model import GlmVisionEncoder


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
            "or launch with `torchrun --nproc-per-node N -m glmvit.cli.dp_bench`"
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
        self.runner: EncoderGraphRunner | None
        if isinstance(encoder_or_runner, EncoderGraphRunner):
            self.runner, self.model = encoder_or_runner, encoder_or_runner.model
        elif isinstance(encoder_or_runner, GlmVisionEncoder):
            self.runner, self.model = None, encoder_or_runner
        else:
            raise TypeError("expected an EncoderGraphRunner or a GlmVisionEncoder, "
                            f"got {type(encoder_or_runner).__name__}")
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
        return [out for out in results if out is not None]  # every item belongs to exactly one rank

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for single-host rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
