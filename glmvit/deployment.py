"""Choosing budgets for a deployment: recommend a set, evaluate one on a workload, export it to vLLM.

Built on :mod:`glmvit.costmodel` (memory, latency table, predicted time) and :mod:`glmvit.packing`; pure functions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .config import VisionConfig
from .costmodel import CaptureCost, LatencyTable, TimeEstimate, graph_memory, predict_time, total_graph_memory
from .geometry import ItemSpec
from .packing import (
    AUTO_RANGE,
    VLLM_MAX_NUM_BATCHED_TOKENS,
    BudgetConfig,
    Plan,
    PlanStats,
    check_items,
    combined_stats,
    plan_batches,
    plan_workload,
    positive_int,
)
from .recorded import capture_cost

CANDIDATE_STEP = 64  # recommend_budgets rounds batch sizes up to this multiple


# ---------------------------------------------------------------------------------------------------------------
# Recommending budgets
# ---------------------------------------------------------------------------------------------------------------
def _round_up(x: int, step: int = CANDIDATE_STEP) -> int:
    return -(-x // step) * step


def _powers_of_two(lo: int, hi: int) -> list[int]:
    """Powers of two p with lo ≤ p and p < 2·hi (so the last one is ≥ hi)."""
    p = 1
    while p < lo:
        p *= 2
    out = []
    while p < 2 * hi:
        out.append(p)
        p *= 2
    return out


def _best_subsets(sizes: list[int], cands: list[int], max_graphs: int, unit_cost: Callable[[int], float],
                  token_coef: float) -> list[tuple[float, tuple[int, ...]]]:
    """Exact DP: for m = 1..max_graphs, the cheapest m budgets from ``cands`` that include cands[-1].

    A batch of x tokens replays the smallest chosen budget c ≥ x at cost unit_cost(c) + token_coef·x.
    """
    sizes_arr = np.sort(np.asarray(sizes, dtype=np.int64))
    cnt = np.searchsorted(sizes_arr, cands, side="right")
    tot = np.concatenate([[0], np.cumsum(sizes_arr)])[cnt].astype(float)
    a = np.array([unit_cost(c) for c in cands], dtype=float)
    levels = [a * cnt + token_coef * tot]  # one budget: c_j covers every batch ≤ c_j
    backs = []
    for _ in range(1, min(max_graphs, len(cands))):
        prev, best, arg = levels[-1], np.full(len(cands), np.inf), np.zeros(len(cands), dtype=int)
        for j in range(1, len(cands)):
            cost = prev[:j] + a[j] * (cnt[j] - cnt[:j]) + token_coef * (tot[j] - tot[:j])
            arg[j] = int(np.argmin(cost))
            best[j] = cost[arg[j]]
        levels.append(best)
        backs.append(arg)
    results = []
    for m, level in enumerate(levels, start=1):
        if not np.isfinite(level[-1]):
            continue
        chosen, j = [len(cands) - 1], len(cands) - 1
        for back in reversed(backs[: m - 1]):
            j = int(back[j])
            chosen.append(j)
        results.append((float(level[-1]), tuple(cands[i] for i in reversed(chosen))))
    return results


def recommend_budgets(requests: Sequence[Sequence[ItemSpec]], max_graphs: int, memory_limit_bytes: int | None = None,
                      table: LatencyTable | None = None, objective: str = "padding",
                      candidates: Iterable[int] | None = None, *, max_items: int | None = None,
                      max_segments: int | None = None, packer: str = "ffd",
                      vision_config: VisionConfig | None = None,
                      dtype: str = "bfloat16") -> tuple[int, ...]:
    """At most ``max_graphs`` budgets minimising the predicted time or padding of a workload.

    ``requests`` is a list of requests, each a list of :class:`~glmvit.geometry.ItemSpec`.
    Method: the largest budget M alone decides the packing (FFD looks only at M and the limits; with
    ``packer="vllm"`` the plan here is ascending next-fit without vLLM 0.33.0's deferral, which needs the budgets),
    so each candidate M packs the workload once; an exact dynamic programme then picks the other budgets below M.
    Per-batch cost: padding → budget − tokens; time → ``table.graph_time(budget)``, plus ``eager_time`` of the
    items that exceed M. Ranking: time → (ms, graphs); padding → (eager items, padded tokens, replays, graphs).
    With ``objective="time"`` the answer is never predicted slower than running every request eagerly: then
    :class:`EagerIsFaster` (a ValueError) says so, with both times.
    Default candidates: powers of two from max_items and the batch sizes rounded up to a multiple of 64; for M
    only up to the first power of two ≥ the largest request, past which packing no longer changes.
    A memory limit (``total_graph_memory`` of ``vision_config``, default GLM-4.1V) drops over-limit optima for
    each (M, graph count): the answer then fits but may not be the constrained optimum.
    """
    if objective not in ("time", "padding"):
        raise ValueError(f"objective must be 'time' or 'padding', got {objective!r}")
    if objective == "time" and table is None:
        raise ValueError("objective='time' needs a latency table")
    max_graphs = positive_int("max_graphs", max_graphs)
    if memory_limit_bytes is not None:
        memory_limit_bytes = positive_int("memory_limit_bytes", memory_limit_bytes)
    # vLLM's auto max items: min(hi // lo, smallest budget), with budgets from lo = 64
    max_items = min(AUTO_RANGE[1] // AUTO_RANGE[0], AUTO_RANGE[0]) if max_items is None else \
        positive_int("max_items", max_items)
    max_segments = max_items if max_segments is None else max_segments
    specs = [check_items(r) for r in requests]
    if not any(specs):
        raise ValueError("the workload has no items")
    vision_config = vision_config or VisionConfig.glm41v()
    given = None if candidates is None else sorted({positive_int("candidate budget", c) for c in candidates})
    tops = [c for c in (given or _default_tops(specs, max_items)) if c >= max_items]
    if not tops:
        raise ValueError(f"no candidate budget is ≥ max_items={max_items}")

    best: tuple | None = None
    for top in tops:
        limits = BudgetConfig.capped((top,), max_items, max_segments)
        for key, budgets in _ranked_options(specs, limits, given, max_graphs, packer, objective, table):
            config = BudgetConfig.capped(budgets, max_items, max_segments)
            memory = total_graph_memory(graph_memory(config, vision_config, dtype))
            if memory_limit_bytes and memory > memory_limit_bytes:
                continue
            if best is None or key < best[0]:
                best = (key, budgets)
    if best is None:
        raise ValueError(f"no budget set fits in memory_limit_bytes={memory_limit_bytes}")
    if objective == "time" and table is not None:
        _check_beats_eager(specs, BudgetConfig.capped(best[1], max_items, max_segments), table, packer)
    return best[1]


class EagerIsFaster(ValueError):
    """The best budget set is predicted slower than running every request eagerly: capture no graphs for this."""

    def __init__(self, budgets: tuple[int, ...], graph_ms: float, eager_ms: float, requests: int):
        super().__init__(f"eager is predicted faster for this workload: the best budgets {list(budgets)} take "
                         f"{graph_ms:.1f} ms over {requests} requests, eager {eager_ms:.1f} ms (the latency table "
                         "says a replay of these budgets costs more than an eager forward of what they hold)")
        self.budgets, self.graph_ms, self.eager_ms = budgets, graph_ms, eager_ms


def _check_beats_eager(requests: list[list[ItemSpec]], config: BudgetConfig, table: LatencyTable, packer: str) -> None:
    estimate = sum((predict_time(p, table) for p in plan_workload(requests, config, packer)), TimeEstimate())
    if estimate.total_ms > estimate.eager_ms:
        raise EagerIsFaster(config.token_budgets, estimate.total_ms, estimate.eager_ms, len(requests))


def _ranked_options(requests: list[list[ItemSpec]], limits: BudgetConfig, given: list[int] | None,
                    max_graphs: int, packer: str, objective: str,
                    table: LatencyTable | None) -> list[tuple[tuple, tuple[int, ...]]]:
    """(ranking key, budgets) of the best 1..max_graphs budgets whose largest is ``limits.largest``."""
    top, max_items = limits.largest, limits.max_items
    plans = plan_workload(requests, limits, packer)
    sizes = [b.tokens for p in plans for b in p.batches if b.budget is not None]
    eager = [b.tokens for p in plans for b in p.batches if b.budget is None]
    lower = given or _powers_of_two(max_items, top) + [_round_up(s) for s in sizes]
    cands = sorted({c for c in lower if max_items <= c < top}) + [top]
    if objective == "time":
        assert table is not None  # recommend_budgets checked it
        eager_ms = sum((table.eager_time(t) for t in eager), 0.0)
        options = _best_subsets(sizes, cands, max_graphs, table.graph_time, 0.0)
        return [((cost + eager_ms, len(budgets)), budgets) for cost, budgets in options]
    options = _best_subsets(sizes, cands, max_graphs, float, -1.0)
    return [((len(eager), cost, len(sizes), len(budgets)), budgets) for cost, budgets in options]


def _default_tops(requests: list[list[ItemSpec]], max_items: int) -> list[int]:
    """Candidate largest budgets: powers of two up to the largest request, plus its and the largest item's size."""
    largest_request = max(sum(spec.tokens for spec in r) for r in requests)
    largest_item = max(spec.tokens for r in requests for spec in r)
    extra = {_round_up(largest_request), _round_up(largest_item)}
    return sorted(set(_powers_of_two(max_items, largest_request)) | extra)




# ---------------------------------------------------------------------------------------------------------------
# Evaluating a budget set for a deployment, and exporting it to vLLM
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimeSummary:
    """Mean, median and P99 of predicted milliseconds per request."""

    mean_ms: float
    median_ms: float
    p99_ms: float

    @classmethod
    def of(cls, ms: Sequence[float]) -> "TimeSummary":
        a = np.asarray(ms, dtype=np.float64)
        if a.size == 0:
            raise ValueError("no requests to summarise")
        return cls(float(a.mean()), float(np.median(a)), float(np.percentile(a, 99)))


@dataclass(frozen=True)
class BudgetReport:
    """What a budget set does to a workload: packing, graph memory, capture time and predicted time per request.

    ``graphs``: predicted ms per request from the table's medians; ``graphs_at_p99``: the same with every batch at
    its budget's P99 latency (a pessimistic request time: slow replays rarely all coincide); ``eager``: the same
    items run eagerly. Each is None without a table (``graphs_at_p99`` also without P99 columns);
    ``capture_s`` is None when the table has no capture times; ``capture`` is the one-time and per-budget cost it
    was estimated from.
    """

    config: BudgetConfig
    stats: PlanStats
    graph_bytes: int  # total_graph_memory: every graph's static buffers plus the one shared pool
    pool_bytes: int
    capture_s: float | None = None
    capture: CaptureCost | None = None
    graphs: TimeSummary | None = None
    graphs_at_p99: TimeSummary | None = None
    eager: TimeSummary | None = None
    per: str = "request"  # how the workload was packed: each request alone, or per vLLM engine step
    groups: int = 0  # requests (per request) or engine steps (per step)


def capture_time(config: BudgetConfig, table: LatencyTable) -> float | None:
    """Estimated seconds to capture every budget of ``config``: a one-time cost plus one per budget
    (:func:`~glmvit.recorded.capture_cost` for ``table``); None: unknown."""
    cost = capture_cost(table)
    return None if cost is None else cost.seconds(len(config.token_budgets))


@dataclass(frozen=True)
class EngineStep:
    """One vLLM engine step at saturation: the requests it schedules and their items' plans, one per modality."""

    requests: tuple[int, ...]
    plans: tuple[Plan, ...]


def plan_engine_steps(requests: Sequence[Sequence[ItemSpec]], config: BudgetConfig,
                      step_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS, packer: str = "vllm",
                      videos: Sequence[Sequence[bool]] | None = None) -> list[EngineStep]:
    """Pack a workload as vLLM's engine does when requests queue: consecutive requests in arrival order share a
    step while their vision tokens fit ``step_tokens`` (the scheduler's encoder budget per step,
    ``max_num_encoder_input_tokens``, which defaults to max_num_batched_tokens; a larger request is a step alone),
    and every item of a step is packed together, per modality (vLLM's ``execute`` runs images and videos apart).

    ``videos[r][i]`` says whether item i of request r is a video; without it an item with more than one segment is
    one (a 1–2-frame video has a single temporal patch and is then counted as an image). A model of the scheduler,
    not vLLM itself: text tokens, which share the step's budget in vLLM, are left out.
    """
    step_tokens = positive_int("step_tokens", step_tokens)
    specs = [check_items(r) for r in requests]
    kinds = [list(v) for v in videos] if videos is not None else [[s.segments > 1 for s in r] for r in specs]
    steps: list[EngineStep] = []
    current: list[int] = []
    used = 0
    for r, items in enumerate(specs):
        tokens = sum(s.tokens for s in items)
        if current and used + tokens > step_tokens:
            steps.append(_step(current, specs, kinds, config, packer))
            current, used = [], 0
        current.append(r)
        used += tokens
    if current:
        steps.append(_step(current, specs, kinds, config, packer))
    return steps


def _step(members: list[int], specs: list[list[ItemSpec]], kinds: list[list[bool]], config: BudgetConfig,
          packer: str) -> EngineStep:
    plans = []
    for video in (False, True):
        items = [s for r in members for s, v in zip(specs[r], kinds[r], strict=True) if v is video]
        if items:
            plans.append(plan_batches(items, config, packer))
    return EngineStep(tuple(members), tuple(plans))


def evaluate_budgets(requests: Sequence[Sequence[ItemSpec]], config: BudgetConfig, table: LatencyTable | None = None,
                     vision_config: VisionConfig | None = None, dtype: str = "bfloat16",
                     packer: str = "ffd", route: bool = False, per: str = "request",
                     step_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS) -> BudgetReport:
    """Pack the workload with ``config`` and report packing, memory (``vision_config``, default GLM-4.1V, in
    ``dtype``), and with a latency table the capture time and the predicted mean / median / P99 ms per request.

    ``per="request"``: every request packed alone (glmvit's runner, one call per request); ``per="step"``: the
    requests of each vLLM engine step packed together (:func:`plan_engine_steps`), a request then waiting for its
    whole step. ``route``: batches the table predicts faster eagerly run eagerly, as glmvit's runner routes
    (vLLM replays whatever a budget holds: ``route=False``).
    """
    if per not in ("request", "step"):
        raise ValueError(f"per must be 'request' or 'step', got {per!r}")
    if per == "request":
        groups = [[p] for p in plan_workload(requests, config, packer)]
        members = [[r] for r in range(len(groups))]
    else:
        steps = plan_engine_steps(requests, config, step_tokens, packer)
        groups, members = [list(s.plans) for s in steps], [list(s.requests) for s in steps]
    plans = [p for g in groups for p in g]
    if not members:
        raise ValueError("the workload has no requests")
    memories = graph_memory(config, vision_config or VisionConfig.glm41v(), dtype)
    report = BudgetReport(config, combined_stats(plans), total_graph_memory(memories),
                          max(m.pool_bytes for m in memories), per=per, groups=len(groups))
    if table is None:
        return report

    def per_request(t: LatencyTable, field: str) -> list[float]:
        times = [sum(getattr(predict_time(p, t, route), field) for p in g) for g in groups]
        return [times[k] for k, rs in enumerate(members) for _ in rs]

    slow = table.p99()
    return dataclasses.replace(
        report, capture_s=capture_time(config, table), capture=capture_cost(table),
        graphs=TimeSummary.of(per_request(table, "total_ms")), eager=TimeSummary.of(per_request(table, "eager_ms")),
        graphs_at_p99=None if slow is None else TimeSummary.of(per_request(slow, "total_ms")))


H200_BYTES = 141 * 10**9  # one H200's HBM3e (NVIDIA's specification): the default deployment target


def check_budget_fits(config: BudgetConfig, dtype: str = "bfloat16", memory_bytes: int = H200_BYTES,
                      vision_config: VisionConfig | None = None, weight_bytes: int | None = None) -> BudgetConfig:
    """``config`` if its graphs (:func:`~glmvit.costmodel.graph_memory`, one shared pool) and the tower's weights
    fit ``memory_bytes`` (the GPU's memory; one H200 by default) for ``vision_config`` (GLM-4.1V) in ``dtype``;
    otherwise a ValueError saying what they need."""
    tower = vision_config or VisionConfig.glm41v()
    if weight_bytes is None:
        import torch

        from .floor import tower_bytes

        weight_bytes = tower_bytes(tower, getattr(torch, dtype))
    need = total_graph_memory(graph_memory(config, tower, dtype)) + weight_bytes
    if need > memory_bytes:
        raise ValueError(f"{len(config.token_budgets)} budgets up to {config.largest:,} tokens need ≈ "
                         f"{need / 2**30:,.0f} GiB for their graphs and the weights (costmodel.graph_memory, "
                         f"{dtype}): more than the {memory_bytes / 2**30:,.0f} GiB of "
                         + ("one H200" if memory_bytes == H200_BYTES else "this GPU"))
    return config


def vllm_frames_needed(requests: Iterable[Sequence[ItemSpec]], config: BudgetConfig) -> int:
    """The most segments in one replayed batch when vLLM packs ``requests``: ascending tokens, next-fit on tokens
    and items only; vLLM's packer has no frame check (``EncoderCudaGraphManager._execute_local`` in
    vllm/v1/worker/encoder_cudagraph.py), so its frame capacity must hold what the other two limits let through."""
    unbounded = BudgetConfig(config.token_budgets, config.max_items, config.largest)  # segments ≤ tokens
    batches = [b for r in requests for b in plan_batches(r, unbounded, "vllm").batches if b.budget is not None]
    return max((b.segments for b in batches), default=0)


def vllm_compilation_config(config: BudgetConfig, frames: int | None = None) -> dict[str, Any]:
    """``config`` as vLLM's ``--compilation-config`` JSON for encoder CUDA graphs.

    The keys are the ``CompilationConfig`` fields (vllm/config/compilation.py) that ``EncoderCudaGraphManager``
    reads (vllm/v1/worker/encoder_cudagraph.py). vLLM's "frames" size the ``cu_seqlens`` buffer: one entry per
    attention sequence, i.e. per grid_thw time step, a temporal patch of 2 sampled frames (the capture grids of
    ``prepare_encoder_cudagraph_capture_inputs`` in vllm/model_executor/models/qwen2_5_vl.py use T = frames per
    item). That is a glmvit segment, so the frames are ``max_segments``, or ``frames`` when given (e.g.
    :func:`vllm_frames_needed`, if larger). vLLM's own rule, max items ≤ the smallest budget, holds for every
    :class:`BudgetConfig`.
    """
    frames = config.max_segments if frames is None else positive_int("frames", frames)
    return {
        "cudagraph_mm_encoder": True,
        "encoder_cudagraph_token_budgets": list(config.token_budgets),
        "encoder_cudagraph_max_vision_items_per_batch": config.max_items,
        "encoder_cudagraph_max_frames_per_batch": frames,
    }
