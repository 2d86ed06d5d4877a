"""Token budgets: item sizes, bucketing and packing, a cost model and synthetic workloads.

Pure functions (numpy only, no torch). A CUDA graph runs at one fixed shape, so the runner captures one graph per
*token budget* (output tokens after the 2×2 merge) and packs the items of a request into batches that each replay
the smallest budget that fits; an item that fits no budget runs eagerly, alone.
"""
from __future__ import annotations

import ast
import bisect
import json
import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

PATCH_SIZE = 14
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28 px: one output token's side
IMAGE_MIN_PIXELS = 12_544  # 112²
IMAGE_MAX_PIXELS = 9_633_792  # 28² · 2 · 6144
VIDEO_MAX_PIXELS = 47_040_000  # 28² · 2 · 30000
AUTO_RANGE = (64, 4096)  # vLLM's GLM range: a 224² image .. max_model_len 4096
CANDIDATE_STEP = 64  # recommend_budgets rounds batch sizes up to this multiple
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# ---------------------------------------------------------------------------------------------------------------
# Sizes: pixels → patch grid → output tokens
# ---------------------------------------------------------------------------------------------------------------
def smart_resize(height: int, width: int, num_frames: int = 2, factor: int = FACTOR, min_pixels: int = IMAGE_MIN_PIXELS,
                 max_pixels: int = IMAGE_MAX_PIXELS, temporal_factor: int = 2) -> tuple[int, int]:
    """GLM-4V's resize rule: the (height, width) in pixels, multiples of ``factor``, that the processor feeds the tower.

    Rounds each side to the nearest multiple (Python ``round``, half to even), then rescales so that
    frames · h · w stays within [min_pixels, max_pixels]. Images count as 2 frames.
    """
    if num_frames < temporal_factor:
        raise ValueError(f"num_frames={num_frames} must be at least temporal_factor={temporal_factor}")
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}×{width}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {height}×{width} exceeds 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for(height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
    """Patch grid (t, h, w) of an image (frames = 1) or a video of ``frames`` frames (paired: t = ceil(frames / 2))."""
    if frames < 1:
        raise ValueError(f"frames must be ≥ 1, got {frames}")
    if frames == 1:
        h_px, w_px = smart_resize(height, width)
    else:
        h_px, w_px = smart_resize(height, width, num_frames=2 * math.ceil(frames / 2), max_pixels=VIDEO_MAX_PIXELS)
    return math.ceil(frames / 2), h_px // PATCH_SIZE, w_px // PATCH_SIZE


def output_tokens(t: int, h: int, w: int, merge: int = MERGE_SIZE) -> int:
    """Tokens the merger emits for a (t, h, w) patch grid: t·h·w / merge²."""
    if h % merge or w % merge:
        raise ValueError(f"grid {h}×{w} is not a multiple of the merge size {merge}")
    return t * h * w // merge**2


def item_spec(t: int, h: int, w: int, merge: int = MERGE_SIZE) -> tuple[int, int]:
    """What packing needs of an item: (output_tokens, frames), frames = t = its attention segments."""
    return output_tokens(t, h, w, merge), t


# ---------------------------------------------------------------------------------------------------------------
# Budgets
# ---------------------------------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def auto_budgets(lo: int, hi: int) -> tuple[int, ...]:
    """vLLM's automatic budgets: lo, 2·lo, 4·lo, … ≤ hi, plus hi itself if the last power falls short."""
    lo, hi = _positive_int("lo", lo), _positive_int("hi", hi)
    if lo > hi:
        raise ValueError(f"auto budget range is empty: lo={lo} > hi={hi}")
    budgets = [lo]
    while budgets[-1] * 2 <= hi:
        budgets.append(budgets[-1] * 2)
    if budgets[-1] < hi:
        budgets.append(hi)
    return tuple(budgets)


def parse_budgets(text: str) -> tuple[int, ...] | None:
    """Budgets typed as text: ``"64, 128 256"`` → (64, 128, 256); ``"auto"`` or blank → None (auto budgets)."""
    words = text.replace(",", " ").split()
    if not words or [w.lower() for w in words] == ["auto"]:
        return None
    try:
        return tuple(int(w) for w in words)
    except ValueError:
        bad = next(w for w in words if not w.lstrip("+-").isdigit())
        raise ValueError(f"budget {bad!r} is not an integer (write e.g. '64, 256, 1024' or 'auto')") from None


@dataclass(frozen=True)
class BudgetConfig:
    """Captured token budgets and the per-batch limits every graph is sized for.

    ``token_budgets=None`` (or empty) ⇒ ``auto_budgets(*auto_range)``. ``max_items=None`` ⇒ vLLM's rule
    min(hi // lo, smallest budget). ``max_frames`` (temporal patches = attention segments per batch) defaults to
    ``max_items``, i.e. room for one image per item; raise it for video.
    """

    token_budgets: tuple[int, ...] | None = None
    max_items: int | None = None
    max_frames: int | None = None
    auto_range: tuple[int, int] = AUTO_RANGE

    def __post_init__(self) -> None:
        lo, hi = self.auto_range
        if self.token_budgets:
            budgets = tuple(sorted({_positive_int("token budget", b) for b in self.token_budgets}))
        else:
            budgets = auto_budgets(lo, hi)
        if self.max_items is None:
            max_items = min(hi // lo, budgets[0])
        else:
            max_items = _positive_int("max_items", self.max_items)
        if max_items > budgets[0]:
            raise ValueError(f"max_items={max_items} exceeds the smallest budget {budgets[0]}: "
                             "a graph needs at least one output token per item")
        max_frames = max_items if self.max_frames is None else _positive_int("max_frames", self.max_frames)
        if max_frames < max_items:
            raise ValueError(f"max_frames={max_frames} is below max_items={max_items}: every item has ≥ 1 frame")
        object.__setattr__(self, "token_budgets", budgets)
        object.__setattr__(self, "max_items", max_items)
        object.__setattr__(self, "max_frames", max_frames)

    @property
    def largest(self) -> int:
        return self.token_budgets[-1]

    def budget_for(self, tokens: int) -> int | None:
        """The smallest budget ≥ tokens, or None when none is large enough."""
        i = bisect.bisect_left(self.token_budgets, tokens)
        return self.token_budgets[i] if i < len(self.token_budgets) else None


# ---------------------------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Batch:
    """Items run together: indices into the request's items, their totals, and the budget (None = eager)."""

    item_indices: tuple[int, ...]
    tokens: int
    frames: int
    budget: int | None

    @property
    def padding(self) -> int:
        return 0 if self.budget is None else self.budget - self.tokens


@dataclass(frozen=True)
class PlanStats:
    """Totals over plans; stats of several requests add up with ``+``."""

    batches: int = 0
    replays: int = 0
    fallbacks: int = 0  # eager batches, one oversize item each
    real_tokens: int = 0  # every item's output tokens, replayed or eager
    padded_tokens: int = 0  # Σ (budget − tokens) over replays
    budget_tokens: int = 0  # Σ budget over replays

    @property
    def padding_fraction(self) -> float:
        return self.padded_tokens / self.budget_tokens if self.budget_tokens else 0.0

    def __add__(self, other: "PlanStats") -> "PlanStats":
        return PlanStats(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass(frozen=True)
class Plan:
    batches: tuple[Batch, ...]

    @property
    def stats(self) -> PlanStats:
        replays = [b for b in self.batches if b.budget is not None]
        return PlanStats(
            batches=len(self.batches),
            replays=len(replays),
            fallbacks=len(self.batches) - len(replays),
            real_tokens=sum(b.tokens for b in self.batches),
            padded_tokens=sum(b.padding for b in replays),
            budget_tokens=sum(b.budget for b in replays),
        )


def _check_items(items: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    specs = []
    for i, item in enumerate(items):
        item = getattr(item, "spec", item)
        if len(item) != 2:
            raise ValueError(f"item {i} must be (output_tokens, frames), got {item!r}")
        specs.append((_positive_int(f"item {i} output_tokens", item[0]), _positive_int(f"item {i} frames", item[1])))
    return specs


def _next_fit(order: list[int], specs: list[tuple[int, int]], config: BudgetConfig) -> list[list[int]]:
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = frames = 0
    for i in order:
        t, f = specs[i]
        if current and (len(current) == config.max_items or tokens + t > config.largest
                        or frames + f > config.max_frames):
            groups.append(current)
            current, tokens, frames = [], 0, 0
        current.append(i)
        tokens, frames = tokens + t, frames + f
    return groups + [current] if current else groups


def _first_fit(order: list[int], specs: list[tuple[int, int]], config: BudgetConfig) -> list[list[int]]:
    bins: list[list[Any]] = []  # [indices, tokens, frames]
    for i in order:
        t, f = specs[i]
        for b in bins:
            if len(b[0]) < config.max_items and b[1] + t <= config.largest and b[2] + f <= config.max_frames:
                b[0].append(i)
                b[1], b[2] = b[1] + t, b[2] + f
                break
        else:
            bins.append([[i], t, f])
    return [b[0] for b in bins]


def _pack_vllm(idx: list[int], specs: list[tuple[int, int]], config: BudgetConfig) -> list[list[int]]:
    """vLLM's order: ascending tokens, next-fit (plus the frame check vLLM lacks)."""
    return _next_fit(sorted(idx, key=lambda i: specs[i][0]), specs, config)


def _pack_ffd(idx: list[int], specs: list[tuple[int, int]], config: BudgetConfig) -> list[list[int]]:
    """First-fit decreasing (by tokens, then frames); keeps vLLM's packing when that needs fewer batches.

    Under the frame limit FFD alone can lose to ascending next-fit: six 1-token items with 2, 7, 5, 1, 9, 2
    frames, budget 3, max_items 3, max_frames 14 take 3 FFD batches but 2 next-fit ones. Ties go to FFD.
    """
    ffd = _first_fit(sorted(idx, key=lambda i: (-specs[i][0], -specs[i][1], i)), specs, config)
    nf = _pack_vllm(idx, specs, config)
    return nf if len(nf) < len(ffd) else ffd


PACKERS: dict[str, Callable[[list[int], list[tuple[int, int]], BudgetConfig], list[list[int]]]] = {
    "vllm": _pack_vllm,
    "ffd": _pack_ffd,
}


def plan_batches(items: Iterable[Sequence[int]], config: BudgetConfig, packer: str = "ffd") -> Plan:
    """Pack one request's items, each (output_tokens, frames), into batches with the smallest fitting budget.

    Items larger than every budget or with more frames than ``max_frames`` run eagerly alone (``budget=None``);
    the rest are packed so that no batch exceeds the largest budget, ``max_items`` or ``max_frames``.
    """
    if packer not in PACKERS:
        raise ValueError(f"unknown packer {packer!r}; choose one of {sorted(PACKERS)}")
    specs = _check_items(items)
    fits = [t <= config.largest and f <= config.max_frames for t, f in specs]
    groups = PACKERS[packer]([i for i, ok in enumerate(fits) if ok], specs, config)
    batches = []
    for group in groups:
        tokens, frames = sum(specs[i][0] for i in group), sum(specs[i][1] for i in group)
        batches.append(Batch(tuple(group), tokens, frames, config.budget_for(tokens)))
    batches += [Batch((i,), *specs[i], None) for i, ok in enumerate(fits) if not ok]
    return Plan(tuple(batches))


def plan_workload(requests: Iterable[Iterable[Sequence[int]]], config: BudgetConfig, packer: str = "ffd") -> list[Plan]:
    """One plan per request (items of different requests are never packed together)."""
    return [plan_batches(request, config, packer) for request in requests]


def combined_stats(plans: Iterable[Plan]) -> PlanStats:
    return sum((p.stats for p in plans), PlanStats())


def compare_packers(items: Iterable[Sequence[int]], config: BudgetConfig) -> dict[str, PlanStats]:
    """Stats of every packer on the same items."""
    items = list(items)
    return {name: plan_batches(items, config, name).stats for name in PACKERS}


# ---------------------------------------------------------------------------------------------------------------
# Cost model: memory and time
# ---------------------------------------------------------------------------------------------------------------
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


def graph_memory(config: BudgetConfig, vision_config: Any, dtype: str = "bfloat16") -> list[GraphMemory]:
    """Analytic memory estimate per budget, for a ``glmvit.VisionConfig``.

    rows = budget · merge_area patch rows. Static buffers: pixels rows × patch_dim (dtype), the int32 metadata
    buffer of ``glmvit.metadata`` (max_frames + 2 + 5·rows + rows / merge_area) and the output budget × out_hidden
    (dtype). Pool: the largest live activations of one forward, in dtype: a block's rows × (3·hidden for q/k/v +
    2·mlp width for gate/up; GLM-4V's block MLP is out_hidden_size wide) plus the merger's budget × 2·intermediate.
    """
    size, vc = _dtype_bytes(dtype), vision_config
    result = []
    for budget in config.token_budgets:
        rows = budget * vc.merge_area
        metadata = config.max_frames + 2 + 5 * rows + rows // vc.merge_area
        static = (rows * vc.patch_dim + budget * vc.out_hidden_size) * size + 4 * metadata
        pool = (rows * (3 * vc.hidden_size + 2 * vc.out_hidden_size) + budget * 2 * vc.intermediate_size) * size
        result.append(GraphMemory(budget, static, pool))
    return result


def total_graph_memory(memories: Iterable[GraphMemory]) -> int:
    """Bytes for all graphs: every static buffer plus ONE shared pool (captured largest first, so the largest)."""
    memories = list(memories)
    return sum(m.static_bytes for m in memories) + max((m.pool_bytes for m in memories), default=0)


@dataclass(frozen=True)
class LatencyTable:
    """Measured milliseconds per budget: graph replay and eager forward of a batch of that many tokens.

    JSON format (``load_latency_table``)::

        {"provenance": {"gpu": "...", "date": "...", "command": "..."},
         "dtype": "bfloat16", "config": "glm41v",
         "budgets": [{"tokens": 64, "graph_ms": 2.9, "eager_ms": 8.1}, ...]}

    At least two entries; other token counts are interpolated linearly (extrapolated from the two nearest
    entries, never below 0).
    """

    tokens: tuple[int, ...]
    graph_ms: tuple[float, ...]
    eager_ms: tuple[float, ...]
    dtype: str = "bfloat16"
    config: str = "glm41v"
    provenance: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.graph_ms) == len(self.eager_ms):
            raise ValueError("latency table: tokens, graph_ms and eager_ms differ in length")
        if len(self.tokens) < 2:
            raise ValueError(f"latency table needs at least 2 budgets, got {len(self.tokens)}")
        for t in self.tokens:
            _positive_int("latency table tokens", t)
        if any(a >= b for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError(f"latency table tokens must be strictly increasing, got {list(self.tokens)}")
        for ms in (*self.graph_ms, *self.eager_ms):
            if not (isinstance(ms, numbers.Real) and math.isfinite(ms) and ms > 0):
                raise ValueError(f"latency table times must be positive finite numbers, got {ms!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LatencyTable":
        try:
            rows = sorted(data["budgets"], key=lambda r: r["tokens"])
            columns = ([r["tokens"] for r in rows], [r["graph_ms"] for r in rows], [r["eager_ms"] for r in rows])
        except (KeyError, TypeError) as err:
            raise ValueError(f"latency table: expected budgets as [{{tokens, graph_ms, eager_ms}}, ...] ({err!r})")
        return cls(*map(tuple, columns), dtype=data.get("dtype", "bfloat16"), config=data.get("config", "glm41v"),
                   provenance=dict(data.get("provenance", {})))

    def graph_time(self, budget: int) -> float:
        return _linear(budget, self.tokens, self.graph_ms)

    def eager_time(self, tokens: int) -> float:
        return _linear(tokens, self.tokens, self.eager_ms)


def _linear(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def load_latency_table(path: str | Path) -> LatencyTable:
    with open(path) as f:
        return LatencyTable.from_dict(json.load(f))


@dataclass(frozen=True)
class TimeEstimate:
    """Predicted ms: replays of graphs, eager fallbacks, and the same batches all run eagerly (the baseline)."""

    graph_ms: float = 0.0
    fallback_ms: float = 0.0
    eager_ms: float = 0.0

    @property
    def total_ms(self) -> float:
        return self.graph_ms + self.fallback_ms

    def __add__(self, other: "TimeEstimate") -> "TimeEstimate":
        return TimeEstimate(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def predict_time(plan: Plan, table: LatencyTable) -> TimeEstimate:
    """Time of a plan: graph_ms(budget) per replay, eager_ms(tokens) per fallback and per batch of the baseline."""
    replays = [b for b in plan.batches if b.budget is not None]
    fallbacks = [b for b in plan.batches if b.budget is None]
    return TimeEstimate(
        graph_ms=sum(table.graph_time(b.budget) for b in replays),
        fallback_ms=sum(table.eager_time(b.tokens) for b in fallbacks),
        eager_ms=sum(table.eager_time(b.tokens) for b in plan.batches),
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


def recommend_budgets(workload_items: Sequence[Sequence[Any]], max_graphs: int, memory_limit_bytes: int | None = None,
                      table: LatencyTable | None = None, objective: str = "padding",
                      candidates: Iterable[int] | None = None, *, max_items: int | None = None,
                      max_frames: int | None = None, packer: str = "ffd", vision_config: Any = None,
                      dtype: str = "bfloat16") -> tuple[int, ...]:
    """At most ``max_graphs`` budgets minimising the predicted time or padding of a workload.

    ``workload_items`` is a list of requests, each a list of items ((output_tokens, frames) or workload items).
    Method: the largest budget M alone decides the packing (packers look only at M and the limits), so each
    candidate M packs the workload once; an exact dynamic programme then picks the other budgets below M.
    Per-batch cost: padding → budget − tokens; time → ``table.graph_time(budget)``, plus ``eager_time`` of the
    items that exceed M. Ranking: time → (ms, graphs); padding → (eager items, padded tokens, replays, graphs).
    Default candidates: powers of two from max_items and the batch sizes rounded up to a multiple of 64; for M
    only up to the first power of two ≥ the largest request, past which packing no longer changes.
    A memory limit (``total_graph_memory`` of ``vision_config``, default GLM-4.1V) drops over-limit optima for
    each (M, graph count): the answer then fits but may not be the constrained optimum.
    """
    if objective not in ("time", "padding"):
        raise ValueError(f"objective must be 'time' or 'padding', got {objective!r}")
    if objective == "time" and table is None:
        raise ValueError("objective='time' needs a latency table")
    max_graphs = _positive_int("max_graphs", max_graphs)
    if memory_limit_bytes is not None:
        memory_limit_bytes = _positive_int("memory_limit_bytes", memory_limit_bytes)
    max_items = AUTO_RANGE[1] // AUTO_RANGE[0] if max_items is None else _positive_int("max_items", max_items)
    max_frames = max_items if max_frames is None else max_frames
    requests = [_check_items(r) for r in workload_items]
    if not any(requests):
        raise ValueError("the workload has no items")
    if vision_config is None:
        from .config import VisionConfig
        vision_config = VisionConfig.glm41v()
    given = None if candidates is None else sorted({_positive_int("candidate budget", c) for c in candidates})
    tops = [c for c in (given or _default_tops(requests, max_items)) if c >= max_items]
    if not tops:
        raise ValueError(f"no candidate budget is ≥ max_items={max_items}")

    best: tuple | None = None
    for top in tops:
        limits = BudgetConfig((top,), max_items, max_frames)
        for key, budgets in _ranked_options(requests, limits, given, max_graphs, packer, objective, table):
            config = BudgetConfig(budgets, max_items, max_frames)
            memory = total_graph_memory(graph_memory(config, vision_config, dtype))
            if memory_limit_bytes and memory > memory_limit_bytes:
                continue
            if best is None or key < best[0]:
                best = (key, budgets)
    if best is None:
        raise ValueError(f"no budget set fits in memory_limit_bytes={memory_limit_bytes}")
    return best[1]


def _ranked_options(requests: list[list[tuple[int, int]]], limits: BudgetConfig, given: list[int] | None,
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
        eager_ms = sum(table.eager_time(t) for t in eager)
        options = _best_subsets(sizes, cands, max_graphs, table.graph_time, 0.0)
        return [((cost + eager_ms, len(budgets)), budgets) for cost, budgets in options]
    options = _best_subsets(sizes, cands, max_graphs, float, -1.0)
    return [((len(eager), cost, len(sizes), len(budgets)), budgets) for cost, budgets in options]


def _default_tops(requests: list[list[tuple[int, int]]], max_items: int) -> list[int]:
    """Candidate largest budgets: powers of two up to the largest request, plus its and the largest item's size."""
    largest_request = max(sum(t for t, _ in r) for r in requests)
    largest_item = max(t for r in requests for t, _ in r)
    extra = {_round_up(largest_request), _round_up(largest_item)}
    return sorted(set(_powers_of_two(max_items, largest_request)) | extra)


# ---------------------------------------------------------------------------------------------------------------
# Workloads (vLLM's random-mm benchmark dataset, and explicit sizes)
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MMItem:
    """One image (num_frames = 1) or video: its input size, its patch grid after smart_resize, its packing spec."""

    height: int
    width: int
    num_frames: int
    grid: tuple[int, int, int]

    @property
    def spec(self) -> tuple[int, int]:
        return item_spec(*self.grid)

    @property
    def tokens(self) -> int:
        return self.spec[0]


def make_item(height: int, width: int, num_frames: int = 1) -> MMItem:
    return MMItem(height, width, num_frames, grid_for(height, width, num_frames))


def workload_from_sizes(sizes: Iterable[Sequence[int]]) -> list[MMItem]:
    """The items of one request from (height, width) or (height, width, frames) sizes."""
    return [make_item(*size) for size in sizes]


def parse_bucket_config(bucket_config: str | Mapping[Any, Any]) -> dict[tuple[int, int, int], float]:
    """``{(height, width, frames): probability}`` (or its string form) → normalised probabilities."""
    if isinstance(bucket_config, str):
        try:
            bucket_config = ast.literal_eval(bucket_config)
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"could not parse bucket_config {bucket_config!r}: {err}") from None
    if not isinstance(bucket_config, Mapping) or not bucket_config:
        raise ValueError(f"bucket_config must be a non-empty dict {{(height, width, frames): prob}}, "
                         f"got {bucket_config!r}")
    buckets = {}
    for key, prob in bucket_config.items():
        if not (isinstance(key, tuple) and len(key) == 3):
            raise ValueError(f"bucket key must be (height, width, frames), got {key!r}")
        key = tuple(_positive_int(f"bucket {key} {name}", v) for name, v in zip(("height", "width", "frames"), key))
        if isinstance(prob, bool) or not isinstance(prob, numbers.Real) or not prob >= 0:
            raise ValueError(f"bucket {key} probability must be a number ≥ 0, got {prob!r}")
        buckets[key] = float(prob)
    total = sum(buckets.values())
    if not total > 0:
        raise ValueError(f"bucket_config probabilities must sum to > 0, got {total}")
    return {k: p / total for k, p in buckets.items() if p > 0}


def random_mm_workload(bucket_config: str | Mapping[Any, Any], num_requests: int, items_per_request: int = 1,
                       range_ratio: float = 0.0, seed: int = 0,
                       limit_per_request: int | None = None) -> list[list[MMItem]]:
    """Requests like vLLM's ``random-mm`` dataset: items per request uniform in [⌊n(1−r)⌋, ⌈n(1+r)⌉]
    (capped by ``limit_per_request``, vLLM's limit-mm-per-prompt), each item's size drawn from the buckets."""
    buckets = parse_bucket_config(bucket_config)
    num_requests = _positive_int("num_requests", num_requests)
    n = _positive_int("items_per_request", items_per_request)
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio!r}")
    lo = max(0, math.floor(n * (1 - range_ratio)))
    hi = math.ceil(n * (1 + range_ratio))
    if limit_per_request is not None:
        hi = min(hi, _positive_int("limit_per_request", limit_per_request))
    if lo > hi:
        raise ValueError(f"items per request range is empty: [{lo}, {hi}]")
    rng = np.random.default_rng(seed)
    keys = list(buckets)
    items = [make_item(*k) for k in keys]
    counts = rng.integers(lo, hi + 1, size=num_requests)
    choices = rng.choice(len(keys), size=int(counts.sum()), p=[buckets[k] for k in keys])
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [[items[c] for c in choices[a:b]] for a, b in zip(bounds[:-1], bounds[1:])]
