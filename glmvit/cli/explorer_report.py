"""What the budget explorer shows for a budget set: the analysis under one system, its rows, its batches, its chart.

Pure functions over :func:`glmvit.deployment.evaluate_budgets` and the plans behind it; :mod:`glmvit.cli.explorer`
puts them in widgets.
"""
from __future__ import annotations

import html
import io
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..config import VisionConfig
from ..costmodel import LatencyTable, graph_memory, total_graph_memory
from ..deployment import BudgetReport, TimeSummary, evaluate_budgets, plan_engine_steps
from ..geometry import ItemSpec
from ..packing import VLLM_MAX_NUM_BATCHED_TOKENS, Batch, BudgetConfig, Plan, plan_workload
from ..routing import Router

SYSTEMS = {"vllm": ("vllm", False), "glmvit": ("ffd", True)}  # system → (packer, route)
BATCH_ROWS = 8  # most common batch shapes in the batch table (the largest and each other way of running added)
GIB = 2**30
REPLAY, ROUTED, OVER, SLOWER = "replay", "eager (routed)", "eager (no budget holds it)", "replay (eager faster)"


Group = list[tuple[Plan, list[ItemSpec]]]  # a request (one plan) or an engine step (a plan per modality)


@dataclass(frozen=True)
class Analysis:
    """A budget set on a workload: the library's report, the plans behind it, and how each batch runs."""

    config: BudgetConfig
    system: str
    report: BudgetReport
    groups: list[Group]
    memory_bytes: int
    pool_bytes: int
    table: LatencyTable | None

    def runs(self, batch: Batch) -> str:
        return batch_runs(batch, self.table, SYSTEMS[self.system][1])

    @property
    def batches(self) -> list[Batch]:
        return [b for group in self.groups for plan, _ in group for b in plan.batches]

    def counts(self) -> Counter:
        return Counter(self.runs(b) for b in self.batches)

    def padding(self) -> tuple[int, int]:
        """(padded tokens, budget tokens) over the batches that really replay."""
        replayed = [b for b in self.batches if self.runs(b) in (REPLAY, SLOWER)]
        return sum(b.padding for b in replayed), sum(b.budget or 0 for b in replayed)


def batch_runs(batch: Batch, table: LatencyTable | None, route: bool) -> str:
    """How a batch runs: eagerly when no budget holds it; with ``route`` (glmvit's runner) eagerly also when the
    table predicts its eager forward faster than its replay (:class:`glmvit.routing.Router`); otherwise it is replayed,
    flagged ``SLOWER`` when the table predicts eager faster (vLLM does not route)."""
    if batch.budget is None:
        return OVER
    if table is None:
        return REPLAY
    faster = Router(table).eager_faster(batch.budget, batch.tokens, batch.segment_rows2)
    return (ROUTED if route else SLOWER) if faster else REPLAY


def plan_groups(specs: list[list[ItemSpec]], config: BudgetConfig, packer: str, per: str,
                step_tokens: int) -> list[Group]:
    """The plans ``evaluate_budgets`` predicts from, each with the items its batches index: one per request, or per
    engine step one per modality (images first), as :func:`glmvit.deployment.plan_engine_steps` packs them."""
    if per == "request":
        return [[(plan, items)] for plan, items in zip(plan_workload(specs, config, packer), specs, strict=True)]
    groups = []
    for step in plan_engine_steps(specs, config, step_tokens, packer):
        kinds = [[s for r in step.requests for s in specs[r] if (s.segments > 1) is video] for video in (False, True)]
        groups.append(list(zip(step.plans, [items for items in kinds if items], strict=True)))
    return groups


