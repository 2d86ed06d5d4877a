"""Images and videos → pixel rows [rows, 1176] and grids [t, h, w] for the GLM-4V vision encoder.

Images go through transformers' own ``Glm4vImageProcessorPil`` (explicitly: no torchvision fallback warning).
transformers' video processors need torchvision, so videos are done here with the same steps: frame sampling
by the GLM-4.1V or GLM-4.6V rule (pure re-implementations of their ``sample_frames``), ``smart_resize`` over the
sampled frame count, PIL bicubic resize, rescale by 1/255 in float64 → float32, OpenAI CLIP normalisation in
float32, and the video patchify (frame pairs are temporal patches).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageSequence, UnidentifiedImageError
from transformers.image_transforms import convert_to_rgb
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, load_image
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

from .geometry import (
    FACTOR,
    IMAGE_MAX_PIXELS,
    IMAGE_MIN_PIXELS,
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    VIDEO_MAX_PIXELS,
    smart_resize,
)

__all__ = [
    "VisionInputs",
    "process_images",
    "process_video",
    "sample_frame_indices_glm41v",
    "sample_frame_indices_glm46v",
    "patchify_image",
    "patchify_video",
]

PATCH, TEMPORAL, MERGE = PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE
RULES = ("glm41v", "glm46v")
KINDS = ("image", "video")

_MEAN = np.array(OPENAI_CLIP_MEAN, dtype=np.float32)
_STD = np.array(OPENAI_CLIP_STD, dtype=np.float32)


@dataclass
class VisionInputs:
    """A batch of images and videos as the encoder takes it, plus what each item was.

    ``timestamps[i]`` is None for an image; for a video, the time in seconds of the first frame of each
    temporal patch (frame pair), as transformers' GLM-4V processor puts it into the prompt.
    """

    pixel_values: torch.Tensor  # float32 [rows, 1176]
    grid_thw: torch.Tensor  # long [items, 3]
    kinds: list[str]
    timestamps: list[list[float] | None]
    sources: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.sources:
            self.sources = [None] * len(self.kinds)
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [items, 3], got {tuple(self.grid_thw.shape)}")
        n = self.grid_thw.shape[0]
        if not len(self.kinds) == len(self.timestamps) == len(self.sources) == n:
            raise ValueError(
                f"{n} grid rows but {len(self.kinds)} kinds, {len(self.timestamps)} timestamps, "
                f"{len(self.sources)} sources"
            )
        if sum(self.item_rows()) != self.pixel_values.shape[0]:
            raise ValueError(f"grids cover {sum(self.item_rows())} rows, pixel_values has {self.pixel_values.shape[0]}")
        rows = zip(self.kinds, self.grid_thw.tolist(), self.timestamps, strict=True)
        for i, (kind, (t, _, _), stamps) in enumerate(rows):
            if kind not in KINDS:
                raise ValueError(f"item {i}: kind must be one of {KINDS}, got {kind!r}")
            if kind == "image" and (t != 1 or stamps is not None):
                raise ValueError(f"item {i}: an image has t = 1 and no timestamps")
            if kind == "video" and (stamps is None or len(stamps) != t):
                raise ValueError(f"item {i}: a video needs one timestamp per temporal patch ({t})")

    def __len__(self) -> int:
        return len(self.kinds)

    def item_rows(self) -> list[int]:
        """Pixel rows of each item (t·h·w)."""
        return self.grid_thw.prod(dim=1).tolist()

    def split(self) -> tuple[torch.Tensor, ...]:
        """The pixel rows of each item."""
        return torch.split(self.pixel_values, self.item_rows())

    @classmethod
    def concat(cls, inputs: list["VisionInputs"]) -> "VisionInputs":
        """One batch holding every item of ``inputs``, in order."""
        if not inputs:
            raise ValueError("VisionInputs.concat needs at least one VisionInputs")
        return cls(
            pixel_values=torch.cat([x.pixel_values for x in inputs]),
            grid_thw=torch.cat([x.grid_thw for x in inputs]),
            kinds=[k for x in inputs for k in x.kinds],
            timestamps=[s for x in inputs for s in x.timestamps],
            sources=[s for x in inputs for s in x.sources],
        )


# --- images ------------------------------------------------------------------------------------------------------


def _load_image(item, index: int) -> tuple[Image.Image, str | None]:
    """One image input as a PIL image (files opened like transformers' ``load_image``) and its source name."""
    if isinstance(item, (str, Path)):
        path = Path(item)
        if not path.is_file():
            raise FileNotFoundError(f"image {index}: no such file: {path}")
        try:
            return load_image(str(path)), str(path)
        except UnidentifiedImageError as err:
            raise ValueError(f"image {index}: cannot decode {path} as an image") from err
    if isinstance(item, Image.Image):
        return item, getattr(item, "filename", None) or None
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim != 3 or item.shape[2] != 3:
            raise ValueError(f"image {index}: arrays must be HWC uint8 with 3 channels, got {item.dtype} {item.shape}")
        return Image.fromarray(item), None
    raise TypeError(f"image {index}: expected a path, a PIL image or an HWC uint8 array, got {type(item).__name__}")


def process_images(images, min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS) -> VisionInputs:
    """Images (paths, PIL images or HWC uint8 arrays; one or a list) through ``Glm4vImageProcessorPil``."""
    if isinstance(images, (str, Path, Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ValueError("process_images needs at least one image")
    loaded = [_load_image(item, i) for i, item in enumerate(images)]
    processor = Glm4vImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    out = processor([image for image, _ in loaded], return_tensors="pt")
    return VisionInputs(
        pixel_values=out["pixel_values"],
        grid_thw=out["image_grid_thw"].long(),
        kinds=["image"] * len(loaded),
        timestamps=[None] * len(loaded),
        sources=[source for _, source in loaded],
    )


# --- patchify ----------------------------------------------------------------------------------------------------


def _check_spatial(height: int, width: int) -> None:
    side = PATCH * MERGE
    if height % side or width % side:
        raise ValueError(f"height × width = {height} × {width} must both be multiples of {side}")


def patchify_image(image: torch.Tensor) -> torch.Tensor:
    """(C, H, W) → (H/14 · W/14, C·2·14·14) rows in block order, the image copied into both temporal slots."""
    c, h, w = image.shape
    _check_spatial(h, w)
    gh, gw = h // PATCH, w // PATCH
    x = image.reshape(c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(1, 4, 2, 5, 0, 3, 6)  # (gh/2, gw/2, mh, mw, C, py, px)
    x = x.unsqueeze(5).expand(*x.shape[:5], TEMPORAL, PATCH, PATCH)
    return x.reshape(gh * gw, c * TEMPORAL * PATCH * PATCH)


def patchify_video(video: torch.Tensor) -> torch.Tensor:
    """(F, C, H, W), F even → (F/2 · H/14 · W/14, C·2·14·14) rows: temporal patch major, then block order."""
    f, c, h, w = video.shape
    if f % TEMPORAL:
        raise ValueError(f"a video needs an even number of frames, got {f}")
    _check_spatial(h, w)
    gh, gw = h // PATCH, w // PATCH
    x = video.reshape(f // TEMPORAL, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (F/2, gh/2, gw/2, mh, mw, C, T, py, px)
    return x.reshape(f // TEMPORAL * gh * gw, c * TEMPORAL * PATCH * PATCH)


# --- frame sampling ----------------------------------------------------------------------------------------------


def _check_video_meta(total_frames: int, video_fps: float) -> None:
    if total_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {total_frames}")
    if not video_fps > 0:
        raise ValueError(f"video_fps must be positive, got {video_fps}")


def _unique_even(indices) -> list[int]:
    """De-duplicate keeping order; repeat the last index if the count is odd."""
    unique = list(dict.fromkeys(int(i) for i in indices))
    if len(unique) % 2:
        unique.append(unique[-1])
    return unique


def sample_frame_indices_glm41v(total_frames: int, video_fps: float, fps: float = 2) -> list[int]:
    """GLM-4.1V's ``Glm4vVideoProcessor.sample_frames``: ``fps`` frames a second, at most 300 s of them."""
    _check_video_meta(total_frames, video_fps)
    if not fps > 0:
        raise ValueError(f"fps must be positive, got {fps}")
    max_duration, last = 300, total_frames - 1
    duration = total_frames / video_fps
    if duration <= max_duration:
        n = max(math.floor(duration * fps), 1)
        indices = [min(last, math.ceil(i * video_fps / fps)) for i in range(n)]
    elif int(max_duration * fps) >= total_frames:
        indices = list(range(total_frames))
    else:
        seconds = np.linspace(0, duration, int(max_duration * fps), endpoint=True)
        indices = [min(last, math.ceil(t * video_fps)) for t in seconds]
    return _unique_even(indices)


def _glm46v_rate(duration: float) -> tuple[float, int]:
    """GLM-4.6V's sampling fps for a video of ``duration`` seconds and the number of frames to extract."""
    effective = min(duration, 2400)
    target_fps = 3 if effective <= 30 else 1 if effective <= 300 else 0.5
    return target_fps, min(int(effective * target_fps * TEMPORAL), 640)


def _walk_seconds(total_frames: int, video_fps: float, target_fps: float, max_second: int) -> list[int]:
    """The first frame at or after each step of 1 / (2·target_fps) seconds, until ``max_second``."""
    frame_seconds = 1 / video_fps
    step = 1 / (TEMPORAL * target_fps)
    indices, current = [], 0
    for index in range(total_frames):
        if index * frame_seconds >= current:
            current += step
            indices.append(index)
            if current >= max_second:
                break
    return indices


def sample_frame_indices_glm46v(total_frames: int, video_fps: float) -> list[int]:
    """GLM-4.6V's ``Glm46VVideoProcessor.sample_frames``: 3, 1 or 0.5 fps by duration, at most 640 frames."""
    _check_video_meta(total_frames, video_fps)
    last = total_frames - 1
    duration = total_frames / video_fps
    target_fps, extract_t = _glm46v_rate(duration)
    if total_frames < extract_t:
        indices = np.linspace(0, last, extract_t, dtype=int).tolist()
    else:
        indices = _walk_seconds(total_frames, video_fps, target_fps, int(duration))
    if len(indices) < extract_t:
        start, end = (indices[0], indices[-1]) if indices else (0, last)
        indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(indices) > extract_t:
        indices = np.linspace(0, last, extract_t, dtype=int).tolist()
    return _unique_even(indices)


# --- videos ------------------------------------------------------------------------------------------------------


def _read_animation(path: Path, video_fps: float | None) -> tuple[np.ndarray, float]:
    """All frames of an animated image (GIF, WebP, ...) as (F, H, W, 3) uint8, and its frame rate.

    The rate is ``video_fps`` if given, else frames / total duration from the per-frame ``duration`` (ms).
    """
    try:
        with Image.open(path) as im:
            frames, durations = [], []
            for frame in ImageSequence.Iterator(im):
                frames.append(convert_to_rgb(frame, return_numpy=True))
                durations.append(frame.info.get("duration") or 0)
    except UnidentifiedImageError as err:
        raise ValueError(f"video {path}: cannot decode it (supported: animated images that PIL reads)") from err
    if video_fps is None:
        if sum(durations) <= 0:
            raise ValueError(f"video {path}: no frame durations in the file; pass video_fps")
        video_fps = len(frames) / (sum(durations) / 1000)
    return np.stack(frames), video_fps


def _load_video(video, video_fps: float | None) -> tuple[np.ndarray, float, str | None]:
    """A video input as (F, H, W, 3) uint8 frames, its frame rate and its source name."""
    if isinstance(video, (str, Path)):
        path = Path(video)
        if not path.is_file():
            raise FileNotFoundError(f"video: no such file: {path}")
        frames, rate = _read_animation(path, video_fps)
        return frames, rate, str(path)
    if isinstance(video, np.ndarray):
        if video.dtype != np.uint8 or video.ndim != 4 or video.shape[3] != 3:
            raise ValueError(f"video arrays must be (F, H, W, 3) uint8, got {video.dtype} {video.shape}")
        if video_fps is None:
            raise ValueError("a video given as an array needs video_fps (the frame rate of its frames)")
        return video, video_fps, None
    raise TypeError(f"video: expected a path or an (F, H, W, 3) uint8 array, got {type(video).__name__}")


def _normalised_frame(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8 → (3, height, width) float32, exactly the steps of ``Glm4vImageProcessorPil``."""
    resized = np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))
    scaled = (resized.astype(np.float64) * (1 / 255)).astype(np.float32)
    return ((scaled - _MEAN) / _STD).transpose(2, 0, 1)


def process_video(
    video,
    fps: float | None = None,
    rule: str = "glm41v",
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    video_fps: float | None = None,
) -> VisionInputs:
    """One video (an animated-image path, or (F, H, W, 3) uint8 frames with ``video_fps``) → one video item.

    ``rule`` picks the frame sampling: "glm41v" (``fps`` frames a second, default 2) or "glm46v" (its own fps).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "glm46v" and fps is not None:
        raise ValueError("rule 'glm46v' chooses its fps from the duration; leave fps as None")
    frames, rate, source = _load_video(video, video_fps)
    if rule == "glm41v":
        indices = sample_frame_indices_glm41v(len(frames), rate, 2 if fps is None else fps)
    else:
        indices = sample_frame_indices_glm46v(len(frames), rate)
    if not indices:
        raise ValueError(f"video {source or '(array)'}: too short, no frame sampled")
    height, width = smart_resize(frames.shape[1], frames.shape[2], len(indices), factor=FACTOR,
                                 min_pixels=min_pixels, max_pixels=max_pixels, temporal_factor=TEMPORAL)
    pixels = np.stack([_normalised_frame(frames[i], height, width) for i in indices])
    return VisionInputs(
        pixel_values=patchify_video(torch.from_numpy(pixels)),
        grid_thw=torch.tensor([[len(indices) // TEMPORAL, height // PATCH, width // PATCH]]),
        kinds=["video"],
        timestamps=[[indices[k] / rate for k in range(0, len(indices), TEMPORAL)]],
        sources=[source],
    )
