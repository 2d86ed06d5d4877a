"""glmvit: the GLM-4V vision encoder under full CUDA graphs, built step by step.

The public API::

    from glmvit import (VisionConfig, GlmVisionEncoder, load_vision_weights, EncoderGraphRunner, BudgetConfig,
                        process_images, process_video)

Each name is imported on first use (:func:`__getattr__`), so ``import glmvit`` costs nothing until then: torch's
import takes seconds, and ``python -m glmvit`` must be inside its Ctrl-C handler (:mod:`glmvit.cli`) before it
begins. transformers' image processor, behind ``process_images`` / ``process_video``, loads later still.

With ``GLMVIT_UNITS_FILE=PREFIX`` set, the process tracks which glmvit code it runs and writes it at exit to
``PREFIX.PID.json`` (:func:`glmvit.fingerprint.start_from_env`): how a parent's record counts a child's code.
"""
import os
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import VisionConfig
    from .graphs import EncoderGraphRunner
    from .model import GlmVisionEncoder
    from .packing import BudgetConfig
    from .processing import process_images, process_video
    from .weights import load_vision_weights

__all__ = ["VisionConfig", "GlmVisionEncoder", "EncoderGraphRunner", "BudgetConfig", "load_vision_weights",
           "process_images", "process_video"]
__version__ = "0.1.0"
_MODULES = {"VisionConfig": "config", "GlmVisionEncoder": "model", "EncoderGraphRunner": "graphs",
            "BudgetConfig": "packing", "load_vision_weights": "weights", "process_images": "processing",
            "process_video": "processing"}

if os.environ.get("GLMVIT_UNITS_FILE"):
    from .fingerprint import start_from_env

    start_from_env()


def __dir__() -> list[str]:
    """The module's names, the public ones included before their first use."""
    return sorted({*globals(), *__all__})


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use."""
    if name in _MODULES:
        return getattr(import_module(f".{_MODULES[name]}", __name__), name)
    raise AttributeError(f"module 'glmvit' has no attribute {name!r}")
