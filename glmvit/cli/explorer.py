"""The budget explorer: ``glmvit plan`` with controls, as an ipywidgets app (``explorer()`` returns it; ``make
explorer`` serves it behind a token, :mod:`glmvit.cli.explorer_serve`).

Times come from a latency table: by default the sweep recorded in data/bench for the graph-compiled runner
(``glmvit.recorded.recorded_table``), or the uncompiled one, or your own (a file or an upload); the page says what
the table measured, on which GPU, at which commit, and whether the code changed since. Two systems are modelled:
vLLM 0.33 (its packer; every batch a budget holds is replayed) and glmvit (first-fit decreasing; each batch replayed
or run eagerly, whichever the table predicts faster), packed per request or per vLLM engine step
(:mod:`glmvit.cli.explorer_report`). The first budget set is exported as vLLM's ``--compilation-config`` JSON, beside
what vLLM is predicted to do with it. File fields read and write only in the :class:`~glmvit.cli.explorer_files.
Workspace`.
"""
from __future__ import annotations

import base64
import html
import json
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator

import ipywidgets as widgets

from ..config import VisionConfig
from ..costmodel import LatencyTable
from ..deployment import check_budget_fits, recommend_budgets
from ..geometry import ItemSpec
from ..modes import TABLE_MODES
from ..packing import VLLM_MAX_NUM_BATCHED_TOKENS, BudgetConfig, max_items_rule, parse_budgets
from ..recorded import load_latency_table, recorded_table
from ..traces import SUFFIXES, parse_trace
from ..workloads import PRESETS, MMItem, random_mm_workload
from .common import check_budgets
from .explorer_files import Workspace, bounded, table_from_bytes, upload_bytes
from .explorer_report import (
    GIB,
    SYSTEM_TEXT,
    SYSTEMS,
    Analysis,
    analyse,
    batch_table_html,
    error_html,
    figure_svg,
    packing_figure,
    rows_html,
    summary_rows,
    table_facts,
    table_warnings,
    times_text,
    warning_html,
)
from .plan import export_config

DEFAULT_PRESET = "mixed-av"  # images and clips of two sizes, 1–3 a request: what the padding trade is about
SAMPLE_GROUPS = 6  # requests (or engine steps) the chart draws
TRACE = "trace"  # the workload dropdown's value for the loaded trace
NO_TABLE = "none"  # the table dropdown's value for "no times"


@lru_cache(maxsize=16)
def _workload(preset: str, num_requests: int, items_per_request: int, seed: int) -> list[list[MMItem]]:
    p = PRESETS[preset]
    return random_mm_workload(p.bucket_config, num_requests, items_per_request, p.range_ratio, seed,
                              p.limit_per_request)


def _specs(requests: list[list[MMItem]]) -> list[list[ItemSpec]]:
    return [[item.spec for item in request] for request in requests]


