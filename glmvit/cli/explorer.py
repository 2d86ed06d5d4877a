"""The budget explorer: an ipywidgets app over :mod:`glmvit.packing`, :mod:`glmvit.costmodel` and
:mod:`glmvit.workloads`.

``explorer()`` returns the widget. Every number it shows comes from those modules; predicted times need a
measured latency table (``data/bench/latency_h200.json``) and are not shown without one.
"""
from __future__ import annotations

import html
import io
from functools import lru_cache
from pathlib import Path
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..config import VisionConfig
from ..costmodel import (
    LatencyTable,
    TimeEstimate,
    graph_memory,
    load_latency_table,
    predict_time,
    recommend_budgets,
    total_graph_memory,
)
from ..geometry import ItemSpec
from ..packing import BudgetConfig, Plan, combined_stats, parse_budgets, plan_workload
from ..workloads import PRESETS, MMItem, random_mm_workload

DEFAULT_TABLE = Path(__file__).resolve().parents[2] / "data" / "bench" / "latency_h200.json"
EXPLORER_PRESETS = ("img1x224", "mixed-img", "mixed-av", "mixed-large", "video8x224")
SAMPLE_REQUESTS = 8
GIB = 2**30


@lru_cache(maxsize=16)
def _workload(preset: str, num_requests: int, items_per_request: int, seed: int) -> list[list[MMItem]]:
    p = PRESETS[preset]
    return random_mm_workload(p.bucket_config, num_requests, items_per_request, p.range_ratio, seed,
                              p.limit_per_request)


def packing_figure(requests: list[list[MMItem]], plans: list[Plan], title: str = "") -> Figure:
    """One bar per batch with its items stacked, a black tick at the budget it replays; eager batches hatched red."""
    fig = Figure(figsize=(9, 3.6), dpi=90)
    ax = fig.add_subplot()
    # eager? → x, height, bottom, colour
    bars: dict[bool, tuple[list[Any], ...]] = {True: ([], [], [], []), False: ([], [], [], [])}
    ticks, x = [], 0
    for items, plan in zip(requests, plans, strict=False):
        for batch in plan.batches:
            bottom = 0
            for k, i in enumerate(batch.item_indices):
                values = (x, items[i].spec.tokens, bottom, f"C{k % 10}")
                for column, value in zip(bars[batch.budget is None], values, strict=True):
                    column.append(value)
                bottom += items[i].spec.tokens
            if batch.budget is not None:
                ticks.append((x, batch.budget))
            x += 1
        ax.axvline(x - 0.5, color="grey", linestyle=":", linewidth=0.8)
    xs, heights, bottoms, colours = bars[False]
    ax.bar(xs, heights, bottom=bottoms, width=0.8, color=colours, edgecolor="white")
    xs, heights, bottoms, _ = bars[True]
    ax.bar(xs, heights, bottom=bottoms, width=0.8, color="mistyrose", edgecolor="firebrick", hatch="//")
    ax.hlines([b for _, b in ticks], [t - 0.45 for t, _ in ticks], [t + 0.45 for t, _ in ticks], color="black",
              linewidth=2)
    ax.set_xlim(-0.6, max(x, 1) - 0.4)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"batches of the first {len(requests)} requests (dotted lines separate requests)")
    ax.set_ylabel("output tokens")
    ax.set_title(title or "stacked items; black tick = budget replayed; hatched = eager fallback", fontsize=10)
    fig.tight_layout()
    return fig


def figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _rows_html(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><td style='padding-right:1em'>{html.escape(k)}</td><td><b>{html.escape(v)}</b></td></tr>"
                   for k, v in rows)
    return f"<table class='glmvit-summary'>{body}</table>"


