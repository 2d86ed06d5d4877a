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
    each batch routed by the mode's latency table (``tables[mode]``) when the benchmark routed, at the budget of the
    graph it would replay in (a uniform graph's where the mode captured one: ``UniformGraphs.route``)."""
    from .budget_views import UniformGraphs

    s = record.settings
    config = BudgetConfig(tuple(record.modes[mode].budgets), s.max_items, s.max_segments)
    router = Router(tables[mode] if s.route and mode in s.tables else None)
    uniform = UniformGraphs.of(record.modes[mode])
    out = []
    for grids in record.workload["grids"][: record.modes[mode].requests]:
        items = [item_spec(*g) for g in grids]
        plan = plan_batches(items, config)
        out.append([(b, uniform.route(router, b, [items[i] for i in b.item_indices]).replay) for b in plan.batches])
    return out


# The notebook's reading of the records, as small functions: each returns what a cell prints, plots or asserts.

SEED_CONFIG = {"budgets": [128, 256, 512, 1024, 1536, 2048], "max_items": 4, "max_segments": 32}  # PR 40576's
ORDER = ["transformers", "eager", "graph", "graph-compiled"]  # the modes of every run
MODES = [*ORDER, "transformers-compiled"]  # every mode a run may record
SHORT = dict(zip(MODES, ["hf", "eager", "graph", "g+comp", "hf+comp"], strict=True))
GRAPH_MODES = ("graph", "graph-compiled")


def is_seed_config(record: Any) -> bool:
    """Whether a benchmark record ran vLLM PR 40576's budgets, item limit and frame limit (:data:`SEED_CONFIG`)."""
    return {k: getattr(record.settings, k) for k in SEED_CONFIG} == SEED_CONFIG


def workload_name(record: Any) -> str:
    """The record's preset name, or ``"N× HxWxF"`` for a bucket config given on the command line."""
    s = record.settings
    return s.workload or f"{s.items_per_request}× {next(iter(s.bucket_config))}"


def load_benches(bench_dir: Any) -> tuple[list[Any], dict[Any, Any], list[str]]:
    """``(runs, seed_runs, lines)`` from every :class:`BenchRecord` in ``bench_dir`` (sorted by file name): the runs
    in glmvit's own configuration, the runs in the seed's keyed by workload, and one ``describe`` line per record."""
    from pathlib import Path

    from ..records import BenchRecord, describe, load_any

    benches = {p: r for p in sorted(Path(bench_dir).glob("*.json")) if isinstance(r := load_any(p), BenchRecord)}
    runs = [r for r in benches.values() if not is_seed_config(r)]
    seed_runs = {r.settings.workload: r for r in benches.values() if is_seed_config(r)}
    return runs, seed_runs, [describe(r, p) for p, r in benches.items()]


def first_pass(mode: Any) -> Any:
    """A mode's first pass as a numpy array: one time per request, in arrival order (what per-request ratios use)."""
    import numpy as np

    return np.array(mode.ms[: mode.requests])


def gain(before: float, after: float) -> float:
    """How many times faster ``after`` is than ``before``."""
    return before / after


def seed_pr_lines(rows_1gpu: dict[str, Any], rows_dp2: dict[str, Any], serve: dict[str, Any]) -> list[str]:
    """The PR's published eager → graph table (:func:`glmvit.lab.seed.seed_rows` for one and two GPUs, and
    :func:`~glmvit.lab.seed.seed_serve`), one line per workload and GPU count, then the serve line."""
    lines = []
    for gpus, table in (("1 GPU", rows_1gpu), ("2 GPUs, DP", rows_dp2)):
        for wl, pr in table.items():
            (e, g), (e99, g99) = pr["mean"], pr["p99"]
            lines.append(f"{wl:<11}{gpus:<11}{pr['model']:<22} mean {e:5.2f} → {g:5.2f} ms ({1 - g / e:+.2%}), "
                         f"P99 {e99:5.2f} → {g99:5.2f} ms ({1 - g99 / e99:+.2%})")
    lines.append("serve: " + "; ".join(f"{k} {a:,.2f} → {b:,.2f} ({b / a - 1:+.1%})" for k, (a, b) in serve.items()))
    return lines


def plot_latency(runs: list[Any]) -> Any:
    """One log-scale box plot per run of every recorded mode's per-request times; returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.4), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        modes = [m for m in MODES if m in r.modes]
        ax.boxplot([r.modes[m].ms for m in modes], showfliers=True, flierprops={"markersize": 2})
        ax.set_xticks(range(1, len(modes) + 1), [SHORT[m] for m in modes], fontsize=7)
        ax.set_yscale("log")
        ax.set_title(workload_name(r), fontsize=9)
    axes[0][0].set_ylabel("encoder_forward_ms per request")
    fig.tight_layout()
    return fig


def latency_lines(runs: list[Any]) -> list[str]:
    """A header and one line per run and mode: requests, timings, mean, median, its ±95 % half-width relative to
    the median, P99 and P99 / median."""
    lines = [f"{'workload':<16}{'mode':<23}{'requests':>9}{'timed':>6}{'mean':>9}{'median':>9}{'±95%':>7}{'P99':>9}"
             f"{'P99/median':>12}"]
    for r in runs:
        for m, d in r.modes.items():
            lo, hi = d.model_extra["median_ci95_ms"]
            lines.append(f"{workload_name(r):<16}{m:<23}{d.requests:>9}{len(d.ms):>6}{d.mean_ms:>9.2f}"
                         f"{d.median_ms:>9.2f}{(hi - lo) / 2 / d.median_ms:>7.1%}{d.p99_ms:>9.2f}"
                         f"{d.p99_ms / d.median_ms:>12.2f}")
    return lines


def plot_ratios(runs: list[Any], pairs: list[tuple[str, str]]) -> Any:
    """Grouped bars of ``r.ratios[a][b]`` (median of a over median of b) per run, for each pair; returns the
    figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(10, 3.4))
    xs = np.arange(len(runs))
    for k, (a, b) in enumerate(pairs):
        ax.bar(xs + 0.2 * k - 0.3, [r.ratios[a][b] for r in runs], width=0.2, label=f"{a} / {b}")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xticks(xs, [workload_name(r) for r in runs], fontsize=8)
    ax.set_ylabel("ratio of median latencies")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def request0_fills_one_budget(record: Any, mode: str = "graph") -> bool:
    """Whether request 0 runs in ``mode`` as one batch whose budget it fills exactly: the GEMM shapes of eager."""
    config = BudgetConfig(tuple(record.modes[mode].budgets), record.settings.max_items, record.settings.max_segments)
    batches = plan_batches([item_spec(*g) for g in record.workload["grids"][0]], config).batches
    return len(batches) == 1 and batches[0].budget == batches[0].tokens


