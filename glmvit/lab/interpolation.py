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


# ---- notebook 02's CPU helpers: the oracle, the Keys kernel, the tolerance, the tables and the records' views ----


def patch_indices(grids: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 ``(h_idx, w_idx, target_h, target_w)`` of every patch of every ``(h, w)`` target, raster order within a
    target, the targets packed one after another."""
    cols: list[list[torch.Tensor]] = [[], [], [], []]
    for h, w in grids:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        for col, values in zip(cols, (hh, ww, torch.full((h, w), h), torch.full((h, w), w)), strict=True):
            col.append(values.flatten())
    h_idx, w_idx, target_h, target_w = (torch.cat(c).int() for c in cols)
    return h_idx, w_idx, target_h, target_w


def grid_sample_oracle(table: torch.Tensor, h_idx: torch.Tensor, w_idx: torch.Tensor, target_h: torch.Tensor,
                       target_w: torch.Tensor, mode: str = "bicubic") -> torch.Tensor:
    """transformers' resampling of a ``(G·G, D)`` table: ``F.grid_sample`` of the ``(1, D, G, G)`` float32 image at
    each patch's centre, ``x = (w + 0.5) / W · 2 − 1`` (and y alike), ``align_corners=False``, border padding.
    Returns ``(N, D)`` float32."""
    import torch.nn.functional as F

    g = int(round(table.shape[0] ** 0.5))
    image = table.float().view(g, g, -1).permute(2, 0, 1)[None]  # (1, D, G, G)
    x = ((w_idx.float() + 0.5) / target_w.float()) * 2 - 1
    y = ((h_idx.float() + 0.5) / target_h.float()) * 2 - 1
    grid = torch.stack([x, y], dim=-1).view(1, -1, 1, 2)  # (1, N, 1, 2) holding (x, y)
    out = F.grid_sample(image, grid, mode=mode, align_corners=False, padding_mode="border")
    return out[0, :, :, 0].T  # (N, D)


def max_diff(label: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    """Print and return the largest absolute difference of two tensors, compared in float32."""
    diff = (got.float() - expected.float()).abs().max().item()
    print(f"{label:<40} max abs diff {diff:.2e}")
    return diff


def keys(u: Any, a: float = -0.75) -> Any:
    """Keys' cubic convolution kernel K(u) with parameter a (PyTorch's bicubic: a = −0.75), on a numpy array."""
    import numpy as np

    u = np.abs(u)
    near = ((a + 2) * u - (a + 3)) * u * u + 1
    far = ((a * u - 5 * a) * u + 8 * a) * u - 4 * a
    return np.where(u <= 1, near, np.where(u < 2, far, 0.0))


def keys_slope(u: Any, a: float = -0.75) -> Any:
    """K'(u), the derivative of :func:`keys`."""
    import numpy as np

    s, u = np.sign(u), np.abs(u)
    near = 3 * (a + 2) * u * u - 2 * (a + 3) * u
    far = 3 * a * u * u - 10 * a * u + 8 * a
    return s * np.where(u <= 1, near, np.where(u < 2, far, 0.0))


def bicubic_tolerance(grid: int, vmax: float, a: float = -0.75) -> dict[str, float]:
    """How far two correct float32 bicubic resamplings of a ``grid``-sided table with entries up to ``vmax`` may differ:
    the coordinate rounded once or twice (one ulp of a value below ``grid``) times max Σ|K'| · max Σ|K| · vmax, per
    axis, plus 16 products summed in another order, 16 ε (max Σ|K|)² vmax. Returns the parts and ``tol``."""
    import numpy as np

    t = np.linspace(0, 1, 10001)
    taps = [t + 1, t, 1 - t, 2 - t]
    spread = float(max(sum(np.abs(keys(u, a)) for u in taps)))  # 1 + the negative lobes
    slope = float(max(sum(np.abs(keys_slope(u, a)) for u in taps)))
    coord_ulp = float(2.0 ** (np.floor(np.log2(grid - 1)) - 23))
    tol = 2 * coord_ulp * slope * spread * vmax + 16 * 2**-23 * spread**2 * vmax
    return {"spread": spread, "slope": slope, "coord_ulp": coord_ulp, "tol": tol}


