"""The install path: constraints.txt resolves beside torch's own pins; the Makefile's commands do what the README says.

constraints.txt must install with a CPU build of torch and with PyPI's default (CUDA) torch wheel on Linux x86-64.
A CPU build's requirements are read from the installed torch; the CUDA wheel's cannot be (CI has no CUDA build), so
they are recorded below from the wheel itself.
"""
import importlib.metadata
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

# Requires-Dist of torch 2.13.0's default Linux x86-64 wheel on PyPI
# (torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl,
# its torch-2.13.0.dist-info/METADATA; the `extra == ...` lines left out). When constraints.txt's torch pin moves,
# read the new wheel's METADATA and replace both.
TORCH_CUDA_WHEEL_VERSION = "2.13.0"
TORCH_CUDA_WHEEL_REQUIRES = [
    "filelock",
    "typing-extensions>=4.10.0",
    "setuptools>=77.0.3",
    "sympy>=1.13.3",
    "networkx>=2.5.1",
    "jinja2",
    "fsspec>=0.8.5",
    "cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3"
    '; platform_system == "Linux"',
    'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
    'nvidia-cudnn-cu13==9.20.0.48; platform_system == "Linux"',
    'nvidia-cusparselt-cu13==0.8.1; platform_system == "Linux"',
    'nvidia-nccl-cu13==2.29.7; platform_system == "Linux"',
    'nvidia-nvshmem-cu13==3.4.5; platform_system == "Linux"',
    'triton==3.7.1; platform_system == "Linux" and python_version < "3.15"',
]
LINUX_X86_64 = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64", "os_name": "posix"}


def constraint_pins(text: str) -> dict[str, str]:
    """`name==version` lines of a constraints file, by canonical name."""
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"constraints.txt should pin exactly: {line}"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def applicable(requires: list[str], env: dict | None = None) -> list[Requirement]:
    """The requirements that apply on `env` (default: this interpreter), extras left out."""
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**(env or {}), "extra": ""}):
            out.append(req)
    return out


def contradictions(pins: dict[str, str], requires: list[Requirement]) -> list[str]:
    """Pins that a requirement does not allow: with these pip ends in ResolutionImpossible."""
    return [
        f"constraints pin {name}=={pins[name]}, torch requires {req}"
        for req in requires
        if (name := canonicalize_name(req.name)) in pins and not req.specifier.contains(pins[name], prereleases=True)
    ]


def exact_pins(requires: list[Requirement]) -> set[str]:
    return {canonicalize_name(r.name) for r in requires if any(s.operator in ("==", "===") for s in r.specifier)}


