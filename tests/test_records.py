"""glmvit.records: typed records, code fingerprints, staleness, and the commands that list and re-record them."""
import json

import pytest

import glmvit.records as records
from glmvit.__main__ import main
from glmvit.cli.record import JOBS, job_status
from glmvit.records import BenchRecord, Fingerprint, LatencySweep, NotebookResult, make, source_hash, staleness

GOLDEN = "2abd8b91e34b4cfd"  # source_hash of the snippet in test_the_hash_is_the_same_on_every_python
CODE = '''"""A module docstring."""
import math


def area(r):
    """A docstring."""
    return math.pi * r * r  # a comment
'''


def test_the_hash_ignores_docs_comments_and_layout_but_not_code():
    same = CODE.replace("A docstring.", "Another text.").replace("# a comment", "# changed").replace(
        "return math.pi * r * r", "return math.pi  *  r * r")
    assert source_hash(same) == source_hash(CODE)
    assert source_hash(CODE.replace("r * r", "r ** 2")) != source_hash(CODE)
    assert source_hash(CODE.replace('"""A docstring."""\n', "")) == source_hash(CODE)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A throwaway package tree standing in for glmvit/: its modules' hashes are what staleness compares with."""
    (tmp_path / "glmvit").mkdir()
    (tmp_path / "glmvit" / "__init__.py").write_text("")
    (tmp_path / "glmvit" / "model.py").write_text(CODE)
    monkeypatch.setattr(records.tree_hash, "__defaults__", (tmp_path / "glmvit",))
    return tmp_path / "glmvit"


def test_a_record_is_stale_exactly_when_a_module_it_measured_changes(package):
    record = make(NotebookResult, provenance={"command": "x"}, name="n",
                  fingerprint=Fingerprint(modules={"glmvit.model": source_hash(CODE), "<cell n>": "abc"}))
    assert staleness(record) == []
    (package / "model.py").write_text(CODE.replace("# a comment", "# edited"))  # docs only: still current
    assert staleness(record) == []
    (package / "model.py").write_text(CODE.replace("r * r", "r ** 2"))
    assert staleness(record) == ["glmvit.model"]
    assert staleness(record, cells={"<cell n>": "def"}) == ["<cell n>", "glmvit.model"]
    (package / "model.py").unlink()
    assert staleness(record) == ["glmvit.model"]  # gone counts as changed
    assert staleness(make(NotebookResult, provenance={}, name="n").model_copy(update={"fingerprint": None})) == \
        ["no fingerprint"]


def test_the_hash_is_the_same_on_every_python():
    """A golden value: ast.dump differs between Pythons (3.12 adds type_params and splits some f-strings), the hash
    must not, or a record made on the GPU machine's Python reads as stale on CI's. Checked here on 3.10–3.13."""
    code = 'class A:\n    def f(self, x: int) -> str:\n        return f"{x}{x!r:>4} and {x}"\n'
    assert source_hash(code) == GOLDEN


def test_this_process_fingerprints_the_glmvit_modules_it_imported():
    import glmvit.graphs  # noqa: F401

    modules = records.fingerprint_now().modules
    assert "glmvit.graphs" in modules and "glmvit.model" in modules
    assert not set(modules) & records.UNFINGERPRINTED  # the recording machinery and dispatchers are left out


def test_reading_checks_the_type_and_names_the_file(tmp_path):
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"kind": "latency", "provenance": {}, "dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"sweep.json: not a valid latency record \(config: Field required\)"):
        records.load(sweep, LatencySweep)
    with pytest.raises(ValueError, match="sweep.json: a 'latency' record, not the 'bench' record expected"):
        records.load(sweep, BenchRecord)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not a JSON record"):
        records.load(tmp_path / "broken.json", BenchRecord)
    with pytest.raises(ValueError, match="no such record file"):
        records.load(tmp_path / "missing.json", BenchRecord)


