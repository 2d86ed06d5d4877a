"""Synthetic workloads: vLLM's ``random-mm`` benchmark dataset, named presets, explicit sizes, random pixels.

An item is an image (``num_frames`` = 1) or a video of ``num_frames`` sampled frames; its patch grid follows
GLM-4V's ``smart_resize`` (:mod:`glmvit.geometry`).
"""
from __future__ import annotations

import ast
import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from .config import VisionConfig
from .geometry import ItemSpec, grid_for, item_spec
from .messages import shown
from .metadata import as_grid_array, rows_of
from .packing import positive_int


@dataclass(frozen=True)
class MMItem:
    """One image (num_frames = 1) or video: its input size, its patch grid after smart_resize, its packing spec."""

    height: int
    width: int
    num_frames: int
    grid: tuple[int, int, int]

    @property
    def spec(self) -> ItemSpec:
        return item_spec(*self.grid)


def make_item(height: int, width: int, num_frames: int = 1) -> MMItem:
    return MMItem(height, width, num_frames, grid_for(height, width, num_frames))


def workload_from_sizes(sizes: Iterable[Sequence[int]]) -> list[MMItem]:
    """The items of one request from (height, width) or (height, width, frames) sizes."""
    return [make_item(*size) for size in sizes]


def parse_bucket_config(bucket_config: str | Mapping[Any, Any]) -> dict[tuple[int, int, int], float]:
    """``{(height, width, frames): probability}`` (or its string form) → normalised probabilities.

    Every bucket must be a size GLM-4V's resize accepts (checked here, naming the bucket) and every probability a
    finite number ≥ 0; any problem is one ValueError.
    """
    if isinstance(bucket_config, str):
        try:
            bucket_config = ast.literal_eval(bucket_config)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError) as err:
            reason = "nested too deeply" if isinstance(err, (RecursionError, MemoryError)) else shown(err, 120)
            raise ValueError(f"could not parse bucket_config {shown(bucket_config)}: {reason}") from None
    if not isinstance(bucket_config, Mapping) or not bucket_config:
        raise ValueError(f"bucket_config must be a non-empty dict {{(height, width, frames): prob}}, "
                         f"got {shown(bucket_config)}")
    buckets = {}
    for key, prob in bucket_config.items():
        if not (isinstance(key, tuple) and len(key) == 3):
            raise ValueError(f"bucket key must be (height, width, frames), got {shown(key)}")
        names = ("height", "width", "frames")
        key = tuple(positive_int(f"bucket {shown(key)} {name}", v) for name, v in zip(names, key, strict=True))
        try:
            make_item(*key)
        except ValueError as err:
            raise ValueError(f"bucket {shown(key)}: {err}") from None
        buckets[key] = _probability(key, prob)
    top = max(buckets.values())
    if not top > 0:
        raise ValueError("bucket_config probabilities must sum to > 0, got 0")
    scaled = {k: p / top for k, p in buckets.items() if p > 0}  # in (0, 1]: the sum cannot overflow
    total = math.fsum(scaled.values())
    return {k: p / total for k, p in scaled.items()}


def _probability(key: tuple[int, ...], prob: Any) -> float:
    if not isinstance(prob, bool) and isinstance(prob, numbers.Real):
        try:
            value = float(prob)
        except OverflowError:  # an int beyond a float
            value = math.inf
        if math.isfinite(value) and value >= 0:
            return value
    raise ValueError(f"bucket {shown(key)} probability must be a finite number ≥ 0, got {shown(prob)}")


