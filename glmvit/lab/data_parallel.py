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
