"""The project's own files agree with each other: set-up commands, extras, constraints, notebook hygiene."""
import json
import re
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))  # 00_tour … 05b_cost_model …


def makefile_var(name: str) -> str:
    return re.search(rf"^{name}\s*\?=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).strip()


def makefile_extras() -> set[str]:
    """The extras `make` installs on a CPU machine (EXTRAS's default, its CUDA-only suffix left out)."""
    value = makefile_var("EXTRAS")
    assert value.endswith("$(CUDA_EXTRA)"), value
    return set(value.removesuffix("$(CUDA_EXTRA)").split(","))


def test_the_cuda_extra_is_added_only_where_a_gpu_answers():
    """CUDA-only wheels never reach a CPU machine: the `cuda` extra joins EXTRAS only when nvidia-smi lists a GPU."""
    line = re.search(r"^CUDA_EXTRA\s*:=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).strip()
    assert line == "$(if $(shell nvidia-smi -L 2>/dev/null),$(comma)cuda)"
    assert "cuda" not in makefile_extras()
    assert "cuda" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_environment_yml_installs_the_same_extras_as_make():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    editable = next(line for line in pip if line.startswith("-e "))
    extras = set(re.search(r"\[(.*)\]", editable).group(1).split(","))
    assert extras == makefile_extras()
    assert "-c constraints.txt" in pip
    known = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras <= known


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make demo" in readme
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "make test"


def readme_notebook_table(readme: str) -> list[str]:
    """The first column of the README's notebook table (under "## The notebooks"), in order."""
    section = readme.split("\n## The notebooks\n", 1)[1]
    rows = re.findall(r"^\| `([^`]+)` \|", section.strip().split("\n\n", 1)[0], re.M)
    assert rows, "the README's notebook table has no rows"
    return rows


def test_the_readme_lists_every_notebook_and_only_those():
    """The README's notebook table and notebooks/ name the same numbered notebooks, in the same order."""
    assert readme_notebook_table((ROOT / "README.md").read_text()) == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_follows_the_template(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for heading in ("What you will build", "What you will learn", "What you need", "Exercises",
                    "Where this lives in glmvit"):
        assert heading.lower() in text.lower(), f"{path.name} lacks '{heading}'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_outputs_are_committed_and_fresh(path):
    """Readers browsing the repository see every figure: notebooks are committed executed (make notebooks), and
    the stamped hash of their code cells proves the outputs were made from the code that is there now."""
    from tools.execute_notebooks import code_hash

    nb = json.loads(path.read_text())
    assert any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code"), f"{path.name}: no outputs"
    stamped = nb["metadata"].get("glmvit", {}).get("code_sha256")
    assert stamped == code_hash(nb), f"{path.name}: code changed after its outputs were made (run make notebooks)"


@pytest.mark.parametrize("path", sorted((ROOT / "data" / "bench").glob("*.json")), ids=lambda p: p.name)
def test_recorded_gpu_results_carry_their_provenance(path):
    """Every recorded result names its GPU, library versions, the exact commit measured and the command."""
    prov = json.loads(path.read_text())["provenance"]
    assert prov["gpu"] and prov["torch"] and prov["triton"] and prov["date_utc"]
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"] or ""), prov.get("git_commit")
    assert "glmvit" in prov["command"] or "bench" in prov["command"] or "tools/" in prov["command"]


def test_readme_results_are_the_recorded_ones():
    """Every GPU number in the README is written by tools/readme_results.py from data/bench, never by hand."""
    from tools.readme_results import main

    assert main(["--check"]) == 0, "run python tools/readme_results.py"


def package_imports(package: Path) -> list[tuple[str, str]]:
    """(file, module) for every import by a module of the package at ``package``, absolute or relative, ``import``,
    ``from … import`` or ``from . import name`` (a name may be a submodule, so ``base.name`` is listed too), at any
    depth of the file (a function's own imports included)."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        inside = path.relative_to(package).parts
        here = [package.name, *inside[:-1]]  # the module's package, e.g. ["glmvit", "kernels"]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*here[:len(here) - node.level + 1], *([node.module] if node.module else [])]) \
                    if node.level else node.module or ""
                modules = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            found += [(str(path.relative_to(package)), m) for m in modules]
    return found


def _within(module: str, packages: set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def cli_imports(package: Path) -> list[tuple[str, str]]:
    """(file, module) for every import of ``glmvit.cli`` (or below it) by a module of the package at ``package``
    outside cli/ and __main__.py."""
    cli = {f"{package.name}.cli"}
    return [(file, m) for file, m in package_imports(package)
            if Path(file).parts[0] != "cli" and file != "__main__.py" and _within(m, cli)]


# The runtime: what encodes a request (request → plan → encoder → outputs), and what a server runs. It imports none
# of the RECORDING modules (typed records and their schemas, provenance, environment capture, the transformers
# oracle, the code fingerprints), nor the lab or the tools.
RUNTIME = ("attention", "config", "costmodel", "defaults", "encoder", "files", "gate_up", "geometry", "graphs",
           "kernels/__init__", "kernels/attention_table", "kernels/reference", "kernels/triton_attention",
           "kernels/triton_bicubic", "messages", "metadata", "model", "modes", "packing", "parallel", "processing",
           "request", "rotary", "routing", "scheduler", "uniform", "video", "weights")
RECORDING = ("records", "recorded", "provenance", "env", "oracle", "fingerprint", "lab", "cli")


def runtime_imports_of_recording(package: Path) -> list[tuple[str, str]]:
    """(file, module) for every import of a RECORDING module by a RUNTIME module of the package at ``package``."""
    runtime = {f"{name}.py" for name in RUNTIME}
    recording = {f"{package.name}.{name}" for name in RECORDING}
    return [(file, m) for file, m in package_imports(package) if file in runtime and _within(m, recording)]


def test_no_library_module_imports_the_tools():
    """The data path never depends on the commands: glmvit/cli imports the library, never the other way."""
    assert cli_imports(ROOT / "glmvit") == []


def test_the_runtime_imports_no_recording_code():
    """The runtime's import graph holds no record schema, provenance, oracle or tool: a server loads none of them."""
    for name in RUNTIME:
        assert (ROOT / "glmvit" / f"{name}.py").is_file(), f"RUNTIME names glmvit/{name}.py, which is gone"
    assert runtime_imports_of_recording(ROOT / "glmvit") == []


def test_importing_the_runtime_loads_no_pydantic_nor_recording_code():
    """In a fresh interpreter, the runner, the encoders, the scheduler and the data-parallel encoder load neither
    pydantic nor any recording module (checked on the modules loaded, not on the source)."""
    import subprocess
    import sys

    code = ("import sys, glmvit.graphs, glmvit.encoder, glmvit.scheduler, glmvit.parallel\n"
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic' or "
            f"m.split('.')[:2] in [['glmvit', n] for n in {list(RECORDING)!r}])))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == []


def test_the_layering_check_finds_every_spelling_of_a_cli_import(tmp_path):
    package = tmp_path / "glmvit"
    (package / "cli").mkdir(parents=True)
    (package / "kernels").mkdir()
    (package / "cli" / "common.py").write_text("from ..packing import BudgetConfig\n")  # cli may import the library
    spellings = {"a.py": "from . import cli\n", "b.py": "from .cli import common\n", "c.py": "from glmvit import cli\n",
                 "d.py": "import glmvit.cli.common\n", "e.py": "from .cli.common import DTYPES\n",
                 "kernels/f.py": "from .. import cli\n", "kernels/g.py": "from ..cli import common\n"}
    for name, line in spellings.items():
        (package / name).write_text(line)
    (package / "fine.py").write_text("from . import packing\nfrom .kernels import client\nimport glmvit.clip\n")
    assert {file for file, _ in cli_imports(package)} == set(spellings)


def test_the_layering_check_finds_every_spelling_of_a_recording_import(tmp_path):
    package = tmp_path / "glmvit"
    (package / "kernels").mkdir(parents=True)
    spellings = {"graphs.py": "from . import records\n", "model.py": "from .records import parse\n",
                 "costmodel.py": "def f():\n    from .provenance import collect\n",
                 "scheduler.py": "import glmvit.oracle\n", "encoder.py": "from glmvit import recorded\n",
                 "kernels/reference.py": "from .. import env\n", "parallel.py": "from .lab import tour\n"}
    for name, line in spellings.items():
        (package / name).write_text(line)
    (package / "deployment.py").write_text("from .recorded import capture_cost\n")  # planning, not the runtime
    (package / "packing.py").write_text("from . import geometry\nimport glmvit.recordings_like\n")
    assert {file for file, _ in runtime_imports_of_recording(package)} == set(spellings)


def _imports(source: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every import statement in ``source``."""
    import ast

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.append((node.module or "", [a.name for a in node.names]))
    return out


def _notebook_code(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_use_the_library_not_the_tools_nor_private_names(path):
    """A notebook teaches the package: it imports no private name, and from the tool layer only the explorer app
    and the command entry point (``glmvit.cli.main``), never a command's internals."""
    for module, names in _imports(_notebook_code(path)):
        if module.startswith("glmvit"):
            assert not any(n.startswith("_") for n in names), (path.name, module, names)
        if module.startswith("glmvit.cli"):
            assert module == "glmvit.cli.explorer" or (module == "glmvit.cli" and names == ["main"]), \
                (path.name, module, names)


CLI_TESTS = {"test_cli.py", "test_bench.py", "test_plan.py", "test_explorer.py", "test_serve.py", "test_dp_bench.py",
             "test_records.py", "test_kernels.py", "test_profiling.py", "test_explorer_browser.py",
             "test_fuzz_inputs.py", "test_ncu.py", "test_record_run.py",
             "test_one_line_errors.py", "test_outputs.py", "test_serve_bodies.py", "test_serve_media.py",
             "test_bench_serve_wait.py", "test_bench_serve_read.py", "test_decode_pool.py", "test_serve_answer.py",
             "test_owned_dir.py", "test_serve_frontends.py", "test_serve_rows.py",
             # these check that the latency and bench commands time, count and route as the library does
             "test_timing_passes.py", "test_request.py", "test_routing.py"}


@pytest.mark.parametrize("path", sorted((ROOT / "tests").rglob("test_*.py")), ids=lambda p: p.name)
def test_tests_import_no_private_names_and_only_cli_tests_the_tools(path):
    """Tests import no private glmvit name; only the tests of the commands import from glmvit.cli."""
    for module, names in _imports(path.read_text()):
        if module.startswith("glmvit"):
            assert not any(n.startswith("_") for n in names), (path.name, module, names)
        if module.startswith("glmvit.cli") or (module == "glmvit" and "cli" in names):
            assert path.name in CLI_TESTS, (path.name, module, names)


def test_every_make_target_the_notebooks_point_to_is_in_the_readme_and_the_makefile():
    readme, makefile = (ROOT / "README.md").read_text(), (ROOT / "Makefile").read_text()
    pointed = {m for path in sorted((ROOT / "notebooks").glob("*.ipynb"))
               for m in re.findall(r"see README: make ([a-z-]+)", path.read_text())}
    assert pointed, "the notebooks name no make target (the hint this test checks moved)"
    for target in pointed:
        assert f"`make {target}`" in readme and re.search(rf"^{target}:", makefile, re.M), target


def test_set_up_shows_pips_progress_and_puts_the_cpu_torch_step_first():
    installs = re.findall(r"pip install.*", (ROOT / "Makefile").read_text())
    assert installs and not any("--quiet" in line for line in installs), installs
    readme = (ROOT / "README.md").read_text()
    set_up = readme[readme.index("## Set-up"):]
    assert set_up.index("download.pytorch.org/whl/cpu") < set_up.index("make demo")


MAX_CODE_LINES, MAX_MARKDOWN_LINES = 40, 25


def _script_strings(source: str) -> list[int]:
    """Line numbers of string literals in ``source`` that are themselves Python programs with imports."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count("\n") >= 4:
            try:
                inner = ast.parse(node.value)
            except SyntaxError:
                continue
            if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(inner)):
                found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebook_cells_are_short_and_hold_no_scripts_in_strings(path):
    """A reader reads a cell at a glance: code cells of at most 40 lines, markdown cells of at most 25; a long
    measurement lives in the package (glmvit/lab) and is shown with glmvit.lab.show, never as a script in a string."""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        lines = len(source.splitlines())
        if cell["cell_type"] == "code":
            assert lines <= MAX_CODE_LINES, f"{path.name} cell {i}: {lines} code lines"
            assert not _script_strings(source), f"{path.name} cell {i}: a script inside a string"
        elif cell["cell_type"] == "markdown":
            assert lines <= MAX_MARKDOWN_LINES, f"{path.name} cell {i}: {lines} markdown lines"


def test_the_script_check_can_fail():
    assert _script_strings('S = """\nimport os\n\nprint(os.getcwd())\nx = 1\n"""\n') == [1]
    assert not _script_strings('S = """\nnot python at all,\njust prose\nover lines\nand lines\n"""\n')
