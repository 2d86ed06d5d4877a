"""Environment check and notebook set-up: the first cell of every glmvit notebook.

``env_check()`` prints a small ``[OK]`` / ``[FAIL]`` / ``[--]`` table (in the style of rasbt/LLMs-from-scratch's
``python_environment_check``) comparing what is installed with the lower bounds in ``pyproject.toml``:

- ``[OK]``   installed and at least the required version (or a fact that is fine as it is);
- ``[FAIL]`` missing or older than required, for something the notebooks need;
- ``[--]``   optional here and absent (no CUDA GPU, no Triton): the notebooks still run, some cells are skipped.

``run_or_replay(name, compute)`` is how a notebook's GPU cell runs everywhere: computed on a CUDA machine, and
replayed elsewhere from ``data/notebooks/NAME.json`` (made by ``python -m glmvit record`` on the GPU its
provenance names).

``setup_notebook()`` fixes the seeds, the CPU thread count and the matplotlib defaults so that every notebook
computes and draws the same thing on every machine.

Import them as ``from glmvit.env import env_check, setup_notebook``.
"""
from __future__ import annotations

import importlib
import importlib.metadata as metadata
import inspect
import os
import random
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["Check", "env_check", "setup_notebook", "lower_bounds", "run_or_replay"]

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"

# Used when pyproject.toml is not next to the package (a non-editable install) or tomllib is missing (Python 3.10).
# Keep in step with pyproject.toml; tests/test_env.py checks that they agree.
FALLBACK_BOUNDS = {
    "python": "3.10",
    "torch": "2.6",
    "numpy": "1.26",
    "pillow": "10.0",
    "safetensors": "0.4",
    "transformers": "5.4",
    "tqdm": "4.66",
    "triton": "3.0",
    "ipywidgets": "8.0",
    "matplotlib": "3.7",
}

# (distribution name, import name, needed by every notebook?)
PACKAGES = [
    ("torch", "torch", True),
    ("triton", "triton", False),
    ("transformers", "transformers", True),
    ("numpy", "numpy", True),
    ("pillow", "PIL", True),
    ("safetensors", "safetensors", True),
    ("ipywidgets", "ipywidgets", False),
    ("matplotlib", "matplotlib", True),
]

OK, FAIL, SKIP = "[OK]", "[FAIL]", "[--]"


@dataclass(frozen=True)
class Check:
    """One row of the table."""

    name: str
    status: str  # "[OK]", "[FAIL]" or "[--]"
    found: str
    required: str
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.status != FAIL


def _parse_requirement(spec: str) -> tuple[str, str] | None:
    """'torch>=2.5' → ('torch', '2.5'); markers (';  platform_system == ...') and extras are ignored."""
    spec = spec.split(";")[0].strip()
    m = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)", spec)
    return (m.group(1).lower().replace("_", "-"), m.group(2)) if m else None


