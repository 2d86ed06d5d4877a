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
