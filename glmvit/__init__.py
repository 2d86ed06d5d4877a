"""glmvit: the GLM-4V vision encoder under full CUDA graphs, built step by step.

The public API::

    from glmvit import (VisionConfig, GlmVisionEncoder, load_vision_weights, EncoderGraphRunner, BudgetConfig,
                        process_images, process_video)
"""
from typing import Any

from .config import VisionConfig
from .graphs import EncoderGraphRunner
from .model import GlmVisionEncoder
from .packing import BudgetConfig
from .weights import load_vision_weights

__all__ = ["VisionConfig", "GlmVisionEncoder", "EncoderGraphRunner", "BudgetConfig", "load_vision_weights",
           "process_images", "process_video"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """process_images / process_video load transformers' image processor: imported on first use only."""
    if name in ("process_images", "process_video"):
        from . import processing

        return getattr(processing, name)
    raise AttributeError(f"module 'glmvit' has no attribute {name!r}")
