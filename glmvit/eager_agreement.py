"""One eager forward timed by several records of a record run, read side by side.

An eager forward of a small batch is bound by the host's kernel launches, so the records that time the same forward
agree as far as the host held one speed across the run. ``tests/test_recorded_data.py`` checks the agreement and
``tools/readme_results.py`` prints it beside the results that divide by eager. Nothing that records imports this
module: the records do not depend on it."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .records import BenchRecord, LatencySweep, load


@dataclasses.dataclass(frozen=True)
class EagerTimings:
    """One eager forward timed by several benchmark records of one record run: ``medians`` maps each record (by
    file name) to its eager median in ms. An eager forward of a small batch is bound by the host's launches, so
    the records agree as far as the host held one speed across the run."""

    forward: str
    run: str | None
    medians: dict[str, float]

    @property
    def spread(self) -> float:
        """Largest median / smallest."""
        return max(self.medians.values()) / min(self.medians.values())


# Records that time the same eager forward (eager ignores the budgets; the latency sweep's 64-token "full" layout is
# one [1, 16, 16] grid): per forward, the benchmark records, and whether the latency sweep times it too.
EAGER_TWINS = {"one 224² image": (("img1x224_h200.json", "seed_img1x224_h200.json"), True),
               "one 8-frame 224² clip": (("video8x224_h200.json", "seed_video8x224_h200.json"), False)}


def eager_timings(bench: Path) -> list[EagerTimings]:
    """Every forward of :data:`EAGER_TWINS` whose records in ``bench`` (a ``data/bench`` directory) all exist and
    come from one record run, with their eager medians; a forward with a record missing is left out."""
    out = []
    for forward, (names, in_sweep) in EAGER_TWINS.items():
        paths = [bench / n for n in names] + ([bench / "latency_h200.json"] if in_sweep else [])
        if not all(p.exists() for p in paths):
            continue
        records = {n: load(bench / n, BenchRecord) for n in names}
        medians = {n: r.modes["eager"].median_ms for n, r in records.items()}
        runs = {r.record_run for r in records.values()}
        if in_sweep:
            sweep = load(paths[-1], LatencySweep)
            budget = next(b for b in sweep.budgets if b.tokens == 64)
            medians[paths[-1].name] = next(lay for lay in budget.layouts if lay.name == "full").eager_ms
            runs.add(sweep.record_run)
        if len(runs) == 1:
            out.append(EagerTimings(forward, runs.pop(), medians))
    return out