def analyse(specs: list[list[ItemSpec]], config: BudgetConfig, table: LatencyTable | None, system: str = "vllm",
            per: str = "request", step_tokens: int = VLLM_MAX_NUM_BATCHED_TOKENS,
            vision_config: VisionConfig | None = None) -> Analysis:
    """``evaluate_budgets`` for ``system`` ("vllm": its packer, no routing; "glmvit": FFD and routing), with graph
    memory estimated for the runner mode and attention the table measured (compiled, triton without a table)."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {sorted(SYSTEMS)}, got {system!r}")
    packer, route = SYSTEMS[system]
    vision_config = vision_config or VisionConfig.glm41v()
    report = evaluate_budgets(specs, config, table, vision_config, packer=packer, route=route, per=per,
                              step_tokens=step_tokens)
    compiled = table is None or table.mode != "graph"
    memories = graph_memory(config, vision_config, compiled=compiled,
                            attention=(table.attention if table and table.attention else "triton"))
    return Analysis(config, system, report, plan_groups(specs, config, packer, per, step_tokens),
                    total_graph_memory(memories), max(m.pool_bytes for m in memories), table)


@dataclass(frozen=True)
class BatchRow:
    """One batch shape of a workload: how often it occurs, its size, and how it runs."""

    count: int
    items: int
    tokens: int
    segments: int
    budget: int | None
    replay_ms: float | None
    eager_ms: float | None
    runs: str


def batch_rows(analysis: Analysis, limit: int = BATCH_ROWS) -> list[BatchRow]:
    """The most common batch shapes (items, tokens, segments, budget, attention work), then the largest batch and
    the most common shape of each way of running that is not among them (routed, replayed slower, over the limits)."""
    def batch(key: tuple[int, int, int, int | None, int]) -> Batch:
        items, tokens, segments, budget, work = key
        return Batch(tuple(range(items)), tokens, segments, budget, work)

    counts: Counter = Counter((len(b.item_indices), b.tokens, b.segments, b.budget, b.segment_rows2)
                              for b in analysis.batches)
    ranked = [k for k, _ in counts.most_common()]
    keys = ranked[:limit]
    extra = [max(counts, key=lambda k: (k[1], counts[k]), default=None)]
    extra += [next((k for k in ranked if analysis.runs(batch(k)) == kind), None) for kind in (ROUTED, SLOWER, OVER)]
    keys += [k for k in dict.fromkeys(extra) if k is not None and k not in keys]
    table, rows = analysis.table, []
    for key in keys:
        items, tokens, segments, budget, work = key
        replay = table.graph_time(budget, work) if table and budget is not None else None
        eager = table.eager_time(tokens, work) if table else None
        rows.append(BatchRow(counts[key], items, tokens, segments, budget, replay, eager, analysis.runs(batch(key))))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The chart
# ---------------------------------------------------------------------------------------------------------------
STYLES = {  # runs → (face colour or None for the item's own, edge colour, hatch)
    REPLAY: (None, "white", ""), SLOWER: (None, "darkorange", ""),
    ROUTED: ("#dbe9f6", "steelblue", "\\\\"), OVER: ("mistyrose", "firebrick", "//"),
}


def packing_figure(groups: list[Group], runs: Callable[[Batch], str], per: str = "request") -> Figure:
    """One bar per batch with its items stacked; a black tick at the budget it replays (dashed grey: the budget a
    routed batch skips); routed batches hatched blue, batches no budget holds hatched red, replays the table
    predicts slower than eager outlined orange."""
    fig = Figure(figsize=(10, 3.8))
    ax = fig.add_subplot()
    bars: dict[str, tuple[list[Any], ...]] = {k: ([], [], [], []) for k in STYLES}  # x, height, bottom, colour
    ticks: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # replayed? → (x, budget)
    x = 0
    for group in groups:
        for plan, items in group:
            for batch in plan.batches:
                kind, bottom = runs(batch), 0
                for k, i in enumerate(batch.item_indices):
                    for column, value in zip(bars[kind], (x, items[i].tokens, bottom, f"C{k % 10}"), strict=True):
                        column.append(value)
                    bottom += items[i].tokens
                if batch.budget is not None:
                    ticks[kind != ROUTED].append((x, batch.budget))
                x += 1
        ax.axvline(x - 0.5, color="grey", linestyle=":", linewidth=0.8)
    for kind, (face, edge, hatch) in STYLES.items():
        xs, heights, bottoms, colours = bars[kind]
        ax.bar(xs, heights, bottom=bottoms, width=0.8, color=face or colours, edgecolor=edge, hatch=hatch,
               linewidth=1.5 if kind == SLOWER else 0.8)
    for replayed in (True, False):
        points = ticks[replayed]
        ax.hlines([b for _, b in points], [t - 0.45 for t, _ in points], [t + 0.45 for t, _ in points],
                  colors="black" if replayed else "grey", linewidths=2.0 if replayed else 1.5,
                  linestyles="solid" if replayed else "dashed")
    ax.set_xlim(-0.6, max(x, 1) - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    what = "requests" if per == "request" else "engine steps"
    ax.set_xlabel(f"batches of the first {len(groups)} {what} (dotted lines separate them)")
    ax.set_ylabel("output tokens")
    legend = [Patch(facecolor="C0", edgecolor="white", label="replayed (items stacked; black tick: its budget)")]
    legend += [Patch(facecolor=STYLES[k][0] or "C0", edgecolor=STYLES[k][1], hatch=STYLES[k][2], label=label)
               for k, label in ((SLOWER, "replayed, eager predicted faster"), (ROUTED, "routed to eager"),
                                (OVER, "eager: no budget holds it")) if bars[k][0]]
    ax.legend(handles=legend, fontsize=8, loc="lower left", bbox_to_anchor=(0, 1), ncol=len(legend), frameon=False)
    fig.subplots_adjust(left=0.075, right=0.99, bottom=0.13, top=0.9)  # fixed: tight_layout costs a draw per chart
    return fig


def figure_svg(fig: Figure) -> bytes:
    """The figure as SVG (sharp at any zoom), text kept as text, reproducible (no date, fixed ids)."""
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "glmvit-explorer"}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# What the page shows, as text
# ---------------------------------------------------------------------------------------------------------------
SYSTEM_TEXT = {
    "vllm": "vLLM 0.33: ascending next-fit with its deferral rule; every batch a budget holds is replayed",
    "glmvit": "glmvit: first-fit decreasing; each batch replayed or run eagerly, whichever the table predicts faster",
}


def table_facts(table: LatencyTable) -> list[tuple[str, str]]:
    """What a latency table measured, where and when, and whether it still describes this code."""
    prov = table.provenance
    compiled = {"graph-compiled": "yes (torch.compile before capture)", "graph": "no"}.get(table.mode or "",
                                                                                       "unknown")
    return [("file", Path(table.source).name if table.source else "given in code"),
            ("runner mode", table.mode or "unknown (a table made by hand)"), ("compiled", compiled),
            ("attention", table.attention or "unknown"), ("model", f"{table.config}, {table.dtype}"),
            ("GPU", str(prov.get("gpu") or prov.get("device") or "unknown")),
            ("commit", str(prov.get("git_commit") or "unknown")[:7]),
            ("recorded", str(prov.get("date_utc") or "undated")[:10]),
            ("status", table.describe().rsplit("; ", 1)[-1].rstrip(")") if table.changed else
             "current" if table.mode else "unknown (a plain table: no fingerprint of the code it measured)")]


def table_warnings(table: LatencyTable, configs: Sequence[BudgetConfig]) -> list[str]:
    """Where a table's answer is out of its depth: stale, another model, no GPU, budgets it never measured."""
    notes = []
    if table.changed:
        notes.append(f"{table.describe()}: the code it measured differs from this checkout's, so its times may "
                     "not hold here; re-record it on the GPU (python -m glmvit record)")
    if table.mode is None:
        notes.append("the table is a plain one (not a recorded sweep): which runner mode and code it measured is "
                     "unknown")
    if table.config != "glm41v":
        notes.append(f"the table measured the {table.config!r} tower, not GLM-4.1V: its times do not describe a "
                     "GLM-4.1V deployment")
    if not table.provenance.get("gpu"):
        notes.append("the table names no GPU: times measured elsewhere do not predict a GPU deployment")
    beyond = sorted({b for c in configs for b in c.token_budgets if b > table.tokens[-1]})
    if beyond:
        notes.append(f"budgets {', '.join(map(str, beyond))} lie above the largest measured ({table.tokens[-1]}): "
                     "their times are extrapolated")
    return notes