def random_mm_workload(bucket_config: str | Mapping[Any, Any], num_requests: int, items_per_request: int = 1,
                       range_ratio: float = 0.0, seed: int = 0,
                       limit_per_request: int | None = None) -> list[list[MMItem]]:
    """Requests like vLLM's ``random-mm`` dataset: items per request uniform in [⌊n(1−r)⌋, ⌈n(1+r)⌉]
    (capped by ``limit_per_request``, vLLM's limit-mm-per-prompt), each item's size drawn from the buckets."""
    buckets = parse_bucket_config(bucket_config)
    num_requests = positive_int("num_requests", num_requests)
    n = positive_int("items_per_request", items_per_request)
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio!r}")
    lo = max(0, math.floor(n * (1 - range_ratio)))
    hi = math.ceil(n * (1 + range_ratio))
    if limit_per_request is not None:
        hi = min(hi, positive_int("limit_per_request", limit_per_request))
    if lo > hi:
        raise ValueError(f"items per request range is empty: [{lo}, {hi}]")
    return _draw(buckets, num_requests, lo, hi, seed)


def _draw(buckets: Mapping[tuple[int, int, int], float], num_requests: int, lo: int, hi: int,
          seed: int) -> list[list[MMItem]]:
    """``num_requests`` requests of a uniform [lo, hi] number of items, each drawn from the buckets."""
    rng = np.random.default_rng(seed)
    keys = list(buckets)
    items = [make_item(*k) for k in keys]
    counts = rng.integers(lo, hi + 1, size=num_requests)
    choices = rng.choice(len(keys), size=int(counts.sum()), p=[buckets[k] for k in keys])
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [[items[c] for c in choices[a:b]] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


@dataclass(frozen=True)
class Preset:
    """A named random-mm workload: buckets {(height, width, frames): probability} and items per request."""

    description: str
    bucket_config: Mapping[tuple[int, int, int], float]
    items_per_request: int
    range_ratio: float = 0.0
    limit_per_request: int | None = None

    def requests(self, num_requests: int, seed: int = 0) -> list[list[MMItem]]:
        return random_mm_workload(self.bucket_config, num_requests, self.items_per_request, self.range_ratio, seed,
                                  self.limit_per_request)


PRESETS: dict[str, Preset] = {
    "img1x224": Preset("one 224² image (64 tokens)", {(224, 224, 1): 1.0}, 1),
    "img4x224": Preset("four 224² images (256 tokens)", {(224, 224, 1): 1.0}, 4),
    "video8x224": Preset("one 8-frame 224² clip (grid [4, 16, 16], 256 tokens)", {(224, 224, 8): 1.0}, 1),
    "video2x8x224": Preset("two 8-frame 224² clips (512 tokens)", {(224, 224, 8): 1.0}, 2),
    "img8x448": Preset("eight 448² images (2,048 tokens)", {(448, 448, 1): 1.0}, 8),
    "mixed-img": Preset("224², 448², 672², 1024² images (0.4/0.3/0.2/0.1), 1–4 per request",
                        {(224, 224, 1): 0.4, (448, 448, 1): 0.3, (672, 672, 1): 0.2, (1024, 1024, 1): 0.1}, 3,
                        range_ratio=0.6, limit_per_request=4),
    "mixed-av": Preset("224² and 448² images and 8- and 16-frame clips, 1–3 per request",
                       {(224, 224, 1): 0.3, (448, 448, 1): 0.2, (224, 224, 8): 0.15, (224, 224, 16): 0.1,
                        (448, 448, 8): 0.15, (448, 448, 16): 0.1}, 2, range_ratio=0.5),
    "mixed-large": Preset("224²–1344² images, 1–4 per request", {(s, s, 1): 1.0 for s in (224, 448, 672, 896, 1120,
                          1344)}, 3, range_ratio=0.6, limit_per_request=4),
}


def random_batch(grids: Any, config: VisionConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random normal pixel rows (float32, CPU) for ``grids`` (rows [t, h, w]), and the grids as a long tensor."""
    checked = as_grid_array(np.asarray(grids).reshape(-1, 3))  # exact rows, bounded: nothing wraps
    grid, rows = torch.from_numpy(checked), rows_of(checked)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, config.patch_dim, generator=gen), grid
