"""glmvit.records: typed records, code fingerprints, staleness, and the commands that list and re-record them."""
import json

import pytest

import glmvit.records as records
from glmvit.__main__ import main
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


def test_a_serve_record_keeps_each_requests_split_and_reads_one_made_before_it(tmp_path):
    """bench-serve's runs keep each request's Server-Timing (per_request.timing_ms, None for a request without
    one); a record made before has none and still reads, and is written back as it was, its fields in their order."""
    from glmvit.records import ServeRecord

    committed = records.load(records.DATA / "bench" / "serve_video8x224.json", ServeRecord)
    assert all("timing_ms" in r["per_request"] for r in committed.runs)  # what bench-serve writes now
    before = json.loads(records.to_json(committed))  # the same record as one made before the split was kept
    for r in before["runs"]:
        del r["per_request"]["timing_ms"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(before, indent=1) + "\n")
    record = records.load(old, ServeRecord)
    assert "timing_ms" not in record.runs[0]["per_request"] and records.to_json(record) == old.read_text()
    run = {**record.runs[0], "per_request": {"ok": [True, False], "sent_s": [0.0, 0.1], "tte_ms": [5.0, 1.0],
                                             "queue_ms": [1.0, None],
                                             "timing_ms": [{"read": 0.5, "queue": 1.0}, None]}}
    new = make(ServeRecord, provenance={}, settings={}, runs=[run])
    path = tmp_path / "serve.json"
    path.write_text(records.to_json(new))
    back = records.load(path, ServeRecord)
    assert back.runs[0]["per_request"]["timing_ms"] == [{"read": 0.5, "queue": 1.0}, None]
    assert list(back.runs[0]) == list(record.runs[0])  # the order bench-serve writes
    with pytest.raises(ValueError, match=r"runs.0.per_request.timing_ms.0: Input should be a valid dictionary"):
        records.parse({"kind": "serve", "provenance": {}, "settings": {},
                       "runs": [{**run, "per_request": {**run["per_request"], "timing_ms": ["slow"]}}]}, ServeRecord)
