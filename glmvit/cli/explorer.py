"""The budget explorer: an ipywidgets app over :mod:`glmvit.packing`, :mod:`glmvit.costmodel`,
:mod:`glmvit.workloads` and :mod:`glmvit.traces` — ``glmvit plan`` with controls.

``explorer()`` returns the widget. The workload is a preset or a trace of real item sizes (a path, or an upload);
times, P99 and capture time come from the latency table in the table field (the H200's by default; measure your
GPU's with ``python -m glmvit latency --json PATH``) and are not shown without one. A second budget set can be
shown beside the first, and the first is exported as vLLM's ``--compilation-config`` JSON.
"""
from __future__ import annotations

import html
import io
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import ipywidgets as widgets
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from ..config import VisionConfig
from ..costmodel import LatencyTable
from ..deployment import check_budget_fits, evaluate_budgets, recommend_budgets
from ..geometry import ItemSpec
from ..packing import BudgetConfig, Plan, parse_budgets, plan_workload
from ..traces import SUFFIXES, load_trace, parse_trace
from ..workloads import PRESETS, MMItem, random_mm_workload
from .common import check_budgets, check_writable, read_latency_table, write_atomic
from .plan import export_config, report_rows

H200_TABLE = Path(__file__).resolve().parents[2] / "data" / "bench" / "latency_h200.json"
DEFAULT_TABLE = H200_TABLE if H200_TABLE.is_file() else None  # a checkout has it; an installed package may not
EXPLORER_PRESETS = ("img1x224", "mixed-img", "mixed-av", "mixed-large", "video8x224")
SAMPLE_REQUESTS = 8
GIB = 2**30
TRACE = "trace"  # the workload dropdown's value for the loaded trace


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


def _rows_html(rows: list[tuple[str, ...]], heads: tuple[str, ...] = ()) -> str:
    head = "".join(f"<th style='text-align:left;padding-right:1em'>{html.escape(h)}</th>" for h in heads)
    body = "".join("<tr><td style='padding-right:1em'>" + html.escape(row[0]) + "</td>" +
                   "".join(f"<td style='padding-right:1em'><b>{html.escape(v)}</b></td>" for v in row[1:]) + "</tr>"
                   for row in rows)
    return f"<table class='glmvit-summary'>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


