"""The one full-size model the lab's GPU measurements share: built once per process, reset on every hand-out."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..config import VisionConfig
from ..model import GlmVisionEncoder
from ..random_weights import random_encoder

# (dtype, seed) -> the tower built for it; one per process, so a long-lived recorder builds each at most once
_BUILT: dict[tuple[torch.dtype, int], GlmVisionEncoder] = {}


def _build(dtype: torch.dtype, seed: int) -> GlmVisionEncoder:
    return random_encoder(VisionConfig.glm41v(), "cuda", dtype, seed=seed)


BUILDER: Callable[[torch.dtype, int], Any] = _build  # replaced by tests, which must not build the full tower


def full_model(dtype: torch.dtype = torch.bfloat16, seed: int = 0, attn_backend: str | None = None) -> GlmVisionEncoder:
    """The full GLM-4.1V tower with seeded random weights on CUDA (what ``random_encoder`` builds), built once per
    ``(dtype, seed)`` in this process. Every call sets ``attn_backend`` (None: the device's default) and eval mode,
    so no caller's backend choice reaches the next caller."""
    key = (dtype, seed)
    if key not in _BUILT:
        _BUILT[key] = BUILDER(dtype, seed)
    model = _BUILT[key]
    model.attn_backend = attn_backend
    return model.eval()
