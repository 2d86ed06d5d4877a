"""Token budgets and packing: which captured graph each batch of a request replays (runtime, pure Python).

A CUDA graph runs at one fixed shape, so the runner captures one graph per *token budget* (output tokens after
the 2×2 merge) and packs the items of a request into batches that each replay the smallest budget that fits; an
item that fits no budget runs eagerly, alone. Items are :class:`~glmvit.geometry.ItemSpec` (tokens, segments).
"""
from __future__ import annotations

import bisect
import numbers
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Sequence

from .geometry import ItemSpec

SMALLEST_BUDGET = 64  # one 224² image: the default ladder starts here
# vLLM 0.33's automatic budgets for GLM-4V (Glm4vForConditionalGeneration.get_encoder_cudagraph_budget_range in
# vllm/model_executor/models/glm4_1v.py): 64 (a 224² image) .. min(max_num_batched_tokens, max_model_len). The
# defaults are `vllm serve` on an H200 (max_num_batched_tokens 8192 for an API server on a 70–160 GiB GPU other than
# an A100 or a GB10: EngineArgs.get_batch_defaults in vllm/engine/arg_utils.py) with GLM-4.1V-9B-Thinking's
# 65,536-token context (GLM-4.6V-Flash: 131,072): 64 .. 8192.
VLLM_MIN_BUDGET = 64
VLLM_MAX_NUM_BATCHED_TOKENS = 8192
GLM41V_MAX_MODEL_LEN = 65_536
VLLM_MAX_FRAMES_PER_VIDEO = 600  # glm4_1v.py's _MAX_FRAMES_PER_VIDEO; vLLM's frames per batch = max items × this
# The largest token budget worth capturing: a request's visual tokens must fit the language model's context (128K
# tokens for GLM-4.6V-Flash), and a graph that large already takes tens of GiB (costmodel.graph_memory).
MAX_BUDGET_TOKENS = 131_072
MAX_TABLE_TOKENS = 2**20  # a latency table's largest budget: far past any context, an error, not a float overflow
MAX_BUDGETS = 64  # vLLM warns past 64 captured encoder graphs: each one costs capture time and static buffers
SERVING_LARGEST_BUDGET = 4096  # a server's default ladder's top: sixteen 8-frame 224² clips, or four 896² images
SERVING_MAX_ITEMS = 64  # vLLM's default max items per batch for its 64..4096 budget range (4096 // 64)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int if it is a positive integer (not a bool); otherwise a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def vllm_auto_range(max_num_batched_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
                    max_model_len: int = GLM41V_MAX_MODEL_LEN) -> tuple[int, int]:
    """vLLM's budget range for GLM-4V: (64, min(max_num_batched_tokens, max_model_len))."""
    return VLLM_MIN_BUDGET, min(positive_int("max_num_batched_tokens", max_num_batched_tokens),
                                positive_int("max_model_len", max_model_len))


AUTO_RANGE = vllm_auto_range()


def auto_budgets(lo: int, hi: int) -> tuple[int, ...]:
    """vLLM's automatic budgets: lo, 2·lo, 4·lo, … ≤ hi, plus hi itself if the last power falls short."""
    lo, hi = positive_int("lo", lo), positive_int("hi", hi)
    if lo > hi:
        raise ValueError(f"auto budget range is empty: lo={lo} > hi={hi}")
    budgets = [lo]
    while budgets[-1] * 2 <= hi:
        budgets.append(budgets[-1] * 2)
    if budgets[-1] < hi:
        budgets.append(hi)
    return tuple(budgets)


LADDER_SPLIT = 512  # without a latency table: above this many tokens the ladder steps by 1.5× and 4/3×, not 2×