class BudgetExplorer:
    """Widgets for a workload (preset or trace), budgets, limits, a latency table and a second budget set; shows
    packing, padding, replays, memory, capture time and predicted median / P99 times, and exports to vLLM."""

    def __init__(self, latency_table: str | Path | None = DEFAULT_TABLE, vision_config: VisionConfig | None = None):
        self.vision_config = vision_config or VisionConfig.glm41v()
        self.table: LatencyTable | None = None
        self._table_note = ""
        self._trace: list[list[MMItem]] = []
        style = {"description_width": "initial"}
        wide = widgets.Layout(width="34em")
        self.preset = widgets.Dropdown(options=self._workload_options(), description="workload", style=style)
        self.packer = widgets.ToggleButtons(options=[("FFD", "ffd"), ("vLLM next-fit", "vllm")], description="packer")
        self.trace_path = widgets.Text(description="trace file", placeholder="trace.csv, .json or .jsonl",
                                       continuous_update=False, style=style, layout=wide)
        self.upload = widgets.FileUpload(accept=",".join(SUFFIXES), multiple=False, description="upload trace")
        self.table_path = widgets.Text(value=str(latency_table or ""), description="latency table",
                                       placeholder="python -m glmvit latency --json PATH", continuous_update=False,
                                       style=style, layout=wide)
        self.budgets = widgets.Text(value="auto", description="budgets", continuous_update=False,
                                    placeholder="64, 256, 1024 or auto", style=style)
        self.compare = widgets.Text(value="", description="compare with", continuous_update=False,
                                    placeholder="second budget set (empty: none)", style=style)
        self.max_items = widgets.IntSlider(64, 1, 64, description="max items", continuous_update=False)
        self.max_segments = widgets.IntSlider(64, 1, 512, description="max segments", continuous_update=False)
        self.num_requests = widgets.IntSlider(1000, 10, 2000, step=10, description="requests",
                                              continuous_update=False)
        self.items_per_request = widgets.IntSlider(1, 1, 8, description="items/request", continuous_update=False,
                                                   style=style)
        self.seed = widgets.BoundedIntText(42, min=0, max=2**32 - 1, description="seed",
                                           layout=widgets.Layout(width="12em"))
        self.max_graphs = widgets.IntSlider(7, 1, 12, description="max graphs", continuous_update=False)
        self.memory_gib = widgets.BoundedFloatText(0.0, min=0.0, max=1024.0, step=0.5, style=style,
                                                   description="memory limit GiB (0 = none)",
                                                   layout=widgets.Layout(width="24em"))
        self.recommend = widgets.Button(description="Recommend", button_style="info",
                                        tooltip="fill the budgets field with recommend_budgets")
        self.export_path = widgets.Text(value="vllm_compilation_config.json", description="export to",
                                        style=style, layout=wide)
        self.export = widgets.Button(description="Export vLLM config", button_style="success",
                                     tooltip="write the first budget set as vLLM's --compilation-config JSON")
        self.message = widgets.HTML()
        self.summary = widgets.HTML()
        self.export_text = widgets.HTML()
        self.picture = widgets.Image(format="png")
        self.widget = widgets.VBox([
            widgets.HTML("<h3>glmvit budget explorer</h3>"),
            widgets.HBox([self.preset, self.packer]),
            widgets.HBox([self.trace_path, self.upload]),
            widgets.HBox([self.num_requests, self.items_per_request, self.seed]),
            widgets.HBox([self.budgets, self.max_items, self.max_segments]),
            widgets.HBox([self.compare, self.table_path]),
            widgets.HBox([self.recommend, self.max_graphs, self.memory_gib]),
            self.message, self.summary,
            widgets.HBox([self.export, self.export_path]), self.export_text,
            self.picture,
        ])
        self._load_table()
        self.preset.observe(self._on_preset, names="value")
        for w in (self.packer, self.budgets, self.compare, self.max_items, self.max_segments, self.num_requests,
                  self.items_per_request, self.seed):
            w.observe(self._on_change, names="value")
        self.table_path.observe(self._on_table, names="value")
        self.trace_path.observe(self._on_trace_path, names="value")
        self.upload.observe(self._on_upload, names="value")
        self.recommend.on_click(self._on_recommend)
        self.export.on_click(self._on_export)
        self._on_preset()

    # ---- inputs ------------------------------------------------------------------------------------------------
    def _workload_options(self, trace: str = "") -> list[tuple[str, str]]:
        options = [(f"{k}: {PRESETS[k].description}", k) for k in EXPLORER_PRESETS]
        return options + [(f"trace: {trace}", TRACE)] if trace else options

    def _load_table(self) -> None:
        path = self.table_path.value.strip()
        if not path:
            self.table, self._table_note = None, ""
            return
        try:
            self.table, self._table_note = read_latency_table(path), ""
        except ValueError as err:
            self.table, self._table_note = None, _error_html(f"latency table unusable: {err}")

    def _set_trace(self, requests: list[list[MMItem]], name: str) -> None:
        self._trace = requests
        label = f"{name} ({len(requests)} requests, {sum(map(len, requests))} items)"
        self.preset.options = self._workload_options(label)
        if self.preset.value == TRACE:
            self._on_preset()
        else:
            self.preset.value = TRACE  # observed: _on_preset redraws

    def _requests(self) -> list[list[MMItem]]:
        if self.preset.value == TRACE:
            return self._trace
        return _workload(self.preset.value, self.num_requests.value, self.items_per_request.value, self.seed.value)

    def _configs(self) -> list[BudgetConfig]:
        configs = [self._config(self.budgets.value)]
        if self.compare.value.strip():
            configs.append(self._config(self.compare.value, "compare with: "))
        return configs

    def _config(self, text: str, what: str = "") -> BudgetConfig:
        try:
            budgets = check_budgets(parse_budgets(text))
            config = BudgetConfig.resolve(budgets, self.max_items.value, self.max_segments.value)
            return check_budget_fits(config)
        except ValueError as err:
            raise ValueError(f"{what}{err}") from None

    # ---- events ------------------------------------------------------------------------------------------------
    def _on_preset(self, change: Any = None) -> None:
        random = self.preset.value != TRACE
        for w in (self.num_requests, self.items_per_request, self.seed):
            w.disabled = not random
        if random:
            self.items_per_request.value = PRESETS[self.preset.value].items_per_request
        self._on_change()

    def _on_table(self, change: Any = None) -> None:
        self._load_table()
        self._on_change()

    def _on_trace_path(self, change: Any = None) -> None:
        path = self.trace_path.value.strip()
        if not path:
            return
        try:
            self._set_trace(load_trace(path), Path(path).name)
        except (ValueError, OSError) as err:
            self._show_error(err)

    def _on_upload(self, change: Any = None) -> None:
        if not self.upload.value:
            return
        upload = self.upload.value[0]
        try:
            self._set_trace(parse_trace(bytes(upload["content"]), upload["name"]), upload["name"])
        except ValueError as err:
            self._show_error(err)

    def _on_change(self, change: Any = None) -> None:
        try:
            requests, configs = self._requests(), self._configs()
        except ValueError as err:
            self._show_error(err)
            return
        self.message.value = self._table_note
        self._show(requests, configs)

    def _show_error(self, err: Exception) -> None:
        """Bad input: a visible message instead of numbers that no longer match the controls."""
        self.message.value = _error_html(err)
        self.summary.value = ""
        self.export_text.value = ""
        self.picture.value = b""

    def _show(self, requests: list[list[MMItem]], configs: list[BudgetConfig]) -> None:
        specs = _specs(requests)
        reports = [evaluate_budgets(specs, c, self.table, self.vision_config, packer=self.packer.value)
                   for c in configs]
        rows = [("workload", *(f"{len(requests)} requests, {sum(map(len, requests))} items, "
                               f"{r.stats.real_tokens} tokens" for r in reports))]
        rows += report_rows(reports, specs, self.packer.value)
        heads = ("", "budget set A", "budget set B") if len(configs) > 1 else ()
        source = "" if self.table is None else \
            f"times from {html.escape(self.table_path.value)} ({self.table.config}, {self.table.dtype}); "
        where = f"<div class='glmvit-note'>{source}graph memory: an estimate for GLM-4.1V in bf16</div>"
        self.summary.value = _rows_html(rows, heads) + where
        self.export_text.value = "<pre class='glmvit-export'>" + html.escape(
            json.dumps(export_config(configs[0], specs))) + "</pre>"
        plans = plan_workload(specs[:SAMPLE_REQUESTS], configs[0], self.packer.value)
        self.picture.value = figure_png(packing_figure(requests[:SAMPLE_REQUESTS], plans))

    def _on_recommend(self, button: Any = None) -> None:
        objective = "padding" if self.table is None else "time"
        try:
            requests, config = self._requests(), self._config(self.budgets.value)
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

    def _on_export(self, button: Any = None) -> None:
        try:
            configs = self._configs()
            path = check_writable(self.export_path.value.strip() or "vllm_compilation_config.json")
            data = export_config(configs[0], _specs(self._requests()))
            write_atomic(path, (json.dumps(data, indent=1) + "\n").encode())
        except (ValueError, OSError) as err:
            self.message.value = _error_html(err)
            return
        self.message.value = f"<span class='glmvit-info'>wrote {html.escape(str(path))}: pass it to vLLM as " \
                             f"--compilation-config \"$(cat {html.escape(str(path))})\"</span>"


def _specs(requests: list[list[MMItem]]) -> list[list[ItemSpec]]:
    return [[item.spec for item in request] for request in requests]


def _error_html(err: Any) -> str:
    return f"<span class='glmvit-error' style='color:#b00020'>⚠ {html.escape(str(err))}</span>"


def explorer(latency_table: str | Path | None = DEFAULT_TABLE) -> widgets.VBox:
    """The budget explorer widget (display it in a notebook or serve it with Voilà)."""
    return BudgetExplorer(latency_table).widget
