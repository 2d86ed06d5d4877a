"""Notebooks 05 and 05b's set-up, plots and tables: the recorded tables and benchmark they read, and the figures and
printed tables that show packing and the cost model. The packers and the cost model themselves live in
``glmvit.packing`` and ``glmvit.costmodel``; what a notebook teaches stays in its cells."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..config import VisionConfig
from ..costmodel import LatencyTable, TimeEstimate, graph_memory, predict_time
from ..deployment import EagerIsFaster, recommend_budgets
from ..geometry import ItemSpec
from ..packing import BudgetConfig, Plan, PlanStats, combined_stats, plan_workload
from ..processing import SAMPLE_DATA
from ..recorded import recorded_table
from ..records import BenchRecord, LatencySweep, describe, find, load
from ..routing import Route, Router
from ..workloads import PRESETS

MODES = ("graph", "graph-compiled")
BENCH = SAMPLE_DATA / "bench"
MiB = 2**20


@dataclass(frozen=True)
class Recorded:
    """What notebooks 05 and 05b read from the GPU records: each graph mode's latency table and its sweep, and the
    ``mixed-img`` benchmark with its requests redrawn (as item specs) and each request's token total."""

    tables: dict[str, LatencyTable]
    sweeps: dict[str, LatencySweep]
    mixed: BenchRecord
    requests: list[list[ItemSpec]]
    totals: list[int]


def load_recorded(verbose: bool = True) -> Recorded:
    """Load each mode's recorded table (chosen by what it measured) and sweep, and the mixed-img benchmark; redraw
    its requests from the preset and the recorded seed. Raises ValueError if the redrawn grids are not the recorded
    ones. ``verbose`` prints where and when each record was made."""
    tables = {m: recorded_table(m) for m in MODES}
    sweeps = {m: load(str(tables[m].source), LatencySweep) for m in MODES}
    mixed = load(BENCH / "mixed_img.json", BenchRecord)
    settings: Any = mixed.settings  # the seed is one of the settings' extra fields
    drawn = [r for r in PRESETS["mixed-img"].requests(settings.num_requests, seed=settings.seed) if r]
    if [[list(item.grid) for item in r] for r in drawn] != mixed.workload["grids"]:
        raise ValueError("mixed_img.json: the redrawn mixed-img requests are not the recorded ones")
    requests = [[item.spec for item in r] for r in drawn]
    if verbose:
        for m, t in tables.items():
            print(f"{m:<15} {t.describe()}")
        print(f"{'benchmark':<15} {describe(mixed, BENCH / 'mixed_img.json')}")
    return Recorded(tables, sweeps, mixed, requests, [sum(s.tokens for s in r) for r in requests])


def specs_of(preset: str, n: int, seed: int = 42) -> list[list[ItemSpec]]:
    """The item specs of ``n`` requests drawn from workload preset ``preset`` with ``seed``, empty requests dropped."""
    return [[it.spec for it in r] for r in PRESETS[preset].requests(n, seed=seed) if r]


# --- notebook 05: packing -------------------------------------------------------------------------------------------

def first_fit_decreasing(items: Sequence[ItemSpec], config: BudgetConfig,
                         pick: Callable[[list[list[Any]]], list[Any]] | None = None) -> list[list[int]]:
    """Plain first-fit decreasing, written out: largest first (tokens, then segments, then index), each item into an
    open batch with room under every limit of ``config``, a new one if none has; returns batches of item indices.
    An open batch is ``[members, tokens, segments]``; ``pick`` chooses among those with room (default: the first,
    i.e. first fit; the fullest gives best fit)."""
    order = sorted(range(len(items)), key=lambda i: (-items[i].tokens, -items[i].segments, i))
    bins: list[list[Any]] = []
    for i in order:
        t, s = items[i].tokens, items[i].segments
        fits = [b for b in bins if len(b[0]) < config.max_items and b[1] + t <= config.largest
                and b[2] + s <= config.max_segments]
        if not fits:
            bins.append([[i], t, s])
            continue
        b = fits[0] if pick is None else pick(fits)
        b[0].append(i)
        b[1] += t
        b[2] += s
    return [b[0] for b in bins]