def default_ladder(largest_request: int, smallest: int = SMALLEST_BUDGET, split: int = LADDER_SPLIT) -> tuple[int, ...]:
    """The default budgets, from ``smallest`` up to the first one ≥ the largest request's tokens.

    Powers of two up to ``split`` tokens, where even a full replay costs less than an eager forward's launches, so
    padding there is cheap; above, where a replay costs what its budget's matmuls cost, the powers of two get a
    midpoint (768, 1536, 3072, …) so a batch pads by at most a third. ``split`` is the mode's own
    (:func:`glmvit.costmodel.ladder_split` of its latency table: a compiled replay is cheaper, so it doubles
    further); 512 without a table.
    """
    budgets = [positive_int("smallest budget", smallest)]
    while budgets[-1] < largest_request:
        last = budgets[-1]
        is_power = last & (last - 1) == 0
        budgets.append(last * 2 if last < split else last * 3 // 2 if is_power else last * 4 // 3)
    return tuple(budgets)


def parse_budgets(text: str) -> tuple[int, ...] | None:
    """Budgets typed as text: ``"64, 128 256"`` → (64, 128, 256); ``"auto"`` or blank → None (auto budgets).

    Each word must be ASCII digits with an optional sign, and at most 18 digits (any budget that long is out of
    every range the callers check; Python refuses to convert past 4,300): anything else is a ValueError naming it.
    """
    words = text.replace(",", " ").split()
    if not words or [w.lower() for w in words] == ["auto"]:
        return None
    budgets = []
    for word in words:
        digits = word[1:] if word[:1] in "+-" else word
        if not (digits.isascii() and digits.isdigit()):
            shown = word if len(word) <= 24 else f"{word[:12]}…{word[-6:]}"
            raise ValueError(f"budget {shown!r} is not an integer (write e.g. '64, 256, 1024' or 'auto')")
        if len(digits.lstrip("0")) > 18:
            raise ValueError(f"budget {word[:12]}… ({len(digits):,} digits) is far larger than any token budget")
        budgets.append(int(word))
    return tuple(budgets)


def check_budgets(budgets: Sequence[int] | None) -> tuple[int, ...] | None:
    """``budgets`` (None: auto) if there are at most :data:`MAX_BUDGETS`, each in [1, :data:`MAX_BUDGET_TOKENS`];
    else a one-line ValueError naming the bad one. :class:`BudgetConfig` holds to these bounds."""
    if budgets is None:
        return None
    budgets = tuple(budgets)
    if len(budgets) > MAX_BUDGETS:
        raise ValueError(f"{len(budgets)} budgets: at most {MAX_BUDGETS} (each is a captured graph)")
    for budget in budgets:
        if not 1 <= budget <= MAX_BUDGET_TOKENS:
            raise ValueError(f"budget {budget:,} is not in [1, {MAX_BUDGET_TOKENS:,}] tokens (a request must fit "
                             "the 128K-token context of GLM-4.6V-Flash, and a graph that large already takes tens "
                             "of GiB)")
    return budgets


def default_max_items(token_budgets: Sequence[int], auto_range: tuple[int, int] = AUTO_RANGE) -> int:
    """vLLM's items per batch when none is given (:meth:`BudgetConfig.resolve`): min(hi // lo of the model range
    ``auto_range``, the smallest budget). The one rule ``plan``, its ``--help`` and the explorer all use."""
    lo, hi = auto_range
    return min(hi // lo, min(positive_int("token budget", b) for b in token_budgets))


def max_items_rule(auto_range: tuple[int, int] = AUTO_RANGE) -> str:
    """:func:`default_max_items` in words, for help texts: ``"min(8192 // 64, smallest budget)"``."""
    return f"min({auto_range[1]} // {auto_range[0]}, smallest budget)"


@dataclass(frozen=True)
class BudgetConfig:
    """Captured token budgets (strictly increasing) and the per-batch limits every graph is sized for.

    ``max_items``: items per batch (≤ the smallest budget: every item has ≥ 1 token). ``max_segments``: attention
    segments (temporal patches) per batch, ≥ ``max_items``; a slot costs 4 bytes of metadata, and a column of
    FlashAttention-2's launch grid (the varlen and flash_attn backends launch it even when empty), but no program of
    glmvit's triton kernel.
    Build one with :meth:`resolve` to get vLLM's defaults, :meth:`for_requests` to size it for a workload, or
    :meth:`capped` to cap given limits to what the budgets can use. Every config holds to its invariants, checked
    here (a one-line ValueError naming the bad value): at most :data:`MAX_BUDGETS` budgets, each at most
    :data:`MAX_BUDGET_TOKENS`; ``max_items`` ≤ the smallest budget ≤ …; ``max_items`` ≤ ``max_segments`` ≤ the
    largest budget (every segment has at least one token, so slots past it are never used).
    """

    token_budgets: tuple[int, ...]
    max_items: int
    max_segments: int

    def __post_init__(self) -> None:
        budgets = check_budgets(tuple(positive_int("token budget", b) for b in self.token_budgets)) or ()
        if not budgets or any(a >= b for a, b in zip(budgets, budgets[1:], strict=False)):
            raise ValueError(f"token budgets must be a non-empty strictly increasing sequence, got {budgets}")
        if positive_int("max_items", self.max_items) > budgets[0]:
            raise ValueError(f"max_items={self.max_items} exceeds the smallest budget {budgets[0]}: "
                             "a graph needs at least one output token per item")
        if positive_int("max_segments", self.max_segments) < self.max_items:
            raise ValueError(f"max_segments={self.max_segments} is below max_items={self.max_items}: "
                             "every item has at least one segment")
        if self.max_segments > budgets[-1]:
            raise ValueError(f"max_segments={self.max_segments:,} exceeds the largest budget {budgets[-1]:,}: "
                             "every segment has at least one token, so a batch never has more segments than tokens")

    @classmethod
    def capped(cls, token_budgets: Iterable[int], max_items: int, max_segments: int) -> BudgetConfig:
        """Budgets (any order) with the given limits capped to what they can use: ``max_items`` to the smallest
        budget, ``max_segments`` to the largest (:meth:`segment_slots`) and to at least ``max_items``."""
        budgets = tuple(sorted({positive_int("token budget", b) for b in token_budgets}))
        if not budgets:
            raise ValueError("token budgets must be a non-empty strictly increasing sequence, got ()")
        items = min(positive_int("max_items", max_items), budgets[0])
        return cls(budgets, items, max(items, cls.segment_slots(max_segments, budgets)))

    @classmethod
    def resolve(cls, token_budgets: Iterable[int] | None = None, max_items: int | None = None,
                max_segments: int | None = None, auto_range: tuple[int, int] = AUTO_RANGE,
                video: bool = True) -> BudgetConfig:
        """vLLM 0.33's rules for what is not given (``EncoderCudaGraphManager.__init__`` in
        vllm/v1/worker/encoder_cudagraph.py), over the model range ``auto_range`` = (lo, hi):

        - budgets and max_items given: as they are;
        - max_items only: ``auto_budgets(max(lo, max_items), hi)``;
        - budgets only, or nothing: max_items = min(hi // lo, smallest budget), budgets ``auto_budgets(lo, hi)``
          when none are given;
        - max_segments (vLLM's frames per batch, one per temporal patch): max_items × 600 with video
          (GLM's ``_MAX_FRAMES_PER_VIDEO``), max_items without video (room for one image per item); either through
          :meth:`segment_slots` (at most the largest budget).
        """
        lo, hi = auto_range
        given = tuple(sorted({positive_int("token budget", b) for b in token_budgets or ()}))
        if max_items is not None:
            max_items = positive_int("max_items", max_items)
            budgets = given or auto_budgets(max(lo, max_items), hi)
        else:
            budgets = given or auto_budgets(lo, hi)
            max_items = default_max_items(budgets, auto_range)
        if max_segments is None:
            max_segments = cls.segment_slots(max_items * VLLM_MAX_FRAMES_PER_VIDEO if video else max_items, budgets)
        return cls(budgets, max_items, max_segments)

    @classmethod
    def for_requests(cls, requests: Iterable[Sequence[ItemSpec]], token_budgets: Iterable[int] | None = None,
                     max_items: int | None = None, max_segments: int | None = None,
                     split: int = LADDER_SPLIT) -> BudgetConfig:
        """Sized for a workload: the default ladder (doubling up to ``split``) up to its largest request, and limits
        that hold its largest request (most items; most segments), capped so that every item still gets a token of
        the smallest budget and every segment one of the largest (:meth:`segment_slots`)."""
        requests = [list(r) for r in requests]
        largest = max((sum(s.tokens for s in r) for r in requests), default=0)
        budgets = tuple(sorted(set(token_budgets))) if token_budgets else default_ladder(largest, split=split)
        if max_items is None:
            max_items = min(max([len(r) for r in requests] + [1]), budgets[0])
        if max_segments is None:
            max_segments = cls.segment_slots(max([max_items] + [sum(s.segments for s in r) for r in requests]), budgets)
        return cls(budgets, max_items, max_segments)

    @classmethod
    def serving(cls, token_budgets: Iterable[int] | None = None, max_items: int | None = None,
                max_segments: int | None = None) -> BudgetConfig:
        """A server's batch limits: the budgets given, else the default ladder up to
        :data:`SERVING_LARGEST_BUDGET`; ``max_items`` given, else :data:`SERVING_MAX_ITEMS` (at most the smallest
        budget); ``max_segments`` given, else ``max_items`` (one image an item)."""
        budgets = tuple(token_budgets) if token_budgets else default_ladder(SERVING_LARGEST_BUDGET)
        # a limit of 0 is a bad value (a ValueError), not one left out
        items = min(SERVING_MAX_ITEMS, min(budgets)) if max_items is None else max_items
        return cls.resolve(budgets, items, items if max_segments is None else max_segments)

    @staticmethod
    def segment_slots(wanted: int, token_budgets: Sequence[int]) -> int:
        """The segment slots to give graphs of ``token_budgets`` (ascending) when ``wanted`` are asked for: at most
        the largest budget, since every segment has at least one token, so a batch never has more segments than
        tokens and slots past it are never used. The one rule every derived ``max_segments`` follows."""
        return min(positive_int("max_segments", wanted), token_budgets[-1])

    @property
    def largest(self) -> int:
        return self.token_budgets[-1]

    def slots(self, budget: int) -> int:
        """The segment slots of ``budget``'s graph: ``max_segments``, at most its tokens (one token a segment)."""
        return min(self.max_segments, budget)

    def budget_for(self, tokens: int) -> int | None:
        """The smallest budget ≥ tokens, or None when none is large enough."""
        i = bisect.bisect_left(self.token_budgets, tokens)
        return self.token_budgets[i] if i < len(self.token_budgets) else None


@dataclass(frozen=True)
class Batch:
    """Items run together: indices into the request's items, their totals, and the budget (None = eager)."""

    item_indices: tuple[int, ...]
    tokens: int
    segments: int
    budget: int | None
    segment_rows2: int = 0  # Σ L² over the batch's segments: what its attention costs

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

    def __add__(self, other: PlanStats) -> PlanStats:
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
            budget_tokens=sum(b.budget or 0 for b in replays),
        )


def check_items(items: Iterable[Sequence[int]]) -> list[ItemSpec]:
    """Items as :class:`ItemSpec` (kept as they are: their rows and work were counted from their grids);
    (tokens, segments) pairs are accepted, anything else is a ValueError naming it."""
    specs = []
    for i, item in enumerate(items):
        if isinstance(item, ItemSpec):
            positive_int(f"item {i} tokens", item.tokens)
            positive_int(f"item {i} segments", item.segments)
            specs.append(item)
            continue
        if not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"item {i} must be an ItemSpec (tokens, segments), got {item!r}")
        specs.append(ItemSpec(positive_int(f"item {i} tokens", item[0]), positive_int(f"item {i} segments", item[1])))
    return specs


