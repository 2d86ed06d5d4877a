"""``python -m glmvit plan``: pack a random-mm workload into token budgets and compare the packers."""
from __future__ import annotations

import argparse

from ..packing import BudgetConfig, PlanStats, compare_packers, parse_budgets
from ..workloads import random_mm_workload

MAX_REQUESTS = 1_000_000  # planning is pure Python: more than this is a typo, not a workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glmvit plan", description=__doc__)
    parser.add_argument("--bucket-config", default="{(224, 224, 1): 1.0}", help="(height, width, frames): probability")
    parser.add_argument("--items-per-request", type=int, default=1)
    parser.add_argument("--range-ratio", type=float, default=0.0)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--budgets", default="auto", help="comma-separated token budgets, or 'auto'")
    parser.add_argument("--max-items", type=int, default=None)
    parser.add_argument("--max-segments", type=int, default=None,
                        help="attention segments (temporal patches) per batch (default: max items)")
    args = parser.parse_args(argv)
    if not 1 <= args.num_requests <= MAX_REQUESTS:
        parser.error(f"--num-requests must be in [1, {MAX_REQUESTS:,}]")
    config = BudgetConfig.resolve(parse_budgets(args.budgets), args.max_items, args.max_segments)
    requests = random_mm_workload(args.bucket_config, args.num_requests, args.items_per_request,
                                  args.range_ratio, args.seed)
    print(f"budgets {list(config.token_budgets)}, max_items {config.max_items}, max_segments {config.max_segments}")
    print(f"{'packer':<8} {'batches':>8} {'replays':>8} {'eager':>6} {'padding':>8}")
    totals: dict[str, PlanStats] = {}
    for request in requests:
        for name, stats in compare_packers([item.spec for item in request], config).items():
            totals[name] = totals.get(name, PlanStats()) + stats
    for name, s in totals.items():
        print(f"{name:<8} {s.batches:>8} {s.replays:>8} {s.fallbacks:>6} {s.padding_fraction:>8.1%}")
    return 0