def pack_table(workloads: Mapping[str, list[list[ItemSpec]]], config: BudgetConfig,
               packers: Sequence[str] = ("vllm", "ffd")) -> dict[tuple[str, str], PlanStats]:
    """Pack every workload with every packer under ``config``; print one row each (requests, replays, eager items,
    padding, budgets replayed ×count) and return the stats by (workload, packer)."""
    stats = {}
    print(f"{'workload':<11}{'packer':>7}{'requests':>9}{'replays':>8}{'eager':>6}{'padding':>8}  budgets replayed")
    for name, reqs in workloads.items():
        for packer in packers:
            plans = plan_workload(reqs, config, packer)
            st = stats[name, packer] = combined_stats(plans)
            used = Counter(b.budget for p in plans for b in p.batches if b.budget is not None)
            print(f"{name:<11}{packer:>7}{len(reqs):>9}{st.replays:>8}{st.fallbacks:>6}{st.padding_fraction:>8.1%}  "
                  + ", ".join(f"{b}×{n}" for b, n in sorted(used.items())))
    return stats


def token_histogram(totals: Sequence[int], title: str) -> Any:
    """A histogram of output tokens per request; returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.4))
    ax.hist(totals, bins=60)
    ax.set(xlabel="output tokens per request", ylabel="requests", title=title)
    return fig


def plot_largest_budget_sweep(sweep: Mapping[int, PlanStats], n_requests: int) -> Any:
    """Padding, and replays and eager fallbacks per request, against the largest budget M; returns the figure."""
    import matplotlib.pyplot as plt

    tops = list(sweep)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    a.plot(tops, [100 * s.padding_fraction for s in sweep.values()], "o-")
    a.set(xscale="log", xlabel="largest budget M", ylabel="padding waste (%)", title="padding")
    b.plot(tops, [s.replays / n_requests for s in sweep.values()], "o-", label="replays")
    b.plot(tops, [s.fallbacks / n_requests for s in sweep.values()], "s--", label="eager fallbacks")
    b.set(xscale="log", xlabel="largest budget M", ylabel="per request", title="replays and fallbacks")
    b.legend()
    return fig


def packer_counts(requests: Sequence[Sequence[ItemSpec]], limits: Sequence[int],
                  packers: Sequence[str] = ("vllm", "ffd")) -> dict[str, tuple[list[int], list[float]]]:
    """For each packer, the batches and the padding (%) of ``requests`` under the automatic budgets with each item
    limit in ``limits``: {packer: (batches per limit, padding % per limit)}."""
    out: dict[str, tuple[list[int], list[float]]] = {p: ([], []) for p in packers}
    for max_items in limits:
        cfg = BudgetConfig.resolve(max_items=max_items)
        for p in packers:
            s = combined_stats(plan_workload(requests, cfg, packer=p))
            out[p][0].append(s.batches)
            out[p][1].append(100 * s.padding_fraction)
    return out


def plot_packer_counts(counts: Mapping[str, tuple[list[int], list[float]]], limits: Sequence[int],
                       n_requests: int) -> Any:
    """Side-by-side bars of batches and padding per item limit, one colour per packer; returns the figure."""
    import matplotlib.pyplot as plt

    x = np.arange(len(limits))
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.8 / len(counts)
    for k, (name, (batches, pads)) in enumerate(counts.items()):
        shift = (k - (len(counts) - 1) / 2) * width
        a.bar(x + shift, batches, width=width, label=name)
        b.bar(x + shift, pads, width=width, label=name)
    a.set(xticks=x, xticklabels=limits, xlabel="max items per batch", ylabel=f"batches ({n_requests} requests)")
    b.set(xticks=x, xticklabels=limits, xlabel="max items per batch", ylabel="padding waste (%)")
    a.legend()
    return fig


# --- notebook 05b: the cost model -----------------------------------------------------------------------------------

def table_fit(table: LatencyTable, sweep: LatencySweep) -> dict[str, np.ndarray]:
    """Every layout of ``sweep`` predicted by ``table``: arrays ``names`` ("budget layout"), measured and predicted
    ``graph``/``eager`` ms (``meas_g``, ``pred_g``, ``meas_e``, ``pred_e``) and relative errors ``g_err``, ``e_err``."""
    rows = [(f"{b.tokens} {x.name}", table.graph_time(b.tokens, x.segment_rows2), x.graph_ms,
             table.eager_time(x.real_tokens, x.segment_rows2), x.eager_ms) for b in sweep.budgets for x in b.layouts]
    names, pred_g, meas_g, pred_e, meas_e = (np.array(v) for v in zip(*rows, strict=True))
    return {"names": names, "pred_g": pred_g, "meas_g": meas_g, "pred_e": pred_e, "meas_e": meas_e,
            "g_err": pred_g / meas_g - 1, "e_err": pred_e / meas_e - 1}


def plot_table_fits(fits: Mapping[str, Mapping[str, np.ndarray]]) -> Any:
    """Predicted against measured ms (log-log, the diagonal dotted), replays and eager forwards, one panel per mode
    of ``fits`` (as :func:`table_fit` returns); returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(fits), figsize=(10, 4.4))
    for ax, (m, f) in zip(np.atleast_1d(axes), fits.items(), strict=True):
        ax.loglog(f["meas_g"], f["pred_g"], "o", label="graph replay")
        ax.loglog(f["meas_e"], f["pred_e"], "^", label="eager forward")
        lim = [min(f["meas_g"].min(), f["meas_e"].min()) * 0.8, max(f["meas_g"].max(), f["meas_e"].max()) * 1.2]
        ax.plot(lim, lim, "k:", lw=1)
        ax.set(xlabel="measured ms (recorded median)", ylabel="predicted ms", title=f"{m}: every layout of the sweep")
        ax.legend()
    fig.tight_layout()
    return fig


