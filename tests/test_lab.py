"""glmvit.lab: every notebook GPU result has one registered library function, its record replays on the CPU, and a
function that times never attaches a profiler."""
from __future__ import annotations

import ast
import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest
import torch

import glmvit.lab.shared as shared
from glmvit.env import RECORDED, run_or_replay
from glmvit.lab import NOTEBOOK_RESULTS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["00_tour", "02_interpolation_kernel", "03_cuda_graphs", "04_static_forward", "06_capture_replay",
             "08_benchmark"]
CALL = re.compile(r"""\brun_or_replay\(\s*["']([0-9]{2}_[A-Za-z0-9_]+)["']""")


def notebook_names() -> set[str]:
    names = set()
    for stem in NOTEBOOKS:
        nb = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                names |= set(CALL.findall("".join(cell["source"])))
    return names


def test_notebooks_call_exactly_the_registered_results():
    assert notebook_names() == set(NOTEBOOK_RESULTS)


def test_every_result_is_recorded():
    for name, entry in NOTEBOOK_RESULTS.items():
        assert entry.name == name
        assert (RECORDED / f"{name}.json").exists(), name


@pytest.mark.parametrize("name", sorted(NOTEBOOK_RESULTS))
def test_recorded_result_replays_on_cpu(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    extras = set(json.loads((RECORDED / f"{name}.json").read_text())) - {
        "kind", "provenance", "fingerprint", "elapsed_s", "record_run", "name"}
    got = run_or_replay(name, NOTEBOOK_RESULTS[name].compute)
    assert got["replayed"] and set(got) - {"provenance", "replayed"} == extras


def same_module_closure(fn) -> str:
    """The source of fn and of every function of its own module that it calls, transitively."""
    module, seen, sources = inspect.getmodule(fn), set(), []
    todo = [fn]
    while todo:
        f = todo.pop()
        if f.__name__ in seen:
            continue
        seen.add(f.__name__)
        source = textwrap.dedent(inspect.getsource(f))
        sources.append(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name) and inspect.isfunction(getattr(module, node.id, None)):
                called = getattr(module, node.id)
                if called.__module__ == module.__name__:
                    todo.append(called)
    return "\n".join(sources)


@pytest.mark.parametrize("name", sorted(n for n, e in NOTEBOOK_RESULTS.items() if not e.profiles))
def test_timing_result_never_profiles(name):
    source = same_module_closure(NOTEBOOK_RESULTS[name].compute)
    assert "torch.profiler" not in source and "profile(" not in source and "profile_kernels" not in source


def test_the_closure_reaches_a_helper_that_profiles():
    """The check above can fail: the profiling results' closures mention the profiler."""
    for name in ("06_timeline_launch", "08_fusion_kernels"):
        assert "torch.profiler" in same_module_closure(NOTEBOOK_RESULTS[name].compute), name


def test_full_model_is_built_once_and_resets_the_backend(monkeypatch):
    built = []

    class Stub(torch.nn.Module):
        attn_backend = None

    def build(dtype, seed):
        built.append((dtype, seed))
        return Stub().train()

    monkeypatch.setattr(shared, "_BUILT", {})
    monkeypatch.setattr(shared, "BUILDER", build)
    first = shared.full_model(attn_backend="varlen")
    assert first.attn_backend == "varlen" and not first.training
    first.train()
    again = shared.full_model()
    assert again is first and again.attn_backend is None and not again.training
    other = shared.full_model(torch.float32, seed=1)
    assert other is not first and built == [(torch.bfloat16, 0), (torch.float32, 1)]


def test_two_gpu_runs_saves_the_run_whole_and_shows_it_again(tmp_path, monkeypatch, capsys):
    import glmvit.lab.data_parallel as dp
    from glmvit.provenance import collect

    path = tmp_path / "09_dp_2gpu.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dp.two_gpu_runs(path) == {}  # nothing recorded, nothing measured
    run = {"world_size": 2, "verification": {"ok": True}, "encoder_forward_ms": {"mean_ms": 3.0},
           "provenance": collect("cpu")}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dp, "two_gpu_run", lambda: run)
    monkeypatch.setenv("GLMVIT_RECORD", "1")
    runs = dp.two_gpu_runs(path)
    assert set(runs) == {"measured now", path.name} and runs["measured now"] is run
    saved = runs[path.name]
    assert {k: v for k, v in saved.items() if k != "provenance"} == {k: v for k, v in run.items() if k != "provenance"}
    assert saved["provenance"]["device"] == "cpu" and not path.with_suffix(".json.tmp").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert set(dp.two_gpu_runs(path)) == {path.name}  # replayed where no GPU is
    assert path.name in capsys.readouterr().out
