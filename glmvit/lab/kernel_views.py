"""Notebook 10's reading of the kernel records (``data/bench/kernels.json``, ``tune_h200.json``,
``ncu.json``, ``capture.json``, the fused-GEMM A/Bs in ``data/sweeps/``): each function returns what a cell
plots, prints or asserts, so the cell shows the lesson rather than the formatting."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WARP_SLOTS = 64  # resident warps an H100/H200 SM holds
SM_REGISTERS = 65536  # 32-bit registers per SM


def recorded(path: str | Path, kind: type) -> Any:
    """The record at ``path`` loaded as ``kind``, after printing its one-line ``describe``."""
    from ..records import describe, load

    record: Any = load(path, kind)
    print(describe(record, path))
    return record


def plot_replay_categories(profile: dict[str, Any], variants: list[str], layouts: list[str]) -> Any:
    """One panel per layout: each variant's kernels of one profiled ``runner.replay`` (staging copies included)
    stacked by category (ms), its median replay wall time as a black tick. Categories are ordered by the first
    variant's time on the last layout."""
    import matplotlib.pyplot as plt
    import numpy as np

    categories = sorted({c for v in variants for lay in layouts for c in profile[v][lay]["by_category_us"]},
                        key=lambda c: -profile[variants[0]][layouts[-1]]["by_category_us"].get(c, 0))
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4), squeeze=False)
    for ax, lay in zip(axes[0], layouts, strict=True):
        bottom = np.zeros(len(variants))
        for cat in categories:
            us = np.array([profile[v][lay]["by_category_us"].get(cat, 0.0) for v in variants])
            ax.bar(variants, us / 1e3, bottom=bottom, label=cat)
            bottom += us / 1e3
        ax.plot(variants, [profile[v][lay]["replay_wall"]["median_ms"] for v in variants], "k_", markersize=30,
                mew=2, label="replay wall time (median)")
        ax.set_title(f"{lay}: kernels of one runner.replay by category")
        ax.set_ylabel("ms")
        ax.tick_params(axis="x", rotation=15)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def replay_rows(profile: dict[str, Any], variants: list[str], layouts: list[str]) -> dict[tuple[str, str], Any]:
    """Per (variant, layout): ``kernels``, ``busy_us`` (the graph's kernel sum), ``gap_us`` (device − busy),
    ``idle_us`` (the profiled replays' time with no kernel running, the launch gap between two replays included: an
    upper bound on the boundaries inside the graph), ``device_us`` and ``wall_us`` (medians) and ``by_category_us``,
    read from a kernel profile."""
    return {(v, lay): {"kernels": p["kernels_per_call"], "busy_us": p["graph_gpu_us_per_call"],
                       "gap_us": p["gaps_us_per_call"], "idle_us": p["graph_idle_us_per_call"],
                       "device_us": p["replay_device"]["median_ms"] * 1e3,
                       "wall_us": p["replay_wall"]["median_ms"] * 1e3, "gpu_us": p["gpu_us_per_call"],
                       "by_category_us": p["by_category_us"]}
            for v in variants for lay in layouts for p in [profile[v][lay]]}