def request0_in_uniform_graph(record: Any, mode: str = "graph") -> bool:
    """Whether a batch of request 0 replays in ``mode`` in a uniform graph (the dense attention kernel, not eager's
    ragged one): its frames share the one h·w a uniform graph of its budget was captured for
    (:class:`glmvit.lab.budget_views.UniformGraphs`, read from the record)."""
    from .budget_views import UniformGraphs

    config = BudgetConfig(tuple(record.modes[mode].budgets), record.settings.max_items, record.settings.max_segments)
    items = [item_spec(*g) for g in record.workload["grids"][0]]
    uniform = UniformGraphs.of(record.modes[mode])
    return any(b.budget is not None and uniform.graph_budget(b.budget, [items[i] for i in b.item_indices]) is not None
               for b in plan_batches(items, config).batches)


def compile_savings(kernels: Any, backend: str) -> dict[str, dict[str, Any]]:
    """Per layout of a :class:`KernelsProfile`, the plain and compiled replay of the kernel ``backend`` runs at the
    layout's rows: ``kernel``, ``kernels`` (plain, compiled), ``gpu_us`` (plain, compiled), ``gemm_us`` (plain,
    compiled) and ``rest_us`` (plain, compiled: every category but GEMM and attention). ``auto``'s kernel is the
    one the record says auto runs on its machine (``KernelsProfile.auto``); a record without that answer predates
    FlashAttention-4 in ``auto``, so its rule without it (``attention_for(rows, fa4=False)``), not this machine's."""
    from ..attention import resolve
    from ..kernels.attention_table import attention_for

    out = {}
    for layout, grids in kernels.layouts.items():
        rows = sum(t * h * w for t, h, w in grids)
        if backend != "auto":
            kern = resolve(backend, rows)
        else:  # where this machine loads FlashAttention-4, its own choice could name a kernel the record never ran
            kern = kernels.auto.get(layout) or attention_for(rows, fa4=False)
        p, c = kernels.profile[kern][layout], kernels.profile[f"{kern}-compiled"][layout]
        out[layout] = {
            "kernel": kern, "kernels": (p["kernels_per_call"], c["kernels_per_call"]),
            "gpu_us": (p["gpu_us_per_call"], c["gpu_us_per_call"]),
            "gemm_us": tuple(q["by_category_us"].get("gemm", 0.0) for q in (p, c)),
            "rest_us": tuple(sum(us for cat, us in q["by_category_us"].items() if cat not in ("gemm", "attention"))
                             for q in (p, c))}
    return out