class BudgetExplorer:
    """Widgets for a workload (preset or trace), the system and how it packs, budgets, limits, a latency table and
    a second budget set; shows packing, padding, how each batch runs, memory, capture time and predicted times,
    and exports the first set to vLLM.

    ``latency_table``: a runner mode ("graph-compiled", the default, or "graph") picks the table recorded for it in
    data/bench; a path or a :class:`LatencyTable` is yours (read as given: code is trusted, the page's fields are
    not); None: no times. ``workspace``: where the page's file fields read and write (:meth:`Workspace.default`).
    ``num_requests``: where the requests slider starts.
    """

    def __init__(self, latency_table: str | Path | LatencyTable | None = "graph-compiled",
                 vision_config: VisionConfig | None = None, workspace: Workspace | None = None,
                 num_requests: int = 1000):
        self.vision_config = vision_config or VisionConfig.glm41v()
        self.workspace = workspace or Workspace.default()
        self.tables: dict[str, LatencyTable | None] = {NO_TABLE: None}
        self._table_labels: dict[str, str] = {NO_TABLE: "no table (no times)"}
        self._notes: list[str] = []  # problems with the tables, shown until the next good one
        self._trace: list[list[MMItem]] = []
        self.analyses: list[Analysis] = []
        self._quiet = True  # no redraws while widgets are built or several change at once
        style = {"description_width": "initial"}
        wide = widgets.Layout(width="30em")
        self.preset = widgets.Dropdown(options=self._workload_options(), value=DEFAULT_PRESET,
                                       description="workload", style=style, layout=widgets.Layout(width="46em"))
        self.num_requests = widgets.IntSlider(num_requests, 10, 2000, step=10, description="requests",
                                              continuous_update=False)
        self.items_per_request = widgets.IntSlider(1, 1, 8, description="items/request", continuous_update=False,
                                                   style=style)
        self.seed = widgets.BoundedIntText(42, min=0, max=2**32 - 1, description="seed",
                                           layout=widgets.Layout(width="12em"))
        self.trace_path = widgets.Text(description="trace file", continuous_update=False, style=style, layout=wide,
                                       placeholder=f"in {self.workspace.root.name or '/'}/: .csv, .json or .jsonl")
        self.upload = widgets.FileUpload(accept=",".join(SUFFIXES), multiple=False, description="upload trace")
        self.system = widgets.ToggleButtons(options=[("vLLM 0.33", "vllm"), ("glmvit", "glmvit")],
                                            description="system", style=style,
                                            tooltips=[SYSTEM_TEXT["vllm"], SYSTEM_TEXT["glmvit"]])
        self.per = widgets.ToggleButtons(options=[("request", "request"), ("engine step", "step")],
                                         description="packed per", style=style,
                                         tooltips=["each request packed alone",
                                                   "vLLM at saturation: every item of an engine step packed together"])
        self.step_tokens = widgets.BoundedIntText(VLLM_MAX_NUM_BATCHED_TOKENS, min=1, max=1_000_000, style=style,
                                                  description="vision tokens per step",
                                                  layout=widgets.Layout(width="16em"), disabled=True)
        self.budgets = widgets.Text(value="auto", description="budgets", continuous_update=False,
                                    placeholder="64, 256, 1024 or auto", style=style)
        self.max_items = widgets.IntSlider(64, 1, 128, description="max items", continuous_update=False)
        self.max_items_auto = widgets.Checkbox(True, description=f"auto: {max_items_rule()}", indent=False,
                                               layout=widgets.Layout(width="22em"))
        self.max_segments = widgets.Text(value="auto", description="max segments", continuous_update=False,
                                         placeholder="auto or a number", style=style,
                                         layout=widgets.Layout(width="16em"))
        self.compare = widgets.Text(value="", description="compare with", continuous_update=False,
                                    placeholder="second budget set (empty: none)", style=style)
        self.table_choice = widgets.Dropdown(description="predict from", style=style,
                                             layout=widgets.Layout(width="30em"))
        self.table_path = widgets.Text(description="table file", continuous_update=False, style=style,
                                       layout=widgets.Layout(width="22em"),
                                       placeholder="python -m glmvit latency --json PATH")
        self.table_upload = widgets.FileUpload(accept=".json", multiple=False, description="upload table")
        self.table_info = widgets.HTML()
        self.max_graphs = widgets.IntSlider(7, 1, 12, description="max graphs", continuous_update=False)
        self.memory_gib = widgets.BoundedFloatText(0.0, min=0.0, max=1024.0, step=0.5, style=style,
                                                   description="memory limit GiB (0 = none)",
                                                   layout=widgets.Layout(width="24em"))
        self.recommend = widgets.Button(description="Recommend", button_style="info",
                                        tooltip="fill the budgets field with recommend_budgets")
        self.export_path = widgets.Text(value="vllm_compilation_config.json", description="export to",
                                        style=style, layout=widgets.Layout(width="26em"))
        self.export = widgets.Button(description="Export vLLM config", button_style="success",
                                     tooltip="write the first budget set as vLLM's --compilation-config JSON in "
                                             "the workspace directory")
        self.message = widgets.HTML()
        self.warnings = widgets.HTML()
        self.summary = widgets.HTML()
        self.routing = widgets.HTML()
        self.export_text = widgets.HTML()
        self.picture = widgets.Image(format="svg+xml", layout=widgets.Layout(width="100%", max_width="1000px"))
        self.widget = widgets.VBox([
            widgets.HTML("<h3>glmvit budget explorer</h3>"),
            self.preset,
            widgets.HBox([self.num_requests, self.items_per_request, self.seed]),
            widgets.HBox([self.trace_path, self.upload]),
            widgets.HBox([self.system, self.per, self.step_tokens]),
            widgets.HBox([self.budgets, self.max_items, self.max_items_auto, self.max_segments]),
            self.compare,
            widgets.HBox([self.table_choice, self.table_path, self.table_upload]),
            self.table_info,
            widgets.HBox([self.recommend, self.max_graphs, self.memory_gib]),
            self.message, self.warnings, self.summary, self.routing, self.picture,
            widgets.HBox([self.export, self.export_path]), self.export_text,
        ])
        self._init_tables(latency_table)
        self.preset.observe(self._on_preset, names="value")
        self.max_items.observe(self._on_max_items, names="value")  # first: auto is off before the redraw
        for w in (self.system, self.per, self.step_tokens, self.budgets, self.compare, self.max_items,
                  self.max_items_auto, self.max_segments, self.num_requests, self.items_per_request, self.seed,
                  self.table_choice):
            w.observe(self._on_change, names="value")
        self.table_path.observe(self._on_table_path, names="value")
        self.table_upload.observe(self._on_table_upload, names="value")
        self.trace_path.observe(self._on_trace_path, names="value")
        self.upload.observe(self._on_upload, names="value")
        self.recommend.on_click(self._on_recommend)
        self.export.on_click(self._on_export)
        self._quiet = False
        self._on_preset()

    # ---- tables ------------------------------------------------------------------------------------------------
    def _init_tables(self, latency_table: str | Path | LatencyTable | None) -> None:
        for mode in TABLE_MODES:
            try:
                table = recorded_table(mode)
                label = f"{'compiled' if mode.compiled else 'uncompiled'} graphs: the recorded " \
                        f"{table.provenance.get('gpu') or ''} table{' (STALE)' if table.changed else ''}"
                self._add_table(f"recorded:{mode}", table, label, select=False)
            except ValueError as err:  # an installed package has no data/bench; a second sweep of a mode is ambiguous
                self._notes.append(f"no recorded {mode} table: {err}")
        if isinstance(latency_table, str) and latency_table in TABLE_MODES:
            key = f"recorded:{latency_table}"
            self._refresh_table_options(key if key in self.tables else NO_TABLE)
        elif latency_table is None:
            self._refresh_table_options(NO_TABLE)
        else:
            try:
                table = latency_table if isinstance(latency_table, LatencyTable) else \
                    load_latency_table(latency_table)
                self._add_table(f"file:{len(self.tables)}", table, f"yours: {Path(table.source or 'table').name}")
            except (ValueError, OSError, UnicodeDecodeError) as err:
                self._notes.append(f"latency table unusable: {err}")
                self._refresh_table_options(NO_TABLE)

    def _add_table(self, key: str, table: LatencyTable, label: str, select: bool = True) -> None:
        self.tables[key] = table
        self._table_labels[key] = label
        self._refresh_table_options(key if select else self.table_choice.value or NO_TABLE)

    def _refresh_table_options(self, value: str) -> None:
        order = [k for k in self.tables if k != NO_TABLE] + [NO_TABLE]
        with self._held():
            self.table_choice.options = [(self._table_labels[k], k) for k in order]
            self.table_choice.value = value

    @contextmanager
    def _held(self, then: Callable[[], None] | None = None) -> Iterator[None]:
        """Change several widgets, then redraw once with ``then`` (default ``_on_change``), if redrawing is on."""
        quiet, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = quiet
        if not quiet:
            (then or self._on_change)()

    @property
    def table(self) -> LatencyTable | None:
        return self.tables.get(self.table_choice.value)

    def _on_table_path(self, change: Any = None) -> None:
        if self.table_path.value.strip():
            self._load_table(lambda: self.workspace.read(self.table_path.value, (".json",), "latency table"))

    def _on_table_upload(self, change: Any = None) -> None:
        if self.table_upload.value:
            upload = self.table_upload.value[0]
            self._load_table(lambda: (upload["name"], upload_bytes(upload)))

    def _load_table(self, read: Callable[[], tuple[str, bytes]]) -> None:
        try:
            name, data = read()
            table = table_from_bytes(data, name)
        except ValueError as err:
            self._notes = [f"latency table unusable: {err}"]
            self._on_change()
            return
        self._notes = []
        self._add_table(f"file:{len(self.tables)}", table, f"yours: {name}")

    # ---- workload ----------------------------------------------------------------------------------------------
    def _workload_options(self, trace: str = "") -> list[tuple[str, str]]:
        options = [(f"{k}: {p.description}", k) for k, p in PRESETS.items()]
        return options + [(f"trace: {trace}", TRACE)] if trace else options

    def _set_trace(self, requests: list[list[MMItem]], name: str) -> None:
        self._trace = bounded(requests, name)
        label = f"{name} ({len(requests)} requests, {sum(map(len, requests))} items)"
        with self._held(self._on_preset):
            self.preset.options = self._workload_options(label)
            self.preset.value = TRACE

    def _requests(self) -> list[list[MMItem]]:
        if self.preset.value == TRACE:
            return self._trace
        return _workload(self.preset.value, self.num_requests.value, self.items_per_request.value, self.seed.value)

    def _on_trace_path(self, change: Any = None) -> None:
        if not self.trace_path.value.strip():
            return
        try:
            name, data = self.workspace.read(self.trace_path.value, SUFFIXES, "trace")
            self._set_trace(parse_trace(data, name), name)
        except ValueError as err:
            self._show_error(err)

    def _on_upload(self, change: Any = None) -> None:
        if not self.upload.value:
            return
        upload = self.upload.value[0]
        try:
            self._set_trace(parse_trace(upload_bytes(upload), upload["name"]), upload["name"])
        except ValueError as err:
            self._show_error(err)

    def _on_preset(self, change: Any = None) -> None:
        if self._quiet:
            return
        random = self.preset.value != TRACE
        with self._held():
            for w in (self.num_requests, self.items_per_request, self.seed):
                w.disabled = not random
            if random:
                self.items_per_request.value = PRESETS[self.preset.value].items_per_request

    # ---- budgets -----------------------------------------------------------------------------------------------
    def _configs(self) -> list[BudgetConfig]:
        configs = [self._config(self.budgets.value)]
        if self.compare.value.strip():
            configs.append(self._config(self.compare.value, "compare with: "))
        return configs

    def _config(self, text: str, what: str = "") -> BudgetConfig:
        """The budgets typed, the limits set; max items "auto": vLLM's (:func:`~glmvit.packing.default_max_items`,
        as ``plan`` resolves it), shown on the slider; max segments "auto": vLLM's 600 frames an item, at most the
        largest budget (a batch never has more segments than tokens, and glmvit refuses graphs with more)."""
        try:
            budgets, segments = check_budgets(parse_budgets(text)), self._max_segments()
            items = None if self.max_items_auto.value else self.max_items.value
            config = check_budget_fits(BudgetConfig.resolve(budgets, items, segments, video=True))
        except ValueError as err:
            raise ValueError(f"{what}{err}") from None
        if items is None and not what:  # the first set's limit on the slider, without a redraw
            quiet, self._quiet = self._quiet, True
            try:
                self.max_items.value = config.max_items
            finally:
                self._quiet = quiet
        return config

    def _on_max_items(self, change: Any = None) -> None:
        """Moving the slider sets max items by hand (auto off)."""
        if not self._quiet:
            self.max_items_auto.value = False

    def _max_segments(self) -> int | None:
        text = self.max_segments.value.strip()
        if text.lower() in ("", "auto"):
            return None
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            raise ValueError(f"max segments {text!r} is not a positive integer or 'auto'")
        return int(text)

    # ---- showing -----------------------------------------------------------------------------------------------
    def _on_change(self, change: Any = None) -> None:
        if self._quiet:
            return
        self.step_tokens.disabled = self.per.value != "step"
        self.table_info.value = self._table_html()
        try:
            requests, configs = self._requests(), self._configs()
            specs = _specs(requests)
            self.analyses = [analyse(specs, c, self.table, self.system.value, self.per.value,
                                     self.step_tokens.value, self.vision_config) for c in configs]
        except ValueError as err:
            self._show_error(err)
            return
        self.message.value = "".join(error_html(n) for n in self._notes)
        self._show(requests, specs)

    def _table_html(self) -> str:
        table = self.table
        if table is None:
            return "<div class='glmvit-table'>no latency table: packing, padding and memory only, no times</div>"
        facts = " · ".join(f"{k}: <b>{html.escape(v)}</b>" for k, v in table_facts(table))
        return f"<div class='glmvit-table'>predicting from {facts}</div>"

    def _show_error(self, err: Exception) -> None:
        """Bad input: a visible message instead of numbers that no longer match the controls."""
        self.message.value = error_html(err)
        for w in (self.warnings, self.summary, self.routing, self.export_text):
            w.value = ""
        self.picture.value = b""
        self.analyses = []

    def _show(self, requests: list[list[MMItem]], specs: list[list[ItemSpec]]) -> None:
        first = self.analyses[0]
        videos = sum(s.segments > 1 for r in specs for s in r)
        plural = "" if videos == 1 else "s"
        workload = (f"{len(requests)} requests, {sum(map(len, requests))} items ({videos} video{plural}), "
                    f"{first.report.stats.real_tokens:,} tokens")
        rows = [("workload", *(workload for _ in self.analyses))] + summary_rows(self.analyses,
                                                                                 self.step_tokens.value)
        heads = ("", "budget set A", "budget set B") if len(self.analyses) > 1 else ()
        note = "<div class='glmvit-note'>graph memory: an estimate for GLM-4.1V in bf16, for the runner mode and " \
               "attention of the table (costmodel.graph_memory)</div>"
        self.summary.value = rows_html(rows, heads) + note
        warnings = table_warnings(self.table, [a.config for a in self.analyses]) if self.table else []
        warnings += [f"budget set {'AB'[k]}: {self.system.value} is predicted slower than running every request "
                     f"eagerly" for k, a in enumerate(self.analyses)
                     if a.report.graphs and a.report.eager and a.report.graphs.mean_ms > a.report.eager.mean_ms]
        self.warnings.value = "".join(warning_html(w) for w in warnings)
        self.routing.value = batch_table_html(first)
        self.picture.value = figure_svg(packing_figure(first.groups[:SAMPLE_GROUPS], first.runs, first.report.per))
        self.export_text.value = self._export_html(specs)

    def _export_html(self, specs: list[list[ItemSpec]]) -> str:
        first = self.analyses[0]
        data = export_config(first.config, specs)
        text = json.dumps(data, indent=1) + "\n"
        link = (f"<a class='glmvit-download' download='vllm_compilation_config.json' "
                f"href='data:application/json;base64,{base64.b64encode(text.encode()).decode()}'>download it</a>")
        vllm = first if first.system == "vllm" else analyse(specs, first.config, self.table, "vllm",
                                                             self.per.value, self.step_tokens.value,
                                                             self.vision_config)
        if vllm.report.graphs is None or vllm.report.eager is None:
            predicted = "no latency table: what vLLM will take is not predicted"
        else:
            predicted = (f"vLLM with this config (its packer, no routing, packed per {self.per.value}): "
                         f"{times_text(vllm.report.graphs)} ms/request (median · mean · P99); all eager "
                         f"{times_text(vllm.report.eager)}")
        slower = vllm.report.graphs and vllm.report.eager and vllm.report.graphs.mean_ms > vllm.report.eager.mean_ms
        warning = warning_html("vLLM is predicted slower with these graphs than without: do not deploy them "
                                "as they are") if slower else ""
        return (f"<div class='glmvit-vllm'>{html.escape(predicted)}</div>{warning}"
                f"<pre class='glmvit-export'>{html.escape(text)}</pre>"
                f"<div>pass it as <code>vllm serve … --compilation-config \"$(cat FILE)\"</code>, or {link}</div>")

    # ---- buttons -----------------------------------------------------------------------------------------------
    def _on_recommend(self, button: Any = None) -> None:
        table = self.table
        objective = "padding" if table is None else "time"
        packer = SYSTEMS[self.system.value][0]
        try:
            requests, config = self._requests(), self._config(self.budgets.value)
            limit = int(self.memory_gib.value * GIB) or None
            budgets = recommend_budgets(_specs(requests), self.max_graphs.value, limit, table, objective,
                                        max_items=config.max_items, max_segments=config.max_segments,
                                        packer=packer, vision_config=self.vision_config)
        except ValueError as err:
            self.message.value = error_html(err)
            return
        self.budgets.value = ", ".join(map(str, budgets))
        self.message.value = (f"<span class='glmvit-info'>recommended {len(budgets)} budgets minimising predicted "
                              f"{objective} ({packer} packer, each request packed alone, no routing)</span>")

    def _on_export(self, button: Any = None) -> None:
        try:
            configs = self._configs()
            data = export_config(configs[0], _specs(self._requests()))
            path = self.workspace.write_export(self.export_path.value or "vllm_compilation_config.json",
                                               (json.dumps(data, indent=1) + "\n").encode())
        except (ValueError, OSError) as err:
            self.message.value = error_html(err)
            return
        self.message.value = f"<span class='glmvit-info'>wrote {html.escape(str(path))}: pass it to vLLM as " \
                             f"--compilation-config \"$(cat {html.escape(str(path))})\"</span>"


def explorer(latency_table: str | Path | LatencyTable | None = "graph-compiled") -> widgets.VBox:
    """The budget explorer widget (display it in a notebook, or serve it: ``make explorer``)."""
    return BudgetExplorer(latency_table).widget


