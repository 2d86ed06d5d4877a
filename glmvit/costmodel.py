"""The offline cost model: graph memory, a measured latency table, predicted time, and recommended budgets.

Pure functions (numpy only, no torch) over :mod:`glmvit.packing` plans. Nothing here runs at serving time: it
answers "which budgets should I capture, and what will they cost?" before a deployment.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .config import VisionConfig
from .geometry import ItemSpec
from .packing import (
    AUTO_RANGE,
    BudgetConfig,
    Plan,
    PlanStats,
    check_items,
    combined_stats,
    plan_batches,
    plan_workload,
    positive_int,
)

CANDIDATE_STEP = 64  # recommend_budgets rounds batch sizes up to this multiple
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class GraphMemory:
    """Estimated bytes one captured graph holds: its static buffers and its pool (activations of one forward)."""

    budget: int
    static_bytes: int
    pool_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.pool_bytes


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# The graph pool per patch row and hidden unit, for 2-byte dtypes, and the pool's fixed part: fitted to the pool
# growth of every recorded H200 capture (data/bench/*_h200.json, 256 to 24,576 rows; tests/test_budget.py checks
# each within 15%). An eager forward's peak holds about 30 bytes per row·hidden (the rotary step keeps q/k in fp32
# beside the bf16 qkv); a capture keeps more, as blocks freed inside it are not all reused. The fixed part is the
# capture stream's own cuBLAS workspace. torch.compile fuses the fp32 temporaries away.
POOL_BYTES_PER_ROW_HIDDEN = {False: 44.2, True: 26.9}  # keyed by "compiled"
POOL_FIXED_BYTES = {False: 46_000_000, True: 25_000_000}


def graph_memory(config: BudgetConfig, vision_config: VisionConfig, dtype: str = "bfloat16",
                 compiled: bool = False) -> list[GraphMemory]:
    """Memory estimate per budget, for a ``glmvit.VisionConfig``.

    rows = budget · merge_area patch rows. Static buffers (exact): pixels rows × patch_dim (dtype), the int32
    metadata buffer of ``glmvit.metadata`` (max_segments + 2 + 5·rows + rows / merge_area) and the output budget ×
    out_hidden (dtype). Pool: ``POOL_FIXED_BYTES`` + rows · hidden · ``POOL_BYTES_PER_ROW_HIDDEN`` (scaled by the
    dtype's size), the measured model above.
    """
    size, vc = _dtype_bytes(dtype), vision_config
    result = []
    for budget in config.token_budgets:
        rows = budget * vc.merge_area
        metadata = config.max_segments + 2 + 5 * rows + rows // vc.merge_area
        static = (rows * vc.patch_dim + budget * vc.out_hidden_size) * size + 4 * metadata
        per_row = vc.hidden_size * POOL_BYTES_PER_ROW_HIDDEN[compiled] * size / 2
        pool = POOL_FIXED_BYTES[compiled] + round(rows * per_row)
        result.append(GraphMemory(budget, static, pool))
    return result


def total_graph_memory(memories: Iterable[GraphMemory]) -> int:
    """Bytes for all graphs: every static buffer plus ONE shared pool (captured largest first, so the largest)."""
    memories = list(memories)
    return sum(m.static_bytes for m in memories) + max((m.pool_bytes for m in memories), default=0)


@dataclass(frozen=True)
class LatencyTable:
    """Measured milliseconds per budget, and how attention adds to them: the cost model's data.

    Since padded rows sit outside every attention segment, a replay of budget B costs its matmuls (all B tokens,
    padding included: ``graph_ms``) plus the attention of its real segments, ``attention_ms`` per 10⁶ of Σ L²
    (L = patch rows of a segment). An eager forward of T tokens costs the same on the GPU, and never less than
    ``eager_floor_ms``, the host's time to launch a forward's ~300 kernels (it dominates small batches).
    Without an attention fit (``attention_ms`` = 0), ``eager_ms`` is read per token count instead.

    JSON (``load_latency_table``): what ``python -m glmvit latency`` writes — per budget a list of ``layouts``
    (``real_tokens``, ``segment_rows2``, ``graph_ms``, ``eager_ms``, and P99s), from which :meth:`from_dict` fits
    the model; or a plain ``{"budgets": [{"tokens", "graph_ms", "eager_ms"}, ...]}``. At least two budgets; other
    token counts are interpolated linearly (extrapolated from the two nearest, never below 0).
    Optional, as ``python -m glmvit latency`` writes them: P99 times (``graph_p99_ms`` / ``eager_p99_ms``; read
    only when every budget has both) and ``"capture": {"64": {"seconds": 0.06}, ...}``, each graph's capture time.
    """

    tokens: tuple[int, ...]
    graph_ms: tuple[float, ...]
    eager_ms: tuple[float, ...]
    dtype: str = "bfloat16"
    config: str = "glm41v"
    provenance: Mapping[str, Any] = field(default_factory=dict)
    attention_ms: float = 0.0  # per 10⁶ rows² of Σ L²
    eager_floor_ms: float = 0.0
    eager_floor_p99_ms: float = 0.0
    graph_p99_ms: tuple[float, ...] | None = None
    eager_p99_ms: tuple[float, ...] | None = None
    capture_s: Mapping[int, float] = field(default_factory=dict)  # budget → seconds its capture took

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.graph_ms) == len(self.eager_ms):
            raise ValueError("latency table: tokens, graph_ms and eager_ms differ in length")
        if len(self.tokens) < 2:
            raise ValueError(f"latency table needs at least 2 budgets, got {len(self.tokens)}")
        for t in self.tokens:
            positive_int("latency table tokens", t)
        if any(a >= b for a, b in zip(self.tokens, self.tokens[1:], strict=False)):
            raise ValueError(f"latency table tokens must be strictly increasing, got {list(self.tokens)}")
        p99 = (self.graph_p99_ms or ()) + (self.eager_p99_ms or ())
        if (self.graph_p99_ms is None) != (self.eager_p99_ms is None) or \
                any(c is not None and len(c) != len(self.tokens) for c in (self.graph_p99_ms, self.eager_p99_ms)):
            raise ValueError("latency table: graph_p99_ms and eager_p99_ms need one value per budget, both or neither")
        for ms in (*self.graph_ms, *self.eager_ms, *p99):
            if not (isinstance(ms, numbers.Real) and math.isfinite(ms) and ms > 0):
                raise ValueError(f"latency table times must be positive finite numbers, got {ms!r}")
        for name in ("attention_ms", "eager_floor_ms", "eager_floor_p99_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"latency table {name} must be a finite number ≥ 0, got {value!r}")
        for budget, seconds in self.capture_s.items():
            positive_int("latency table capture budget", budget)
            if not (isinstance(seconds, numbers.Real) and math.isfinite(seconds) and seconds >= 0):
                raise ValueError(f"latency table capture seconds must be finite numbers ≥ 0, got {seconds!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyTable:
        try:
            rows = sorted(data["budgets"], key=lambda r: r["tokens"])
            if all(r.get("layouts") for r in rows):
                return _fit(rows, data)
            columns = ([r["tokens"] for r in rows], [r["graph_ms"] for r in rows], [r["eager_ms"] for r in rows])
        except (KeyError, TypeError) as err:
            raise ValueError(f"latency table: expected budgets as [{{tokens, graph_ms, eager_ms}}, ...] ({err!r})") \
                from None
        tokens, graph_ms, eager_ms = (tuple(c) for c in columns)
        p99 = all("graph_p99_ms" in r and "eager_p99_ms" in r for r in rows)
        return cls(tokens, graph_ms, eager_ms, **_labels(data),
                   graph_p99_ms=tuple(r["graph_p99_ms"] for r in rows) if p99 else None,
                   eager_p99_ms=tuple(r["eager_p99_ms"] for r in rows) if p99 else None)

    def graph_time(self, budget: int, segment_rows2: int = 0) -> float:
        """A replay of ``budget``'s graph whose real segments have Σ L² = ``segment_rows2``."""
        return _linear(budget, self.tokens, self.graph_ms) + self.attention_ms * segment_rows2 / 1e6

    def eager_time(self, tokens: int, segment_rows2: int = 0) -> float:
        """One eager forward of ``tokens`` tokens whose segments have Σ L² = ``segment_rows2``."""
        if not self.attention_ms:
            return _linear(tokens, self.tokens, self.eager_ms)
        return max(self.eager_floor_ms, self.graph_time(tokens, segment_rows2))

    def p99(self) -> "LatencyTable | None":
        """This table with every budget's P99 times in place of its medians; None when it has no P99 columns."""
        if self.graph_p99_ms is None or self.eager_p99_ms is None:
            return None
        return dataclasses.replace(self, graph_ms=self.graph_p99_ms, eager_ms=self.eager_p99_ms, graph_p99_ms=None,
                                   eager_p99_ms=None, eager_floor_ms=self.eager_floor_p99_ms or self.eager_floor_ms)

    def capture_time(self, budget: int) -> float | None:
        """Seconds to capture ``budget``'s graph: as measured, else interpolated between the measured budgets like
        the times (None with fewer than two measured). The first capture of a run also pays one-time start-up."""
        if budget in self.capture_s:
            return self.capture_s[budget]
        if len(self.capture_s) < 2:
            return None
        budgets = sorted(self.capture_s)
        return _linear(budget, budgets, [self.capture_s[b] for b in budgets])


def _labels(data: Mapping[str, Any]) -> dict[str, Any]:
    return {"dtype": data.get("dtype", "bfloat16"), "config": data.get("config", "glm41v"),
            "provenance": dict(data.get("provenance", {})), "capture_s": _capture_seconds(data.get("capture", {}))}


def _fit(rows: list[Mapping[str, Any]], data: Mapping[str, Any]) -> LatencyTable:
    """The model of :class:`LatencyTable` from measured layouts: attention_ms by least squares within each budget
    (layouts of one budget differ only in their attention), each budget's graph_ms = mean of replay − attention,
    eager_floor_ms = median eager time of layouts ≤ 256 tokens (where launches, not the GPU, set the time)."""
    dx, dy = [], []
    for r in rows:
        work = np.array([x["segment_rows2"] / 1e6 for x in r["layouts"]])
        ms = np.array([x["graph_ms"] for x in r["layouts"]])
        dx += list(work - work.mean())
        dy += list(ms - ms.mean())
    slope = max(0.0, float(np.dot(dx, dy) / np.dot(dx, dx))) if np.dot(dx, dx) > 0 else 0.0
    base = [float(np.mean([x["graph_ms"] - slope * x["segment_rows2"] / 1e6 for x in r["layouts"]])) for r in rows]
    small = [x["eager_ms"] for r in rows for x in r["layouts"] if x["real_tokens"] <= 256]
    eager = [float(r["eager_ms"]) for r in rows]
    small_p99 = [x["eager_p99_ms"] for r in rows for x in r["layouts"] if x["real_tokens"] <= 256]
    # P99 columns: each budget's base plus the largest tail (P99 − median) of its layouts
    tail = [max(x["graph_p99_ms"] - x["graph_ms"] for x in r["layouts"]) for r in rows]
    eager_tail = [max(x["eager_p99_ms"] - x["eager_ms"] for x in r["layouts"]) for r in rows]
    return LatencyTable(tuple(int(r["tokens"]) for r in rows), tuple(base), tuple(eager), **_labels(data),
                        graph_p99_ms=tuple(b + t for b, t in zip(base, tail, strict=True)),
                        eager_p99_ms=tuple(e + t for e, t in zip(eager, eager_tail, strict=True)), attention_ms=slope,
                        eager_floor_ms=float(np.median(small)) if small else 0.0,
                        eager_floor_p99_ms=float(np.median(small_p99)) if small_p99 else 0.0)

def _capture_seconds(capture: Any) -> dict[int, float]:
    """``{"64": {"seconds": 0.06, ...}, ...}`` (a latency table's ``capture``) → {64: 0.06, ...}."""
    try:
        return {int(budget): entry["seconds"] for budget, entry in capture.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"latency table: expected capture as {{budget: {{seconds, ...}}, ...}} ({err!r})") from None


def _linear(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def load_latency_table(path: str | Path) -> LatencyTable:
    with open(path) as f:
        return LatencyTable.from_dict(json.load(f))


@dataclass(frozen=True)
class TimeEstimate:
    """Predicted ms: replays of graphs, eager fallbacks, and the baseline: the whole request in one eager forward."""

    graph_ms: float = 0.0
    fallback_ms: float = 0.0
    eager_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.graph_ms + self.fallback_ms

    def __add__(self, other: "TimeEstimate") -> "TimeEstimate":
        return TimeEstimate(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def predict_time(plan: Plan, table: LatencyTable) -> TimeEstimate:
    """Time of one request's plan: a replay per batch (its budget, its real attention), an eager forward per
    fallback, and the baseline: the whole request in one eager forward."""
    tokens = sum(b.tokens for b in plan.batches)
    work = sum(b.segment_rows2 for b in plan.batches)
    return TimeEstimate(
        graph_ms=sum((table.graph_time(b.budget, b.segment_rows2) for b in plan.batches if b.budget is not None), 0.0),
        fallback_ms=sum((table.eager_time(b.tokens, b.segment_rows2) for b in plan.batches if b.budget is None), 0.0),
        eager_ms=table.eager_time(tokens, work) if plan.batches else 0.0,
    )


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
    Method: the largest budget M alone decides the packing (packers look only at M and the limits), so each
    candidate M packs the workload once; an exact dynamic programme then picks the other budgets below M.
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
    max_items = AUTO_RANGE[1] // AUTO_RANGE[0] if max_items is None else positive_int("max_items", max_items)
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
        limits = BudgetConfig((top,), max_items, max_segments)
        for key, budgets in _ranked_options(specs, limits, given, max_graphs, packer, objective, table):
            config = BudgetConfig(budgets, max_items, max_segments)
            memory = total_graph_memory(graph_memory(config, vision_config, dtype))
            if memory_limit_bytes and memory > memory_limit_bytes:
                continue
            if best is None or key < best[0]:
                best = (key, budgets)
    if best is None:
        raise ValueError(f"no budget set fits in memory_limit_bytes={memory_limit_bytes}")
    if objective == "time" and table is not None:
        _check_beats_eager(specs, BudgetConfig(best[1], max_items, max_segments), table, packer)
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
    largest_request = max(sum(t for t, _ in r) for r in requests)
    largest_item = max(t for r in requests for t, _ in r)
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
    ``capture_s`` is None when the table has no capture times.
    """

    config: BudgetConfig
    stats: PlanStats
    graph_bytes: int  # total_graph_memory: every graph's static buffers plus the one shared pool
    pool_bytes: int
    capture_s: float | None = None
    graphs: TimeSummary | None = None
    graphs_at_p99: TimeSummary | None = None
    eager: TimeSummary | None = None


def capture_time(config: BudgetConfig, table: LatencyTable) -> float | None:
    """Estimated seconds to capture every budget of ``config`` (:meth:`LatencyTable.capture_time`); None: unknown."""
    seconds = [table.capture_time(b) for b in config.token_budgets]
    return None if any(s is None for s in seconds) else sum(s for s in seconds if s is not None)


def evaluate_budgets(requests: Sequence[Sequence[ItemSpec]], config: BudgetConfig, table: LatencyTable | None = None,
                     vision_config: VisionConfig | None = None, dtype: str = "bfloat16",
                     packer: str = "ffd") -> BudgetReport:
    """Pack every request with ``config`` and report packing, memory (``vision_config``, default GLM-4.1V, in
    ``dtype``), and with a latency table the capture time and the predicted mean / median / P99 ms per request."""
    plans = plan_workload(requests, config, packer)
    if not plans:
        raise ValueError("the workload has no requests")
    memories = graph_memory(config, vision_config or VisionConfig.glm41v(), dtype)
    report = BudgetReport(config, combined_stats(plans), total_graph_memory(memories),
                          max(m.pool_bytes for m in memories))
    if table is None:
        return report
    estimates = [predict_time(p, table) for p in plans]
    slow = table.p99()
    return dataclasses.replace(
        report, capture_s=capture_time(config, table), graphs=TimeSummary.of([e.total_ms for e in estimates]),
        eager=TimeSummary.of([e.eager_ms for e in estimates]),
        graphs_at_p99=None if slow is None else TimeSummary.of([predict_time(p, slow).total_ms for p in plans]))


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
