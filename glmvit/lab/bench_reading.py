"""Notebook 08's reading of a benchmark record: the batches each graph mode's runner made, rebuilt from the
record's workload, budgets and latency tables."""
from __future__ import annotations

from typing import Any

from ..costmodel import LatencyTable
from ..geometry import item_spec
from ..packing import Batch, BudgetConfig, plan_batches
from ..routing import Router


def runner_batches(record: Any, mode: str, tables: dict[str, LatencyTable]) -> list[list[tuple[Batch, bool]]]:
    """Per request, [(batch, replayed)] as the runner of ``mode`` made them: its own budgets, glmvit's packer (FFD),
    each batch routed by the mode's latency table (``tables[mode]``) when the benchmark routed."""
    s = record.settings
    config = BudgetConfig(tuple(record.modes[mode].budgets), s.max_items, s.max_segments)
    router = Router(tables[mode] if s.route and mode in s.tables else None)
    out = []
    for grids in record.workload["grids"][: record.modes[mode].requests]:
        plan = plan_batches([item_spec(*g) for g in grids], config)
        out.append([(b, router.route(b.budget, b.tokens, b.segment_rows2).replay) for b in plan.batches])
    return out