def summary_rows(analyses: Sequence[Analysis], step_tokens: int) -> list[tuple[str, ...]]:
    """The comparison as rows: (label, value for each budget set)."""
    def each(f: Callable[[Analysis], str]) -> tuple[str, ...]:
        return tuple(f(a) for a in analyses)

    def padding(a: Analysis) -> str:
        padded, total = a.padding()
        return f"{padded / total if total else 0:.1%} of replayed tokens ({padded} tokens)"

    def batches(a: Analysis) -> str:
        c = a.counts()
        routed = f", {c[ROUTED]} routed to eager" if a.system == "glmvit" else \
            f" ({c[SLOWER]} predicted faster eagerly)" if c[SLOWER] else ""
        return f"{sum(c.values())}: {c[REPLAY] + c[SLOWER]} replayed{routed}, {c[OVER]} over the limits (eager)"

    def packed(a: Analysis) -> str:
        if a.report.per == "request":
            return "each request alone (times: per request)"
        return (f"per vLLM engine step: {a.report.groups} steps of ≤ {step_tokens:,} vision tokens "
                "(times: each request waits for its whole step)")

    first = analyses[0]
    rows: list[tuple[str, ...]] = [
        ("system", *each(lambda a: SYSTEM_TEXT[a.system])),
        ("packed", *each(packed)),
        ("budgets", *each(lambda a: ", ".join(map(str, a.config.token_budgets)))),
        ("limits per batch", *each(lambda a: f"{a.config.max_items} items, {a.config.max_segments:,} segments")),
        ("batches", *each(batches)),
        ("padding waste", *each(padding)),
        ("graph memory (estimate)", *each(lambda a: f"{a.memory_bytes / GIB:.2f} GiB "
                                                    f"(pool {a.pool_bytes / GIB:.2f} GiB)")),
        ("capture time", *each(_capture_text)),
    ]
    if first.table is None:
        return rows + [("predicted time", *each(lambda a: "unknown (no latency table: make one with "
                                                          "python -m glmvit latency --json PATH)"))]
    return rows + [
        ("ms/request, graphs: median · mean · P99", *each(lambda a: times_text(a.report.graphs))),
        ("… every batch at its P99 latency: P99", *each(
            lambda a: "unknown (the table has no P99 columns)" if a.report.graphs_at_p99 is None
            else f"{a.report.graphs_at_p99.p99_ms:.2f}")),
        ("ms/request, all eager: median · mean · P99", *each(lambda a: times_text(a.report.eager))),
        ("graphs against all eager (mean)", *each(_speedup)),
    ]