def lower_bounds(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """The ``>=`` lower bounds of pyproject.toml (dependencies and every extra) plus ``python`` (requires-python)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return dict(FALLBACK_BOUNDS)
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError, ValueError):
        return dict(FALLBACK_BOUNDS)
    bounds: dict[str, str] = {}
    specs = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    for spec in specs:
        parsed = _parse_requirement(spec)
        if parsed and parsed[0] not in bounds:
            bounds[parsed[0]] = parsed[1]
    m = re.search(r">=\s*([0-9.]+)", project.get("requires-python", ""))
    bounds["python"] = m.group(1) if m else FALLBACK_BOUNDS["python"]
    return bounds


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in re.split(r"[.+-]", version):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def version_at_least(found: str, required: str) -> bool:
    """``found >= required`` with packaging.version when available (local labels like '+cpu' are ignored)."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return _version_tuple(found) >= _version_tuple(required)
    try:
        return Version(found).release >= Version(required).release
    except InvalidVersion:
        return _version_tuple(found) >= _version_tuple(required)


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _package_row(dist: str, module: str, needed: bool, bounds: dict[str, str]) -> Check:
    required = bounds.get(dist, "")
    req = f">={required}" if required else "any"
    found = _installed(dist)
    if found is None:
        return Check(dist, FAIL if needed else SKIP, "not installed", req, "" if needed else "optional")
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - any import failure is what the row reports
        return Check(dist, FAIL if needed else SKIP, found, req, f"import failed: {type(err).__name__}")
    if required and not version_at_least(found, required):
        return Check(dist, FAIL, found, req, "too old")
    return Check(dist, OK, found, req)


def _torch_rows(bounds: dict[str, str]) -> list[Check]:
    rows = [_package_row("torch", "torch", True, bounds)]
    if rows[0].status == FAIL:
        return rows
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        rows.append(Check("CUDA", OK, f"{torch.version.cuda}", "optional", f"{torch.cuda.device_count()}× {name}"))
    else:
        rows.append(Check("CUDA", SKIP, "not available", "optional", "CPU only: GPU cells show recorded results"))
    return rows


def _triton_rows(bounds: dict[str, str]) -> list[Check]:
    row = _package_row("triton", "triton", False, bounds)
    rows = [row]
    if row.status == SKIP:
        rows[0] = Check(row.name, SKIP, row.found, row.required, "kernels use the exact torch fallback")
        return rows
    flag = os.environ.get("TRITON_INTERPRET", "")
    kernel = sys.modules.get("glmvit.kernels.triton_bicubic")  # never imported here: that would fix the mode
    if kernel is not None:
        mode = "interpreter" if getattr(kernel, "INTERPRETED", False) else "compiled"
        note = f"glmvit kernels already imported: {mode}"
    else:
        note = "kernels not imported yet"
    rows.append(Check("triton mode", OK, f"TRITON_INTERPRET={flag or 'unset'}", "-", note))
    return rows


def env_check(verbose: bool = True) -> list[Check]:
    """Check Python, torch (+ CUDA), Triton (+ interpreter mode) and the other packages; print and return the rows."""
    bounds = lower_bounds()
    py = ".".join(map(str, sys.version_info[:3]))
    need_py = bounds.get("python", FALLBACK_BOUNDS["python"])
    rows = [Check("python", OK if version_at_least(py, need_py) else FAIL, py, f">={need_py}")]
    rows += _torch_rows(bounds)
    rows += _triton_rows(bounds)
    for dist, module, needed in PACKAGES:
        if dist not in ("torch", "triton"):
            rows.append(_package_row(dist, module, needed, bounds))
    if verbose:
        print(format_table(rows))
    return rows


def format_table(rows: list[Check]) -> str:
    widths = [max(len(getattr(r, f)) for r in rows) for f in ("status", "name", "found", "required")]
    lines = []
    for r in rows:
        cells = [r.status.ljust(widths[0]), r.name.ljust(widths[1]), r.found.ljust(widths[2]),
                 r.required.ljust(widths[3])]
        lines.append("  ".join(cells + ([r.note] if r.note else [])).rstrip())
    failed = [r.name for r in rows if r.status == FAIL]
    lines.append(f"-> {len(failed)} problem(s): {', '.join(failed)}" if failed
                 else "-> everything the notebooks need is here")
    return "\n".join(lines)


def setup_notebook(seed: int = 0, threads: int = 2, figsize: tuple[float, float] = (6.4, 4.0), dpi: int = 100) -> None:
    """Seed random / numpy / torch, cap CPU threads at ``min(threads, cpu_count)`` and fix matplotlib defaults."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.rcParams.update({"figure.figsize": figsize, "figure.dpi": dpi, "savefig.dpi": dpi,
                                "axes.grid": False, "font.size": 10})


RECORDED = Path(__file__).resolve().parent.parent / "data" / "notebooks"
RECORD_ENV = "GLMVIT_RECORD"


def _cell_hash(name: str, compute: Callable[[], Any]) -> dict[str, str]:
    """``{"<cell NAME>": hash}`` of the compute function's source (what the notebook itself contributes), if known."""
    from .records import source_hash

    try:
        return {f"<cell {name}>": source_hash(textwrap.dedent(inspect.getsource(compute)))}
    except (OSError, TypeError, SyntaxError):  # a builtin, a partial, or source that is not on record
        return {}


def run_or_replay(name: str, compute: Callable[[], dict[str, Any]], needs: str = "a CUDA GPU") -> dict[str, Any]:
    """A notebook's GPU cell, runnable everywhere: on a CUDA machine ``compute()`` runs (and, with
    ``GLMVIT_RECORD=1``, its JSON-able result is saved as ``data/notebooks/NAME.json``, a
    :class:`~glmvit.records.NotebookResult` with provenance and fingerprint); elsewhere the recorded result is
    returned, marked ``"replayed": True``, and the cell says where it was recorded and whether the code it measured
    (the package's modules and this cell's ``compute``) has changed since."""
    import torch

    from .provenance import collect
    from .records import NotebookResult, describe, fingerprint_now, load, make, to_json

    path = RECORDED / f"{name}.json"
    cell = _cell_hash(name, compute)
    if torch.cuda.is_available():
        result = compute()
        clash = sorted(set(result) & set(NotebookResult.model_fields))
        if clash:
            raise ValueError(f"cell {name}: result keys {clash} are record fields; rename them")
        record = make(NotebookResult, provenance=collect("cuda"), fingerprint=fingerprint_now(cell), name=name,
                      **result)
        if os.environ.get(RECORD_ENV) == "1":
            RECORDED.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(to_json(record))
            os.replace(tmp, path)
        return {**result, "provenance": record.provenance.model_dump(), "replayed": False}
    if not path.exists():
        raise FileNotFoundError(f"this cell needs {needs}, and no recorded result {path.name} is in data/notebooks/")
    record = load(path, NotebookResult)
    print(f"needs {needs}: showing the result recorded in data/notebooks/{describe(record, path, cell)}")
    return {**(record.model_extra or {}), "provenance": record.provenance.model_dump(), "replayed": True}
