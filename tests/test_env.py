"""glmvit.env: the environment table every notebook starts with, and the deterministic notebook set-up."""
import random
import sys

import numpy as np
import torch

from glmvit import env
from glmvit.env import FAIL, OK, env_check, lower_bounds, setup_notebook, version_at_least


def test_env_check_reports_the_core_packages_ok(capsys):
    rows = {r.name: r for r in env_check()}
    printed = capsys.readouterr().out
    for name in ("python", "torch", "transformers", "numpy", "pillow", "safetensors", "matplotlib"):
        assert rows[name].status == OK, rows[name]
        assert name in printed
    assert rows["torch"].found == torch.__version__
    assert rows["CUDA"].status == (OK if torch.cuda.is_available() else env.SKIP)
    assert not [r for r in rows.values() if r.status == FAIL]


def test_env_check_quiet_prints_nothing(capsys):
    assert env_check(verbose=False)
    assert capsys.readouterr().out == ""


def test_env_check_never_imports_the_triton_kernel_module():
    """Importing glmvit.kernels.triton_bicubic fixes interpreter vs compiled mode: the check must not do it."""
    before = "glmvit.kernels.triton_bicubic" in sys.modules
    env_check(verbose=False)
    assert ("glmvit.kernels.triton_bicubic" in sys.modules) == before


def test_lower_bounds_follow_pyproject_and_the_fallback_agrees():
    bounds = lower_bounds()
    assert {"torch", "transformers", "python"} <= set(bounds) and bounds["python"] == "3.10"
    for name, version in env.FALLBACK_BOUNDS.items():
        assert bounds[name] == version, name
    assert lower_bounds(env.PYPROJECT.parent / "missing.toml") == env.FALLBACK_BOUNDS


def test_too_old_and_missing_packages_fail(monkeypatch):
    monkeypatch.setattr(env, "lower_bounds", lambda: {**env.FALLBACK_BOUNDS, "numpy": "999.0"})
    real = env._installed
    monkeypatch.setattr(env, "_installed", lambda d: None if d in ("safetensors", "ipywidgets") else real(d))
    rows = {r.name: r for r in env_check(verbose=False)}
    assert rows["numpy"].status == FAIL and rows["numpy"].note == "too old"
    assert rows["safetensors"].status == FAIL  # needed
    assert rows["ipywidgets"].status == env.SKIP  # optional


def test_version_comparison():
    assert version_at_least("2.13.0+cpu", "2.5")
    assert not version_at_least("2.4.1", "2.5")
    assert version_at_least("10.0", "10.0")
    assert env._version_tuple("3.9.0rc1") == (3, 9, 0)


def test_setup_notebook_is_deterministic():
    draws = []
    for _ in range(2):
        setup_notebook(seed=3)
        draws.append((random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()))
    assert draws[0] == draws[1]
    setup_notebook(seed=4)
    assert torch.rand(3).tolist() != draws[0][2]
    import matplotlib

    assert matplotlib.rcParams["figure.dpi"] == 100
    if not torch.cuda.is_available():
        assert torch.get_num_threads() <= 2
