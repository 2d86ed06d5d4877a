"""The cost model: graph memory, a measured latency table, and the predicted time of a plan.

Functions over :mod:`glmvit.packing` plans, in numpy; torch is imported through :mod:`glmvit.metadata`'s shapes.
Two users: planning offline (recommend, evaluate, export to vLLM: :mod:`glmvit.deployment`), and the runner at
serving time, whose :class:`~glmvit.routing.Router` asks a :class:`LatencyTable` for a batch's times, once per
batch. Reading a table from a recorded file is :mod:`glmvit.recorded`'s (this module imports no record schema).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
import numbers
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .config import VisionConfig
from .geometry import ItemSpec
from .metadata import BatchShape
from .packing import MAX_TABLE_TOKENS, SMALLEST_BUDGET, BudgetConfig, Plan, positive_int
from .routing import Router

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MIN_BASE_MS = 1e-3  # one microsecond: the least a replay or a forward can cost (a kernel launch)


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


# The graph pool per patch row and hidden unit (2-byte dtypes) and its fixed part, keyed by (compiled, attention):
# "library" for the varlen/flash kernels, "triton" for glmvit's. Fitted to earlier captures in data/bench (compiled
# library: run s42_570b020r1's, with each block's residual adds in the matmuls' epilogue: its slope, and a fixed part
# that covers the 20 MiB allocator segment a 256-row pool takes, so no compiled pool of that run is under-stated by
# more than 6 %); tests/test_recorded_data.py keeps every compiled capture within 15 % of this model or two allocator
# segments, and no uncompiled one above it by more: uncompiled pools are over-stated, never under-stated.
POOL_BYTES_PER_ROW_HIDDEN = {(False, "library"): 44.2, (True, "library"): 26.45,
                             (False, "triton"): 41.6, (True, "triton"): 23.6}
POOL_FIXED_BYTES = {(False, "library"): 46_000_000, (True, "library"): 15_000_000,
                    (False, "triton"): 42_800_000, (True, "triton"): 16_000_000}
# The row range where the triton attention rotates q and k in its loop; outside it, each attention holds a
# (rows, 2·hidden) scratch of rotated q and k, which a compiled graph's pool keeps. glmvit.kernels.attention_table
# holds the same range (a test keeps them equal; a copy here, since the cost model runs where triton is not installed).
IN_LOOP_ROWS = (257, 1024)


def prerotated(rows: int) -> bool:
    """Whether the triton attention of ``rows`` packed rows takes its prerotated path (``IN_LOOP_ROWS``)."""
    return not IN_LOOP_ROWS[0] <= rows <= IN_LOOP_ROWS[1]


def graph_memory(config: BudgetConfig, vision_config: VisionConfig, dtype: str = "bfloat16",
                 compiled: bool = False, attention: str = "triton") -> list[GraphMemory]:
    """Memory estimate per budget, for a ``glmvit.VisionConfig``.

    rows = budget · merge_area patch rows. Static buffers (exact): pixels rows × patch_dim (dtype), the int32
    metadata buffer of ``glmvit.metadata`` (``BatchShape.packed_size``: ≈ max_segments + 5·rows + rows / merge_area)
    and the output budget × out_hidden (dtype). Pool: ``POOL_FIXED_BYTES`` + rows · hidden ·
    ``POOL_BYTES_PER_ROW_HIDDEN`` (scaled by the dtype's size), the measured model above, plus the prerotated
    attention's scratch where a compiled graph holds it (``prerotated``). ``attention``: "triton"
    (glmvit's kernel, the CUDA default) or any library backend ("varlen", "flash_attn", …).
    """
    key = (compiled, "triton" if attention == "triton" else "library")
    size, vc = _dtype_bytes(dtype), vision_config
    result = []
    for budget in config.token_budgets:
        rows = budget * vc.merge_area
        metadata = BatchShape(rows, config.max_segments, rows).packed_size(vc.merge_area)
        static = (rows * vc.patch_dim + budget * vc.out_hidden_size) * size + 4 * metadata
        per_row = vc.hidden_size * POOL_BYTES_PER_ROW_HIDDEN[key] * size / 2
        pool = POOL_FIXED_BYTES[key] + round(rows * per_row)
        if key == (True, "triton") and prerotated(rows):
            pool += rows * 2 * vc.hidden_size * size
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
    (L = patch rows of a segment). An eager forward of T tokens costs ``eager_ms`` at T (the full layouts' eager
    times with their attention taken out, interpolated) plus the same attention, and never less than
    ``eager_floor_ms``, the host's time to launch a forward's ~300 kernels (it dominates small batches). Without
    an attention fit (``attention_ms`` = 0, a table made by hand), ``eager_ms`` is read per token count as it is.

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
    mode: str | None = None  # the runner mode measured: "graph" or "graph-compiled" (None: a table made by hand)
    attention: str | None = None  # the attention backend measured
    source: str | None = None  # the file it was read from
    changed: tuple[str, ...] = ()  # code changed since it was recorded (glmvit.records.staleness): empty = current

    def __post_init__(self) -> None:
        if not len(self.tokens) == len(self.graph_ms) == len(self.eager_ms):
            raise ValueError("latency table: tokens, graph_ms and eager_ms differ in length")
        if len(self.tokens) < 2:
            raise ValueError(f"latency table needs at least 2 budgets, got {len(self.tokens)}")
        for t in (*self.tokens, *self.capture_s):
            if positive_int("latency table tokens", t) > MAX_TABLE_TOKENS:
                raise ValueError(f"latency table: a budget of {t:,} tokens; none is above {MAX_TABLE_TOKENS:,}")
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

    def describe(self) -> str:
        """What the table measured, where, and whether it still describes this code: for every tool that predicts."""
        prov = self.provenance
        what = f"{self.mode or 'mode unknown'}, {self.attention or 'attention unknown'}, {self.config}, {self.dtype}"
        where = f"{prov.get('gpu') or prov.get('device') or 'device unknown'}, commit {str(prov.get('git_commit'))[:7]}"
        status = "current" if not self.changed else "STALE: " + (
            "recorded before fingerprints" if self.changed == ("no fingerprint",) else
            ", ".join(self.changed) + " changed since")
        name = Path(self.source).name if self.source else "latency table"
        return f"{name} ({what}; {where}; {status})"

    def graph_time(self, budget: int, segment_rows2: int = 0) -> float:
        """A replay of ``budget``'s graph whose real segments have Σ L² = ``segment_rows2``."""
        return _linear(budget, self.tokens, self.graph_ms) + self.attention_ms * segment_rows2 / 1e6

    def eager_time(self, tokens: int, segment_rows2: int = 0) -> float:
        """One eager forward of ``tokens`` tokens whose segments have Σ L² = ``segment_rows2``."""
        if not self.attention_ms:
            return _linear(tokens, self.tokens, self.eager_ms)
        attention = self.attention_ms * segment_rows2 / 1e6
        return max(self.eager_floor_ms, _linear(tokens, self.tokens, self.eager_ms) + attention)

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


@dataclass(frozen=True)
class CaptureCost:
    """Seconds to capture a budget set: a one-time cost, paid by a process's first captures (compilation and its
    recompilation for dynamic shapes, lazy initialisation), plus a cost per budget. Capturing largest first, the
    largest budgets paid the one-time cost in a recorded run; it belongs to the set, not to them."""

    one_time_s: float
    per_budget_s: float
    source: str  # the run it was fitted on

    def seconds(self, budgets: int) -> float:
        """Estimated seconds to capture ``budgets`` budgets."""
        return self.one_time_s + budgets * self.per_budget_s

    def describe(self, budgets: int) -> str:
        return (f"{self.one_time_s:.2f} s once + {budgets} × {self.per_budget_s:.2f} s per budget, fitted on "
                f"{self.source}")


def fit_capture_cost(seconds: Mapping[int, float], source: str) -> CaptureCost | None:
    """The cost of one run's captures (budget → seconds): per budget, the median capture (the few captures that paid
    the one-time cost do not move it); one-time, the run's total less that many per-budget costs. None with fewer
    than two captures."""
    if len(seconds) < 2:
        return None
    per = float(np.median(list(seconds.values())))
    return CaptureCost(max(0.0, float(sum(seconds.values())) - len(seconds) * per), per, source)


def _linear(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def ladder_split(table: LatencyTable, merge_area: int = 4) -> int:
    """Where a mode's default ladder stops doubling (:func:`glmvit.packing.default_ladder`): the largest power of
    two, within the table's budgets, whose replay of one full image costs no more than the eager forward's launch
    floor — below it a padded replay still beats running eagerly. The smallest budget when none does."""
    split = SMALLEST_BUDGET
    while 2 * split <= table.tokens[-1] and \
            table.graph_time(2 * split, ItemSpec(2 * split, 1, merge_area * 2 * split).work) <= table.eager_floor_ms:
        split *= 2
    return split


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


def predict_time(plan: Plan, table: LatencyTable, route: bool = False) -> TimeEstimate:
    """Time of one request's plan: per batch, the time of the way :class:`glmvit.routing.Router` runs it (a replay
    of its budget with its real attention, or an eager forward), and the baseline: the whole request in one eager
    forward. ``route``: as glmvit's runner routes (a batch the table predicts faster eagerly runs eagerly);
    otherwise every batch a budget holds replays, as vLLM's."""
    router = Router(table, by_time=route)
    graph_ms = fallback_ms = 0.0
    for b in plan.batches:
        replay, ms = router.route(b.budget, b.tokens, b.segment_rows2)
        assert ms is not None, "a router with a table predicts every batch"
        if replay:
            graph_ms += ms
        else:
            fallback_ms += ms
    tokens = sum(b.tokens for b in plan.batches)
    work = sum(b.segment_rows2 for b in plan.batches)
    return TimeEstimate(graph_ms=graph_ms, fallback_ms=fallback_ms,
                        eager_ms=table.eager_time(tokens, work) if plan.batches else 0.0)
