"""A static picture of the budget explorer on vLLM PR 40576's configuration, for readers who cannot run the widget.

    python tools/explorer_picture.py            # writes notebooks/explorer_pr40576.png and .json beside it
    python tools/explorer_picture.py --check    # exit 1 if the committed numbers differ from a fresh computation

The numbers come from the explorer itself, driven as a reader would: its default workload and latency table, the
PR's budgets and limits (``data/seed_pr40576.json``) typed in, ``auto`` to compare with, then **Recommend**. Three
budget sets: the PR's, vLLM's automatic ones under the same limits, and ``recommend_budgets`` by predicted time.
The JSON beside the picture holds every number it draws; ``tests/test_explorer.py`` recomputes and compares them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PICTURE = ROOT / "notebooks" / "explorer_pr40576.png"
NUMBERS = PICTURE.with_suffix(".json")
DIGITS = 4  # floats are stored rounded: the comparison is of what is drawn, not of the last bit
COLOURS = {"PR 40576": "C0", "auto (vLLM)": "C7", "Recommend": "C2"}


def _set_numbers(name: str, analysis: Any) -> dict[str, Any]:
    from glmvit.cli.explorer_report import GIB, OVER, REPLAY, ROUTED, SLOWER

    report, counts = analysis.report, analysis.counts()
    padded, total = analysis.padding()

    def times(summary: Any) -> dict[str, float]:
        return {k: round(getattr(summary, f"{k}_ms"), DIGITS) for k in ("median", "mean", "p99")}

    return {"name": name, "budgets": list(analysis.config.token_budgets), "max_items": analysis.config.max_items,
            "max_segments": analysis.config.max_segments, "batches": sum(counts.values()),
            "replayed": counts[REPLAY] + counts[SLOWER], "replayed_eager_faster": counts[SLOWER],
            "routed": counts[ROUTED], "eager_over_limits": counts[OVER], "padded_tokens": padded,
            "padding_fraction": round(padded / total if total else 0.0, DIGITS),
            "graph_memory_gib": round(analysis.memory_bytes / GIB, DIGITS),
            "capture_s": None if report.capture_s is None else round(report.capture_s, DIGITS),
            "graphs_ms": times(report.graphs), "eager_ms": times(report.eager)}


def numbers() -> dict[str, Any]:
    """What the explorer shows for the PR's set, ``auto`` and the recommended set, and the PR set's export."""
    from glmvit.cli.explorer import BudgetExplorer
    from glmvit.cli.plan import export_config
    from glmvit.lab.seed import load_seed, seed_budget_config

    pr = seed_budget_config(load_seed())
    app = BudgetExplorer()  # the notebook's explorer(): default workload, system, packing and table
    app.max_items_auto.value = False
    app.max_items.value = pr.max_items
    app.max_segments.value = str(pr.max_segments)
    app.budgets.value = ", ".join(map(str, pr.token_budgets))
    app.compare.value = "auto"
    if app.message.value:  # an error or a table problem: no picture of a page that shows one
        raise ValueError(f"the explorer refused the PR's configuration: {app.message.value}")
    sets = [_set_numbers("PR 40576", app.analyses[0]), _set_numbers("auto (vLLM)", app.analyses[1])]
    specs = [[item.spec for item in request] for request in app._requests()]
    export = export_config(app.analyses[0].config, specs)
    app.recommend.click()
    sets.append(_set_numbers("Recommend", app.analyses[0]))
    table = app.table
    assert table is not None and table.mode is not None  # the recorded table, as the page reads it
    return {"workload": {"preset": app.preset.value, "requests": len(specs), "seed": app.seed.value,
                         "items": sum(map(len, specs)), "tokens": sum(s.tokens for r in specs for s in r)},
            "system": app.system.value, "per": app.per.value, "max_graphs": app.max_graphs.value,
            "table": {"mode": table.mode, "gpu": str(table.provenance.get("gpu"))},
            "sets": sets, "export": export}


def draw(n: dict[str, Any]) -> Any:
    """The explorer's comparison at a glance: padding, batches, predicted ms per request, graph memory."""
    from matplotlib.figure import Figure

    sets = n["sets"]
    names = [s["name"] for s in sets]
    colours = [COLOURS[s] for s in names]
    fig = Figure(figsize=(15, 6.8), dpi=100)
    grid = fig.add_gridspec(2, 4, height_ratios=(3, 0.85), hspace=0.3, wspace=0.32,
                            left=0.05, right=0.99, top=0.86, bottom=0.03)
    w = n["workload"]
    fig.suptitle(f"Budget explorer on vLLM PR 40576's configuration: {w['preset']}, {w['requests']} requests "
                 f"(seed {w['seed']}, {w['items']} items, {w['tokens']:,} tokens), vLLM 0.33 packing each request "
                 f"alone,\ntimes predicted from the recorded {n['table']['gpu']} table ({n['table']['mode']})",
                 fontsize=12)

    ax = fig.add_subplot(grid[0, 0])
    bars = ax.bar(names, [100 * s["padding_fraction"] for s in sets], color=colours)
    ax.bar_label(bars, [f"{100 * s['padding_fraction']:.1f}%\n{s['padded_tokens']:,} tok" for s in sets],
                 fontsize=9)
    ax.set_title("padding waste (% of replayed tokens)", fontsize=10)
    ax.margins(y=0.25)

    ax = fig.add_subplot(grid[0, 1])
    parts = (("replayed", lambda s: s["replayed"] - s["replayed_eager_faster"], "C0", ""),
             ("replayed, eager faster", lambda s: s["replayed_eager_faster"], "darkorange", ""),
             ("routed to eager", lambda s: s["routed"], "#dbe9f6", "\\\\"),
             ("eager: no budget holds it", lambda s: s["eager_over_limits"], "mistyrose", "//"))
    bottom = [0] * len(sets)
    for label, value, colour, hatch in parts:
        heights = [value(s) for s in sets]
        ax.bar(names, heights, bottom=bottom, color=colour, hatch=hatch, edgecolor="grey", linewidth=0.5,
               label=f"{label}: {', '.join(map(str, heights))}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, total in enumerate(bottom):
        ax.annotate(f"{total:,}", (x, total), ha="center", va="bottom", fontsize=9)
    ax.set_title("batches, and how they run", fontsize=10)
    ax.legend(fontsize=7, loc="lower center")
    ax.set_ylim(0, 1.12 * max(bottom))

    ax = fig.add_subplot(grid[0, 2])
    stats, width = ("median", "mean", "p99"), 0.2
    for k, s in enumerate(sets):
        xs = [i + (k - 1.5) * width for i in range(3)]
        b = ax.bar(xs, [s["graphs_ms"][m] for m in stats], width, color=colours[k], label=s["name"])
        ax.bar_label(b, [f"{s['graphs_ms'][m]:.1f}" for m in stats], fontsize=7, rotation=90, padding=2)
    eager = sets[0]["eager_ms"]
    b = ax.bar([i + 1.5 * width for i in range(3)], [eager[m] for m in stats], width, color="white",
               edgecolor="firebrick", hatch="//", label="all eager")
    ax.bar_label(b, [f"{eager[m]:.1f}" for m in stats], fontsize=7, rotation=90, padding=2)
    ax.set_ylim(0, 1.2 * max(eager.values()))
    ax.set_xticks(range(3), ["median", "mean", "P99"])
    ax.set_title("predicted ms per request", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")

    ax = fig.add_subplot(grid[0, 3])
    bars = ax.bar(names, [s["graph_memory_gib"] for s in sets], color=colours)
    ax.bar_label(bars, [f"{s['graph_memory_gib']:.2f} GiB\ncapture ≈ {s['capture_s']:.1f} s" for s in sets],
                 fontsize=9)
    ax.set_title("graph memory (estimate, GLM-4.1V bf16)", fontsize=10)
    ax.set_ylim(0, 1.3 * max(s["graph_memory_gib"] for s in sets))
    for a in fig.axes:
        a.tick_params(axis="x", labelsize=9)

    text = fig.add_subplot(grid[1, :])
    text.axis("off")
    lines = [f"{s['name']:<12} budgets {', '.join(map(str, s['budgets']))}  ·  {s['max_items']} items, "
             f"{s['max_segments']} segments a batch  ·  mean {s['graphs_ms']['mean']:.2f} ms/request, "
             f"{s['eager_ms']['mean'] / s['graphs_ms']['mean']:.2f}× faster than all eager" for s in sets]
    lines.append(f"Recommend: at most {n['max_graphs']} budgets minimising predicted time (recommend_budgets), "
                 "same limits.")
    lines.append("Export vLLM config (PR 40576), for vllm serve … --compilation-config:")
    lines.append(f"  {json.dumps(n['export'], separators=(',', ':'))}")
    text.text(0, 1, "\n".join(lines), family="monospace", fontsize=8.5, va="top")
    return fig


def write(n: dict[str, Any]) -> None:
    """The picture and its numbers, each replaced whole."""
    import io

    from glmvit.cli.common import write_atomic

    buf = io.BytesIO()
    draw(n).savefig(buf, format="png", metadata={"Software": None})
    write_atomic(PICTURE, buf.getvalue())
    write_atomic(NUMBERS, (json.dumps(n, indent=1, ensure_ascii=False) + "\n").encode())


def main(argv: list[str]) -> int:
    n = numbers()
    if argv == ["--check"]:
        same = NUMBERS.is_file() and json.loads(NUMBERS.read_text()) == n
        print("numbers are current" if same else f"{NUMBERS.name} differs: run python tools/explorer_picture.py")
        return 0 if same else 1
    if argv:
        print("usage: python tools/explorer_picture.py [--check]", file=sys.stderr)
        return 2
    write(n)
    print(f"wrote {PICTURE.relative_to(ROOT)} and {NUMBERS.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
