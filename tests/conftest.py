import os
import sys

import pytest
import torch

from glmvit import VisionConfig
from glmvit.oracle import encoder_like, hf_vision_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _close_figures():
    """Every figure a test drew is closed after it (the lab's plotting helpers leave theirs open for notebooks)."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture(scope="session")
def tiny_config():
    return VisionConfig.tiny()


@pytest.fixture(scope="session")
def tiny_hf(tiny_config):
    """transformers' Glm4vVisionModel (eager attention) with random non-trivial weights: the oracle."""
    return hf_vision_model(tiny_config, seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_hf, tiny_config):
    """Our encoder with the oracle's weights."""
    return encoder_like(tiny_hf, tiny_config)


def run_interpreted(module: str, function: str = "_interpreter_child", timeout: int = 600):
    """``module.function()`` in a fresh Python with TRITON_INTERPRET=1 (the interpreter is chosen when a kernel's
    module is imported, so it needs its own process); returns the JSON its last stdout line prints."""
    import importlib.util
    import json
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: the kernel cannot run under the interpreter")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests and tools import as from the root
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", f"import {module}; {module}.{function}()"],
                          cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


H200_SHARED_PER_BLOCK = 227 * 1024  # bytes of shared memory a block may have on the H100/H200


def sweep_configs(module: str) -> dict:
    """A kernel module's ``SWEEP_CONFIGS`` by name (empty without Triton: the tests over them skip anyway)."""
    import importlib

    try:
        return {config.name: config for config in importlib.import_module(module).SWEEP_CONFIGS}
    except ImportError:
        return {}


def skip_unless_sm90_compiler() -> None:
    """Skip a test that compiles for sm_90 without a GPU where it cannot: under the interpreter (nothing compiles)
    or with a Triton that has no NVIDIA backend."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter: nothing is compiled")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend: it cannot target sm_90")


def assert_items_match_forward(model, outs, pixels, grids, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    """Each of a runner's per-item outputs against the model's forward of that item alone (float32 on the CPU: the
    same arithmetic in other batches, so only summation order differs: 1e-5)."""
    import torch

    start = 0
    with torch.no_grad():
        for out, (t, h, w) in zip(outs, grids, strict=True):
            rows = t * h * w
            expected = model(pixels[start : start + rows], torch.tensor([[t, h, w]]))
            start += rows
            torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