def kernels_by_kind(kernels: list[tuple[str, float]]) -> dict[str, tuple[int, float]]:
    """``{category: (launches, total µs)}`` of profiled ``(name, µs)`` kernels, by
    :func:`glmvit.profiling.categorise`."""
    from ..profiling import categorise

    out: dict[str, tuple[int, float]] = {}
    for name, dur in kernels:
        n, t = out.get(categorise(name), (0, 0.0))
        out[categorise(name)] = (n + 1, t + dur)
    return out


def plot_kinds(by_label: dict[str, dict[str, tuple[int, float]]]) -> Any:
    """One stacked horizontal bar per label of kernel time (ms) by category (:func:`kernels_by_kind`)."""
    import matplotlib.pyplot as plt

    kinds = sorted({k for per in by_label.values() for k in per})
    fig, ax = plt.subplots(figsize=(7, 2.6))
    for row, per in enumerate(by_label.values()):
        left = 0.0
        for i, kind in enumerate(kinds):
            width = per.get(kind, (0, 0.0))[1] / 1e3
            ax.barh(row, width, left=left, color=f"C{i}", label=kind if row == 0 else None)
            left += width
    ax.set_yticks(range(len(by_label)), list(by_label))
    ax.set_xlabel("kernel time in one replay (ms)")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_sweeps(sweeps: dict[str, Any]) -> tuple[Any, dict[str, dict[int, float]]]:
    """Left: the uncompiled sweep's graph (○) and eager (×) medians per budget and layout; right: one 224² image's
    replay over eager per budget, for each mode, against one eager reference (the mean of the sweeps' eager
    times). Returns ``(figure, {mode: {budget: replay / eager}})``."""
    import matplotlib.pyplot as plt
    import numpy as np

    by_budget = {b.tokens: {x.name: x for x in b.layouts} for b in sweeps["graph"].budgets}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    for i, layout in enumerate(["full", "full-many", "half", "one-small"]):
        xs = [b for b in sorted(by_budget) if layout in by_budget[b]]
        ax1.plot(xs, [by_budget[b][layout].graph_ms for b in xs], "o-", color=f"C{i}", label=f"graph, {layout}")
        ax1.plot(xs, [by_budget[b][layout].eager_ms for b in xs], "x--", color=f"C{i}", alpha=0.6)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("budget (tokens)")
    ax1.set_ylabel("median ms (○ graph, × eager)")
    ax1.legend(fontsize=7)
    one_small = {m: {b.tokens: x for b in sw.budgets for x in b.layouts if x.name == "one-small"}
                 for m, sw in sweeps.items()}
    eager_ref = {b: float(np.mean([one_small[m][b].eager_ms for m in sweeps])) for b in one_small["graph"]}
    small = {m: {b: x.graph_ms / eager_ref[b] for b, x in per.items()} for m, per in one_small.items()}
    for m in sweeps:
        ax2.plot(list(small[m]), list(small[m].values()), "o-", label=m)
    ax2.axhline(1, color="gray", lw=0.8)
    ax2.set_xscale("log", base=2)
    ax2.legend(fontsize=8)
    ax2.set_xlabel("budget (tokens)")
    ax2.set_ylabel("replay / eager, one 224² image")
    fig.tight_layout()
    return fig, small


