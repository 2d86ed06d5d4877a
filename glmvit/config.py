"""The vision-tower configuration: GLM-4.1V-9B-Thinking / GLM-4.6V-Flash, a tiny test config, and HF import."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

_HF_ALIASES = {"num_hidden_layers": "depth", "num_attention_heads": "num_heads"}


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
            if value is None or value <= 0:
                raise ValueError(f"VisionConfig.{f.name} must be positive, got {value!r}")
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
        """Build from a transformers config object or a ``config.json`` dict (full model or vision sub-config)."""
        if not isinstance(config, Mapping):
            config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
        if "vision_config" in config:
            config = config["vision_config"]
        if not isinstance(config, Mapping):
            config = config.to_dict()
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in config.items():
            key = _HF_ALIASES.get(key, key)
            if key in names:
                values[key] = value
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if isinstance(rope, Mapping) and "rope_theta" in rope:
            values["rope_theta"] = float(rope["rope_theta"])
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported (GLM-4V), got {act!r}")
        if config.get("attention_bias"):
            raise ValueError("attention_bias=True is not a GLM-4V vision tower")
        return cls(**values)

    def to_hf_dict(self) -> dict[str, Any]:
        """Keyword arguments for transformers' ``Glm4vVisionConfig`` describing the same tower."""
        d = dataclasses.asdict(self)
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": d.pop("rope_theta")}
        d["hidden_act"] = "silu"
        d["attention_bias"] = False
        return d
