"""Repository-wide pytest hooks: GPU skips for tests and notebook cells, and a check that every notebook ran."""
from collections import Counter

import pytest
import torch

_notebook_cells: Counter = Counter()
_notebook_executed: Counter = Counter()


def pytest_collection_modifyitems(config, items):
    """Skip `gpu`/`multigpu` tests and notebook cells tagged `gpu` where CUDA is missing."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        cell = getattr(item, "cell", None)
        tags = cell.get("metadata", {}).get("tags", []) if cell is not None else []
        if ("gpu" in item.keywords or "gpu" in tags) and gpus == 0:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA GPUs"))


def pytest_runtest_logreport(report):
    """Count executed cells per notebook (runs on the controller under xdist too)."""
    path = report.nodeid.split("::")[0]
    if path.endswith(".ipynb") and report.when == "call":
        _notebook_cells[path] += 1
        if report.passed:
            _notebook_executed[path] += 1
    elif path.endswith(".ipynb") and report.when == "setup" and report.skipped:
        _notebook_cells[path] += 1


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if a notebook that was collected contributed no executed cell."""
    idle = sorted(p for p in _notebook_cells if _notebook_executed[p] == 0)
    if idle:
        print("\nnotebooks with no executed cell: " + ", ".join(idle))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
