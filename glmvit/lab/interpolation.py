"""Notebook 02's GPU measurements: the position-table interpolation (glmvit's Triton kernel and transformers'
``Glm4vVisionEmbeddings``, bf16 576 × 1536 table) issued alone and inside a CUDA graph, and the kernels of one
replay under the profiler. Each runs in a fresh Python process without ``TRITON_INTERPRET`` (the notebook imports
the kernel interpreted): ``python -m glmvit.lab.interpolation time|kernels CALLS REPLAYS CASES_JSON``."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

CASES = {"1 x 224²": [[1, 16, 16]], "4 x 224²": [[1, 16, 16]] * 4, "16 x 224²": [[1, 16, 16]] * 16,
         "1 x 1024²": [[1, 74, 74]]}
ROOT = Path(__file__).resolve().parents[2]


def _interpreted() -> bool:
    """Whether this process runs Triton interpreted (a notebook's set-up): then the measurement needs a process of
    its own; a record run measures here."""
    return "TRITON_INTERPRET" in os.environ


def _in_fresh_process(mode: str, calls_per_graph: int, replays: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "glmvit.lab.interpolation", mode, str(calls_per_graph), str(replays),
            json.dumps(CASES)]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interp_in_graph(calls_per_graph: int = 100, replays: int = 5) -> dict[str, Any]:
    """Per case and path: one call issued alone (median of event-bracketed calls) and one call inside a graph of
    ``calls_per_graph`` calls (replays timed with CUDA events), and the two paths' max difference. No profiler."""
    if not _interpreted():
        return _time_cases(calls_per_graph, replays, CASES)
    return _in_fresh_process("time", calls_per_graph, replays)


def interp_kernels(calls_per_graph: int = 100) -> dict[str, Any]:
    """Per case and path: the kernels' own time and count per call in one replay of the graph of
    :func:`interp_in_graph`, under torch.profiler (in a process of its own)."""
    if not _interpreted():
        return _profile_cases(calls_per_graph, CASES)
    return _in_fresh_process("kernels", calls_per_graph, 0)


def _paths(grids: list[list[int]]) -> dict[str, Callable[[], torch.Tensor]]:
    """The two interpolation paths on the GPU for one case, the same bf16 table in both."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionEmbeddings

    from ..config import VisionConfig
    from ..kernels import interpolate_pos_embed, uses_triton
    from ..metadata import build_metadata

    dev = torch.device("cuda")
    table = torch.randn(576, 1536, generator=torch.Generator().manual_seed(0)).to(dev, torch.bfloat16)
    if not uses_triton(table):
        raise RuntimeError("the Triton kernel is not used (TRITON_INTERPRET is set, or Triton is missing)")
    hf = Glm4vVisionEmbeddings(Glm4vVisionConfig(**VisionConfig.glm41v().to_hf_dict())).to(dev, torch.bfloat16)
    hf.requires_grad_(False)
    hf.position_embedding.weight.copy_(table)
    meta = build_metadata(grids).to(dev)
    h_long, w_long = meta.h_idx.long(), meta.w_idx.long()
    lengths = torch.tensor([t * h * w for t, h, w in grids], device=dev)
    shapes = torch.tensor(grids, device=dev)
    zeros = torch.zeros(h_long.shape[0], table.shape[1], device=dev, dtype=table.dtype)
    return {"triton": lambda: interpolate_pos_embed(table, meta.h_idx, meta.w_idx, meta.target_h, meta.target_w,
                                                    check_values=False),
            "transformers": lambda: hf(zeros, lengths, shapes, h_long, w_long)}


def _event_ms(fn: Callable[[], Any], calls: int) -> float:
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def _graph_of(fn: Callable[[], Any], calls: int) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of fn captured into one graph (after a warm-up on a side stream), replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()  # compile and initialise lazily: never inside a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def _time_cases(calls: int, replays: int, cases: dict[str, list[list[int]]]) -> dict[str, Any]:
    results = []
    with torch.no_grad():
        for case, grids in cases.items():
            paths = _paths(grids)
            ours, theirs = paths["triton"]().float(), paths["transformers"]().float()
            row: dict[str, Any] = {"case": case, "grids": grids, "tokens": int(ours.shape[0]),
                                   "max_abs_diff": (ours - theirs).abs().max().item(),
                                   "max_abs": theirs.abs().max().item()}
            for path, fn in paths.items():
                for _ in range(25):
                    fn()
                single_us = 1000 * _event_ms(fn, 200)
                replay_ms = _event_ms(_graph_of(fn, calls).replay, replays)
                row[path] = {"single_call_us": single_us, "in_graph_us": 1000 * replay_ms / calls}
            results.append(row)
    return {"calls_per_graph": calls, "replays": replays, "results": results}


def _profile_cases(calls: int, cases: dict[str, list[list[int]]]) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    results = []
    with torch.no_grad():
        for case, grids in cases.items():
            row: dict[str, Any] = {"case": case}
            for path, fn in _paths(grids).items():
                graph = _graph_of(fn, calls)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graph.replay()
                    torch.cuda.synchronize()
                kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
                row[path] = {"kernel_us": sum(e.time_range.elapsed_us() for e in kernels) / calls,
                             "kernels_per_call": len(kernels) / calls}
            results.append(row)
    return {"calls_per_graph": calls, "results": results}


def main(argv: list[str]) -> int:
    mode, calls, replays, cases = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3])
    result = _time_cases(calls, replays, cases) if mode == "time" else _profile_cases(calls, cases)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