def kernel_delta(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kernel name of two profiles of one layout (``profile[variant][layout]``: their ``top`` lists, each kernel's
    µs and launches per call), what changed: ``name``, ``category``, ``before_us``, ``after_us`` (0 where the
    profile has no such kernel), ``delta_us`` (after − before) and the launches per call of each, largest
    ``|delta_us|`` first. Kernels below either profile's ``top`` cut are not seen: the category sums
    (``by_category_us``) are the whole replay."""
    rows: dict[str, dict[str, Any]] = {}
    for side, profile in (("before", before), ("after", after)):
        for t in profile["top"]:
            row = rows.setdefault(t["name"], {"name": t["name"], "category": t["category"], "before_us": 0.0,
                                              "after_us": 0.0, "before_launches": 0.0, "after_launches": 0.0})
            row[f"{side}_us"] += t["us_per_call"]
            row[f"{side}_launches"] += t["launches_per_call"]
    for row in rows.values():
        row["delta_us"] = row["after_us"] - row["before_us"]
    return sorted(rows.values(), key=lambda r: -abs(r["delta_us"]))


def plot_kernel_delta(rows: list[dict[str, Any]], before: str, after: str, top: int = 10) -> Any:
    """Horizontal bars of :func:`kernel_delta`'s ``top`` rows: each kernel's time per replay before and after, in ms
    (labelled ``before`` and ``after``), the largest change first, its launches per replay in the label."""
    import matplotlib.pyplot as plt
    import numpy as np

    shown = rows[:top][::-1]
    y = np.arange(len(shown))
    fig, ax = plt.subplots(figsize=(11, 0.42 * len(shown) + 1.2))
    ax.barh(y + 0.2, [r["before_us"] / 1e3 for r in shown], 0.4, label=before)
    ax.barh(y - 0.2, [r["after_us"] / 1e3 for r in shown], 0.4, label=after)
    ax.set_yticks(y, [f"{r['name'][:44]} ({r['before_launches']:.0f}→{r['after_launches']:.0f}×)" for r in shown],
                  fontsize=8)
    ax.set_xlabel("ms per replay")
    ax.set_title(f"the {len(shown)} kernels whose time changed most, {before} → {after}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_rooflines(gemm: dict[str, list[dict[str, Any]]], layouts: list[str]) -> Any:
    """Grouped bars of each matmul's ``roofline_fraction`` (roofline / measured) per layout."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(11, 3.8))
    width = 0.2
    for i, lay in enumerate(layouts):
        ax.bar(np.arange(len(gemm[lay])) + i * width, [r["roofline_fraction"] for r in gemm[lay]], width, label=lay)
    ax.set_xticks(np.arange(len(gemm[layouts[0]])) + 1.5 * width, [r["name"] for r in gemm[layouts[0]]], rotation=20)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_ylabel("roofline / measured (1 = at the roofline)")
    ax.set_title("Each matmul of the forward, cuBLAS, alone in a graph (gate_up: what the fused GEMM replaced)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def split_k_ratios(tune: Any) -> tuple[dict[tuple[int, int, int], float], int]:
    """``({(M, K, N): best split-K µs / cuBLAS µs}, shapes where the best TMA-load configuration beats the best
    pointer-load one)`` from a :class:`~glmvit.records.TuneSweep`; a configuration key ending in ``t`` loads by TMA."""
    def best(row: dict[str, Any], tma: bool) -> float:
        return min(v["us"] for key, v in row["configs"].items() if isinstance(v, dict) and key.endswith("t") == tma)

    ratios = {(r["m"], r["k"], r["n"]): r["best_us"] / r["cublas_us"] for r in tune.gemm}
    return ratios, sum(best(r, True) < best(r, False) for r in tune.gemm)


def misaligned_views(budgets: tuple[int, ...], max_segments: int) -> list[tuple[int, int, str]]:
    """``(budget, segments, view)`` for every metadata view that does not start on a 16-byte boundary of its packed
    buffer, over every budget and 1 … ``max_segments`` segment slots (empty: inductor copies none)."""
    from ..metadata import BatchShape, build_metadata

    names = ("cu_seqlens", "h_idx", "w_idx", "target_h", "target_w", "segment_ids", "token_valid")
    bad = []
    for budget in budgets:
        for segments in range(1, max_segments + 1):
            meta = build_metadata([[1, 2, 2]], 2, BatchShape(4 * budget, segments, 4 * budget)).to("cpu")
            base = meta.packed.data_ptr()
            bad += [(budget, segments, n) for n in names if (getattr(meta, n).data_ptr() - base) % 16]
    return bad


def region_costs(profile: dict[str, Any], model_variant: str, layouts: list[str], depth: int) -> dict[str, Any]:
    """Per layout, regional against whole-model compilation (``model_variant`` ends in ``-model``): ``kernels``
    (regions, whole), ``extra_per_block``, ``copy_us`` (regions, whole), ``device_ms`` (regions, whole),
    ``per_block_copies``: the regional replay's top Memcpy entries launched at least once per block, and
    ``shortest_copy_us``: the shortest mean launch among either replay's top copy entries (Memcpy, Memset);
    ValueError where neither lists one."""
    out = {}
    for lay in layouts:
        regions, whole = profile[model_variant.removesuffix("-model")][lay], profile[model_variant][lay]
        out[lay] = {
            "kernels": (regions["kernels_per_call"], whole["kernels_per_call"]),
            "extra_per_block": (regions["kernels_per_call"] - whole["kernels_per_call"]) / depth,
            "copy_us": tuple(p["by_category_us"].get("copy", 0.0) for p in (regions, whole)),
            "device_ms": tuple(p["replay_device"]["median_ms"] for p in (regions, whole)),
            "per_block_copies": [t for t in regions["top"]
                                 if t["name"].startswith("Memcpy") and t["launches_per_call"] >= depth],
            "shortest_copy_us": min(t["us_per_call"] / t["launches_per_call"] for p in (regions, whole)
                                    for t in p["top"] if t["category"] == "copy" and t["launches_per_call"])}
    return out


def plot_startup(starts: dict[str, float]) -> Any:
    """Horizontal bars of seconds to compile + capture per start-up run (warm runs in a second colour)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.4))
    ax.barh(list(starts), list(starts.values()), color=["C1" if "warm" in k else "C0" for k in starts])
    ax.set_xlabel("seconds to compile + capture six budgets (recorded)")
    fig.tight_layout()
    return fig


def target_verdicts(bench_dir: str | Path, targets: dict[str, tuple[str, float]],
                    p99_within: float) -> dict[str, dict[str, Any]]:
    """Per workload ``name`` of ``targets`` (``(kind, goal)``: ``median_ms`` at most goal, or ``rate`` of the
    matmul rate at least goal), its ``{name}.json`` graph-compiled run: ``median_ms``, ``tail`` (P99 / median),
    ``x_floor``, ``rate``, ``met`` (the target), ``steady`` (tail at most ``p99_within``) and ``commit`` (the
    record's, short). Every request of
    these workloads is the same, so request 0's FLOPs and floor stand for all."""
    from ..records import BenchRecord, load

    out = {}
    for name, (kind, goal) in targets.items():
        run: Any = load(Path(bench_dir) / f"{name}.json", BenchRecord)
        mode = run.modes["graph-compiled"]
        rate = run.flops["per_request"][0] / (mode.median_ms * 1e-3) / 1e12 / run.floor["matmul_tflops"]
        tail = mode.p99_ms / mode.median_ms
        out[name] = {"median_ms": mode.median_ms, "tail": tail, "rate": rate,
                     "x_floor": mode.median_ms / run.floor["per_request_ms"][0],
                     "met": mode.median_ms <= goal if kind == "median_ms" else rate >= goal,
                     "steady": tail <= p99_within, "commit": run.provenance.short_commit}
    return out


GPU_KINDS = ("h100", "h200")  # the GPUs data/sweeps/ holds files for, as their names spell them


def gpu_kind(gpu: str) -> str:
    """The short name a sweep file of ``data/sweeps/`` carries (``h100``, ``h200``: ``skeleton_bound_h100.json``)
    for the GPU a record names (``provenance.gpu``, e.g. ``NVIDIA H100 80GB HBM3``). ValueError, naming it, for a GPU
    no sweep was recorded on."""
    for kind in GPU_KINDS:
        if kind.upper() in gpu:
            return kind
    raise ValueError(f"no sweeps are recorded for {gpu!r}: only for {', '.join(k.upper() for k in GPU_KINDS)}")


def skeleton_verdicts(path: str | Path, targets: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per workload of a skeleton bound (``tools/skeleton_bound.py``'s JSON) named in ``targets`` (ms): the model's
    and the skeleton's medians in both regimes (``model_burst``, ``skeleton_burst``, ``model_sustained``,
    ``skeleton_sustained``, ms), the SM clocks of the sustained runs, ``left_ms`` (target − skeleton from idle: what
    every op outside the matmuls and the attention may cost at most), ``reachable`` (the skeleton from idle is under
    the target: no forward of these kernels can meet it otherwise) and ``reachable_held`` (the same back to back,
    at the clock a long run holds), and ``attention`` (the kernel that won). Where the bound also timed the records'
    own regime (``run``: back to back as many times as the workload's record times it), ``model_run``,
    ``skeleton_run``, ``mhz_run`` (model's, skeleton's) and ``reachable_run`` (the verdict in the regime the records'
    medians come from); else those four are None."""
    workloads = json.loads(Path(path).read_text())["workloads"]
    out = {}
    for name, target in targets.items():
        w = workloads[name]
        burst, held, run = w["burst"], w["sustained"], w.get("run")
        out[name] = {"target": target, "model_burst": burst["model"]["ms"], "skeleton_burst": burst["skeleton"]["ms"],
                     "model_sustained": held["model"]["ms"], "skeleton_sustained": held["skeleton"]["ms"],
                     "mhz_sustained": (held["model"]["sm_mhz"], held["skeleton"]["sm_mhz"]),
                     "left_ms": target - burst["skeleton"]["ms"], "reachable": burst["skeleton"]["ms"] < target,
                     "reachable_held": held["skeleton"]["ms"] < target, "attention": w["chosen"]["attention"]["kernel"],
                     "model_run": run["model"]["ms"] if run else None,
                     "skeleton_run": run["skeleton"]["ms"] if run else None,
                     "mhz_run": (run["model"]["sm_mhz"], run["skeleton"]["sm_mhz"]) if run else None,
                     "reachable_run": run["skeleton"]["ms"] < target if run else None}
    return out


def describe_sweep(path: str | Path) -> str:
    """One line for a sweep JSON of ``data/sweeps/`` (its own format, not a record kind): its file name, GPU,
    commit (short) and date, from its ``provenance``."""
    p = json.loads(Path(path).read_text())["provenance"]
    return f"{Path(path).name}: sweep ({p['gpu']}, commit {p['git_commit'][:7]}, {p['date_utc']})"


def fused_ab(path: str | Path) -> list[dict[str, Any]]:
    """Per row count of a fused-GEMM A/B (``tools/swiglu_ab.py``, ``qkv_rope_ab.py``): ``rows``, ``unfused`` (the
    faster of cuBLAS + the epilogue's kernels, eager or compiled), ``fused`` and ``best`` (the fastest correct
    ``triton@…`` configuration) and ``gate_up_us`` (the gate_up matmul alone, where the A/B timed it)."""
    ab = json.loads(Path(path).read_text())
    rows = []
    for r in ab["results"]:
        p = r["paths"]
        fused = {k: v["us"] for k, v in p.items() if k.startswith("triton@") and v["ok"]}
        best = min(fused, key=lambda k: fused[k])
        rows.append({"rows": r["rows"], "unfused": min(p["torch"]["us"], p["compiled"]["us"]), "fused": fused[best],
                     "best": best, "gate_up_us": p.get("gate_up_only", {}).get("us"), "gpu": ab["provenance"]["gpu"]})
    return rows


def ncu_lines(layouts: dict[str, Any], top: int = 5) -> list[str]:
    """Per layout of an :class:`~glmvit.records.NcuProfile`: its kernels' time by limiter, then its ``top`` kernel
    groups with share, limiter, grid, warps per SM, DRAM and tensor-pipe use and the two leading stalls."""
    lines = []
    for name, entry in layouts.items():
        shares = sorted(((v / entry["gpu_us"], k) for k, v in entry["by_limiter_us"].items()), reverse=True)
        lines.append(f"{name}: {entry['kernels']} kernels; their time by limiter: "
                     + ", ".join(f"{k} {share:.0%}" for share, k in shares if share >= 0.01))
        for g in entry["groups"][:top]:
            lines.append(f"  {g['name'][:40]:<41}{g['us'] / entry['gpu_us']:>4.0%} {g['limiter']:>11}  "
                         f"{g['grid']:5.0f} blocks, {g['occupancy_pct'] / 100 * WARP_SLOTS:4.1f} warps/SM, DRAM "
                         f"{g['dram_pct']:3.0f} %, tensor {g['tensor_pct']:3.0f} %, waits on "
                         f"{', '.join(list(g['stalls'])[:2])}")
    return lines


def blocks_by_registers(registers_per_thread: float, threads_per_block: float) -> int:
    """How many blocks of ``threads_per_block`` threads an SM's register file holds at ``registers_per_thread``."""
    return SM_REGISTERS // (int(registers_per_thread) * int(threads_per_block))


def small_tower(device: str, dtype: Any, depth: int = 6) -> tuple[Any, Any, Any, Any]:
    """``(tower, metadata, cos, sin)``: a ``depth``-block encoder (hidden 64, 4 heads, ``sdpa_masked``) in eval mode
    on ``device`` in ``dtype``, with the metadata and rotary tables of one 4 × 4 image, for compiling on a CPU."""
    from .. import GlmVisionEncoder, VisionConfig
    from ..metadata import build_metadata
    from ..rotary import rotary_cos_sin

    config = VisionConfig(depth=depth, hidden_size=64, num_heads=4, image_size=112, out_hidden_size=64,
                          intermediate_size=128)
    tower = GlmVisionEncoder(config, attn_backend="sdpa_masked").eval().to(device, dtype)
    meta = build_metadata([[1, 4, 4]], 2).to(device)
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, tower.rotary_pos_emb.inv_freq)
    return tower, meta, cos, sin


def compiled_code(fn: Any, *args: Any) -> tuple[Any, str]:
    """``(output, generated code)`` of ``torch.compile(fn, fullgraph=True)(*args)``, after resetting dynamo so
    nothing is reused from an earlier compile."""
    import torch
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    out, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return out, "\n".join(code)