class BudgetExplorer:
    """Widgets for a workload, budgets and limits; shows packing, padding, replays, memory and predicted time."""

    def __init__(self, latency_table: str | Path | None = DEFAULT_TABLE, vision_config: VisionConfig | None = None):
        self.vision_config = vision_config or VisionConfig.glm41v()
        self.table, self._table_note = self._load_table(latency_table)
        style = {"description_width": "initial"}
        self.preset = widgets.Dropdown(options=[(f"{k}: {PRESETS[k].description}", k) for k in EXPLORER_PRESETS],
                                      description="workload", style=style)
        self.packer = widgets.ToggleButtons(options=[("FFD", "ffd"), ("vLLM next-fit", "vllm")], description="packer")
        self.budgets = widgets.Text(value="auto", description="budgets", continuous_update=False,
                                    placeholder="64, 256, 1024 or auto", style=style)
        self.max_items = widgets.IntSlider(64, 1, 64, description="max items", continuous_update=False)
        self.max_segments = widgets.IntSlider(64, 1, 512, description="max segments", continuous_update=False)
        self.num_requests = widgets.IntSlider(1000, 10, 2000, step=10, description="requests",
                                              continuous_update=False)
        self.items_per_request = widgets.IntSlider(1, 1, 8, description="items/request", continuous_update=False,
                                                   style=style)
        self.seed = widgets.IntText(42, description="seed", layout=widgets.Layout(width="12em"))
        self.max_graphs = widgets.IntSlider(7, 1, 12, description="max graphs", continuous_update=False)
        self.memory_gib = widgets.BoundedFloatText(0.0, min=0.0, max=1024.0, step=0.5, style=style,
                                                   description="memory limit GiB (0 = none)",
                                                   layout=widgets.Layout(width="24em"))
        self.recommend = widgets.Button(description="Recommend", button_style="info",
                                        tooltip="fill the budgets field with recommend_budgets")
        self.message = widgets.HTML()
        self.summary = widgets.HTML()
        self.picture = widgets.Image(format="png")
        self.widget = widgets.VBox([
            widgets.HTML("<h3>glmvit budget explorer</h3>"),
            widgets.HBox([self.preset, self.packer]),
            widgets.HBox([self.num_requests, self.items_per_request, self.seed]),
            widgets.HBox([self.budgets, self.max_items, self.max_segments]),
            widgets.HBox([self.recommend, self.max_graphs, self.memory_gib]),
            self.message, self.summary, self.picture,
        ])
        self.preset.observe(self._on_preset, names="value")
        for w in (self.packer, self.budgets, self.max_items, self.max_segments, self.num_requests,
                  self.items_per_request, self.seed):
            w.observe(self._on_change, names="value")
        self.recommend.on_click(self._on_recommend)
        self._on_preset()

    @staticmethod
    def _load_table(path: str | Path | None) -> tuple[LatencyTable | None, str]:
        if path is None or not Path(path).exists():
            return None, ""
        try:
            return load_latency_table(path), ""
        except (ValueError, OSError) as err:
            return None, _error_html(f"latency table {path} is unusable: {err}")

    def _requests(self) -> list[list[MMItem]]:
        return _workload(self.preset.value, self.num_requests.value, self.items_per_request.value, self.seed.value)

    def _config(self) -> BudgetConfig:
        return BudgetConfig.resolve(parse_budgets(self.budgets.value), self.max_items.value, self.max_segments.value)

    def _on_preset(self, change: Any = None) -> None:
        self.items_per_request.value = PRESETS[self.preset.value].items_per_request
        self._on_change()

    def _on_change(self, change: Any = None) -> None:
        try:
            requests, config = self._requests(), self._config()
        except ValueError as err:
            self._show_error(err)
            return
        self.message.value = self._table_note
        self._show(requests, config)

    def _show_error(self, err: Exception) -> None:
        """Bad input: a visible message instead of numbers that no longer match the controls."""
        self.message.value = _error_html(err)
        self.summary.value = ""
        self.picture.value = b""

    def _show(self, requests: list[list[MMItem]], config: BudgetConfig) -> None:
        specs = _specs(requests)
        plans = plan_workload(specs, config, self.packer.value)
        other = "vllm" if self.packer.value == "ffd" else "ffd"
        other_stats = combined_stats(plan_workload(specs, config, other))
        stats = combined_stats(plans)
        memories = graph_memory(config, self.vision_config)
        rows = [
            ("budgets", ", ".join(map(str, config.token_budgets))),
            ("limits per batch", f"{config.max_items} items, {config.max_segments} segments"),
            ("workload", f"{len(requests)} requests, {sum(map(len, requests))} items, {stats.real_tokens} tokens"),
            ("batches", f"{stats.batches} ({other}: {other_stats.batches})"),
            ("replays", str(stats.replays)),
            ("fallbacks (eager items)", str(stats.fallbacks)),
            ("padding waste", f"{stats.padding_fraction:.1%} of replayed tokens ({stats.padded_tokens} tokens; "
                              f"{other}: {other_stats.padding_fraction:.1%})"),
            ("graph memory (estimate, bf16)", f"{total_graph_memory(memories) / GIB:.2f} GiB for {len(memories)} "
                                              f"graphs (pool {max(m.pool_bytes for m in memories) / GIB:.2f} GiB)"),
            ("predicted time", self._time_text(plans)),
        ]
        self.summary.value = _rows_html(rows)
        sample = requests[:SAMPLE_REQUESTS]
        self.picture.value = figure_png(packing_figure(sample, plans[:SAMPLE_REQUESTS]))

    def _time_text(self, plans: list[Plan]) -> str:
        if self.table is None:
            return "no latency table recorded (data/bench/latency_h200.json)"
        t = sum((predict_time(p, self.table) for p in plans), TimeEstimate())
        return (f"graphs {t.total_ms:.1f} ms (of which eager fallbacks {t.fallback_ms:.1f} ms) vs eager "
                f"{t.eager_ms:.1f} ms ({self.table.config}, {self.table.dtype})")

    def _on_recommend(self, button: Any = None) -> None:
        objective = "padding" if self.table is None else "time"
        try:
            requests, config = self._requests(), self._config()
            limit = int(self.memory_gib.value * GIB) or None
            budgets = recommend_budgets(_specs(requests), self.max_graphs.value, limit, self.table, objective,
                                        max_items=config.max_items, max_segments=config.max_segments,
                                        packer=self.packer.value, vision_config=self.vision_config)
        except ValueError as err:
            self.message.value = _error_html(err)
            return
        self.budgets.value = ", ".join(map(str, budgets))
        self.message.value = f"<span class='glmvit-info'>recommended {len(budgets)} budgets minimising predicted " \
                             f"{objective}</span>"


def _specs(requests: list[list[MMItem]]) -> list[list[ItemSpec]]:
    return [[item.spec for item in request] for request in requests]


def _error_html(err: Any) -> str:
    return f"<span class='glmvit-error' style='color:#b00020'>⚠ {html.escape(str(err))}</span>"


def explorer(latency_table: str | Path | None = DEFAULT_TABLE) -> widgets.VBox:
    """The budget explorer widget (display it in a notebook or serve it with Voilà)."""
    return BudgetExplorer(latency_table).widget