def _capture_text(a: Analysis) -> str:
    if a.report.capture_s is not None and a.report.capture is not None:
        return f"≈ {a.report.capture_s:.2f} s ({a.report.capture.describe(len(a.report.config.token_budgets))})"
    return "unknown (the table has no capture times)" if a.table else "unknown (no latency table)"


def times_text(summary: TimeSummary | None) -> str:
    assert summary is not None  # shown only with a table
    return f"{summary.median_ms:.2f} · {summary.mean_ms:.2f} · {summary.p99_ms:.2f}"


def _speedup(a: Analysis) -> str:
    assert a.report.graphs is not None and a.report.eager is not None
    ratio = a.report.eager.mean_ms / a.report.graphs.mean_ms
    return f"{ratio:.2f}× faster" if ratio >= 1 else f"{1 / ratio:.2f}× SLOWER than eager"


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def batch_table_html(analysis: Analysis) -> str:
    rows = batch_rows(analysis)
    total = len(analysis.batches)
    heads = ("batches", "items", "tokens → budget", "padding", "segments", "replay ms", "eager ms", "runs")
    body = []
    for r in rows:
        budget = "none" if r.budget is None else f"{r.budget}"
        pad = "–" if r.budget is None else f"{(r.budget - r.tokens) / r.budget:.0%}"
        cells = (f"{r.count} ({r.count / total:.0%})", str(r.items), f"{r.tokens} → {budget}", pad,
                 str(r.segments), _ms(r.replay_ms), _ms(r.eager_ms), r.runs)
        body.append(cells)
    c = analysis.counts()
    if analysis.table is None:
        note = "no latency table: no times, so no routing (every batch a budget holds is replayed)"
    elif analysis.system == "glmvit":
        note = (f"glmvit's runner replays a batch only where the table predicts its replay no slower than its eager "
                f"forward: {c[ROUTED]} of {c[REPLAY] + c[ROUTED]} batches a budget holds run eagerly")
    else:
        note = (f"vLLM replays every batch a budget holds: the table predicts {c[SLOWER]} of {c[REPLAY] + c[SLOWER]} "
                "faster eagerly")
    return (f"<div class='glmvit-routing'><b>How batches run</b> (budget set A; the most common shapes and the "
            f"largest)<br>{html.escape(note)}{rows_html(body, heads, 'glmvit-batches')}</div>")


def rows_html(rows: Sequence[Sequence[str]], heads: Sequence[str] = (), css: str = "glmvit-summary") -> str:
    cell = "style='padding-right:1em;text-align:left'"
    head = "".join(f"<th {cell}>{html.escape(h)}</th>" for h in heads)
    body = "".join("<tr><td " + cell + ">" + html.escape(row[0]) + "</td>" +
                   "".join(f"<td {cell}><b>{html.escape(v)}</b></td>" for v in row[1:]) + "</tr>" for row in rows)
    return f"<table class='{css}'>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def error_html(err: Any) -> str:
    return f"<span class='glmvit-error' style='color:#b00020'>⚠ {html.escape(str(err))}</span>"


def warning_html(text: str) -> str:
    return f"<div class='glmvit-warning' style='color:#8a4b00'>⚠ {html.escape(text)}</div>"


