"""One eager forward timed by several records of a record run, read side by side.

An eager forward of a small batch is bound by the host's kernel launches, so the records that time the same forward
agree as far as the host held one speed across the run. The host's CPUs do not: on the H200 machine host work with no
GPU in it slows in step with the forward, up to about 2× within seconds (``data/sweeps/eager_probe_h200.json``). So
each record's median carries the share of its requests the host ran slow, and its 10th percentile (P10, over all its
requests) the forward at the host's full speed: :attr:`EagerTimings.fast` sets those side by side.
``tests/test_recorded_data.py`` checks the agreement and ``tools/readme_results.py`` prints it beside the results that
divide by eager. Nothing that records imports this module: the records do not depend on it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from .records import BenchRecord, LatencySweep, load


@dataclasses.dataclass(frozen=True)
class EagerTimings:
    """One eager forward timed by several benchmark records of one record run: ``medians`` maps each record (by
    file name) to its eager median in ms, ``fast`` each benchmark record to its eager P10 over all its requests in
    ms (the latency sweep keeps no per-request times: it is in ``medians`` only). An eager forward of a small batch
    is bound by the host's launches, so the medians agree as far as the host held one speed across the run, the
    P10s as far as each record saw the host at full speed for a tenth of its requests."""

    forward: str
    run: str | None
    medians: dict[str, float]
    fast: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def spread(self) -> float:
        """Largest median / smallest."""
        return max(self.medians.values()) / min(self.medians.values())

    @property
    def fast_spread(self) -> float:
        """Largest P10 / smallest (1.0 with fewer than two)."""
        return max(self.fast.values()) / min(self.fast.values()) if len(self.fast) > 1 else 1.0


# Records that time the same eager forward (eager ignores the budgets; the latency sweep's 64-token "full" layout is
# one [1, 16, 16] grid): per forward, the benchmark records, and whether the latency sweep times it too.
EAGER_TWINS = {"one 224² image": (("img1x224.json", "seed_img1x224.json"), True),
               "one 8-frame 224² clip": (("video8x224.json", "seed_video8x224.json"), False)}


def eager_timings(bench: Path) -> list[EagerTimings]:
    """Every forward of :data:`EAGER_TWINS` whose records in ``bench`` (a ``data/bench`` directory) all exist and
    come from one record run, with their eager medians; a forward with a record missing is left out."""
    out = []
    for forward, (names, in_sweep) in EAGER_TWINS.items():
        paths = [bench / n for n in names] + ([bench / "latency.json"] if in_sweep else [])
        if not all(p.exists() for p in paths):
            continue
        records = {n: load(bench / n, BenchRecord) for n in names}
        medians = {n: r.modes["eager"].median_ms for n, r in records.items()}
        fast = {n: float(np.percentile((r.modes["eager"].model_extra or {})["ms"], 10)) for n, r in records.items()}
        runs = {r.record_run for r in records.values()}
        if in_sweep:
            sweep = load(paths[-1], LatencySweep)
            budget = next(b for b in sweep.budgets if b.tokens == 64)
            medians[paths[-1].name] = next(lay for lay in budget.layouts if lay.name == "full").eager_ms
            runs.add(sweep.record_run)
        if len(runs) == 1:
            out.append(EagerTimings(forward, runs.pop(), medians, fast))
    return out
