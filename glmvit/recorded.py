"""Latency tables and capture costs read from recorded results: the typed files the tools write.

The recording side of the cost model. :mod:`glmvit.costmodel` holds the model (:class:`~glmvit.costmodel.LatencyTable`,
what the runner routes by); this module fits it on a recorded sweep or reads a plain table, both checked by
:mod:`glmvit.records`' schemas, and finds recorded ones in the directories it is given (by default the checkout's
``data/``). The runtime never imports it: a runner routes by the table it is handed.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .config import VisionConfig
from .costmodel import MIN_BASE_MS, CaptureCost, LatencyTable, fit_capture_cost
from .files import read_bounded
from .model import GlmVisionEncoder
from .modes import TABLE_MODES, RunMode
from .records import (
    MAX_RECORD_BYTES,
    RECORD_DIRS,
    LatencySweep,
    PlainLatencyTable,
    StartupRecord,
    find_one,
    parse,
    staleness,
)


def table_from_sweep(sweep: LatencySweep, source: str | None = None) -> LatencyTable:
    """The model fitted on a recorded sweep (``python -m glmvit latency``), labelled with what it measured."""
    data = sweep.model_dump(mode="json")
    table = _fit(data["budgets"], data)
    return dataclasses.replace(table, mode=sweep.mode, attention=sweep.attn_backend, source=source,
                               changed=tuple(staleness(sweep)))


def table_from_dict(data: Mapping[str, Any]) -> LatencyTable:
    """A plain table, ``{"budgets": [{tokens, graph_ms, eager_ms[, graph_p99_ms, eager_p99_ms][, layouts]}]}``,
    typed as strictly as a recorded sweep (:class:`glmvit.records.PlainLatencyTable`): fitted on its layouts if
    every budget has them, else read as columns."""
    table = parse(dict(data), PlainLatencyTable, "latency table").model_dump(mode="json", exclude_none=True)
    rows = sorted(table["budgets"], key=lambda r: r["tokens"])
    if all("layouts" in r for r in rows):
        return _fit(rows, table)
    tokens, graph_ms, eager_ms = (tuple(r[key] for r in rows) for key in ("tokens", "graph_ms", "eager_ms"))
    p99 = all("graph_p99_ms" in r and "eager_p99_ms" in r for r in rows)
    return LatencyTable(tokens, graph_ms, eager_ms, **_labels(table),
                        graph_p99_ms=tuple(r["graph_p99_ms"] for r in rows) if p99 else None,
                        eager_p99_ms=tuple(r["eager_p99_ms"] for r in rows) if p99 else None)


def _labels(data: Mapping[str, Any]) -> dict[str, Any]:
    """The labels of a typed table (a sweep's or a plain table's dump): its dtype, config, provenance, captures."""
    return {"dtype": data.get("dtype", "bfloat16"), "config": data.get("config", "glm41v"),
            "provenance": dict(data.get("provenance", {})), "capture_s": _capture_seconds(data.get("capture", {}))}


def _fit(rows: list[Mapping[str, Any]], data: Mapping[str, Any]) -> LatencyTable:
    """The model of :class:`LatencyTable` from measured layouts: attention_ms by least squares within each budget
    (layouts of one budget differ only in their attention), each budget's graph_ms = mean of replay − attention,
    eager_ms = the full layout's eager time − its attention (the full layout comes first: its real tokens are the
    budget's), eager_floor_ms = median eager time of layouts ≤ 256 tokens (where launches, not the GPU, set it)."""
    dx, dy = [], []
    for r in rows:
        work = np.array([x["segment_rows2"] / 1e6 for x in r["layouts"]])
        ms = np.array([x["graph_ms"] for x in r["layouts"]])
        dx += list(work - work.mean())
        dy += list(ms - ms.mean())
    slope = max(0.0, float(np.dot(dx, dy) / np.dot(dx, dx))) if np.dot(dx, dx) > 0 else 0.0
    # Attention cannot take longer than a whole replay, nor than the whole eager forward of a full layout: noisy
    # timings (a loaded CPU) must not fit a slope that leaves a budget a negative base. A base that the cap leaves
    # at zero is held at MIN_BASE_MS: no forward is faster than launching its work.
    ratios = [x["graph_ms"] / (x["segment_rows2"] / 1e6) for r in rows for x in r["layouts"] if x["segment_rows2"]]
    ratios += [r["layouts"][0]["eager_ms"] / (r["layouts"][0]["segment_rows2"] / 1e6) for r in rows
               if r["layouts"][0]["segment_rows2"]]
    slope = min([slope, *ratios])
    base = [max(MIN_BASE_MS, float(np.mean([x["graph_ms"] - slope * x["segment_rows2"] / 1e6 for x in r["layouts"]])))
            for r in rows]
    small = [x["eager_ms"] for r in rows for x in r["layouts"] if x["real_tokens"] <= 256]
    eager = [max(MIN_BASE_MS, float(r["layouts"][0]["eager_ms"]) - slope * r["layouts"][0]["segment_rows2"] / 1e6)
             for r in rows]
    small_p99 = [x["eager_p99_ms"] for r in rows for x in r["layouts"] if x["real_tokens"] <= 256]
    # P99 columns: each budget's base plus the largest tail (P99 − median) of its layouts
    tail = [max(x["graph_p99_ms"] - x["graph_ms"] for x in r["layouts"]) for r in rows]
    eager_tail = [max(x["eager_p99_ms"] - x["eager_ms"] for x in r["layouts"]) for r in rows]
    return LatencyTable(tuple(int(r["tokens"]) for r in rows), tuple(base), tuple(eager), **_labels(data),
                        graph_p99_ms=tuple(b + t for b, t in zip(base, tail, strict=True)),
                        eager_p99_ms=tuple(e + t for e, t in zip(eager, eager_tail, strict=True)), attention_ms=slope,
                        eager_floor_ms=float(np.median(small)) if small else 0.0,
                        eager_floor_p99_ms=float(np.median(small_p99)) if small_p99 else 0.0)


