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


# ---- notebook 07's CPU helpers: the clip, the masks, a graph's capacity and the figures ----

def load_gif(path: Path) -> tuple[np.ndarray, float]:
    """Every frame of an animated GIF as uint8 RGB, shape (F, H, W, 3), and its frame rate (frames over the summed
    frame durations). Raises ValueError for a file whose frames carry no duration."""
    from PIL import Image, ImageSequence

    with Image.open(path) as im:
        frames = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)])
        ms = sum(f.info.get("duration", 0) for f in ImageSequence.Iterator(im))
    if ms <= 0:
        raise ValueError(f"{path}: its frames carry no duration")
    return frames, len(frames) / (ms / 1000)


def block_mask(cu_seqlens: Any) -> np.ndarray:
    """The attention mask of segments [cu[i], cu[i+1]): True where query and key rows share a segment; rows past
    ``cu_seqlens[-1]`` attend nothing."""
    cu = np.asarray(cu_seqlens).tolist()
    mask = np.zeros((cu[-1], cu[-1]), bool)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        mask[a:b, a:b] = True
    return mask


def graph_capacity(config: Any, budget: int, max_segments: int) -> dict[str, Any]:
    """What one captured graph of ``budget`` tokens holds and launches at a segment limit: ``slots`` =
    min(max_segments, budget); ``meta_bytes``, its packed int32 metadata; ``pixel_mib``, ``output_mib`` (bf16);
    ``fa2_programs``, FlashAttention-2's varlen grid (⌈rows / 128⌉, slots, heads) with the graph's rows as max_seqlen;
    ``triton_programs``, glmvit's kernel's grid (⌈rows / BLOCK_M⌉, heads), which has no slot term."""
    from ..kernels.attention_table import config_for
    from ..metadata import BatchShape

    rows = config.merge_area * budget
    slots = min(max_segments, budget)
    return {"slots": slots, "meta_bytes": BatchShape(rows, slots, rows).packed_size(config.merge_area) * 4,
            "pixel_mib": rows * config.patch_dim * 2 / 2**20, "output_mib": budget * config.out_hidden_size * 2 / 2**20,
            "fa2_programs": -(-rows // 128) * slots * config.num_heads,
            "triton_programs": -(-rows // config_for(rows).block_m) * config.num_heads}


def plot_sampled_frames(frames: np.ndarray, marks: dict[str, list[int]]) -> Any:
    """Every frame of a clip on a grid of five columns, titled with the names in ``marks`` whose indices include it
    (red: the first name's). Returns the figure."""
    import matplotlib.pyplot as plt

    rows = -(-len(frames) // 5)
    fig, axes = plt.subplots(rows, 5, figsize=(10, 1.4 * rows), squeeze=False)
    first = next(iter(marks.values()))
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i < len(frames):
            ax.imshow(frames[i])
            tags = " ".join(name for name, idx in marks.items() if i in idx)
            ax.set_title(f"{i}: {tags}", fontsize=8, color="C3" if i in first else "black")
    fig.suptitle("every frame, and which rule samples it")
    fig.tight_layout()
    return fig


def plot_frame_pairs(frames: np.ndarray, idx: list[int], pixel_values: Any, grid: list[int], patch: int) -> Any:
    """Per temporal patch k of a processed video (``pixel_values`` rows of grid [t, h, w]): frames idx[2k] and
    idx[2k+1] beside patch ``patch``'s two temporal slots, un-normalised. Returns the figure."""
    import matplotlib.pyplot as plt
    import torch
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    t, gh, gw = grid
    rows = pixel_values.view(t, gh * gw, 3, 2, 14, 14)
    mean, std = torch.tensor(OPENAI_CLIP_MEAN)[:, None, None], torch.tensor(OPENAI_CLIP_STD)[:, None, None]
    fig, axes = plt.subplots(t, 4, figsize=(9, 2.4 * t), squeeze=False)
    for k in range(t):
        pictures = [(frames[idx[2 * k + s]], f"frame {idx[2 * k + s]}") for s in (0, 1)]
        pictures += [((rows[k, patch, :, s] * std + mean).clamp(0, 1).permute(1, 2, 0).numpy(),
                      f"patch {patch}, slot {s}") for s in (0, 1)]
        for ax, (picture, title) in zip(axes[k], pictures, strict=True):
            ax.imshow(picture)
            ax.set_title(title, fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[k, 0].set_ylabel(f"temporal patch {k}")
    fig.tight_layout()
    return fig


def plot_slot_limits(limits: list[int], budgets: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)) -> Any:
    """Segment slots min(max_segments, budget) against the token budget, one line per limit, log-log. Returns the
    figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3))
    bs = np.array(budgets)
    for m in limits:
        ax.plot(bs, np.minimum(m, bs), marker="o", label=f"max_segments = {m}")
    ax.set(xlabel="token budget", ylabel="segment slots")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