Packer = Callable[[list[int], list[ItemSpec], BudgetConfig], list[list[int]]]


def _next_fit(order: list[int], specs: list[ItemSpec], config: BudgetConfig,
              defer: bool = False) -> list[list[int]]:
    """Items in ``order``, each into the current batch while it fits (items, largest budget, segments), else into a
    new one; ``defer`` adds vLLM 0.33.0's deferral rule (:func:`_pack_vllm`)."""
    groups: list[list[int]] = []
    current: list[int] = []
    tokens = segments = 0
    for i in order:
        t, s = specs[i].tokens, specs[i].segments
        fits = len(current) < config.max_items and tokens + t <= config.largest and segments + s <= config.max_segments
        if current and (not fits or (defer and _splitting_is_cheaper(tokens, t, config))):
            groups.append(current)
            current, tokens, segments = [], 0, 0
        current.append(i)
        tokens, segments = tokens + t, segments + s
    return groups + [current] if current else groups


def _splitting_is_cheaper(batch_tokens: int, item_tokens: int, config: BudgetConfig) -> bool:
    """vLLM 0.33.0's deferral rule (``should_defer_item``, nested in ``_execute_local`` of
    vllm/v1/worker/encoder_cudagraph.py at tag v0.33.0, commit 4ba787ec9): close the batch before an item when b(batch)
    + b(item) < b(batch + item) and b(item) ≥ b(batch), b the smallest budget holding those tokens (only asked when the
    item fits, so every b exists)."""
    b_cur, b_alone, b_merged = (config.budget_for(x) for x in (batch_tokens, item_tokens, batch_tokens + item_tokens))
    assert b_cur is not None and b_alone is not None and b_merged is not None
    return b_cur + b_alone < b_merged and b_alone >= b_cur


