"""``python -m glmvit latency``: the latency table of the cost model, measured on realistic layouts.

For every budget, the same graph is replayed with several layouts — full (one image of the whole budget), half
full, one small image, many small images, a video clip — and the same batches run eagerly. An eager forward is
timed as ``bench`` times a request (:func:`time_eager`), once per distinct batch of grids. The table's ``graph_ms``
of a budget is the slowest layout's median (what any batch in that graph may cost); ``eager_ms`` is the full
layout's. The JSON is a :class:`glmvit.records.LatencySweep`; :func:`glmvit.recorded.load_latency_table` fits
the cost model on it, and the layouts stay in it for notebooks::

    python -m glmvit latency --budgets 64,128,256,512,1024,2048,4096 --json data/bench/latency.json
"""
from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import VisionConfig
from ..defaults import dtype_name
from ..deployment import check_budget_fits
from ..encoder import build_encoder
from ..floor import encoder_flops
from ..geometry import ItemSpec, grid_specs
from ..graphs import EncoderGraphRunner
from ..model import GlmVisionEncoder
from ..modes import RunMode
from ..packing import BudgetConfig
from ..provenance import collect
from ..records import LatencySweep, make
from ..timing import CHECK_EVERY, MAX_PASSES, PRECISION, WARMUP, quiet_host, time_passes, time_until_steady
from .common import (
    DTYPES,
    MAX_BUDGET_TOKENS,
    Parser,
    add_model_args,
    budgets_arg,
    check_writable,
    graph_memory_target,
    int_in,
    model_from_args,
    output_path,
    resolve_model_args,
    write_record,
)
from .session import runner_key

if TYPE_CHECKING:
    from .session import Session

Grids = tuple[tuple[int, ...], ...]
EagerTimes = dict[Grids, list[float]]  # a batch's grids → ms of its eager forwards (the budget does not matter)
# A replay (and so every graph time here) varies by well under 1 % from run to run: its timing stops once
# STEADY_RUNS runs agree within 2 % (glmvit.timing.time_until_steady), at most --runs.
STEADY_RUNS = 3
# An eager forward is timed as bench times a one-shape workload's request (glmvit.timing.time_passes with its
# warm-up, precision and passes): passes of EAGER_CALLS forwards, except that a pass also ends after EAGER_PASS_S
# once it holds STEADY_RUNS forwards: a host-bound forward (the same ~launch-bound time whatever its tokens) still
# gets its EAGER_CALLS a pass on an H200, a GPU-bound one (the largest budgets' full images) a few, which agree
# within 1 %. Per distinct batch: WARMUP forwards, then at most MAX_PASSES × EAGER_PASS_S (plus one forward a pass).
EAGER_CALLS = 50
EAGER_PASS_S = 0.6

CPU_QUICK_BUDGET = 256  # above this, a CPU sweep takes minutes: say so before starting
MAX_RUNS = 10_000  # replays per layout, per budget: more is hours, not precision
SMALL = [1, 16, 16]  # one 224² image: 64 tokens
CLIP = [4, 16, 16]  # an 8-frame 224² clip: 4 segments, 256 tokens


