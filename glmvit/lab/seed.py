"""The seed's published numbers (vLLM PR #40576, ``data/seed_pr40576.json``) as the notebooks read them: its
configuration as a :class:`~glmvit.packing.BudgetConfig`, its ``encoder_forward_ms`` rows per workload, and its
serving run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..packing import BudgetConfig

SEED_PATH = Path(__file__).resolve().parents[2] / "data" / "seed_pr40576.json"
# glmvit's preset names for the PR's two benchmark workloads
WORKLOADS = {"img1x224": "one 224² image per request", "video8x224": "one 8-frame 224² clip per request"}


def load_seed() -> dict[str, Any]:
    """``data/seed_pr40576.json`` as published."""
    seed: dict[str, Any] = json.loads(SEED_PATH.read_text())
    return seed


def seed_budget_config(seed: dict[str, Any]) -> BudgetConfig:
    """The PR's own configuration: its token budgets, max vision items per batch and max frames per batch (glmvit's
    ``max_segments``, as notebook 08's seed runs set it)."""
    cc = seed["compilation_config"]
    budgets = tuple(cc["encoder_cudagraph_token_budgets"])
    return BudgetConfig(budgets, cc["encoder_cudagraph_max_vision_items_per_batch"],
                        cc["encoder_cudagraph_max_frames_per_batch"])


def seed_rows(seed: dict[str, Any], gpus: str) -> dict[str, dict[str, Any]]:
    """Per glmvit preset, the PR's row for ``gpus``: model, (eager, graph) mean and P99 in ms."""
    rows = {(r["workload"], r["gpus"]): r for r in seed["encoder_forward_ms"]}
    out = {}
    for preset, workload in WORKLOADS.items():
        r = rows[(workload, gpus)]
        out[preset] = {"model": r["model"].split("/")[-1], "mean": (r["eager"]["mean_ms"], r["graph"]["mean_ms"]),
                       "p99": (r["eager"]["p99_ms"], r["graph"]["p99_ms"])}
    return out


def seed_serve(seed: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """The PR's ``vllm bench serve`` run: (eager, graph) per quantity."""
    e, g = seed["serve"]["eager"], seed["serve"]["graph"]
    return {"benchmark duration (s)": (e["duration_s"], g["duration_s"]),
            "request throughput (req/s)": (e["request_throughput"], g["request_throughput"]),
            "mean TTFT (ms)": (e["mean_ttft_ms"], g["mean_ttft_ms"]),
            "P99 TTFT (ms)": (e["p99_ttft_ms"], g["p99_ttft_ms"])}
