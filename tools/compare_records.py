"""Old against new: every benchmark's median per mode at a git revision and in the working tree, side by side.

    python tools/compare_records.py a926270            # a markdown table, one row per workload and mode

A row says whether the old median falls inside the new one's 95 % interval (``median_ci95_ms``; records made before
intervals have none, so only the new side is needed) and the ratio new / old.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = "data/bench"


def at_revision(revision: str, path: str) -> dict | None:
    """The JSON of ``path`` at ``revision``, or None if it was not there."""
    shown = subprocess.run(["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return json.loads(shown.stdout) if shown.returncode == 0 else None


def rows(revision: str) -> list[str]:
    out = [f"| workload | mode | old median (requests) @ {revision} | new median [95 % interval] (requests) | "
           "new / old | old inside the new interval |", "|---|---|---|---|---|---|"]
    for path in sorted((ROOT / BENCH).glob("*.json")):
        new = json.loads(path.read_text())
        if new.get("kind") != "bench":
            continue
        # records were named for the H200 (img1x224_h200.json) before they were named for what they measure
        old = (at_revision(revision, f"{BENCH}/{path.name}")
               or at_revision(revision, f"{BENCH}/{path.stem}_h200.json") or {"modes": {}})
        for mode, n in new["modes"].items():
            o = old["modes"].get(mode)
            lo, hi = n.get("median_ci95_ms") or (float("nan"), float("nan"))
            new_cell = f"{n['median_ms']:.3f} [{lo:.3f}, {hi:.3f}] ({n.get('timed_requests', n['requests'])})"
            if o is None:
                out.append(f"| {path.stem} | {mode} | – | {new_cell} | – | – |")
                continue
            inside = "yes" if lo <= o["median_ms"] <= hi else "no"
            out.append(f"| {path.stem} | {mode} | {o['median_ms']:.3f} ({o['requests']}) | {new_cell} | "
                       f"{n['median_ms'] / o['median_ms']:.3f} | {inside} |")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    print("\n".join(rows(argv[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