def mixed_lines(record: Any) -> list[str]:
    """The mixed workload's summary: its size, a table of each mode's times and per-request share slower than
    eager, and each graph mode's replays, eager batches and padding."""
    s, w = record.settings, record.workload
    lines = [f"{w['requests']} requests, {w['items']} items, {w['tokens']:,} tokens; max_items {s.max_items}, "
             f"max_segments {s.max_segments}; routing {'on' if s.route and s.tables else 'off'}",
             f"{'mode':<16}{'requests':>9}{'mean':>9}{'median':>9}{'P99':>9}{'slower than eager':>19}"
             f"{'worst / eager':>15}"]
    for m in ORDER:
        d = record.modes[m]
        v = d.vs_eager_per_request
        lines.append(f"{m:<16}{d.requests:>9}{d.mean_ms:>9.2f}{d.median_ms:>9.2f}{d.p99_ms:>9.2f}"
                     f"{v['share_slower']:>18.1%}{v['worst_ratio']:>15.2f}")
    for m in GRAPH_MODES:
        st = record.modes[m].runner
        lines.append(f"{m}: budgets {record.modes[m].budgets}; {st['replays']} replays, {st['eager_batches']} eager "
                     f"batches ({st['routed_eager']} routed there by the table), padding "
                     f"{st['padding_fraction']:.1%} of the replayed budget tokens")
    return lines


def request_tokens(record: Any) -> Any:
    """Each request's output tokens (numpy array), from the record's workload grids."""
    import numpy as np

    return np.array([sum(item_spec(*g).tokens for g in grids) for grids in record.workload["grids"]])


def plot_per_request(record: Any) -> tuple[Any, dict[str, Any]]:
    """A scatter of each graph mode's first-pass time over eager's, per request, against the request's tokens.
    Returns ``(figure, {mode: ratios})``."""
    import matplotlib.pyplot as plt

    tokens, eager = request_tokens(record), first_pass(record.modes["eager"])
    ratios = {m: first_pass(record.modes[m]) / eager for m in GRAPH_MODES}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (m, ratio), colour in zip(ratios.items(), ("C1", "C2"), strict=True):
        ax.scatter(tokens, ratio, s=8, alpha=0.6, color=colour, label=f"{m} / eager")
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("request size (output tokens)")
    ax.set_ylabel("time / eager time, same request")
    ax.legend(fontsize=8)
    ax.set_title(f"{workload_name(record)}, {len(tokens)} requests, {record.provenance.gpu}", fontsize=9)
    fig.tight_layout()
    return fig, ratios


def route_counts(per_request: list[list[tuple[Batch, bool]]]) -> tuple[int, int]:
    """``(replays, eager batches)`` over :func:`runner_batches`' output."""
    replays = sum(ok for batches in per_request for _, ok in batches)
    return replays, sum(len(batches) for batches in per_request) - replays


