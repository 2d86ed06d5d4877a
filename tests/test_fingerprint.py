"""glmvit.fingerprint: a record depends on the code units that ran, by content, so refactors leave it current.

The measured path runs from the real package under a scope; every edit is made to a copy of the package in a
temporary directory, and staleness is asked of that copy.
"""
import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from glmvit import fingerprint
from glmvit.geometry import item_spec
from glmvit.kernels.attention_table import config_for
from glmvit.metadata import build_metadata
from glmvit.packing import BudgetConfig, plan_batches
from glmvit.records import Fingerprint, NotebookResult, fingerprint_now, load, make, staleness, to_json, tree_hash

PACKAGE = fingerprint.PACKAGE
MONITORING = sys.version_info >= (3, 12)


@pytest.fixture
def tracked():
    """Tracking on for one test (sys.monitoring on 3.12+, the profiler hooks below), and off again after it."""
    was = fingerprint.tracking()
    assert fingerprint.start(force=True)
    yield
    if not was:
        fingerprint.stop()


def measure() -> None:
    """The measured path: packing a request, its metadata, and a kernel module's launch table and buffers."""
    items = [item_spec(1, 16, 16), item_spec(1, 32, 32), item_spec(2, 16, 16)]
    plan_batches(items, BudgetConfig((64, 256, 512), 8, 16))
    build_metadata(np.array([[1, 16, 16], [2, 8, 8]]), 2)
    config_for(300)
    from glmvit.kernels.triton_gemm import tile_counters

    tile_counters("cpu")


@pytest.fixture(scope="module")
def record():
    """A record of the measured path, made once: tracking is on only while it runs."""
    was = fingerprint.tracking()
    assert fingerprint.start(force=True)
    try:
        with fingerprint.scope() as scope:
            measure()
    finally:
        if not was:
            fingerprint.stop()
    return make(NotebookResult, provenance={}, name="n", fingerprint=Fingerprint(units=scope.units()))


