"""Notebook 09's runs: ``torchrun`` on this CPU (two gloo ranks running this tree's glmvit), the two-GPU benchmark,
and the summaries its cells print."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def cpu_env() -> dict[str, str]:
    """The environment of a CPU ``torchrun``: one thread per rank, no GPU, and this tree's glmvit in every rank."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}


def torchrun(*args: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC ARGS`` on this CPU; raises with the end of its stderr when a
    rank fails."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=cpu_env())
    if proc.returncode != 0:
        raise RuntimeError(f"torchrun {' '.join(args)} failed: {proc.stderr[-3000:]}")
    return proc


def last_json_line(proc: subprocess.CompletedProcess[str]) -> Any:
    """The last line of a run's stdout, read as JSON (what rank 0 prints last)."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slowest(times: list[list[float]]) -> float:
    """Per request (or repetition) the slower rank's time, then the median: what a request waits for."""
    return float(np.median(np.max(times, axis=0)))


def check_costs(ranks_out: list[dict[str, Any]]) -> dict[str, Any]:
    """``glmvit.lab.dp_checks``' per-rank results as one summary: median ms per protocol (slowest rank per request),
    the gap, the check's parts timed alone (hash, input check, each int64 exchange) and glmvit's own check timer."""
    med = {p: slowest([r["ms"][p] for r in ranks_out]) for p in ("glmvit", "gather-only")}
    hash_ms, inputs_ms = (slowest([r[k] for r in ranks_out]) for k in ("hash_ms", "inputs_ms"))
    exchanges = [(int(n), slowest([r["exchange_ms"][n] for r in ranks_out])) for n in ranks_out[0]["exchange_ms"]]
    return {"med": med, "gap": med["glmvit"] - med["gather-only"], "hash_ms": hash_ms, "inputs_ms": inputs_ms,
            "exchanges": exchanges, "parts": hash_ms + inputs_ms + sum(t for _, t in exchanges),
            "check_phase": slowest([r["check_phase_ms"] for r in ranks_out]),
            "hash_rate": ranks_out[0]["pixel_bytes"] / (hash_ms * 1e-3), "requests": len(ranks_out[0]["ms"]["glmvit"])}


def two_gpu_run(timeout: float = 600) -> dict[str, Any]:
    """``dp_bench`` over NCCL on two GPUs: two 8-frame clips per request, 50 requests, and the fault drill."""
    out = Path(tempfile.mkdtemp()) / "dp_2gpu.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "glmvit.cli.dp_bench", "--modality", "video", "--items-per-request", "2",
           "--num-requests", "50", "--warmup", "5", "--fault-drill", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"dp_bench on two GPUs failed: {proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def describe_dp_run(name: str, rec: dict[str, Any]) -> str:
    """One line for a ``dp_bench`` result: ranks, devices, mode, workload, mean and P99, the one-GPU comparison."""
    f, s = rec["encoder_forward_ms"], rec.get("single_process_ms")
    devices = sorted({r["device"] for r in rec["provenance"].get("ranks", [])}) or [rec["device"]]
    line = (f"{name}: {rec['world_size']} × {', '.join(devices)} over {rec['backend']}, mode {rec['mode']} "
            f"({rec['runner_mode']}), {rec['config']} {rec['dtype']}, buckets {rec['workload']['bucket_config']}, "
            f"{rec['workload']['items_per_request']} items/request: mean {f['mean_ms']:.2f} ms, "
            f"P99 {f['p99_ms']:.2f} ms")
    if s:
        ratio = rec["speedup_mean"]
        line += f"; one GPU {s['mean_ms']:.2f} ms: " + (f"speed-up {ratio:.2f}×" if ratio >= 1 else
                                                       f"slow-down {1 / ratio:.2f}×")
    return line


def two_gpu_runs(path: Path = REPO / "data" / "notebooks" / "09_dp_2gpu.json") -> dict[str, dict[str, Any]]:
    """The two-GPU ``dp_bench`` runs notebook 09 shows, by name, each with its ``provenance``: ``"measured now"``
    where this machine has two CUDA GPUs or more (:func:`two_gpu_run`; with ``GLMVIT_RECORD=1`` it is saved whole as
    the :class:`~glmvit.records.NotebookResult` at ``path``, its result under ``dp_bench``), and the run recorded at
    ``path`` if any, under its file name. Prints a line per recorded run, or why there is none."""
    import torch

    from ..records import NotebookResult, describe, find, make, to_json

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    runs: dict[str, dict[str, Any]] = {}
    if gpus >= 2:
        runs["measured now"] = now = two_gpu_run()
        if os.environ.get("GLMVIT_RECORD") == "1":
            result = {k: v for k, v in now.items() if k != "provenance"}
            saved = make(NotebookResult, provenance=now["provenance"], name=path.stem, dp_bench=result)
            partial = path.with_suffix(".json.tmp")
            partial.write_text(to_json(saved))
            os.replace(partial, path)  # whole or not at all
    for found, record in find(NotebookResult, (path.parent,), name=path.stem):
        print(describe(record, found))
        runs[found.name] = {**(record.model_extra or {})["dp_bench"], "provenance": record.provenance.model_dump()}
    if not runs:
        print(f"this machine has {gpus} CUDA GPU(s) and no two-GPU run is recorded: the run needs two")
    return runs


def draw_gathered(gathered: Any, world: int, pad_to: int) -> None:
    """Section 3's picture: the gathered buffer as one row of token rows, each coloured by its item index (column
    0 of ``gathered``), padding (-1) grey, a line between ranks' blocks of ``pad_to`` rows."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.6))
    ids = gathered[:, 0].numpy()[None, :]
    ax.imshow(np.ma.masked_equal(ids, -1), cmap="tab10", vmin=0, vmax=9, aspect="auto")
    ax.imshow(np.ma.masked_not_equal(ids, -1), cmap="Greys", vmin=-2, vmax=0, aspect="auto")
    for x, v in enumerate(ids[0]):
        ax.text(x, 0, "·" if v < 0 else str(int(v)), ha="center", va="center", fontsize=8)
    for r in range(1, world):
        ax.axvline(r * pad_to - 0.5, color="black", lw=2)
    ax.set_yticks([])
    ax.set_xticks([r * pad_to + pad_to / 2 - 0.5 for r in range(world)], [f"rank {r}" for r in range(world)])
    ax.set_title("the gathered buffer: item index per token row, · = padding")
    plt.show()
    plt.close(fig)


# ---- notebook 09's CPU helpers: loads, shares and their costs, the record's lines and the figures ----

def patches(item: Any) -> int:
    """An item's load as vLLM counts it: input patches t·h·w of its grid."""
    t, h, w = item.grid
    return int(t * h * w)


def plot_assignments(sizes: list[int], assignments: dict[str, Any]) -> Any:
    """One stacked bar chart per named assignment (``glmvit.parallel.Assignment``): per rank its items' sizes, each
    labelled with the item's index, and the mean load dashed. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(assignments), figsize=(5 * len(assignments), 3.6), sharey=True, squeeze=False)
    colours = plt.cm.tab20(np.linspace(0, 1, 20))
    for ax, (title, a) in zip(axes[0], assignments.items(), strict=True):
        for r, items in enumerate(a.ranks):
            bottom = 0
            for i in items:
                ax.bar(r, sizes[i], bottom=bottom, color=colours[i % 20], edgecolor="black", linewidth=0.5)
                ax.text(r, bottom + sizes[i] / 2, str(i), ha="center", va="center", fontsize=8)
                bottom += sizes[i]
        ax.axhline(sum(sizes) / len(a.ranks), color="grey", ls="--", lw=1, label="mean load")
        ax.set_title(f"{title}: imbalance {a.imbalance:.2f}")
        ax.set_xticks(range(len(a.ranks)), [f"rank {r}" for r in range(len(a.ranks))])
        ax.legend(loc="upper right")
    axes[0, 0].set_ylabel("patches (t·h·w)")
    fig.tight_layout()
    return fig


def mean_imbalance(buckets: dict[Any, float], worlds: tuple[int, ...], counts: tuple[int, ...],
                   requests: int = 300) -> dict[tuple[int, int], tuple[float, float]]:
    """Per (ranks, items per request): the mean imbalance of round-robin and of LPT (``balance_items``) over
    ``requests`` random requests of ``buckets`` (seeded by ranks·100 + items), loads in patches."""
    from ..parallel import balance_items, round_robin_items
    from ..workloads import random_mm_workload

    table = {}
    for world in worlds:
        for n in counts:
            reqs = random_mm_workload(buckets, num_requests=requests, items_per_request=n, seed=world * 100 + n)
            per = [[patches(it) for it in r] for r in reqs]
            table[world, n] = (float(np.mean([round_robin_items(s, world).imbalance for s in per])),
                               float(np.mean([balance_items(s, world).imbalance for s in per])))
    return table


def shares(items: list[Any], world: int, ladder: Any, latency: Any) -> tuple[Any, list[dict[str, Any]]]:
    """A request split over ``world`` ranks by ``balance_items`` (patches), and per rank its share as its runner plans
    it on ``ladder``: items, patches, real tokens, budgets, padding tokens, and the cost model's time in ms (replays
    routed by ``latency``, collectives left out)."""
    from ..costmodel import predict_time
    from ..packing import plan_batches
    from ..parallel import balance_items

    assignment = balance_items([patches(it) for it in items], world)
    out = []
    for r, mine in enumerate(assignment.ranks):
        plan = plan_batches([items[i].spec for i in mine], ladder)
        out.append({"items": list(mine), "patches": assignment.loads[r], "tokens": plan.stats.real_tokens,
                    "budgets": [b.budget for b in plan.batches], "padding": plan.stats.padded_tokens,
                    "ms": predict_time(plan, latency, route=True).total_ms})
    return assignment, out


def plot_shares(ranks: list[dict[str, Any]]) -> Any:
    """Two panels for ``shares``' per-rank rows: the patches LPT balances, and real tokens plus padding to the budget
    a replay costs (predicted ms on top). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    names = [f"rank {r}" for r in range(len(ranks))]
    axes[0].bar(names, [v["patches"] for v in ranks], color="C0")
    axes[0].set_title("what LPT balances: patches")
    axes[1].bar(names, [v["tokens"] for v in ranks], color="C0", label="real tokens")
    axes[1].bar(names, [v["padding"] for v in ranks], bottom=[v["tokens"] for v in ranks], color="lightgrey",
                label="padding to the budget")
    for r, v in enumerate(ranks):
        axes[1].text(r, v["tokens"] + v["padding"], f"{v['ms']:.2f} ms", ha="center", va="bottom")
    axes[1].set_title("what a replay costs: its budget (predicted ms on top)")
    axes[1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def preset_views(requests: list[list[Any]], ladder: Any, latency: Any,
                 worlds: tuple[int, ...] = (1, 2, 4)) -> dict[int, dict[str, float]]:
    """Per rank count, over ``requests``: the summed slowest rank's patches and predicted ms (``shares``), and the
    padding share of the budgets' tokens. Speed-ups are ratios of the one-rank sums to these."""
    views = {}
    for world in worlds:
        worst_patches = worst_ms = real = budget_tokens = 0.0
        for r in requests:
            assignment, ranks = shares(r, world, ladder, latency)
            worst_patches += max(assignment.loads)
            worst_ms += max(v["ms"] for v in ranks)
            real += sum(v["tokens"] for v in ranks)
            budget_tokens += sum(v["tokens"] + v["padding"] for v in ranks)
        views[world] = {"patches": worst_patches, "ms": worst_ms, "padding": 1 - real / budget_tokens}
    return views


def check_cost_lines(costs: dict[str, Any], ranks_out: list[dict[str, Any]]) -> list[str]:
    """``check_costs``' summary and ``glmvit.lab.dp_checks``' outcome as lines: both protocols' medians and the gap,
    the check's parts timed alone, and what each protocol did with a rank out of step."""
    med, gap, r0 = costs["med"], costs["gap"], ranks_out[0]
    return [f"median ms per request over {costs['requests']} requests: glmvit {med['glmvit']:.1f}, gather-only "
            f"{med['gather-only']:.1f}: the checks cost {gap:.1f} ms; glmvit's own check timer "
            f"{costs['check_phase']:.1f} ms",
            f"  parts alone: SHA-256 of {r0['pixel_bytes'] / 2**20:.1f} MiB {costs['hash_ms']:.1f} ms (one thread, "
            f"{costs['hash_rate'] / 1e9:.2f} GB/s), check_inputs {costs['inputs_ms']:.1f} ms, "
            + ", ".join(f"an exchange of {k} int64s {t:.2f} ms" for k, t in costs["exchanges"])
            + f"; together {costs['parts']:.1f} ms of the {gap:.1f}",
            f"rank 1 out of step: gather-only returned wrong items {r0['gather_only_wrong_items']} on rank 0, "
            f"silently; glmvit raised on every rank: {ranks_out[1]['glmvit_raised']}"]


def hash_shares(hash_rate: float, encode_ms: dict[str, float],
                pixel_bytes: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per workload: the one-thread SHA-256 time of its pixel bytes at ``hash_rate`` (bytes/s), its share of the
    encode, the threads that would bring it to ≤ 10 % of the encode, and its 1 MiB pieces (glmvit hashes one piece
    per thread at most)."""
    out = {}
    for name, ms in encode_ms.items():
        hash_ms = pixel_bytes[name] / hash_rate * 1e3
        out[name] = {"mib": pixel_bytes[name] / 2**20, "hash_ms": hash_ms, "encode_ms": ms, "share": hash_ms / ms,
                     "threads": int(np.ceil(hash_ms / (0.1 * ms))), "pieces": -(-pixel_bytes[name] // 2**20)}
    return out