class _OpenBins:
    """First fit in O(log bins) per item: a tournament tree over the bins holding, per node, the most token room and
    the most segment room of any open bin below it (−1: none open). A bin is open while it has room for one more item
    under ``max_items``; the leftmost open bin with room for an item is found by descending where both maxima allow."""

    def __init__(self, capacity: int):
        self.size = 1 << max(1, (max(capacity, 1) - 1).bit_length())
        self.tokens = [-1] * (2 * self.size)
        self.segments = [-1] * (2 * self.size)

    def set(self, leaf: int, tokens: int, segments: int) -> None:
        v = leaf + self.size
        self.tokens[v], self.segments[v] = tokens, segments
        v //= 2
        while v:
            self.tokens[v] = max(self.tokens[2 * v], self.tokens[2 * v + 1])
            self.segments[v] = max(self.segments[2 * v], self.segments[2 * v + 1])
            v //= 2

    def leftmost(self, tokens: int, segments: int, v: int = 1) -> int | None:
        if self.tokens[v] < tokens or self.segments[v] < segments:
            return None
        if v >= self.size:
            return v - self.size
        found = self.leftmost(tokens, segments, 2 * v)  # the maxima may come from different bins: try both sides
        return found if found is not None else self.leftmost(tokens, segments, 2 * v + 1)


