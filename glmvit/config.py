"""The vision-tower configuration: GLM-4.1V-9B-Thinking / GLM-4.6V-Flash, a tiny test config, and HF import."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

_HF_ALIASES = {"num_hidden_layers": "depth", "num_attention_heads": "num_heads"}
GLM4V_MODEL_TYPES = ("glm4v", "glm4v_moe", "glm46v")  # full models whose vision_config is this tower
GLM4V_VISION_TYPES = ("glm4v_vision", "glm4v_moe_vision")  # transformers' vision sub-configs of the same tower
_REQUIRED = ("depth", "hidden_size", "num_heads")  # what tells a tower's size; the rest has GLM-4V defaults
# Bounds on a config's sizes (a checkpoint's config.json comes from outside): far above GLM-4V's, low enough that
# no weight's element count can overflow while the tower is built (on the meta device, before any file is read).
MAX_DEPTH = 1024  # GLM-4V has 24 blocks; a config asking for millions would exhaust memory building modules
MAX_WIDTH = 2**17  # every matrix side: GLM-4V's widest is the merger MLP's 13,696; the largest LLMs' MLPs ~53k
MAX_POS_GRID = 1024  # the learned position table's side (GLM-4V: 24); the table has side² rows


@dataclass(frozen=True)
class VisionConfig:
    """Shape of a GLM-4V vision tower. Field names follow transformers' ``Glm4vVisionConfig``."""

    depth: int = 24
    hidden_size: int = 1536
    num_heads: int = 12
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    image_size: int = 336
    out_hidden_size: int = 4096  # also the width of every block MLP (a GLM-4V quirk)
    intermediate_size: int = 13696  # used only by the merger MLP
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or not value > 0 or value == math.inf:
                raise ValueError(f"VisionConfig.{f.name} must be positive and finite, got {_shown(value)}")
        widths = {"depth": (self.depth, MAX_DEPTH), "hidden_size": (self.hidden_size, MAX_WIDTH),
                  "out_hidden_size": (self.out_hidden_size, MAX_WIDTH),
                  "intermediate_size": (self.intermediate_size, MAX_WIDTH),
                  "patch_dim (in_channels·temporal_patch_size·patch_size²)": (self.patch_dim, MAX_WIDTH),
                  "spatial_merge_size²·hidden_size": (self.merge_area * self.hidden_size, MAX_WIDTH),
                  "pos_grid (image_size / patch_size)": (self.image_size // self.patch_size, MAX_POS_GRID)}
        for name, (value, bound) in widths.items():
            if value > bound:
                raise ValueError(f"VisionConfig.{name} {_shown(value)} is implausible: at most {bound:,} "
                                 "(glmvit.config bounds; GLM-4V's are far below)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be divisible by 4 (2D rotary, half-split)")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Width of one pixel row: C · T · P · P (1176 for GLM-4V)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def pos_grid(self) -> int:
        """Side G of the learned G×G position table (24 for GLM-4V)."""
        return self.image_size // self.patch_size

    @property
    def merge_area(self) -> int:
        """Patches per output token (m² = 4)."""
        return self.spatial_merge_size**2

    @classmethod
    def glm41v(cls) -> "VisionConfig":
        """The vision tower of GLM-4.1V-9B-Thinking and GLM-4.6V-Flash (892.5 M parameters)."""
        return cls()

    @classmethod
    def tiny(cls) -> "VisionConfig":
        """A 182,400-parameter tower with the real patch geometry, for CPU tests and notebooks."""
        return cls(depth=2, hidden_size=64, num_heads=4, image_size=112, out_hidden_size=64, intermediate_size=128)

    @classmethod
    def from_hf(cls, config: Any) -> "VisionConfig":
        """Build from a transformers config object or a ``config.json`` dict (full GLM-4V model or vision sub-config).

        Raises ValueError, saying what is wrong, for anything that is not a GLM-4V vision tower.
        """
        config = _as_dict(config, "config")
        model_type = config.get("model_type")
        if model_type in GLM4V_MODEL_TYPES:
            if "vision_config" not in config:
                raise ValueError(f"a {model_type!r} config without a vision_config")
            vision = _as_dict(config["vision_config"], "vision_config")
            if vision.get("model_type") not in (None, *GLM4V_VISION_TYPES, *GLM4V_MODEL_TYPES):
                raise ValueError(f"vision_config has model_type {vision['model_type']!r}, not a GLM-4V vision tower "
                                 f"(expected one of {GLM4V_VISION_TYPES})")
        elif model_type in GLM4V_VISION_TYPES:
            vision = config
        else:
            raise ValueError(f"model_type {model_type!r} is not a GLM-4V model "
                             f"(expected one of {GLM4V_MODEL_TYPES + GLM4V_VISION_TYPES})")
        return cls(**_vision_values(vision))

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for transformers' ``Glm4vVisionConfig`` describing the same tower."""
        d = dataclasses.asdict(self)
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": d.pop("rope_theta")}
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        return d


def _as_dict(config: Any, what: str) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise ValueError(f"{what} must be a JSON object or a transformers config, got {type(config).__name__}")


def _vision_values(vision: Mapping[str, Any]) -> dict[str, Any]:
    """VisionConfig keyword arguments from a vision sub-config, each checked for its type."""
    fields = {f.name: f.type for f in dataclasses.fields(VisionConfig)}
    values: dict[str, Any] = {}
    for key, value in vision.items():
        name = _HF_ALIASES.get(key, key)
        if name in fields and (name == key or name not in vision):
            values[name] = value
    rope = vision.get("rope_parameters") or vision.get("rope_scaling") or {}
    if isinstance(rope, Mapping) and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    missing = [name for name in _REQUIRED if name not in values]
    if missing:
        raise ValueError(f"vision_config lacks {', '.join(missing)}")
    for name, value in values.items():
        number = isinstance(value, int) or (fields[name] == "float" and isinstance(value, float))
        if not number or isinstance(value, bool):
            raise ValueError(f"vision_config.{name} must be {'a number' if fields[name] == 'float' else 'an integer'}, "
                             f"got {value!r}")
        if fields[name] == "float":
            values[name] = float(value)
    act = vision.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"only hidden_act='silu' is supported (GLM-4V), got {act!r}")
    if vision.get("attention_bias"):
        raise ValueError("attention_bias=True is not a GLM-4V vision tower")
    return values


def _shown(value: Any) -> str:
    """A config value for an error message: a number too long to read is given by its digit count."""
    if isinstance(value, int) and value.bit_length() > 100:
        return f"(an int of about {value.bit_length() * 0.30103:,.0f} digits)"
    text = repr(value)
    return text if len(text) <= 40 else text[:20] + "…"