def square_grid(tokens: int, merge: int = 2) -> list[int]:
    """A one-image grid [1, h, w] with h·w = m²·tokens, h and w multiples of m, as square as possible."""
    a = math.isqrt(tokens)
    while tokens % a:
        a -= 1
    return [1, merge * a, merge * (tokens // a)]


def layouts(budget: int, max_items: int, max_segments: int, merge: int = 2) -> dict[str, list[list[int]]]:
    """Named batches (grids) that fit ``budget`` tokens within the limits; the full one always comes first.

    "full" is one image of the whole budget (the most attention work a full batch can have); "full-many" fills
    the budget with as many equal images as the limits allow (little attention work); the rest leave padding.
    """
    out = {"full": [square_grid(budget, merge)]}
    n = min(max_items, max_segments, budget // 64)
    while n > 1 and budget % n:
        n -= 1
    if n > 1:
        out["full-many"] = [square_grid(budget // n, merge)] * n
    if budget >= 2 * 64:
        out["half"] = [square_grid(budget // 2, merge)]
        out["one-small"] = [SMALL]
    many = min(max_items, max_segments, budget // 64)
    if many > 1:
        out["many-small"] = [SMALL] * many
    if budget >= 256 and max_segments >= CLIP[0]:
        out["video"] = [CLIP]
    return out


def grids_key(grids: np.ndarray) -> Grids:
    return tuple(tuple(int(v) for v in row) for row in grids)


def time_eager(model: GlmVisionEncoder, pixels: torch.Tensor, grids: np.ndarray) -> list[float]:
    """ms of eager forwards of one batch, timed as ``bench`` times a request (:data:`EAGER_CALLS`,
    :data:`EAGER_PASS_S`); call it on a quiet host (:func:`glmvit.timing.quiet_host`)."""
    ms, _, _ = time_passes(lambda j: model(pixels, grids), EAGER_CALLS, model.device, warmup=WARMUP,
                           pass_budget_s=EAGER_PASS_S, min_calls=STEADY_RUNS)
    return ms


def layout_spec(grids: np.ndarray, config: VisionConfig) -> ItemSpec:
    """The rows, tokens and Σ L² of a layout's items together: what the table records and the cost model fits
    (:func:`glmvit.geometry.item_spec`, the count the runner routes by)."""
    return ItemSpec.total(grid_specs(grids.tolist(), config.spatial_merge_size))


def measure(runner: EncoderGraphRunner, model: GlmVisionEncoder, runs: int, warmup: int, seed: int,
            quiet: bool, eager_times: EagerTimes | None = None) -> list[dict[str, Any]]:
    """Median and P99 ms of every layout of every captured budget, replayed in that budget (``runs`` and
    ``warmup``) and run eagerly (:func:`time_eager`, once per distinct batch of grids: the same forward whatever
    budget lists it). ``eager_times``: eager runs already timed in this process for the same model (a record run
    times eager once for both sweeps); what it lacks is timed and added to it."""
    cfg, device = model.config, model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    eager_times = {} if eager_times is None else eager_times
    rows = []
    for budget in tqdm(sorted(runner.graphs), desc="latency table", unit="budget", file=sys.stderr, disable=quiet):
        entry: dict[str, Any] = {"tokens": budget, "layouts": []}
        timed = {}
        with quiet_host():
            for name, grid in layouts(budget, runner.budgets.max_items, runner.graphs[budget].shape.segments,
                                      cfg.spatial_merge_size).items():
                grids = np.array(grid, dtype=np.int64)
                pixels = torch.randn(layout_spec(grids, cfg).rows, cfg.patch_dim, device=device,
                                     dtype=model.dtype, generator=gen)
                graph = time_until_steady(partial(runner.replay, budget, pixels, grids), device, runs, warmup,
                                          min(runs, STEADY_RUNS))
                key = grids_key(grids)
                if key not in eager_times:
                    eager_times[key] = time_eager(model, pixels, grids)
                timed[name] = (grids, graph, eager_times[key])
        for name, (grids, graph, eager) in timed.items():
            entry["layouts"].append({
                "name": name, "grids": grids.tolist(), "items": len(grids),
                "real_tokens": layout_spec(grids, cfg).tokens,
                "segment_rows2": layout_spec(grids, cfg).work,
                "graph_ms": float(np.median(graph)), "graph_p99_ms": float(np.percentile(graph, 99)),
                "eager_ms": float(np.median(eager)), "eager_p99_ms": float(np.percentile(eager, 99)),
                "flops": encoder_flops(cfg, grids)})
        full = entry["layouts"][0]
        entry.update(grid=full["grids"][0], eager_ms=full["eager_ms"], eager_p99_ms=full["eager_p99_ms"],
                     full_graph_ms=full["graph_ms"], graph_ms=max(x["graph_ms"] for x in entry["layouts"]),
                     graph_p99_ms=max(x["graph_p99_ms"] for x in entry["layouts"]), flops=full["flops"])
        entry["worst_layout_vs_full"] = entry["graph_ms"] / full["graph_ms"]
        rows.append(entry)
    return rows


def parse(argv: list[str]) -> tuple[argparse.Namespace, BudgetConfig]:
    """The flags, checked (one line and exit 2 for a bad one), and the budget config they describe."""
    parser = Parser(prog="python -m glmvit latency", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--budgets", type=budgets_arg, default="64,128,256,512,1024,2048,4096",
                        help="token budgets (at least two)")
    parser.add_argument("--max-items", type=int_in(1, MAX_BUDGET_TOKENS), default=16,
                        help="items per batch (default 16)")
    parser.add_argument("--max-segments", type=int_in(1, MAX_BUDGET_TOKENS), default=32,
                        help="segment slots per batch (default 32)")
    parser.add_argument("--runs", type=int_in(1, MAX_RUNS), default=20,
                        help="timed replays per layout at most (default 20; eager forwards are timed as bench times a "
                             "request)")
    parser.add_argument("--warmup", type=int_in(0, MAX_RUNS), default=3,
                        help="untimed replays per layout first (default 3)")
    parser.add_argument("--compile", action="store_true", help="torch.compile forward_static before capture")
    parser.add_argument("--json", metavar="PATH", type=output_path, help="write the table with provenance here")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_model_args(parser)
    args = parser.parse_args(argv)
    resolve_model_args(parser, args)
    try:
        budgets = args.budgets or ()
        if len(budgets) < 2:
            raise ValueError("--budgets needs at least two budgets, e.g. 64,128,256,512")
        config = BudgetConfig.capped(budgets, args.max_items, args.max_segments)
        check_budget_fits(config, dtype_name(args.dtype), graph_memory_target(args.device))
        if args.json:
            check_writable(args.json)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    if args.device == "cpu" and max(budgets) > CPU_QUICK_BUDGET:
        per_layout = args.runs + args.warmup + WARMUP + EAGER_CALLS
        forwards = per_layout * sum(len(layouts(b, config.max_items, config.max_segments)) for b in budgets)
        print(f"warning: {forwards:,} forwards on a CPU, up to {max(budgets):,} tokens each: this takes long (many "
              f"minutes with the defaults); for a quick table pass --budgets 16,64,128 --runs 3", file=sys.stderr)
    return args, config


def check_fits_now(args: argparse.Namespace, config: BudgetConfig) -> None:
    """A ValueError unless the sweep's memory estimate (:func:`~glmvit.costmodel.graph_memory`, one shared pool, and
    the weights, for the tower, dtype, attention and compilation it will run) fits what the device has free now: a
    sweep past it would swap or die minutes in, not fail at once."""
    from ..attention import default_backend
    from ..costmodel import graph_memory, total_graph_memory
    from ..floor import tower_bytes
    from ..weights import checkpoint_config
    from .common import free_memory_bytes, vision_config

    tower = checkpoint_config(args.weights)[0] if args.weights else vision_config(args.config)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    attention = default_backend(device, dtype, tower.hidden_size // tower.num_heads)
    need = total_graph_memory(graph_memory(config, tower, str(dtype).removeprefix("torch."), args.compile,
                                           attention)) + tower_bytes(tower, dtype)
    free = free_memory_bytes(device)
    if need > free:
        raise ValueError(f"budgets up to {config.largest:,} tokens need ≈ {need / 2**30:,.1f} GiB for their graphs, "
                         f"one forward's activations and the weights (costmodel.graph_memory): more than the "
                         f"{free / 2**30:,.1f} GiB free on {device} now; use smaller --budgets")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, config = parse(argv)
    try:
        check_fits_now(args, config)  # here, not in parse: a record run sizes its own sweeps
    except ValueError as err:
        Parser(prog="python -m glmvit latency").error(str(err))
    table = run_sweep(args, config, " ".join([sys.executable, "-m", "glmvit", "latency", *argv]))
    print_table(table.model_dump(mode="json")["budgets"])
    if args.json:
        write_record(args.json, table)
    return 0


def run_sweep(args: argparse.Namespace, config: BudgetConfig, command: str, session: Session | None = None,
              eager_times: EagerTimes | None = None) -> LatencySweep:
    """The sweep the resolved flags describe, as a record; a ``session`` (a record run) lends its model, and
    ``eager_times`` shares eager runs between the graph and the compiled sweep (:func:`measure`), and the runner
    comes through it (:meth:`Session.runner <glmvit.cli.session.Session.runner>`: ``measurement.runner_source``)."""
    model = session.model(args) if session is not None else model_from_args(args)
    mode = RunMode.GRAPH_COMPILED if args.compile else RunMode.GRAPH

    def build() -> EncoderGraphRunner:
        built = build_encoder(model, mode, config, progress=not args.quiet)
        assert isinstance(built, EncoderGraphRunner)
        return built

    source = None
    if session is not None:  # a record run: says which earlier jobs' compiled code the capture found
        runner, source = session.runner(runner_key(model, mode, config, model.attention_backend(), None), build,
                                        model.device)
    else:
        runner = build()
    with torch.inference_mode():
        rows = measure(runner, model, args.runs, args.warmup, args.seed, args.quiet, eager_times)
    return make(
        LatencySweep, provenance=collect(model.device, command),
        dtype=str(model.dtype).replace("torch.", ""), config="glm41v" if args.config == "full" else args.config,
        attn_backend=runner.attention, compiled=args.compile, max_items=config.max_items,
        max_segments=config.max_segments, budgets=rows,
        measurement={"runner_mode": runner.mode.value, "runs": args.runs, "warmup": args.warmup, "statistic": "median",
                     "stopping": f"replays: {STEADY_RUNS} to runs, until {STEADY_RUNS} agree within 2 %",
                     "eager_timing": f"as bench times a request (glmvit.timing.time_passes): {WARMUP} untimed, then "
                                     f"passes of {EAGER_CALLS} while the median's 95 % interval is wider than "
                                     f"±{PRECISION:.0%}, at most {MAX_PASSES}; a pass ends after {EAGER_PASS_S} s once "
                                     f"it holds {STEADY_RUNS}, a later one once the interval is within ±"
                                     f"{PRECISION:.0%} (checked every {CHECK_EVERY} forwards); once per distinct "
                                     "batch of grids",
                     "eager": "timed once per process for both sweeps" if eager_times is not None else "timed here",
                     "host": "cycle collector off, the CPU left to the scheduler (glmvit.timing.quiet_host)",
                     **({"runner_source": source} if source is not None else {})},
        capture={str(k): v.as_dict() for k, v in runner.captures.items()},
        failed={str(k): v for k, v in runner.failed.items()},
    )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'tokens':>7} {'eager ms':>9} {'full ms':>9} {'worst ms':>9} {'worst/full':>10}  worst layout")
    for r in rows:
        worst = max(r["layouts"], key=lambda x: x["graph_ms"])["name"]
        print(f"{r['tokens']:>7} {r['eager_ms']:>9.3f} {r['full_graph_ms']:>9.3f} {r['graph_ms']:>9.3f} "
              f"{r['worst_layout_vs_full']:>10.3f}  {worst}")
