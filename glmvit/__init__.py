"""glmvit: the GLM-4V vision encoder under full CUDA graphs, built step by step."""
from .config import VisionConfig
from .model import GlmVisionEncoder
from .weights import load_vision_weights

__all__ = ["VisionConfig", "GlmVisionEncoder", "load_vision_weights"]
__version__ = "0.1.0"
