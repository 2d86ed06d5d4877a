"""Execute notebooks in place (outputs and figures committed for readers) and stamp the hash of their code.

    python tools/execute_notebooks.py                 # every notebook under notebooks/
    python tools/execute_notebooks.py notebooks/03_cuda_graphs.ipynb

``make notebooks`` runs this. ``tests/test_project.py`` fails when a notebook's code cells no longer match the
stamped hash, i.e. when code changed after its outputs were made. On a CPU, GPU cells show the results recorded on
a GPU (``glmvit.env.run_or_replay``).
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def code_hash(nb: dict) -> str:
    """sha256 of every code cell's source, in order: what the committed outputs were made from."""
    code = "\n\0".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    return hashlib.sha256(code.encode()).hexdigest()


def execute(path: Path, timeout: int = 900) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources=resources).execute()
    nb.metadata.setdefault("glmvit", {})["code_sha256"] = code_hash(json.loads(nbformat.writes(nb)))
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: executed in {execute(path):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
