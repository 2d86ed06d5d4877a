"""Notebook 07's oracle for frame sampling: GLM-4V's ``sample_frames`` and its constants, read from the installed
transformers source (the video processors of ``glm4v`` and ``glm46v``) rather than copied, so a change upstream
shows up as a failed check."""
from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np


def models_dir() -> Path:
    """transformers' ``models`` folder, as installed."""
    import transformers

    return Path(transformers.__file__).parent / "models"


def processor_source(folder: str, cls_name: str) -> tuple[Path, ast.ClassDef]:
    """The class definition of a transformers video processor, parsed from the installed file (the class name's case
    differs between transformers versions, e.g. Glm46vVideoProcessor / Glm46VVideoProcessor)."""
    path = models_dir() / folder / f"video_processing_{folder}.py"
    tree = ast.parse(path.read_text())
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.lower() == cls_name.lower()]
    if not found:
        raise LookupError(f"{path}: no class {cls_name}")
    return path, found[0]


def sample_frames_def(cls: ast.ClassDef) -> ast.FunctionDef:
    """The class's ``sample_frames`` method, its annotations removed (they may name typing helpers)."""
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    for arg in [*method.args.args, *method.args.kwonlyargs, method.args.vararg, method.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    method.returns = None
    return method


def compiled_sample_frames(folder: str, cls_name: str, **attributes: Any) -> Callable[..., list[int]]:
    """``sample_frames`` of that class, compiled from the installed source and bound to the given class attributes:
    ``fn(metadata, **kw)`` returns the sampled frame indices as a list."""
    from transformers.video_utils import VideoMetadata

    path, cls = processor_source(folder, cls_name)
    namespace: dict[str, Any] = {"math": math, "np": np, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module(body=[sample_frames_def(cls)], type_ignores=[]), str(path), "exec"), namespace)
    return lambda metadata, **kw: np.asarray(namespace["sample_frames"](SimpleNamespace(**attributes), metadata,
                                                                        **kw)).tolist()


def constants(folder: str, cls_name: str) -> dict[str, Any]:
    """Simple assignments NAME = literal in the class body and in sample_frames (the rates and caps)."""
    _, cls = processor_source(folder, cls_name)
    found = {}
    for node in cls.body + sample_frames_def(cls).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return found
