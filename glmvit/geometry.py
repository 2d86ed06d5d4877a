"""Item geometry: pixels → GLM-4V's resize rule → patch grid [t, h, w] → what packing needs (:class:`ItemSpec`).

One set of constants, taken from the tower's defaults (:class:`~glmvit.config.VisionConfig`) and from what the
GLM-4V checkpoints' processors ship. Words used throughout the package:

- a *frame* is one picture of a video (an image counts as one frame);
- a *temporal patch* pairs two frames (``temporal_patch_size`` = 2): grid ``t`` counts them;
- a *segment* is one attention segment: every temporal patch of every item is its own, so an item has t segments.
"""
from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Sequence

from .config import VisionConfig

_DEFAULT = VisionConfig.glm41v()
PATCH_SIZE = _DEFAULT.patch_size  # 14 px
MERGE_SIZE = _DEFAULT.spatial_merge_size  # 2: a 2×2 block of patches is one output token
TEMPORAL_PATCH_SIZE = _DEFAULT.temporal_patch_size  # 2 frames per temporal patch
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28 px: one output token's side
IMAGE_MIN_PIXELS = 112 * 112  # Glm4vImageProcessor's size["shortest_edge"]
IMAGE_MAX_PIXELS = 28 * 28 * 2 * 6144  # 9,633,792: size["longest_edge"] of the GLM-4V checkpoints
VIDEO_MAX_PIXELS = 28 * 28 * 2 * 30000  # the video processors' longest_edge; counts t̄·h·w
# Bounds on sizes from outside (files, traces, bucket configs), checked before any arithmetic: the resize rule
# works in floats, and a 400-digit side would overflow them. Pillow and FFmpeg keep a picture's sides in C ints,
# so no decoder yields a side above MAX_SIDE; MAX_FRAMES is 155 hours at 30 fps.
MAX_SIDE = 2**31 - 1
MAX_FRAMES = 2**24
# The most pixels of one decoded picture (an image, or a frame of a video) the readers accept, checked from the
# file's header before decoding: 8192² = 64 MP, above the 50 MP of today's largest camera photos. The model sees at
# most IMAGE_MAX_PIXELS / 2 = 4.8 MP of a picture; decoding and converting one costs about 15 bytes a pixel.
MAX_FRAME_PIXELS = 8192 * 8192


class _ItemFields(NamedTuple):
    tokens: int
    segments: int
    rows: int
    work: int


class ItemSpec(_ItemFields):
    """What packing and the cost model need of one item: output tokens after the merge, attention segments (its
    temporal patches), patch rows, and attention work Σ L² over its segments (L = patch rows per segment).

    Made from a grid by :func:`item_spec` (the one place that counts them). ``ItemSpec(tokens, segments)`` alone
    describes an item of equal segments at the tower's merge size: rows = tokens · MERGE_SIZE², work = rows² / segments.
    """

    __slots__ = ()

    def __new__(cls, tokens: int, segments: int, rows: int | None = None, work: int | None = None) -> "ItemSpec":
        if rows is None:
            rows = tokens * MERGE_SIZE**2
        if work is None:
            work = rows * rows // segments if segments else 0
        return super().__new__(cls, tokens, segments, rows, work)

    @property
    def segment_rows2(self) -> int:
        """Σ L² over the item's segments: its attention work (``work``)."""
        return self.work

    @classmethod
    def from_grid(cls, grid: Sequence[int], merge: int = MERGE_SIZE) -> "ItemSpec":
        """The spec of one (t, h, w) patch grid (:func:`item_spec`)."""
        t, h, w = (int(x) for x in grid)
        return item_spec(t, h, w, merge)

    @classmethod
    def total(cls, specs: Iterable["ItemSpec"]) -> "ItemSpec":
        """The tokens, segments, rows and work of several items together (one batch)."""
        tokens = segments = rows = work = 0
        for spec in specs:
            tokens, segments = tokens + spec.tokens, segments + spec.segments
            rows, work = rows + spec.rows, work + spec.work
        return cls(tokens, segments, rows, work)