def test_a_record_round_trips_through_its_type(tmp_path):
    record = make(NotebookResult, provenance={"gpu": "NVIDIA H200", "git_commit": "abc1234def"}, name="x",
                  answer=42, nested={"a": [1, 2]})
    path = tmp_path / "x.json"
    path.write_text(records.to_json(record))
    back = records.load(path, NotebookResult)
    assert back == record and back.model_extra == {"answer": 42, "nested": {"a": [1, 2]}}
    assert "x.json: notebook record (NVIDIA H200, commit abc1234" in records.describe(back, path)


def test_records_lists_what_is_stale_and_never_fails_unless_strict(capsys):
    assert main(["records"]) == 0
    out = capsys.readouterr().out
    stale = [line for line in out.splitlines() if " stale" in line and line.startswith("data/")]
    assert out.strip().splitlines()[-1].startswith(f"{len(stale)} of ")
    assert main(["records", "--strict"]) == (1 if stale else 0)


def test_record_plans_jobs_in_dependency_order_and_skips_current_ones(capsys, monkeypatch):
    names = [j.name for j in JOBS]
    assert names.index("latency") < names.index("mixed_img") and names.index("latency_compiled") < \
        names.index("mixed_av")  # the benchmarks route and predict with the sweeps
    assert main(["record", "--dry-run", "--groups", "sweeps"]) == 0
    assert all(line.startswith(("[run]", "[skip]", "record run")) for line in capsys.readouterr().out.splitlines())
    current = next(j for j in JOBS if j.name == "interp")
    monkeypatch.setattr("glmvit.cli.record.job_status", lambda job, run_id=None: (job is current, 10.0))
    assert main(["record", "--dry-run", "--only", "interp,latency", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "[skip] interp: current" in out and "[later] latency: expected 10 s, 5 s left" in out
    with pytest.raises(SystemExit):
        main(["record", "--only", "nope"])
    assert job_status(current)[1] > 0


def test_a_forced_record_resumes_skipping_only_what_its_own_run_id_made(monkeypatch):
    """``--force`` re-records current results too; a later call of the same run must not redo what it made."""
    from types import SimpleNamespace

    from glmvit.cli import record

    job = next(j for j in JOBS if j.name == "interp")
    made = SimpleNamespace(record_run="run-a", elapsed_s=12.0)
    monkeypatch.setattr(record, "load_any", lambda path: made)
    monkeypatch.setattr(record, "staleness", lambda rec: [])
    assert job_status(job) == (True, 12.0)  # current: an unforced run skips it
    assert job_status(job, "run-a") == (True, 12.0)  # made by this forced run: skipped on resume
    assert job_status(job, "run-b") == (False, 12.0)  # current but older: a forced run re-records it
    monkeypatch.setattr(record, "staleness", lambda rec: ["glmvit.model"])
    assert job_status(job, "run-a") == (False, 12.0)  # this run's, but the code changed since: stale


def test_record_archive_holds_every_finished_job_before_the_next_starts(tmp_path, monkeypatch, capsys):
    """A device lease can end mid-run: the archive is rewritten after every job, so it never waits for the last."""
    import subprocess
    import tarfile

    import torch

    from glmvit.cli import record
    from glmvit.records import REPO

    jobs = [j for j in JOBS if j.name in ("latency", "latency_compiled")]
    fakes = {j.name: REPO / "data" / j.outputs[0] for j in jobs}  # existing files, never written here
    archive = tmp_path / "records.tgz"
    seen = []

    def run(argv, **_):
        if "--compile" in argv:  # the second job: the first one's record is already packed
            with tarfile.open(archive) as tar:
                seen.append(tar.getnames())
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(record, "job_status", lambda job, run_id=None: (False, 1.0))
    monkeypatch.setattr(record, "stamp_elapsed", lambda job, seconds, started: [fakes[job.name]])
    monkeypatch.setattr(record.subprocess, "run", run)
    assert main(["record", "--only", "latency,latency_compiled", "--archive", str(archive)]) == 0
    assert seen == [["data/bench/latency_h200.json"]]
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["data/bench/latency_h200.json", "data/bench/latency_compiled_h200.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["records.tgz"] and "wrote" in capsys.readouterr().out