def worst_padding(ladder: Sequence[int], lo: int, hi: int) -> float:
    """The largest padding fraction (B − T) / B of a batch of T tokens, lo < T ≤ hi, in the smallest budget B of
    ``ladder`` holding it (every T must fit)."""
    return max((b - t) / b for t in range(lo + 1, hi + 1) for b in [min(x for x in ladder if x >= t)])


def replay_vs_eager(table: LatencyTable, ladder: Sequence[int], tokens: np.ndarray) -> np.ndarray:
    """Predicted replay / eager time of one image of T tokens (T in ``tokens``, 16 T² segment rows²), replayed in the
    smallest budget of ``ladder`` holding it."""
    return np.array([table.graph_time(min(b for b in ladder if b >= n), 16 * n * n) / table.eager_time(n, 16 * n * n)
                     for n in tokens])


def plot_ratio_curves(tokens: np.ndarray, by_mode: Mapping[str, Mapping[str, np.ndarray]],
                      splits: Mapping[str, int]) -> Any:
    """One panel per mode: each ladder's replay / eager curve against tokens, the line 1 and the mode's split
    (dotted); returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(by_mode), figsize=(10, 3.4), sharey=True)
    for ax, (m, ratios) in zip(np.atleast_1d(axes), by_mode.items(), strict=True):
        for name, r in ratios.items():
            ax.plot(tokens, r, label=name)
        ax.axhline(1, color="k", lw=0.8)
        ax.axvline(splits[m], color="gray", ls=":", lw=1)
        ax.set(xscale="log", xlabel="tokens of the batch (one image)", title=f"{m}: replay vs eager, one image")
        ax.legend(fontsize=8)
    np.atleast_1d(axes)[0].set_ylabel("predicted replay / eager")
    fig.tight_layout()
    return fig


def plot_per_request(measured: Mapping[str, np.ndarray], predicted: Mapping[str, np.ndarray]) -> Any:
    """Predicted against measured ms per request (log-log, the diagonal dotted), one panel per mode of
    ``measured``; returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(measured), figsize=(12, 3.8))
    for ax, m in zip(np.atleast_1d(axes), measured, strict=True):
        ax.loglog(measured[m], predicted[m], ".", alpha=0.5)
        lim = [min(measured[m].min(), predicted[m].min()) * 0.8, max(measured[m].max(), predicted[m].max()) * 1.2]
        ax.plot(lim, lim, "k:", lw=1)
        ax.set(xlabel="measured ms", ylabel="predicted ms", title=f"{m}: {len(measured[m])} requests (recorded)")
    fig.tight_layout()
    return fig