def _first_fit(order: list[int], specs: list[ItemSpec], config: BudgetConfig) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[list[int]] = []  # [tokens, segments] left per bin
    tree = _OpenBins(len(order))
    for i in order:
        t, s = specs[i].tokens, specs[i].segments
        b = tree.leftmost(t, s)
        if b is None:
            b = len(bins)
            bins.append([])
            room.append([config.largest, config.max_segments])
        bins[b].append(i)
        room[b][0] -= t
        room[b][1] -= s
        is_open = len(bins[b]) < config.max_items
        tree.set(b, room[b][0] if is_open else -1, room[b][1] if is_open else -1)
    return bins


def _ascending(idx: list[int], specs: list[ItemSpec]) -> list[int]:
    return sorted(idx, key=lambda i: specs[i].tokens)  # stable: ties keep input order, as vLLM's sorted()


def _pack_vllm(idx: list[int], specs: list[ItemSpec], config: BudgetConfig) -> list[list[int]]:
    """vLLM 0.33.0's packer (``EncoderCudaGraphManager._execute_local`` in vllm/v1/worker/encoder_cudagraph.py at tag
    v0.33.0, commit 4ba787ec9; at GitHub commits 034e78dd993c and 6d2dda3c87f9 it lacks the deferral): items by
    ascending tokens, next-fit under max_items and the largest budget, and its deferral rule — before adding an item
    that fits, close the batch when splitting strictly lowers the summed budgets and the item alone outweighs the batch
    (items of 64 and 200 tokens on budgets 64/128/256/512: batches (64) and (200), not one 512 batch). glmvit adds the
    segment limit, which vLLM's packer does not check (vLLM sizes max frames per batch for 600 frames per item, so it
    rarely binds; glmvit's graphs have the segment slots ``max_segments`` asks for)."""
    return _next_fit(_ascending(idx, specs), specs, config, defer=True)