@pytest.fixture
def copy(tmp_path):
    """A copy of the package: what every edit below changes."""
    shutil.copytree(PACKAGE, tmp_path / "glmvit", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "glmvit"


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert text.count(old) == count, f"{path.name}: {old!r} found {text.count(old)} times, expected {count}"
    path.write_text(text.replace(old, new))


def function_source(path: Path, name: str) -> str:
    text = path.read_text()
    node = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return "".join(text.splitlines(keepends=True)[node.lineno - 1:node.end_lineno])


def rename_everywhere(package: Path, old: str, new: str) -> int:
    """Rename the identifier ``old`` in every file of ``package``; how many files changed."""
    changed = 0
    for path in package.rglob("*.py"):
        text = path.read_text()
        renamed = re.sub(rf"\b{old}\b", new, text)
        if renamed != text:
            path.write_text(renamed)
            changed += 1
    return changed


def test_the_record_names_what_ran_and_not_what_did_not(record):
    units = record.fingerprint.units
    assert {"glmvit/packing.py:plan_batches", "glmvit/packing.py:_pack_ffd", "glmvit/metadata.py:build_metadata",
            "glmvit/metadata.py:BatchShape.cu_slots", "glmvit/kernels/attention_table.py:config_for"} <= set(units)
    assert "glmvit/packing.py:compare_packers" not in units and "glmvit/packing.py:_pack_vllm" not in units
    assert "glmvit/kernels/triton_gemm.py:_splitk_kernel" in units  # a kernel of a module that ran
    assert not any(label.startswith(("glmvit/records.py", "glmvit/fingerprint.py")) for label in units)
    assert set(units.values()) <= fingerprint.tree_unit_hashes()


def test_a_copy_of_the_tree_is_current(record, copy):
    assert staleness(record, package=copy) == []


def test_renaming_a_local_variable_leaves_it_current(record, copy):
    path = copy / "packing.py"
    old = function_source(path, "plan_batches")
    new = re.sub(r"\bspecs\b", "item_specs", old)
    assert new != old
    edit(path, old, new)
    assert staleness(record, package=copy) == []


def test_renaming_an_executed_function_and_its_callers_leaves_it_current(record, copy):
    assert rename_everywhere(copy, "_pack_ffd", "_pack_decreasing") == 1
    assert rename_everywhere(copy, "check_items", "validated_items") >= 1
    assert staleness(record, package=copy) == []


def test_moving_an_executed_function_to_another_module_leaves_it_current(record, copy):
    source = function_source(copy / "metadata.py", "rows_of")
    edit(copy / "metadata.py", source, "")
    edit(copy / "metadata.py", "from .rotary import rot_pos_ids\n",
         "from .geometry import rows_of\nfrom .rotary import rot_pos_ids\n")
    geometry = copy / "geometry.py"
    geometry.write_text(geometry.read_text().replace("import math\n", "import math\n\nimport numpy as np\n", 1)
                        + "\n\n" + source)
    assert staleness(record, package=copy) == []


def test_comments_docstrings_and_annotations_leave_it_current(record, copy):
    edit(copy / "metadata.py", '"""Σ t·h·w of ``grids``', '"""The total of t·h·w over ``grids``')
    edit(copy / "packing.py", "    specs = check_items(items)\n", "    specs = check_items(items)  # validated\n")
    edit(copy / "packing.py", 'config: BudgetConfig, packer: str = "ffd") -> Plan:',
         'config: "BudgetConfig", packer: "str | None" = "ffd") -> "Plan | None":')
    assert staleness(record, package=copy) == []


def test_changing_an_executed_function_body_stales_it(record, copy):
    edit(copy / "metadata.py", "return -(-(self.segments + 2) // 4) * 4", "return -(-(self.segments + 2) // 8) * 8")
    assert "glmvit/metadata.py:BatchShape.cu_slots" in staleness(record, package=copy)


def test_cloning_in_the_packing_path_stales_it(record, copy):
    edit(copy / "packing.py", "    specs = check_items(items)\n", "    specs = list(check_items(items))\n")
    assert staleness(record, package=copy) == ["glmvit/packing.py:plan_batches"]


def test_changing_a_module_constant_or_launch_table_stales_it(record, copy):
    edit(copy / "kernels" / "attention_table.py", "(1024, AttnConfig(64, 64, 4, 1))",
         "(2048, AttnConfig(64, 64, 4, 1))")
    changed = staleness(record, package=copy)
    assert len(changed) == 1 and changed[0].startswith("glmvit/kernels/attention_table.py:<module stmt ")
    edit(copy / "metadata.py", "MAX_ROWS = 2**30", "MAX_ROWS = 2**29")
    assert len(staleness(record, package=copy)) == 2


def test_editing_a_kernel_of_a_module_that_ran_stales_it(record, copy):
    path = copy / "kernels" / "triton_gemm.py"
    old = function_source(path, "_splitk_kernel")
    new = old.replace("tl.program_id(0)", "tl.program_id(1)", 1)
    assert new != old
    edit(path, old, new)
    assert staleness(record, package=copy) == ["glmvit/kernels/triton_gemm.py:_splitk_kernel"]


def test_an_unexecuted_function_does_not_count(record, copy):
    edit(copy / "packing.py", "    items = list(items)\n    return {name:",
         "    items = tuple(items)\n    return {name:")
    assert staleness(record, package=copy) == []


def test_fingerprint_now_takes_the_open_scope_else_the_modules(tracked):
    with fingerprint.scope():
        config_for(10)
        inside = fingerprint_now({"<cell c>": "abc"})
    assert inside.units is not None and "glmvit/kernels/attention_table.py:config_for" in inside.units
    assert inside.units["<cell c>"] == "abc" and "glmvit/packing.py:plan_batches" not in inside.units
    fingerprint.stop()
    assert fingerprint_now().units is None and "glmvit.packing" in fingerprint_now().modules


def test_nested_scopes_both_receive_what_runs(tracked):
    with fingerprint.scope() as outer:
        config_for(10)
        with fingerprint.scope() as inner:
            config_for(20)
            inner.add({"glmvit/x.py:f": "0123"})
    assert "glmvit/kernels/attention_table.py:config_for" in inner.units() and "glmvit/x.py:f" in inner.units()
    assert "glmvit/kernels/attention_table.py:config_for" in outer.units() and "glmvit/x.py:f" not in outer.units()


@pytest.mark.skipif(MONITORING, reason="3.12+ tracks by default")
def test_tracking_is_off_unless_forced_below_3_12():
    if fingerprint.tracking():
        pytest.skip("tracking already on in this process")
    assert fingerprint.start() is False and not fingerprint.tracking()


@pytest.mark.skipif(not MONITORING, reason="sys.monitoring needs Python 3.12+")
def test_a_function_disabled_after_its_first_call_is_seen_again_by_a_new_scope():
    was = fingerprint.tracking()
    assert fingerprint.start()
    try:
        config_for(10)
        with fingerprint.scope() as scope:
            config_for(20)
        assert "glmvit/kernels/attention_table.py:config_for" in scope.units()
    finally:
        if not was:
            fingerprint.stop()


def test_a_child_process_writes_the_units_it_ran(tmp_path):
    prefix = tmp_path / "units"
    code = ("import glmvit\nfrom glmvit.geometry import item_spec\n"
            "from glmvit.packing import BudgetConfig, plan_batches\n"
            "plan_batches([item_spec(1, 16, 16)], BudgetConfig((64, 256), 8, 16))")
    env = dict(os.environ, GLMVIT_UNITS_FILE=str(prefix))
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=PACKAGE.parent, timeout=300)
    (written,) = tmp_path.glob("units.*.json")
    units = fingerprint.read_units(prefix)
    assert units == json.loads(written.read_text())
    assert units["glmvit/packing.py:plan_batches"] == fingerprint.tree().units("glmvit.packing")[
        "glmvit/packing.py:plan_batches"]
    assert "glmvit/metadata.py:build_metadata" not in units
    (tmp_path / "units.1.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"units.1.json: not a units file"):
        fingerprint.read_units(prefix)


def test_an_old_record_with_module_hashes_still_reads_and_checks(tmp_path, copy):
    path = tmp_path / "old.json"
    record = make(NotebookResult, provenance={}, name="n",
                  fingerprint=Fingerprint(modules={"glmvit.packing": tree_hash("glmvit.packing", copy)}))
    path.write_text(to_json(record))
    assert "units" not in json.loads(path.read_text())["fingerprint"]  # written as before
    old = load(path, NotebookResult)
    assert old.fingerprint == record.fingerprint and staleness(old, package=copy) == []
    edit(copy / "packing.py", "    items = list(items)\n", "    items = tuple(items)\n")
    assert staleness(old, package=copy) == ["glmvit.packing"]  # any change to the module, as before


def test_a_units_record_round_trips_without_module_hashes(record, tmp_path):
    path = tmp_path / "new.json"
    path.write_text(to_json(record))
    assert "modules" not in json.loads(path.read_text())["fingerprint"]
    assert load(path, NotebookResult) == record


UNIT_GOLDEN = "3237fc41f30df045"  # the unit hash of `scale` below: the same on 3.10-3.13 (checked when written)


def test_a_unit_hash_is_the_same_on_every_python(tmp_path):
    """A record made on the GPU machine's Python must read as current on CI's: ast differs between Pythons (3.12
    adds type_params, splits f-strings), the unit text must not. Also: the def name and annotations do not count."""
    (tmp_path / "glmvit").mkdir()
    (tmp_path / "glmvit" / "m.py").write_text(
        'def scale(x: int, k=2) -> str:\n    """Doc."""\n'
        '    y = [v * k for v in range(x)]\n    return f"{y}{x!r:>4}"\n')
    units = fingerprint.tree(tmp_path / "glmvit").units("glmvit.m")
    assert units == {"glmvit/m.py:scale": UNIT_GOLDEN}
    (tmp_path / "glmvit" / "m.py").write_text(
        'def times(x, k=2):\n    w = [u * k for u in range(x)]\n    return f"{w}{x!r:>4}"\n')
    assert set(fingerprint.tree(tmp_path / "glmvit").units("glmvit.m").values()) == {UNIT_GOLDEN}


def test_describe_names_a_few_changed_units_and_counts_the_rest():
    from glmvit.records import describe

    gone = {f"glmvit/graphs.py:f{k}": "not a hash of this tree" for k in range(5)}
    record = make(NotebookResult, provenance={}, name="n", fingerprint=Fingerprint(units=gone))
    assert describe(record).endswith(
        "STALE: glmvit/graphs.py:f0, glmvit/graphs.py:f1, glmvit/graphs.py:f2 and 2 more changed since")


def test_code_that_calls_the_recording_machinery_names_it_and_does_not_hold_its_content(copy):
    """A unit calling an unfingerprinted function (here ``glmvit.records.staleness``) holds its name: editing that
    function changes no unit of the measured code; editing the unit itself still does."""
    before = fingerprint.tree(copy).units("glmvit.recorded")["glmvit/recorded.py:table_from_sweep"]
    edit(copy / "records.py", "    if record.fingerprint is None:\n", "    if record.fingerprint is None:  # x\n"
         "        pass\n")
    assert fingerprint.tree(copy).units("glmvit.recorded")["glmvit/recorded.py:table_from_sweep"] == before
    edit(copy / "recorded.py", "    data = sweep.model_dump(mode=\"json\")\n",
         "    data = sweep.model_dump(mode=\"python\")\n")
    assert fingerprint.tree(copy).units("glmvit.recorded")["glmvit/recorded.py:table_from_sweep"] != before