def plot_vs_eager(totals: Sequence[int], measured: Mapping[str, np.ndarray], modes: Sequence[str] = MODES) -> Any:
    """Each mode's measured time over eager's, per request, against the request's tokens; returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for m in modes:
        ax.semilogx(totals, measured[m] / measured["eager"], ".", alpha=0.5, label=f"{m} (routed), measured")
    ax.axhline(1, color="k", lw=0.8)
    ax.set(xlabel="tokens in the request", ylabel="mode / eager", title="routed replays against eager, per request")
    ax.legend(fontsize=8)
    return fig


@dataclass(frozen=True)
class PoolPoint:
    """One recorded capture against ``graph_memory``: its record, mode, attention kind ("triton" or "library"),
    patch rows of its largest budget, recorded and estimated pool bytes, recorded and estimated static bytes, and
    what the captures after the largest added to the pool."""

    record: str
    mode: str
    kind: str
    rows: int
    recorded: int
    estimated: int
    static_recorded: int
    static_estimated: int
    later: int


def pool_points(vision: VisionConfig, modes: Sequence[str] = MODES) -> list[PoolPoint]:
    """Every capture recorded in a latency sweep or a benchmark (graph modes of ``modes``), set against
    ``graph_memory`` for its budgets, mode and attention; prints one row per capture."""
    captures: list[tuple[str, str, str, Any]] = [(path.name, rec.mode, rec.attn_backend, rec.capture)
                                                 for path, rec in find(LatencySweep)]
    for path, bench in find(BenchRecord):
        modes_: dict[str, Any] = dict(bench.modes)  # a mode's capture is one of its extra fields
        captures += [(path.name, m, bench.settings.attn_backend, modes_[m].capture) for m in modes if m in modes_]
    points = []
    print(f"{'record':<26} {'mode':<15} {'attention':<9} {'largest':>7} {'static':>15} "
          f"{'pool est./rec. MiB':>19} ratio")
    for name, mode, attention, cap in captures:
        budgets = tuple(sorted(int(b) for b in cap))
        cfg = BudgetConfig(budgets, 1, max(c["segments"] for c in cap.values()))
        memories = graph_memory(cfg, vision, compiled=mode != "graph", attention=attention)
        p = PoolPoint(name, mode, "triton" if attention == "triton" else "library", 4 * budgets[-1],
                      sum(c["graph_bytes"] for c in cap.values()), max(m.pool_bytes for m in memories),
                      sum(c["buffer_bytes"] for c in cap.values()), sum(m.static_bytes for m in memories),
                      sum(c["graph_bytes"] for c in cap.values()) - cap[str(budgets[-1])]["graph_bytes"])
        points.append(p)
        print(f"{name:<26} {mode:<15} {attention:<9} {budgets[-1]:>7} {p.static_recorded / MiB:6.1f} / "
              f"{p.static_estimated / MiB:6.1f} {p.estimated / MiB:8.0f} / {p.recorded / MiB:<8.0f} "
              f"{p.estimated / p.recorded:.2f}")
    return points


def held_out_pools(points: Sequence[PoolPoint]) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """Per (mode, kind) group with runs at three sizes or more: hold out every run at one size, fit a line
    (fixed + per row) to the others' recorded pools, and return {group: [(rows, held-out estimate / recorded)]},
    sorted by rows; prints each group."""
    groups: dict[tuple[str, str], list[PoolPoint]] = defaultdict(list)
    for p in points:
        groups[(p.mode, p.kind)].append(p)
    out = {}
    for key, runs in sorted(groups.items()):
        sizes = sorted({p.rows for p in runs})
        if len(sizes) < 3:
            print(f"{key}: runs at {len(sizes)} size(s) only, too few to hold one out")
            continue
        ratios = []
        for size in sizes:
            train = [p for p in runs if p.rows != size]
            (fixed, per_row), *_ = np.linalg.lstsq(np.array([[1.0, p.rows] for p in train]),
                                                  np.array([p.recorded for p in train], float), rcond=None)
            ratios += [(p.rows, float((fixed + per_row * p.rows) / p.recorded)) for p in runs if p.rows == size]
        out[key] = ratios
        print(f"{key}: held-out estimate / recorded by size: " + ", ".join(f"{r} rows {x:.2f}" for r, x in ratios))
    return out


def recommend_rows(requests: Sequence[Sequence[ItemSpec]], tables: Mapping[str, LatencyTable],
                   ks: Sequence[int] = (1, 3, 5, 10), max_items: int = 4,
                   max_segments: int = 4) -> dict[tuple[str, int], dict[str, Any]]:
    """``recommend_budgets(objective="time")`` with each mode's table for each graph count k; where EagerIsFaster is
    raised, its budgets (marked ``eager_wins``). Returns {(mode, k): budgets, per-request predicted ms unrouted and
    routed, eager ms, stats, eager_wins} and prints one row each."""
    rows = {}
    n = len(requests)
    for m, table in tables.items():
        for k in ks:
            note = ""
            try:
                budgets = recommend_budgets(requests, max_graphs=k, table=table, objective="time",
                                            max_items=max_items, max_segments=max_segments)
            except EagerIsFaster as eager_wins:  # the best k graphs are predicted slower than eager
                budgets, note = eager_wins.budgets, " ← EagerIsFaster: " + str(eager_wins).split(":")[0]
            plans = plan_workload(requests, BudgetConfig(budgets, max_items, max_segments))
            est = sum((predict_time(p, table) for p in plans), TimeEstimate())
            routed = sum((predict_time(p, table, route=True) for p in plans), TimeEstimate())
            stats = combined_stats(plans)
            rows[(m, k)] = {"budgets": budgets, "ms": est.total_ms / n, "routed_ms": routed.total_ms / n,
                            "eager_ms": est.eager_ms / n, "stats": stats, "eager_wins": bool(note)}
            print(f"{m:<15} {k:>2} graph(s) {str(budgets):<52} {est.total_ms / n:6.2f} ms, routed "
                  f"{routed.total_ms / n:6.2f} ms (eager {est.eager_ms / n:.2f}); "
                  f"{stats.fallbacks} eager items, padding {stats.padding_fraction:.1%}{note}")
    return rows


@dataclass(frozen=True)
class UniformGraphs:
    """The uniform graphs a benchmark mode captured: (ladder budget, rows per frame h·w) → the graph's own token
    budget (its record's ``uniform_capture``), and the fewest rows a batch holds to replay in one (``min_rows``)."""

    budgets: Mapping[tuple[int, int], int]
    min_rows: int

    @classmethod
    def of(cls, mode: Any) -> UniformGraphs:
        """Those of one mode of a bench record (none where it captured none)."""
        from ..uniform import DENSE_MIN_ROWS  # the bench runner's threshold (glmvit.encoder.build_encoder)

        captured = (mode.model_extra or {}).get("uniform_capture") or {}
        budgets = {(int(b), int(f)): int(c["budget"]) for key, c in captured.items() for b, f in [key.split("x")]}
        return cls(budgets, DENSE_MIN_ROWS if budgets else 0)

    def graph_budget(self, budget: int, items: Sequence[ItemSpec]) -> int | None:
        """The token budget of the uniform graph a batch of ``items`` replayed in ``budget`` runs in (every frame one
        h·w, at least ``min_rows`` rows, a graph captured for both); None where it replays in the ladder's graph.
        The rule of ``EncoderGraphRunner.uniform_graph``, from the record."""
        from ..uniform import uniform_length

        length = uniform_length((it.rows // it.segments for it in items), sum(it.rows for it in items), self.min_rows)
        return None if length is None else self.budgets.get((budget, length))

    def route(self, router: Router, batch: Any, items: Sequence[ItemSpec]) -> Route:
        """The runner's route of a planned ``batch`` (a :class:`~glmvit.packing.Batch`) of ``items``: asked at the
        budget of the graph it would replay in, its uniform graph's where it has one, else its own
        (``EncoderGraphRunner._plan``'s rule)."""
        budget = batch.budget
        if budget is not None:
            budget = self.graph_budget(budget, items) or budget
        return router.route(budget, batch.tokens, batch.segment_rows2)


def predicted_per_request(plans: Sequence[Plan], table: LatencyTable, route: bool,
                          requests: Sequence[Sequence[ItemSpec]] | None = None,
                          uniform: UniformGraphs | None = None) -> np.ndarray:
    """``predict_time(plan, table, route).total_ms`` of each plan, as an array. With ``uniform`` (and each plan's
    request), a batch the runner would replay in a uniform graph is routed and predicted at that graph's budget, as
    the runner routes it and the benchmark predicts it (``glmvit.cli.bench.runner_prediction``)."""
    if uniform is None or not uniform.budgets:
        return np.array([predict_time(p, table, route=route).total_ms for p in plans])
    assert requests is not None and len(requests) == len(plans), "uniform graphs need each plan's request"
    router = Router(table, by_time=route)
    out = []
    for plan, items in zip(plans, requests, strict=True):
        total = 0.0
        for b in plan.batches:
            ms = uniform.route(router, b, [items[i] for i in b.item_indices]).predicted_ms
            assert ms is not None, "a router with a table predicts every batch"
            total += ms
        out.append(total)
    return np.array(out)


def plan_violations(n_items: int, plan: Plan, config: BudgetConfig) -> list[str]:
    """What is wrong with ``plan`` for a request of ``n_items`` items under ``config``, one line each (empty: a
    valid plan): an item missing or placed twice, or a replayed batch over the item or segment limit, or not in the
    smallest budget holding its tokens."""
    placed = sorted(i for b in plan.batches for i in b.item_indices)
    wrong = [] if placed == list(range(n_items)) else [f"items placed {placed}, expected each of 0…{n_items - 1} once"]
    for k, b in enumerate(plan.batches):
        if b.budget is None:
            continue
        if len(b.item_indices) > config.max_items:
            wrong.append(f"batch {k}: {len(b.item_indices)} items > {config.max_items}")
        if b.segments > config.max_segments:
            wrong.append(f"batch {k}: {b.segments} segments > {config.max_segments}")
        if b.budget != config.budget_for(b.tokens):
            wrong.append(f"batch {k}: {b.tokens} tokens in budget {b.budget}, not {config.budget_for(b.tokens)}")
    return wrong


@dataclass(frozen=True)
class SeedRow:
    """One mode on one of the PR's benchmark workloads: the plan's one batch (tokens, budget), the time predicted
    from ``tables`` (eager: the uncompiled table's eager forward), the GPU benchmark's mean and median ms, what its
    runner predicted per request and counted, and the PR's published mean (None where the PR has no such mode)."""

    tokens: int
    budget: int | None
    predicted_ms: float
    mean_ms: float
    median_ms: float
    runner_predicted_ms: list[float] | None
    runner: dict[str, Any] | None
    pr_ms: float | None


def seed_rows_predicted(tables: Mapping[str, LatencyTable], seed: dict[str, Any],
                        workloads: Sequence[str] = ("img1x224", "video8x224"),
                        gpus: str = "1× RTX 4090") -> dict[tuple[str, str], SeedRow]:
    """The PR's configuration (``seed_budget_config``) on each of its workloads: plan the one item every request of
    ``data/bench/seed_<workload>.json`` holds with ``packer="vllm"``, predict it routed with each mode's table,
    and set it beside that benchmark and the PR's means on ``gpus``; prints one row per (workload, mode). Raises
    ValueError if a benchmark ran another configuration or more than one distinct item."""
    from ..geometry import item_spec
    from ..packing import plan_batches
    from .seed import seed_budget_config, seed_rows

    config, pr_means = seed_budget_config(seed), seed_rows(seed, gpus)
    out = {}
    print(f"{'':<11}{'mode':<15}{'predicted':>10}{'GPU mean':>10}{'error':>8}{'mean/median':>12}{'PR (4090)':>10}")
    for wl in workloads:
        run = load(BENCH / f"seed_{wl}.json", BenchRecord)
        s = run.settings
        if (tuple(s.budgets), s.max_items, s.max_segments) != (config.token_budgets, config.max_items,
                                                                config.max_segments):
            raise ValueError(f"seed_{wl}.json: ran budgets {s.budgets}, not the PR's {config.token_budgets}")
        grids = {tuple(map(tuple, g)) for g in run.workload["grids"]}
        if len(grids) != 1:
            raise ValueError(f"seed_{wl}.json: {len(grids)} distinct requests, expected one repeated")
        plan = plan_batches([item_spec(*g) for g in grids.pop()], config, packer="vllm")
        (batch,) = plan.batches
        est = {m: predict_time(plan, tables[m], route=True) for m in tables}
        pr_ms = dict(zip(("eager", "graph"), pr_means[wl]["mean"], strict=True))
        for m, ms in {"eager": est[MODES[0]].eager_ms, **{m: e.total_ms for m, e in est.items()}}.items():
            r: Any = run.modes[m]  # the runner's predictions and counts are extra fields of a graph mode
            row = out[wl, m] = SeedRow(batch.tokens, batch.budget, ms, r.mean_ms, r.median_ms,
                                       None if m == "eager" else list(r.predicted_ms),
                                       None if m == "eager" else dict(r.runner), pr_ms.get(m))
            print(f"{wl:<11}{m:<15}{ms:>7.2f} ms{r.mean_ms:>7.2f} ms{ms / r.mean_ms - 1:>+8.1%}"
                  f"{r.mean_ms / r.median_ms:>12.2f}" + (f"{row.pr_ms:>7.2f} ms" if row.pr_ms else f"{'-':>10}"))
    return out