def smart_resize(height: int, width: int, num_frames: int = TEMPORAL_PATCH_SIZE, *, factor: int = FACTOR,
                 min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS,
                 temporal_factor: int = TEMPORAL_PATCH_SIZE) -> tuple[int, int]:
    """GLM-4V's resize rule (transformers' ``image_processing_pil_glm4v.smart_resize``, arguments reordered).

    Rounds each side to the nearest multiple of ``factor`` (Python ``round``: half to even), then rescales so that
    frames · h · w stays within [min_pixels, max_pixels]. Images count as ``temporal_factor`` frames.
    Returns (height, width) in pixels.
    """
    if not temporal_factor <= num_frames <= MAX_FRAMES:
        raise ValueError(f"num_frames={_side(num_frames)} must be at least temporal_factor={temporal_factor}"
                         if num_frames < temporal_factor else f"{_side(num_frames)} frames: at most {MAX_FRAMES:,}")
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {_side(height)}×{_side(width)}")
    if max(height, width) > MAX_SIDE:
        raise ValueError(f"image size {_side(height)}×{_side(width)}: a side is larger than {MAX_SIDE:,} pixels, "
                         "more than any decoder gives")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} is larger than max_pixels={max_pixels}")
    sent = f"{_side(height)}×{_side(width)}"  # an error names the size as given, not as scaled up below
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {sent} (height×width) exceeds 200:1")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for(height: int, width: int, frames: int = 1) -> tuple[int, int, int]:
    """Patch grid (t, h, w) of an image (frames = 1) or a video of ``frames`` sampled frames (t = ceil(frames / 2))."""
    if not 1 <= frames <= MAX_FRAMES:
        raise ValueError(f"frames must be in [1, {MAX_FRAMES:,}], got {_side(frames)}")
    t = math.ceil(frames / TEMPORAL_PATCH_SIZE)
    if frames == 1:
        h_px, w_px = smart_resize(height, width)
    else:
        h_px, w_px = smart_resize(height, width, TEMPORAL_PATCH_SIZE * t, max_pixels=VIDEO_MAX_PIXELS)
    return t, h_px // PATCH_SIZE, w_px // PATCH_SIZE


def check_frame_pixels(width: int, height: int, name: str, max_frame_pixels: int = MAX_FRAME_PIXELS,
                       error: type[ValueError] = ValueError) -> None:
    """Refuse a picture of more than ``max_frame_pixels`` before it is decoded or copied (a file's header states
    its size): an ``error`` naming it."""
    if width * height > max_frame_pixels:
        raise error(f"{name}: {width}×{height} is {width * height:,} pixels, more than max_frame_pixels="
                    f"{max_frame_pixels:,} (glmvit.geometry.MAX_FRAME_PIXELS): resize it first, or raise the limit "
                    "for a file you trust")


def _side(value: int) -> str:
    """A size for an error message: the number, or its digit count if it is too long to read."""
    text = f"{value:,}"
    return text if len(text) <= 27 else f"(a {len(str(value))}-digit number)"


def output_tokens(t: int, h: int, w: int, merge: int = MERGE_SIZE) -> int:
    """Tokens the merger emits for a (t, h, w) patch grid: t·h·w / merge² (:func:`item_spec`)."""
    return item_spec(t, h, w, merge).tokens


def item_spec(t: int, h: int, w: int, merge: int = MERGE_SIZE) -> ItemSpec:
    """The :class:`ItemSpec` of a (t, h, w) patch grid at spatial merge size ``merge``: the one function that counts
    an item. t segments of L = h·w patch rows each: rows t·h·w, tokens t·h·w / merge², work Σ L² = t·(h·w)².
    A ValueError when h or w is not a multiple of ``merge``."""
    if h % merge or w % merge:
        raise ValueError(f"grid {h}×{w} is not a multiple of the merge size {merge}")
    frame = h * w
    return ItemSpec(t * frame // merge**2, t, t * frame, t * frame * frame)


def grid_specs(grids: Iterable[Sequence[int]], merge: int = MERGE_SIZE) -> list[ItemSpec]:
    """:func:`item_spec` of every (t, h, w) row of ``grids``."""
    return [ItemSpec.from_grid(g, merge) for g in grids]
