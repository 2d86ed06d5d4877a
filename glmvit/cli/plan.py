"""``python -m glmvit plan``: choose token budgets for a deployment and export them to vLLM.

Packs a workload — a named preset, a random-mm bucket config, or a trace of real item sizes (CSV / JSON / JSON
Lines of height, width, frames and optionally request; see :mod:`glmvit.traces`) — into a budget set, and reports
batches, eager items, padding, graph memory (an estimate for the GLM-4.1V tower) and, from a latency table, the capture
time and the predicted median / mean / P99 milliseconds per request. The table is the one recorded for ``--mode``
(graph-compiled by default) in data/bench, or yours (``--latency-table``); which one, and whether it still describes
this code, is printed. ``--system vllm`` (default) models vLLM 0.33.0 (its packer, no routing; glmvit's packer adds a
segment limit that vLLM's does not check), ``--system glmvit`` glmvit's runner (first-fit decreasing, routed; vLLM's
``--compilation-config`` line, which deploys vLLM only, is then not printed); ``--per step`` packs every request of a
vLLM engine step together. ``--compare`` puts a second budget set beside the first; ``--export`` writes the first as
vLLM's ``--compilation-config`` JSON. Warnings go to stderr: a table of another tower, dtype or device, a stale one,
budgets it never measured, an exported set predicted slower than eager::

    python -m glmvit latency --compile --json latency.json    # once, on the GPU you deploy on
    python -m glmvit plan --trace trace.csv --latency-table latency.json --budgets 64,256,1024,4096 \\
        --compare auto --export vllm_compilation_config.json
    vllm serve zai-org/GLM-4.1V-9B-Thinking --compilation-config "$(cat vllm_compilation_config.json)"
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..costmodel import LatencyTable
from ..defaults import dtype_name
from ..deployment import (
    BudgetReport,
    TimeSummary,
    check_budget_fits,
    evaluate_budgets,
    vllm_compilation_config,
    vllm_frames_needed,
)
from ..geometry import ItemSpec
from ..modes import TABLE_MODES
from ..packing import PACKERS, VLLM_MAX_NUM_BATCHED_TOKENS, BudgetConfig, combined_stats, max_items_rule, plan_workload
from ..provenance import collect
from ..recorded import recorded_table
from ..traces import load_trace
from ..workloads import PRESETS, MMItem, random_mm_workload
from .common import (
    DTYPES,
    MAX_BUDGET_TOKENS,
    SEED_MAX,
    Parser,
    bucket_config_arg,
    budgets_arg,
    check_writable,
    float_in,
    int_in,
    output_path,
    read_latency_table,
    refuse_given_with,
    refuse_outputs_over_inputs,
    refuse_preset_flags,
    write_atomic,
    write_json,
)

MAX_REQUESTS = 1_000_000
MAX_ITEMS = 10_000_000  # planning is pure Python at ≈ 30 µs an item (both packers): 10⁷ items take ≈ 5 minutes
RANDOM_ONLY = ("num_requests", "items_per_request", "range_ratio", "seed")  # flags a trace has no use for
GIB = 2**30
SYSTEMS = {"vllm": ("vllm", False), "glmvit": ("ffd", True)}  # system → (packer, routing)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m glmvit plan", description=(__doc__ or "").split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(__doc__ or "").split("\n\n", 1)[1])
    w = p.add_argument_group("workload (one of; default: --bucket-config \"{(224, 224, 1): 1.0}\")")
    source = w.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=list(PRESETS), help="a named preset: " +
                        "; ".join(f"{k}: {v.description}" for k, v in PRESETS.items()))
    source.add_argument("--bucket-config", type=bucket_config_arg, help="{(height, width, frames): probability}")
    source.add_argument("--trace", metavar="PATH", help="item sizes of real traffic: .csv with a header row, .json "
                        "array or .jsonl of records {height, width, frames (default 1), request (optional: records "
                        "with the same request are one request; without it each record is one)}")
    w.add_argument("--num-requests", type=int_in(1, MAX_REQUESTS), help="random workloads: requests (default 1000)")
    w.add_argument("--items-per-request", type=int_in(1, MAX_ITEMS), help="random: items per request (default 1)")
    w.add_argument("--range-ratio", type=float_in(0, 1), help="random: items per request uniform in n·[1−r, 1+r]")
    w.add_argument("--seed", type=int_in(0, SEED_MAX), help="random: seed (default 42)")
    b = p.add_argument_group("budgets")
    b.add_argument("--budgets", type=budgets_arg, default=None, help="comma-separated token budgets, or 'auto' "
                   "(vLLM's on an H200: 64, 128, … 8192)")
    b.add_argument("--compare", type=budgets_arg, metavar="BUDGETS", default=False,
                   help="a second budget set to show beside the first (same limits), e.g. 64,256,1024 or auto")
    b.add_argument("--max-items", type=int_in(1), help=f"items per batch (default: vLLM's, {max_items_rule()})")
    b.add_argument("--max-segments", type=int_in(1),
                   help="attention segments (temporal patches) per batch (default: vLLM's, max items × 600 but at "
                        "most the largest budget for a workload with video, else max items)")
    b.add_argument("--system", choices=list(SYSTEMS), default="vllm",
                   help="whose runtime to model: vllm (default: vLLM 0.33's packer, every batch a budget holds "
                        "replays; what --export deploys) or glmvit (first-fit decreasing, each batch routed to the "
                        "faster of replay and eager by the table)")
    b.add_argument("--per", choices=("request", "step"), default="request",
                   help="pack each request alone (default), or every request of a vLLM engine step together")
    b.add_argument("--step-tokens", type=int_in(1, MAX_BUDGET_TOKENS), default=VLLM_MAX_NUM_BATCHED_TOKENS,
                   help=f"with --per step: vision tokens per engine step (vLLM's max_num_batched_tokens; default "
                        f"{VLLM_MAX_NUM_BATCHED_TOKENS})")
    c = p.add_argument_group("cost")
    c.add_argument("--mode", choices=TABLE_MODES, default="graph-compiled",
                   help="the runner mode predicted: graph-compiled (default) or graph; its recorded table in "
                        "data/bench is used unless --latency-table is given")
    c.add_argument("--latency-table", metavar="PATH", help="a latency table measured on your GPU for --mode "
                   "(python -m glmvit latency [--compile] --json PATH); 'none': predict no times")
    c.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="for the graph memory estimate")
    o = p.add_argument_group("output")
    o.add_argument("--export", metavar="PATH", type=output_path,
                   help="write the first budget set as vLLM's --compilation-config JSON")
    o.add_argument("--json", metavar="PATH", type=output_path,
                   help="write the whole report, with provenance, as JSON")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[list[MMItem]],
                                                                                   list[BudgetConfig],
                                                                                   LatencyTable | None]:
    """Every value checked, every output checked writable, the workload drawn or read: before any planning."""
    refuse_given_with(parser, args, "trace", RANDOM_ONLY, "a trace has its own requests")
    refuse_preset_flags(parser, args)
    outputs = [Path(p) for p in (args.export, args.json) if p]
    table_input = args.latency_table if args.latency_table != "none" else None
    refuse_outputs_over_inputs(parser, {"--export": args.export, "--json": args.json},
                               {"the --trace input": args.trace, "the --latency-table input": table_input})
    dtype = dtype_name(args.dtype)
    try:
        configs = [_budget_config(args.budgets, args, dtype)]
        if args.compare is not False:
            configs.append(_budget_config(args.compare, args, dtype, "--compare: "))
        for path in outputs:
            check_writable(path)
        table = _table(args)
        requests = load_trace(args.trace) if args.trace else _random_requests(args)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    return requests, configs, table


def _table(args: argparse.Namespace) -> LatencyTable | None:
    """--latency-table, or the table recorded for --mode (None when there is none, or with 'none')."""
    if args.latency_table == "none":
        return None
    if args.latency_table:
        table = read_latency_table(args.latency_table)
        if table.mode is not None and table.mode != args.mode:
            raise ValueError(f"--latency-table {table.describe()} measured {table.mode}, not --mode {args.mode}")
        return table
    try:
        return recorded_table(args.mode)
    except ValueError:
        return None


def warnings(table: LatencyTable | None, configs: list[BudgetConfig], reports: list[BudgetReport],
             dtype: str) -> list[str]:
    """What the plan cannot vouch for: a table of another tower, dtype or device, or stale; budgets past the ones
    it measured (extrapolated); an exported set predicted slower than running everything eagerly."""
    out: list[str] = []
    if table is None:
        return out
    if table.config != "glm41v" or table.dtype != dtype:
        out.append(f"the latency table measured the {table.config} tower in {table.dtype}, but the plan is for "
                   f"GLM-4.1V in {dtype}: its times do not describe this deployment")
    if table.provenance.get("device") not in (None, "cuda") and not table.provenance.get("gpu"):
        out.append(f"the latency table was measured on {table.provenance.get('device')}, not a GPU")
    if table.changed:
        out.append(f"the latency table is stale: {table.describe()}")
    lo, hi = table.tokens[0], table.tokens[-1]
    outside = sorted({b for c in configs for b in c.token_budgets if not lo <= b <= hi})
    if outside:
        out.append(f"budgets {outside} lie outside the measured {lo}..{hi} tokens: their times are extrapolated")
    first = reports[0]
    if first.graphs is not None and first.eager is not None and first.graphs.mean_ms > first.eager.mean_ms:
        out.append(f"budgets {list(first.config.token_budgets)} are predicted slower than running every request "
                   f"eagerly ({first.graphs.mean_ms:.2f} vs {first.eager.mean_ms:.2f} ms per request): capture no "
                   "graphs for this traffic, or choose other budgets (python -m glmvit plan --compare auto)")
    return out


def _budget_config(budgets: tuple[int, ...] | None, args: argparse.Namespace, dtype: str,
                   what: str = "") -> BudgetConfig:
    try:
        return check_budget_fits(BudgetConfig.resolve(budgets, args.max_items, args.max_segments), dtype)
    except ValueError as err:
        raise ValueError(f"{what}{err}") from None


def _random_requests(args: argparse.Namespace) -> list[list[MMItem]]:
    """The random workload of the flags; refuses more than MAX_ITEMS items before drawing any."""
    if args.workload:
        preset = PRESETS[args.workload]
        buckets, n, ratio, limit = preset.bucket_config, preset.items_per_request, preset.range_ratio, \
            preset.limit_per_request
    else:
        buckets, n, ratio, limit = args.bucket_config or {(224, 224, 1): 1.0}, args.items_per_request or 1, \
            args.range_ratio or 0.0, None
    requests = args.num_requests or 1000
    most = min(math.ceil(n * (1 + ratio)), limit or math.inf)
    if requests * most > MAX_ITEMS:
        raise ValueError(f"{requests:,} requests of up to {most:,} items is more than {MAX_ITEMS:,} items "
                         f"(planning takes ≈ 30 µs an item)")
    return random_mm_workload(buckets, requests, n, ratio, 42 if args.seed is None else args.seed, limit)


def report_rows(reports: list[BudgetReport], specs: list[list[ItemSpec]], packer: str) -> list[tuple[str, ...]]:
    """The comparison as rows (label, value for each budget set): what ``plan`` prints and the explorer shows."""
    other = next(name for name in PACKERS if name != packer)
    per = "per engine step" if reports[0].per == "step" else "per request"
    rows: list[tuple[str, ...]] = [
        ("budgets", *(", ".join(map(str, r.config.token_budgets)) for r in reports)),
        ("limits per batch", *(f"{r.config.max_items} items, {r.config.max_segments} segments" for r in reports)),
        (f"batches ({packer}, {per}; {other} per request)",
         *(f"{r.stats.batches} ({other}: {combined_stats(plan_workload(specs, r.config, other)).batches})"
           for r in reports)),
        ("replays", *(str(r.stats.replays) for r in reports)),
        ("eager items (over the limits)", *(str(r.stats.fallbacks) for r in reports)),
        ("padding waste", *(f"{r.stats.padding_fraction:.1%} of replayed tokens ({r.stats.padded_tokens} tokens)"
                            for r in reports)),
        ("graph memory (estimate)", *(f"{r.graph_bytes / GIB:.2f} GiB (pool {r.pool_bytes / GIB:.2f} GiB)"
                                      for r in reports)),
        ("capture time", *(_capture_text(r) for r in reports)),
    ]
    if all(r.graphs is not None for r in reports):
        rows += [
            ("ms/request, graphs: median · mean · P99", *(_times(r.graphs) for r in reports)),
            ("… every batch at its P99 latency: P99", *("unknown (the table has no P99 columns)"
                                                        if r.graphs_at_p99 is None else f"{r.graphs_at_p99.p99_ms:.2f}"
                                                        for r in reports)),
            ("ms/request, all eager: median · mean · P99", *(_times(r.eager) for r in reports)),
        ]
    else:
        rows.append(("predicted time", *("unknown (no latency table: make one with python -m glmvit latency)"
                                         for _ in reports)))
    return rows


def _capture_text(report: BudgetReport) -> str:
    if report.capture_s is not None and report.capture is not None:
        return f"≈ {report.capture_s:.2f} s ({report.capture.describe(len(report.config.token_budgets))})"
    return "unknown (the table has no capture times)" if report.graphs else "unknown (no latency table)"


def _times(summary: TimeSummary | None) -> str:
    assert summary is not None  # report_rows shows times only when every report has them
    return f"{summary.median_ms:.2f} · {summary.mean_ms:.2f} · {summary.p99_ms:.2f}"


def print_rows(rows: list[tuple[str, ...]]) -> None:
    width = max(len(row[0]) for row in rows)
    columns = [max(len(row[i]) for row in rows) for i in range(1, len(rows[0]))]
    for row in rows:
        values = "  │  ".join(f"{v:<{w}}" for v, w in zip(row[1:], columns, strict=True))
        print(f"{row[0]:<{width}}  {values}".rstrip())


def export_config(config: BudgetConfig, specs: list[list[ItemSpec]]) -> dict[str, Any]:
    """vLLM's compilation config for ``config``, with frames enough for the batches vLLM's own packer makes."""
    return vllm_compilation_config(config, max(config.max_segments, vllm_frames_needed(specs, config)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    requests, configs, table = check_args(parser, args)
    specs = [[item.spec for item in request] for request in requests]
    dtype = dtype_name(args.dtype)
    packer, route = SYSTEMS[args.system]
    reports = [evaluate_budgets(specs, c, table, dtype=dtype, packer=packer, route=route, per=args.per,
                                step_tokens=args.step_tokens) for c in configs]
    source = f"trace {args.trace}" if args.trace else f"workload {args.workload or 'random-mm'}"
    print(f"{source}: {len(requests)} requests, {sum(map(len, requests))} items, "
          f"{reports[0].stats.real_tokens} tokens; memory for GLM-4.1V in {dtype}; as {args.system} runs it"
          + (", each batch routed to the faster of replay and eager" if route else "")
          + (f", {reports[0].groups} engine steps of ≤ {args.step_tokens} tokens" if args.per == "step" else ""))
    print(f"times: {table.describe()}" if table else "times: no latency table (none recorded for --mode "
          f"{args.mode}, or --latency-table none)")
    for warning in warnings(table, configs, reports, dtype):
        print(f"warning: {warning}", file=sys.stderr)
    print_rows(report_rows(reports, specs, packer))
    exported = export_config(configs[0], specs)
    if args.system == "vllm":  # the flag deploys vLLM's runtime only: glmvit's runner takes no such config
        print(f"\nvLLM: --compilation-config '{json.dumps(exported)}'")
        if exported["encoder_cudagraph_max_frames_per_batch"] > configs[0].max_segments:
            print(f"(frames per batch raised from max_segments={configs[0].max_segments}: vLLM packs on tokens and "
                  "items only, and its batches of this workload reach that many temporal patches)")
    if args.export:
        write_atomic(args.export, (json.dumps(exported, indent=1) + "\n").encode())
        print(f"wrote {args.export}")
    if args.json:
        write_json(args.json, {
            "report": "glmvit plan", "provenance": collect("cpu", " ".join([sys.executable, "-m", "glmvit",
                                                                                    "plan", *argv])),
            "source": source, "requests": len(requests), "system": args.system, "per": args.per,
            "latency_table": table.describe() if table else None,
            "warnings": warnings(table, configs, reports, dtype),
            "reports": [_report_json(r) for r in reports], "vllm_compilation_config": exported})
    return 0


def _report_json(report: BudgetReport) -> dict[str, Any]:
    def times(summary: TimeSummary | None) -> dict[str, float] | None:
        return None if summary is None else vars(summary)

    return {"token_budgets": list(report.config.token_budgets), "max_items": report.config.max_items,
            "max_segments": report.config.max_segments, "stats": vars(report.stats),
            "padding_fraction": report.stats.padding_fraction, "graph_bytes": report.graph_bytes,
            "pool_bytes": report.pool_bytes, "capture_s": report.capture_s, "graphs_ms": times(report.graphs),
            "graphs_at_p99_ms": times(report.graphs_at_p99), "eager_ms": times(report.eager)}
