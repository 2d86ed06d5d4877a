"""tools/eager_probe.py's CPU choice for its pinned condition, and a dry run of the whole probe on the CPU."""
import json

import pytest

from tools import eager_probe


def test_the_quietest_cpu_is_one_the_thread_may_use_and_the_probe_leaves_its_cpus_alone():
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity here")
    allowed = os.sched_getaffinity(0)
    assert eager_probe.quietest_cpu(sorted(allowed)) in allowed
    assert os.sched_getaffinity(0) == allowed
    assert eager_probe.quietest_cpu([min(allowed)]) == min(allowed)  # one CPU: nothing to measure


def test_the_quietest_cpu_is_the_one_whose_loops_run_fastest(monkeypatch):
    import os

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    a, b = sorted(os.sched_getaffinity(0))[:2]
    slow = {a: 4.0, b: 3.0}  # CPU a is busy with other work: its loops take longer
    monkeypatch.setattr(eager_probe, "spin_ms", lambda iterations: slow[min(os.sched_getaffinity(0))])
    assert eager_probe.quietest_cpu([a, b]) == b
    slow[a], slow[b] = 3.0, 4.0
    assert eager_probe.quietest_cpu([a, b]) == a


def test_the_probe_runs_every_condition_and_writes_its_rows(tmp_path, monkeypatch):
    out = tmp_path / "probe.json"
    monkeypatch.setattr("sys.argv", ["eager_probe", "--device", "cpu", "--config", "tiny", "--blocks", "1",
                                     "--requests", "2", "--json", str(out)])
    eager_probe.main()
    result = json.loads(out.read_text())
    assert [r["condition"] for r in result["rows"]] == [c for c in eager_probe.CONDITIONS for _ in range(2)]
    assert all(r["wall_ms"] >= r["issue_ms"] > 0 and r["spin_ms"] > 0 and r["host_ms"] > 0 and r["minor_faults"] >= 0
               for r in result["rows"])
    assert "corr_wall_host" in result["summary"] or len({r["wall_ms"] for r in result["rows"]}) == 1
    assert set(result["summary"]["by_condition"]) == set(eager_probe.CONDITIONS)
    assert result["provenance"]["device"] == "cpu" and result["provenance"]["command"].startswith("python")
