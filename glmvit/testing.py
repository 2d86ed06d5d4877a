"""Helpers shared by tests and notebooks: a transformers oracle on the same random weights, and random batches."""
from __future__ import annotations

import math
from contextlib import contextmanager

import numpy as np
import torch

from .config import VisionConfig
from .model import GlmVisionEncoder


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every parameter with non-trivial random values (norm weights 1 + 0.5·N, biases 0.1·N)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                value = 1 + 0.5 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif p.ndim == 1 or "position_embedding" in name:
                value = noise
            else:
                value = noise / math.sqrt(p[0].numel())
            p.copy_(value.to(p.dtype))
    return model


def hf_vision_model(config: VisionConfig, seed: int = 0, attn: str = "eager"):
    """transformers' ``Glm4vVisionModel`` for ``config`` with :func:`randomize_` weights (the oracle)."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    hf_config = Glm4vVisionConfig(**config.to_hf_dict())
    hf_config._attn_implementation = attn
    return randomize_(Glm4vVisionModel(hf_config).eval(), seed)


def encoder_like(hf_model, config: VisionConfig, **kwargs) -> GlmVisionEncoder:
    """A :class:`GlmVisionEncoder` holding the same weights as ``hf_model`` (strict load)."""
    model = GlmVisionEncoder(config, **kwargs).eval()
    model.load_state_dict(hf_model.state_dict(), strict=True)
    return model


def random_batch(grids, config: VisionConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel rows for ``grids`` (rows [t, h, w]) and the grid tensor."""
    grid = torch.as_tensor(np.asarray(grids), dtype=torch.long).reshape(-1, 3)
    rows = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, config.patch_dim, generator=gen), grid


def flatten_video_grids(grids) -> torch.Tensor:
    """Split each [t, h, w] row into t rows [1, h, w]: what transformers' tower needs for videos."""
    rows = [[1, int(h), int(w)] for t, h, w in np.asarray(grids).reshape(-1, 3) for _ in range(int(t))]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


SYNC_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def forbid_host_syncs():
    """Make every Tensor method that reads device data on the host raise while the block runs (CPU check)."""
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def forbidden(name):
        def raise_(*args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name}() called inside a graph-safe region")

        return raise_

    try:
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, forbidden(name))
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
