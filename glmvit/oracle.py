"""transformers' ``Glm4vVisionModel`` as the oracle: built for a config, on random or on our model's weights.

Tests, notebooks and the benchmark's ``transformers`` mode all build it here, so "the same weights" means the same
thing everywhere.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .config import VisionConfig
from .model import GlmVisionEncoder
from .random_weights import randomize_


def hf_vision_model(config: VisionConfig, seed: int = 0, attn: str = "eager") -> Any:
    """transformers' ``Glm4vVisionModel`` for ``config`` with :func:`~glmvit.random_weights.randomize_` weights."""
    return randomize_(_hf_model(config, attn).eval(), seed)


def hf_twin(model: GlmVisionEncoder, attn: str = "sdpa") -> Any:
    """transformers' ``Glm4vVisionModel`` holding ``model``'s weights, on its device and in its dtype."""
    with torch.device(model.device):
        hf = _hf_model(model.config, attn)
    hf = hf.to(model.dtype).eval()
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf


def encoder_like(hf_model: Any, config: VisionConfig, **kwargs: Any) -> GlmVisionEncoder:
    """A :class:`GlmVisionEncoder` holding the same weights as ``hf_model`` (strict load)."""
    model = GlmVisionEncoder(config, **kwargs).eval()
    model.load_state_dict(hf_model.state_dict(), strict=True)
    return model


def flatten_video_grids(grids: Any) -> torch.Tensor:
    """Split each [t, h, w] row into t rows [1, h, w]: what transformers' tower needs for videos."""
    rows = [[1, int(h), int(w)] for t, h, w in np.asarray(grids).reshape(-1, 3) for _ in range(int(t))]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)


def _hf_model(config: VisionConfig, attn: str) -> Any:
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel

    hf_config = Glm4vVisionConfig(**config.to_hf_dict())
    hf_config._attn_implementation = attn
    return Glm4vVisionModel(hf_config)


def transformers_glm46v_sampler() -> Any:
    """transformers' ``Glm46VVideoProcessor.sample_frames``, compiled from the installed source on its own (its
    module imports torchvision, which a CPU machine may lack): called as ``sampler(metadata)``."""
    import ast
    import math
    from functools import partial
    from pathlib import Path
    from types import SimpleNamespace

    import transformers
    from transformers.video_utils import VideoMetadata

    path = Path(transformers.__file__).parent / "models" / "glm46v" / "video_processing_glm46v.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Glm46VVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    namespace: dict[str, Any] = {"math": math, "np": np, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), namespace)
    return partial(namespace["sample_frames"], SimpleNamespace(temporal_patch_size=2))
