"""``python -m glmvit records``: every recorded result, what it measured, and whether it still describes this code.

A record is *stale* when code it measured has changed since (:func:`glmvit.records.staleness`); re-record with
``python -m glmvit record`` on a CUDA machine. Exit status 0 (a listing), or 1 with ``--strict`` when any record is
stale. ``.ci/run`` prints this list as a warning: a CPU machine cannot re-record, so staleness never fails CI.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..records import RECORD_DIRS, REPO, RESULT_KINDS, changed_summary, load_any, staleness
from .common import Parser


def rows(dirs: tuple[Path, ...] = RECORD_DIRS) -> list[tuple[str, str, str, list[str]]]:
    """(file, kind, commit, what changed) of every record; a file that is no record says so as its change."""
    out = []
    for directory in dirs:
        for path in sorted(directory.glob("*.json")):
            name = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)
            try:
                record = load_any(path)
            except ValueError as err:
                out.append((name, "?", "?", [f"unreadable: {err}"]))
                continue
            out.append((name, record.kind, record.provenance.short_commit, staleness(record)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m glmvit records", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--stale", action="store_true", help="list only the stale records")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any record is stale")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    listing = rows()
    stale = [r for r in listing if r[3] and r[1] in RESULT_KINDS]  # an input (a tune sweep) is listed, not counted
    width = max((len(r[0]) for r in listing), default=10)
    for name, kind, commit, changed in (stale if args.stale else listing):
        status = "current" if not changed else "stale: " + (
            "made before fingerprints" if changed == ["no fingerprint"] else changed_summary(changed))
        if kind not in RESULT_KINDS and kind != "?":
            status = f"an input, not re-measured by python -m glmvit record ({status})"
        print(f"{name:<{width}}  {kind:<9} {commit:<8} {status}")
    n = len(listing)
    print(f"{len(stale)} of {n} record{'s' if n != 1 else ''} stale" + (
        " (re-record on a CUDA machine: python -m glmvit record)" if stale else ""))
    return 1 if args.strict and stale else 0