def makefile_default(name: str) -> str:
    return re.search(rf"^{name}\s*\?=[ \t]*(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).strip()


@pytest.fixture(scope="module")
def pins():
    return constraint_pins((ROOT / "constraints.txt").read_text())


# --- constraints.txt against torch -----------------------------------------------------------------------------------


def test_the_checks_catch_what_broke_the_cuda_install():
    """triton==3.9.0 beside torch 2.13.0's triton==3.7.1 was the ResolutionImpossible; a sympy below torch's too."""
    cuda = applicable(TORCH_CUDA_WHEEL_REQUIRES, LINUX_X86_64)
    assert contradictions({"triton": "3.9.0", "sympy": "1.13.1", "numpy": "2.4.6"}, cuda) == [
        "constraints pin sympy==1.13.1, torch requires sympy>=1.13.3",
        "constraints pin triton==3.9.0, torch requires triton==3.7.1"
        '; platform_system == "Linux" and python_version < "3.15"',
    ]
    assert {"triton", "nvidia-nccl-cu13", "cuda-toolkit"} <= exact_pins(cuda)
    assert "sympy" not in exact_pins(cuda)
    assert not applicable(['triton==3.7.1; platform_system == "Linux"'], {**LINUX_X86_64, "platform_system": "Darwin"})


def test_the_recorded_cuda_wheel_is_the_pinned_torch(pins):
    assert pins["torch"] == TORCH_CUDA_WHEEL_VERSION, (
        f"constraints.txt pins torch=={pins['torch']}: record that wheel's Requires-Dist in TORCH_CUDA_WHEEL_REQUIRES"
    )
    assert "+" not in pins["torch"], "pin torch without a local build label so CUDA machines can resolve it"


def test_constraints_pin_nothing_torchs_cuda_wheel_pins_exactly(pins):
    pinned_twice = sorted(exact_pins(applicable(TORCH_CUDA_WHEEL_REQUIRES, LINUX_X86_64)) & set(pins))
    assert not pinned_twice, f"torch's CUDA wheel pins {pinned_twice} itself: leave them out of constraints.txt"


def test_constraints_agree_with_torchs_cuda_wheel(pins):
    for py in ("3.11", "3.12", "3.13"):
        cuda = applicable(TORCH_CUDA_WHEEL_REQUIRES, {**LINUX_X86_64, "python_version": py})
        assert not contradictions(pins, cuda)


def test_constraints_agree_with_the_installed_torch(pins):
    installed = importlib.metadata.version("torch")
    if Version(installed).base_version != pins["torch"]:
        pytest.skip(f"torch {installed} is installed, constraints.txt is for {pins['torch']}")
    assert not contradictions(pins, applicable(importlib.metadata.requires("torch") or []))


def test_constraints_pin_every_direct_dependency(pins):
    """Every dependency `make` installs is pinned, except those torch's CUDA wheel pins itself (triton)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = makefile_default("EXTRAS").removesuffix("$(CUDA_EXTRA)").split(",") + ["cuda"]  # cuda: on a GPU
    wanted = project["dependencies"] + [d for extra in extras for d in project["optional-dependencies"][extra]]
    names = {canonicalize_name(Requirement(d).name) for d in wanted}
    torch_owned = exact_pins(applicable(TORCH_CUDA_WHEEL_REQUIRES, LINUX_X86_64))
    assert "triton" in names & torch_owned
    missing = sorted(names - torch_owned - set(pins))
    assert not missing, f"constraints.txt does not pin {missing}"


def test_constraints_meet_pyprojects_lower_bounds(pins):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        req = Requirement(line)
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), (req, pins[canonicalize_name(req.name)])


# --- the Makefile --------------------------------------------------------------------------------------------------


def make_env() -> dict[str, str]:
    """This environment without an enclosing `make test`'s flags (a -n or -j there must not reach these runs)."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def make_dry_run(*args: str, installed: bool = True) -> str:
    """The commands `make` would run (make -n); `installed`: as if .venv were set up (its stamp is not remade)."""
    assume = ["-o", f"{makefile_default('VENV')}/.glmvit-installed"] if installed else []
    out = subprocess.run(["make", "-n", *assume, *args], cwd=ROOT, env=make_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_lab_and_explorer_run_headless_as_root_on_loopback_by_default():
    lab = make_dry_run("lab")
    assert "jupyter lab notebooks/" in lab
    for flag in ("--no-browser", "--allow-root", "--ip=127.0.0.1", "--port=8888"):
        assert flag in lab.split(), lab
    explorer = make_dry_run("explorer")
    for flag in ("--no-browser", "--Voila.ip=127.0.0.1", "--port=8866"):
        assert flag in explorer.split(), explorer


def test_lab_and_explorer_take_a_port_and_a_host():
    assert {"--ip=0.0.0.0", "--port=8899"} <= set(make_dry_run("lab", "PORT=8899", "HOST=0.0.0.0").split())
    assert {"--Voila.ip=0.0.0.0", "--port=8899"} <= set(make_dry_run("explorer", "PORT=8899", "HOST=0.0.0.0").split())


def test_env_knobs_reach_venv_and_pip():
    default = make_dry_run("-B", "env", installed=False)
    assert "-m venv .venv" in default and "-c constraints.txt" in default
    assert '-e ".[test,notebooks,video,serve]"' in default
    cuda = make_dry_run(
        "-B", "env", "VENV_FLAGS=--system-site-packages", "CONSTRAINTS=", "EXTRAS=", "PIP_FLAGS=--no-index",
        installed=False,
    )
    assert "-m venv --system-site-packages .venv" in cuda
    assert "-c " not in cuda and "--no-index" in cuda and '-e "."' in cuda


def test_an_existing_environment_is_installed_into_not_recreated(tmp_path):
    """VENV may name an environment that already holds a CUDA torch: make installs into it, never runs venv over it."""
    python = tmp_path / "bin" / "python"  # stands in for the environment's python: records how it was called
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls\n')
    python.chmod(0o755)
    out = subprocess.run(
        ["make", "-B", f"VENV={tmp_path}", "PYTHON=false", "CONSTRAINTS=", "env"],  # PYTHON=false: `venv` would fail
        cwd=ROOT, env=make_env(), capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    expected = ["-m", "pip", "install", "--progress-bar", "on", "-e", ".[test,notebooks,video,serve]"]
    assert (tmp_path / "calls").read_text().split() == expected
    assert (tmp_path / ".glmvit-installed").exists()


def test_test_oldest_installs_pyprojects_lowest_transformers():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (bound,) = [Requirement(d).specifier for d in project["dependencies"] if Requirement(d).name == "transformers"]
    (lower,) = [s.version for s in bound if s.operator == ">="]
    commands = make_dry_run("test-oldest")
    assert f'"transformers=={lower}"' in commands and "tests/test_processing.py" in commands


def test_every_make_variable_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    named = {var for cmd in re.findall(r"\bmake [^\n`]*", readme) for var in re.findall(r"\b([A-Z][A-Z_]{2,})=", cmd)}
    assert {"PORT", "VENV_FLAGS", "CONSTRAINTS"} <= named
    for name in named:
        makefile = (ROOT / "Makefile").read_text()
        assert re.search(rf"^{name}\s*\?=", makefile, re.M), f"README names make {name}=, Makefile lacks it"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("target", ["lab", "explorer"])
def test_lab_and_explorer_start_here_as_whoever_runs_them(target, tmp_path):
    """Started through make, as this user (root in CI and in containers): each listens on the port it was given."""
    venv = Path(sys.prefix)
    if not (venv / "bin" / ("jupyter" if target == "lab" else "voila")).exists():
        pytest.skip(f"{target}'s server is not installed in {venv}")
    port = _free_port()
    log = tmp_path / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["make", "-o", f"{venv}/.glmvit-installed", target, f"VENV={venv}", f"PORT={port}"],
            cwd=ROOT, env=make_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            exited = f"make {target} exited {proc.returncode} (uid {os.geteuid()}):\n{log.read_text()}"
            assert proc.poll() is None, exited
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.25)
        else:
            pytest.fail(f"make {target} did not listen on 127.0.0.1:{port} within 60 s:\n{log.read_text()}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