def _capture_seconds(capture: Mapping[str, Mapping[str, Any]]) -> dict[int, float]:
    """``{"64": {"seconds": 0.06, ...}, ...}`` (a typed table's ``capture``) → {64: 0.06, ...}."""
    return {int(budget): entry["seconds"] for budget, entry in capture.items()}


def load_latency_table(path: str | Path) -> LatencyTable:
    """A latency table from a file: a recorded sweep (``"kind": "latency"``), or a plain ``{"budgets": [...]}``."""
    raw = read_bounded(path, MAX_RECORD_BYTES, "latency table")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:  # RecursionError: nesting too deep
        raise ValueError(f"{path}: not a latency table: not JSON ({' '.join(str(err).split())[:200]})") from None
    return latency_table_from_json(data, str(path))


def latency_table_from_json(data: Any, source: str) -> LatencyTable:
    """A decoded latency-table file: a recorded sweep (``"kind": "latency"``) or a plain ``{"budgets": [...]}``."""
    if isinstance(data, dict) and "kind" in data:
        return table_from_sweep(parse(data, LatencySweep, source), source)
    if not isinstance(data, Mapping):
        raise ValueError(f"latency table: expected a JSON object, got {type(data).__name__}")
    return dataclasses.replace(table_from_dict(data), source=source)


Dirs = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]  # one directory, or several


def record_dirs(dirs: Dirs) -> tuple[Path, ...]:
    """``dirs`` as the distinct directories to search, in order: one path (a ``str`` or ``Path``) is one directory,
    never its characters; a directory named twice is searched once (its records are not two records)."""
    if isinstance(dirs, (str, os.PathLike)):
        dirs = (dirs,)
    distinct: dict[str, Path] = {}
    for d in dirs:
        distinct.setdefault(os.path.realpath(d), Path(d))
    return tuple(distinct.values())


def recorded_table(mode: RunMode | str = RunMode.GRAPH_COMPILED, attention: str | None = None,
                   dirs: Dirs = RECORD_DIRS) -> LatencyTable:
    """The latency table recorded in ``dirs`` (default: the checkout's ``data/bench`` and ``data/notebooks``) for a
    runner mode (``graph-compiled`` or ``graph``), and an attention backend if given (else the one sweep of that
    mode): chosen by what each sweep recorded, never by file name or order. :meth:`LatencyTable.describe` says
    which it is and whether it is current."""
    mode = RunMode.parse(mode)
    if mode not in TABLE_MODES:
        raise ValueError(f"no latency table is recorded for mode {mode.value!r}; choose one of "
                         f"{', '.join(TABLE_MODES)}")
    match: dict[str, Any] = {"compiled": mode.compiled, **({"attn_backend": attention} if attention else {})}
    path, sweep = find_one(LatencySweep, record_dirs(dirs), **match)
    return table_from_sweep(sweep, str(path))


STARTUP_SETTING = "blocks-auto"  # the compile setting the runner uses by default (tools/capture_time.py's names)


def recorded_capture_cost(start: str = "cold", dirs: Dirs = RECORD_DIRS) -> CaptureCost | None:
    """:func:`fit_capture_cost` on the recorded start-up (the startup record in ``dirs``, the default compile
    setting): ``start`` "cold" (empty compile caches, a server's first start) or "warm". None without one."""
    try:
        path, record = find_one(StartupRecord, record_dirs(dirs))
    except ValueError:
        return None
    run = record.runs.get(f"{STARTUP_SETTING}-{start}")
    if not isinstance(run, Mapping) or not isinstance(run.get("budgets"), Mapping):
        return None
    seconds = {int(b): float(entry["seconds"]) for b, entry in run["budgets"].items()}
    return fit_capture_cost(seconds, f"{path.name} ({start} start, compiled)")


def capture_cost(table: LatencyTable) -> CaptureCost | None:
    """The capture cost for ``table``'s runner: a compiled table's from the recorded cold start-up (its own sweep
    captured in a process that had compiled before), any other from the table's own capture times."""
    if table.mode == RunMode.GRAPH_COMPILED:
        cost = recorded_capture_cost("cold")
        if cost is not None:
            return cost
    return fit_capture_cost(table.capture_s, f"{Path(table.source).name if table.source else 'the table'}'s "
                                             "captures")


def recorded_table_for(model: GlmVisionEncoder, compiled: bool, attention: str | None = None, *,
                       dirs: Dirs) -> LatencyTable | None:
    """The latency table recorded in ``dirs`` (explicit: e.g. a checkout's ``data/bench``) for a runner of this mode
    (compiled or not) that measured this model — the GLM-4.1V tower, its dtype and attention backend
    (``attention``, or the model's) — on this GPU; None when there is none (a runner without a table replays
    whatever a budget holds). Stale or not: :meth:`LatencyTable.describe` says which."""
    try:
        mode = RunMode.GRAPH_COMPILED if compiled else RunMode.GRAPH
        table = recorded_table(mode, model.attention_backend(attention), dirs)
    except ValueError:
        return None
    gpu = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None
    dtype = str(model.dtype).replace("torch.", "")
    matches = model.config == VisionConfig.glm41v() and table.config == "glm41v" and table.dtype == dtype
    return table if matches and table.provenance.get("gpu") == gpu else None
