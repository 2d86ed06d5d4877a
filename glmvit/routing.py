"""How a planned batch runs: replayed in the captured budget that holds it, or eagerly — the one rule.

:class:`Router` is that rule. The graph runner routes every batch with it, :func:`glmvit.costmodel.predict_time`
predicts a plan's time with it, and the tools that report a runner's predicted or routed batches call it, so
what is predicted is what runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .costmodel import LatencyTable


class Route(NamedTuple):
    """A batch's way of running: ``replay`` (True: in its budget's graph; False: one eager forward) and the
    latency table's time for that way (None without a table)."""

    replay: bool
    predicted_ms: float | None


@dataclass(frozen=True)
class Router:
    """Decides, per batch, replay or eager.

    A batch no captured budget holds runs eagerly. Without a ``table`` every other batch replays. With one, and
    ``by_time`` (glmvit's runner), a batch replays only when the table predicts its replay no slower than its eager
    forward; without ``by_time`` (vLLM's rule) it replays whenever a budget holds it, and the table only predicts.
    """

    table: LatencyTable | None = None
    by_time: bool = True

    def route(self, budget: int | None, tokens: int, work: int) -> Route:
        """The route of a batch of ``tokens`` tokens whose segments have Σ L² = ``work``, held by the captured
        ``budget`` (None: none holds it)."""
        table = self.table
        if table is None:
            return Route(budget is not None, None)
        eager_ms = table.eager_time(tokens, work)
        if budget is None:
            return Route(False, eager_ms)
        graph_ms = table.graph_time(budget, work)
        if not self.by_time or graph_ms <= eager_ms:
            return Route(True, graph_ms)
        return Route(False, eager_ms)

    def eager_faster(self, budget: int, tokens: int, work: int) -> bool:
        """Whether the table predicts a held batch faster eagerly (False without a table): what ``by_time``
        routes by, for a report of the batches a non-routing runner replays slower."""
        return not Router(self.table).route(budget, tokens, work).replay