def request_classes(per_request: list[list[tuple[Batch, bool]]]) -> dict[str, Any]:
    """Boolean masks over requests: ``routed to eager`` (any batch ran eagerly), ``replayed, no padding`` and
    ``replayed, padded`` (the others, by whether a replayed batch padded its budget)."""
    import numpy as np

    routed = np.array([any(not ok for _, ok in batches) for batches in per_request])
    pad = np.array([sum(b.padding for b, ok in batches if ok) for batches in per_request])
    return {"routed to eager": routed, "replayed, no padding": ~routed & (pad == 0),
            "replayed, padded": ~routed & (pad > 0)}


def size_classes(record: Any, tables: dict[str, LatencyTable], edges: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per request-size class (``lo < tokens <= hi`` over ``edges``, the last class up to the largest request):
    ``lo``, ``hi``, ``n``, the mean ``floor`` and the first-pass means ``ms[mode]`` (eager, graph,
    graph-compiled), and ``padding``: graph-compiled's padded tokens over the class's tokens."""
    import numpy as np

    tokens, floor = request_tokens(record), np.array(record.floor["per_request_ms"])
    ms = {m: first_pass(record.modes[m]) for m in ("eager", *GRAPH_MODES)}
    batches = runner_batches(record, "graph-compiled", tables)
    rows = []
    for lo, hi in zip(edges, (*edges[1:], int(tokens.max())), strict=True):
        sel = (tokens > lo) & (tokens <= hi)
        padded = sum(b.padding for i in np.flatnonzero(sel) for b, ok in batches[i] if ok)
        rows.append({"lo": lo, "hi": hi, "n": int(sel.sum()), "floor": floor[sel].mean(),
                     "ms": {m: v[sel].mean() for m, v in ms.items()}, "padding": padded / tokens[sel].sum()})
    return rows


def plot_vs_floor(runs: list[Any]) -> Any:
    """Grouped log-scale bars of each mode's median time over the floor per run (a missing mode leaves a gap)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.16
    for i, m in enumerate(MODES):
        ax.bar(np.arange(len(runs)) + i * width, [r.modes[m].vs_floor_median if m in r.modes else np.nan
                                                  for r in runs], width=width, color=f"C{i}", label=m)
    ax.axhline(1, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(np.arange(len(runs)) + 2 * width, [workload_name(r) for r in runs], fontsize=8)
    ax.set_ylabel("median time / floor")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def floor_parts(record: Any) -> tuple[Any, float]:
    """``(compute_ms per request, weight-read ms)``: the two terms whose maximum is the record's floor."""
    import numpy as np

    f = record.floor
    compute = np.array(record.flops["per_request"]) / (f["matmul_tflops"] * 1e12) * 1e3
    return compute, f["weight_bytes"] / (f["copy_gbps"] * 1e9) * 1e3


def seed_lines(seed_pr: dict[str, Any], seed_runs: dict[str, Any]) -> list[str]:
    """The PR's published eager → graph mean and P99 beside glmvit's runs in the PR's configuration (both graph
    modes), one line each, under a header."""
    lines = [f"{'workload':<12}{'who':<28}{'eager mean':>11}{'graph mean':>11}{'× mean':>8}{'eager P99':>11}"
             f"{'graph P99':>11}{'× P99':>7}"]
    for wl, pr in seed_pr.items():
        r = seed_runs[wl]
        lines.append(f"{wl:<12}{'PR 40576, RTX 4090':<28}{pr['mean'][0]:>11.2f}{pr['mean'][1]:>11.2f}"
                     f"{gain(*pr['mean']):>7.2f}×{pr['p99'][0]:>11.2f}{pr['p99'][1]:>11.2f}{gain(*pr['p99']):>6.2f}×")
        e = r.modes["eager"]
        for m in GRAPH_MODES:
            g = r.modes[m]
            lines.append(f"{'':<12}{'glmvit ' + m + ', ' + str(r.provenance.gpu):<28}{e.mean_ms:>11.2f}"
                         f"{g.mean_ms:>11.2f}{gain(e.mean_ms, g.mean_ms):>7.2f}×{e.p99_ms:>11.2f}{g.p99_ms:>11.2f}"
                         f"{gain(e.p99_ms, g.p99_ms):>6.2f}×")
    return lines


def diff_stats(got: Any, ref: Any) -> tuple[float, float, float]:
    """``(max |Δ|, mean |Δ|, min row cosine)`` of two [rows, dim] tensors."""
    import torch

    diff = (got - ref).abs()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    return diff.max().item(), diff.mean().item(), cos.min().item()


def textbook_sdpa(q: Any, k: Any, v: Any, attn_mask: Any = None) -> Any:
    """torch's scaled_dot_product_attention written as QKᵀ, softmax, PV, for a counter that sees only matmuls;
    no mask (the segments backend passes none: a mask raises)."""
    if attn_mask is not None:
        raise ValueError("textbook_sdpa takes no attn_mask")
    return (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).softmax(-1) @ v


def padding_by_budget(made: list[list[tuple[Batch, bool]]], table: LatencyTable) -> dict[int, tuple[int, int, float]]:
    """Per budget that replayed in :func:`runner_batches`' output: ``(replays, padded tokens, padded ms)``, a padded
    token costing ``table.graph_time(budget) / budget``."""
    out: dict[int, tuple[int, int, float]] = {}
    for batches in made:
        for b, replayed in batches:
            if replayed and b.budget is not None:
                n, pad, ms = out.get(b.budget, (0, 0, 0.0))
                out[b.budget] = (n + 1, pad + b.padding, ms + b.padding * table.graph_time(b.budget) / b.budget)
    return out


def counted_flops(model: Any, x: Any, grids: Any) -> dict[str, tuple[int, Any]]:
    """``{label: (FlopCounterMode's total, output)}`` of ``model(x, grids)`` under ``segments``, ``sdpa_masked``,
    and ``segments, textbook attention`` (torch's SDPA replaced by :func:`textbook_sdpa`, whose matmuls the counter
    sees); runs under ``inference_mode`` and leaves ``model.attn_backend`` as it found it."""
    from unittest import mock

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    F, before = torch.nn.functional, model.attn_backend
    sdpa = F.scaled_dot_product_attention
    out = {}
    try:
        for label, backend, attention in [("segments", "segments", sdpa), ("sdpa_masked", "sdpa_masked", sdpa),
                                          ("segments, textbook attention", "segments", textbook_sdpa)]:
            model.attn_backend = backend
            with torch.inference_mode(), mock.patch.object(F, "scaled_dot_product_attention", attention), \
                    FlopCounterMode(display=False) as counter:
                y = model(x, grids)
            out[label] = (counter.get_total_flops(), y)
    finally:
        model.attn_backend = before
    return out


def accuracy_lines(sources: list[str], grids: list[Any], ref: list[Any], eager: list[Any],
                   graph: list[Any]) -> tuple[list[str], float]:
    """A table of :func:`diff_stats` per item for eager vs transformers, graph vs eager and graph vs transformers,
    and the worst max |Δ| relative to the reference's scale (its max |value|, at least 1)."""
    from pathlib import Path

    lines = [f"{'item':<14}{'grid':<14}{'pair':<24}{'max |Δ|':>10}{'mean |Δ|':>10}{'min cos':>12}"]
    worst = 0.0
    for src, g, r, e, q in zip(sources, grids, ref, eager, graph, strict=True):
        for pair, a, b in [("eager vs transformers", e, r), ("graph vs eager", q, e), ("graph vs transformers", q, r)]:
            mx, mean, cmin = diff_stats(a, b)
            worst = max(worst, mx / max(1.0, b.abs().max().item()))
            lines.append(f"{Path(src).name:<14}{str(g):<14}{pair:<24}{mx:>10.2e}{mean:>10.2e}{cmin:>12.8f}")
    return lines, worst