def sincos_table(g: int, d: int) -> torch.Tensor:
    """The standard 2-D sin-cos position embedding, ``(g·g, d)`` float32: d/2 channels encode the row, d/2 the
    column, as sin and cos at d/4 frequencies ``10000^(−i/(d/4))``."""
    if d % 4:
        raise ValueError(f"d must be a multiple of 4, got {d}")
    y, x = torch.meshgrid(*[torch.arange(g, dtype=torch.float64)] * 2, indexing="ij")
    omega = 1.0 / 10000 ** (torch.arange(d // 4, dtype=torch.float64) / (d // 4))
    angles = [torch.outer(p.flatten(), omega) for p in (y, x)]
    return torch.cat([f(a) for a in angles for f in (torch.sin, torch.cos)], 1).float()


def judge_bilinear(table: torch.Tensor, grids: dict[str, tuple[int, int]]) -> dict[str, dict[str, float]]:
    """Per named ``(h, w)`` grid, against the fp32 bicubic result E (:func:`grid_sample_oracle`): ``noise`` =
    max |bf16(E) − E|, ``vllm`` = max |vLLM's bilinear − E|, ``above`` = the share of entries where vLLM's error
    exceeds that entry's bf16 noise, ``half_pixel`` = max |bilinear at transformers' points − E|."""
    from ..kernels.reference import vllm_bilinear

    judged = {}
    for name, (h, w) in grids.items():
        args = patch_indices([(h, w)])
        exact = grid_sample_oracle(table, *args)
        noise = (exact.bfloat16().float() - exact).abs()
        err = (vllm_bilinear(table, h, w) - exact).abs()
        half = (grid_sample_oracle(table, *args, mode="bilinear") - exact).abs()
        judged[name] = {"noise": noise.max().item(), "vllm": err.max().item(),
                        "above": (err > noise).float().mean().item(), "half_pixel": half.max().item()}
    return judged


def judged_table(judged: dict[str, dict[str, float]], grids: dict[str, tuple[int, int]]) -> str:
    """:func:`judge_bilinear`'s result as a text table, one image per line."""
    lines = [f"{'image (h × w)':<16}{'grid':>9}{'bf16 noise':>12}{'vLLM bilinear':>15}{'× noise':>9}"
             f"{'above noise':>13}{'half-pixel bilinear':>21}"]
    for name, j in judged.items():
        h, w = grids[name]
        lines.append(f"{name:<16}{f'{h} × {w}':>9}{j['noise']:>12.2e}{j['vllm']:>15.2e}{j['vllm'] / j['noise']:>9.0f}"
                     f"{j['above']:>13.0%}{j['half_pixel']:>21.2e}")
    return "\n".join(lines)


def plot_resampled(images: dict[str, torch.Tensor]) -> Any:
    """Channel 0 of each named ``(h, w, D)`` image side by side, widths in proportion. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(images), figsize=(9, 4),
                             gridspec_kw={"width_ratios": [img.shape[1] for img in images.values()]})
    for ax, (title, img) in zip(axes, images.items(), strict=True):
        ax.imshow(img[..., 0].numpy(force=True), cmap="RdBu", vmin=-2.5, vmax=2.5, aspect="auto")
        ax.set_title(title)
        ax.set_xticks([]), ax.set_yticks([])
    return fig


def plot_kernel(kernel: Callable[[Any], Any], title: str) -> Any:
    """``kernel`` on [−2.5, 2.5]. Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    u = np.linspace(-2.5, 2.5, 501)
    fig, ax = plt.subplots(figsize=(6, 2.5))
    ax.plot(u, kernel(u))
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_title(title)
    return fig


def bench_lines(record: Any) -> list[str]:
    """One line per case of a ``bench-interp`` record (``records.InterpRecord``): tokens and median µs per path."""
    lines = []
    for r in record.results:
        t, s = r["median_us"], r["speedup"]
        lines.append(f"{r['case']:<10} {r['tokens']:>6} tokens   triton {t['triton']:7.1f} µs   per-item "
                     f"{t['per_item']:8.1f} µs ({s['per_item']:.0f}×)   hf_batched {t['hf_batched']:7.1f} µs "
                     f"({s['hf_batched']:.0f}×)")
    return lines


def in_graph_lines(in_graph: dict[str, Any], kernels: dict[str, Any]) -> list[str]:
    """Per case and path of :func:`interp_in_graph` and :func:`interp_kernels` (same cases, same order): one call
    alone, in a graph, and the profiled kernels' time and count per call."""
    if [k["case"] for k in kernels["results"]] != [r["case"] for r in in_graph["results"]]:
        raise ValueError("the two records hold different cases")
    lines = []
    for r, k in zip(in_graph["results"], kernels["results"], strict=True):
        for path in ("triton", "transformers"):
            m, p = r[path], k[path]
            lines.append(f"{r['case']:<10} {path:<12} one call {m['single_call_us']:8.1f} µs   in a graph "
                         f"{m['in_graph_us']:8.1f} µs   kernels {p['kernel_us']:8.1f} µs ({p['kernels_per_call']:.0f})")
    return lines


def plot_in_graph(in_graph: dict[str, Any]) -> Any:
    """Bars per case, log scale: one call alone and per call in a graph, for the Triton kernel and transformers (one
    hue per path, dark alone, light in a graph). Returns the figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    cases = [r["case"] for r in in_graph["results"]]
    series = {f"{label}, {where}": [r[path][key] for r in in_graph["results"]]
              for path, label in (("triton", "Triton kernel"), ("transformers", "transformers"))
              for key, where in (("single_call_us", "one call"), ("in_graph_us", "in a graph"))}
    x, width = np.arange(len(cases)), 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(10, 3.4))
    colors = ["tab:blue", "lightsteelblue", "tab:red", "lightsalmon"]
    for i, ((label, values), color) in enumerate(zip(series.items(), colors, strict=True)):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label, color=color)
    prov = in_graph["provenance"]
    ax.set(xticks=x, xticklabels=cases, yscale="log", ylabel="µs per call (median)",
           title=f"position-table interpolation, bf16 576 × 1536 table ({prov['gpu']}, "
                 f"commit {prov['git_commit'][:7]})")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def truncate_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to bf16 by truncation (the low 16 bits dropped), not to nearest."""
    if x.dtype != torch.float32:
        raise ValueError(f"need a float32 tensor, got {x.dtype}")
    return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()


def main(argv: list[str]) -> int:
    mode, calls, replays, cases = argv[0], int(argv[1]), int(argv[2]), json.loads(argv[3])
    result = _time_cases(calls, replays, cases) if mode == "time" else _profile_cases(calls, cases)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
