"""What a model runs on unless told otherwise: the device, the tower and the dtype, each following the one before.

The commands resolve their ``--device``, ``--config`` and ``--dtype`` flags here, so a library user who builds a
model gets the same choices: CUDA when a GPU is visible, else the CPU; GLM-4.1V's tower on CUDA (a checkpoint's own
when weights are given), the tiny test tower on the CPU; bfloat16 on CUDA, float32 on the CPU.
"""
from __future__ import annotations

import torch

from .config import VisionConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # the dtype names the tools take
TOWERS = ("full", "tiny", "checkpoint")  # GLM-4.1V's tower, the tiny test tower, a checkpoint's own


def default_device() -> str:
    """``"cuda"`` when a CUDA GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_tower(device: torch.device | str, weights: bool = False) -> str:
    """The tower for ``device``: the checkpoint's when ``weights`` are given, else ``full`` on CUDA, ``tiny``
    elsewhere (one of :data:`TOWERS`)."""
    return "checkpoint" if weights else "full" if torch.device(device).type == "cuda" else "tiny"


def default_dtype(device: torch.device | str) -> str:
    """The dtype name (a key of :data:`DTYPES`) for ``device``: ``bf16`` on CUDA, ``fp32`` elsewhere."""
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def dtype_name(dtype: str) -> str:
    """A tool's dtype name as torch spells it (``bf16`` → ``bfloat16``): the name the cost model takes."""
    return str(DTYPES[dtype]).removeprefix("torch.")


def tower_config(name: str) -> VisionConfig:
    """The config of a random-weights tower: ``full`` (GLM-4.1V) or ``tiny``; a ValueError for any other name."""
    if name not in ("full", "tiny"):
        raise ValueError(f"tower {name!r} has no config of its own; choose full or tiny")
    return VisionConfig.glm41v() if name == "full" else VisionConfig.tiny()