def _pack_ffd(idx: list[int], specs: list[ItemSpec], config: BudgetConfig) -> list[list[int]]:
    """First-fit decreasing (by tokens, then segments), O(n log n); keeps plain ascending next-fit when that needs
    fewer batches.

    Under the segment limit FFD alone can lose to ascending next-fit: six 16-token items with 2, 7, 5, 1, 9, 2
    segments, budget 48, max_items 3, max_segments 14 take 3 FFD batches but 2 next-fit ones. Ties go to FFD.
    """
    ffd = _first_fit(sorted(idx, key=lambda i: (-specs[i].tokens, -specs[i].segments, i)), specs, config)
    nf = _next_fit(_ascending(idx, specs), specs, config)
    return nf if len(nf) < len(ffd) else ffd


PACKERS: dict[str, Packer] = {"vllm": _pack_vllm, "ffd": _pack_ffd}


def plan_batches(items: Iterable[Sequence[int]], config: BudgetConfig, packer: str = "ffd") -> Plan:
    """Pack one request's items (:class:`ItemSpec`) into batches with the smallest fitting budget.

    Items larger than every budget or with more segments than ``max_segments`` run eagerly alone
    (``budget=None``); the rest are packed so that no batch exceeds the largest budget, ``max_items`` or
    ``max_segments``.
    """
    if packer not in PACKERS:
        raise ValueError(f"unknown packer {packer!r}; choose one of {sorted(PACKERS)}")
    specs = check_items(items)
    fits = [spec.tokens <= config.largest and spec.segments <= config.max_segments for spec in specs]
    groups = PACKERS[packer]([i for i, ok in enumerate(fits) if ok], specs, config)
    batches = []
    for group in groups:
        batch = ItemSpec.total(specs[i] for i in group)
        batches.append(Batch(tuple(group), batch.tokens, batch.segments, config.budget_for(batch.tokens), batch.work))
    batches += [Batch((i,), specs[i].tokens, specs[i].segments, None, specs[i].work) for i, ok in enumerate(fits)
                if not ok]
    return Plan(tuple(batches))


def plan_workload(requests: Iterable[Iterable[Sequence[int]]], config: BudgetConfig,
                  packer: str = "ffd") -> list[Plan]:
    """One plan per request, each packed alone (as the runner packs one call; the serving scheduler,
    :mod:`glmvit.scheduler`, joins concurrent requests' items into one call, and vLLM an engine step's:
    :func:`glmvit.deployment.plan_engine_steps`)."""
    return [plan_batches(request, config, packer) for request in requests]


def combined_stats(plans: Iterable[Plan]) -> PlanStats:
    return sum((p.stats for p in plans), PlanStats())


def compare_packers(items: Iterable[Sequence[int]], config: BudgetConfig) -> dict[str, PlanStats]:
    """Stats of every packer on the same items."""
    items = list(items)
    return {name: plan_batches(items, config, name).stats for name in PACKERS}
