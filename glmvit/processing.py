"""Images and videos → pixel rows [rows, 1176] and grids [t, h, w] for the GLM-4V vision encoder.

Images get the steps of transformers' ``Glm4vImageProcessorPil`` (its ``smart_resize`` size, PIL bicubic, then
its rescale and normalisation as one exact table lookup; tests/test_processing.py compares the two bitwise), fed RGB
images converted here, so that the result is the same on every transformers ≥ 5.4:

- transparency is composited on white, as transformers' ``convert_to_rgb`` does for PIL images since it learned
  to (5.24 does; 5.4 and 5.17 drop the alpha channel, and its ``load_image`` drops it for paths on every version):
  an RGBA file gives the same pixels by path and as a PIL image;
- 16-bit and 32-bit images are scaled to 8 bits, never clipped (PIL's own ``convert("RGB")``, which transformers
  uses, saturates them at 255): modes ``I;16*`` and ``I`` are read as 0..65535, mode ``F`` as 0..1; values
  outside that range are an error naming the item;
- paths are opened like transformers' ``load_image`` (EXIF orientation applied), and any decoding failure is one
  ``ValueError`` naming the item and the file.

Videos are done here with the video processors' steps (transformers' video processors need torchvision): frame
sampling by the GLM-4.1V or GLM-4.6V rule (pure re-implementations of their ``sample_frames``), ``smart_resize``
over the sampled frame count, bicubic resize, rescale and CLIP normalisation, and the video patchify (frame pairs
are temporal patches). Files are read by :mod:`glmvit.video`, which decodes only up to the last sampled frame and
holds one decoded frame at a time.

Both stop after the resize in :class:`VisionFrames` (uint8 frames: what ``glmvit serve``'s decode workers hand
over); :func:`rows_from_frames`, on any device, makes the pixel rows of :class:`VisionInputs` from them.

Why one module of this length: images and videos end in the same VisionInputs and share the resize, the
conversion to RGB and the patchify; file decoding for videos lives in :mod:`glmvit.video`.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
import os
import stat
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from . import decode_clock
from . import video as video_files
from .files import file_kind
from .geometry import (
    FACTOR,
    IMAGE_MAX_PIXELS,
    IMAGE_MIN_PIXELS,
    MAX_FRAME_PIXELS,
    MAX_FRAMES,
    MERGE_SIZE,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    VIDEO_MAX_PIXELS,
    check_frame_pixels,
    smart_resize,
)
from .metadata import as_grid_array
from .video import MAX_DECODED_PIXELS, PIL_ERRORS, VideoInfo

__all__ = [
    "VisionInputs",
    "VisionFrames",
    "rows_from_frames",
    "image_frames",
    "video_frames",
    "process_images",
    "process_video",
    "sample_frame_indices_glm41v",
    "sample_frame_indices_glm46v",
    "patchify_image",
    "patchify_video",
    "smart_resize",
]

PATCH, TEMPORAL, MERGE = PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE
RULES = ("glm41v", "glm46v")
RESIZES = ("pil", "torchvision")
KINDS = ("image", "video")
# transformers' image_utils.OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, written out: importing that module imports
# torchvision and torch._dynamo (seconds), which a process that only sends media (bench-serve --url) must not pay
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

_MEAN = np.array(OPENAI_CLIP_MEAN, dtype=np.float32)
_STD = np.array(OPENAI_CLIP_STD, dtype=np.float32)


@dataclass
class VisionInputs:
    """A batch of images and videos as the encoder takes it, plus what each item was.

    ``timestamps[i]`` is None for an image; for a video, the time in seconds of the first frame of each
    temporal patch (frame pair), as transformers' GLM-4V processor puts it into the prompt.
    ``frame_indices[i]`` is None for an image; for a video, the sampled frame indices (2·t of them).
    """

    pixel_values: torch.Tensor  # float32 [rows, 1176]
    grid_thw: torch.Tensor  # long [items, 3]
    kinds: list[str]
    timestamps: list[list[float] | None]
    sources: list[str | None] = field(default_factory=list)
    frame_indices: list[list[int] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.sources:
            self.sources = [None] * len(self.kinds)
        if not self.frame_indices:
            self.frame_indices = [None] * len(self.kinds)
        if self.grid_thw.ndim != 2 or self.grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must have shape [items, 3], got {tuple(self.grid_thw.shape)}")
        as_grid_array(self.grid_thw)  # positive entries whose products and sum are exact (metadata.MAX_ROWS)
        n = self.grid_thw.shape[0]
        columns = (self.kinds, self.timestamps, self.sources, self.frame_indices)
        if any(len(column) != n for column in columns):
            raise ValueError(f"{n} grid rows but {len(self.kinds)} kinds, {len(self.timestamps)} timestamps, "
                             f"{len(self.sources)} sources, {len(self.frame_indices)} frame_indices")
        if sum(self.item_rows()) != self.pixel_values.shape[0]:
            raise ValueError(f"grids cover {sum(self.item_rows())} rows, pixel_values has {self.pixel_values.shape[0]}")
        rows = zip(self.kinds, self.grid_thw.tolist(), self.timestamps, self.frame_indices, strict=True)
        for i, (kind, (t, _, _), stamps, frames) in enumerate(rows):
            if kind not in KINDS:
                raise ValueError(f"item {i}: kind must be one of {KINDS}, got {kind!r}")
            if kind == "image" and (t != 1 or stamps is not None or frames is not None):
                raise ValueError(f"item {i}: an image has t = 1 and no timestamps or frame indices")
            if kind == "video" and (stamps is None or len(stamps) != t):
                raise ValueError(f"item {i}: a video needs one timestamp per temporal patch ({t})")
            if kind == "video" and frames is not None and len(frames) != TEMPORAL * t:
                raise ValueError(f"item {i}: a video of {t} temporal patches has {TEMPORAL * t} frame indices")

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
        """One batch holding every item of ``inputs``, in order (one VisionInputs: itself, its rows not copied)."""
        if not inputs:
            raise ValueError("VisionInputs.concat needs at least one VisionInputs")
        if len(inputs) == 1:
            return inputs[0]
        return cls(
            pixel_values=torch.cat([x.pixel_values for x in inputs]),
            grid_thw=torch.cat([x.grid_thw for x in inputs]),
            kinds=[k for x in inputs for k in x.kinds],
            timestamps=[s for x in inputs for s in x.timestamps],
            sources=[s for x in inputs for s in x.sources],
            frame_indices=[f for x in inputs for f in x.frame_indices],
        )


@dataclass
class VisionFrames:
    """Items after the resize, before normalisation: ``frames[i]`` is item i's (F, H, W, 3) uint8 RGB frames (an
    image: F = 1), the other fields as :class:`VisionInputs`'. ``levels`` is the normalisation's (3, 256) table
    (None: the image processor's); :meth:`inputs` makes the pixel rows."""

    frames: list[torch.Tensor]
    grid_thw: torch.Tensor  # long [items, 3]
    kinds: list[str]
    timestamps: list[list[float] | None]
    sources: list[str | None]
    frame_indices: list[list[int] | None]
    levels: torch.Tensor | None = None

    def inputs(self, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> VisionInputs:
        """The items' pixel rows (:func:`rows_from_frames`) in ``dtype`` on ``device`` (None: the frames')."""
        rows = [rows_from_frames(f if device is None else f.to(device), kind, dtype, self.levels)
                for f, kind in zip(self.frames, self.kinds, strict=True)]
        return VisionInputs(pixel_values=rows[0] if len(rows) == 1 else torch.cat(rows), grid_thw=self.grid_thw,
                            kinds=self.kinds, timestamps=self.timestamps, sources=self.sources,
                            frame_indices=self.frame_indices)


def _check_pixel_bounds(min_pixels: int, max_pixels: int) -> None:
    if not 1 <= min_pixels <= max_pixels:
        raise ValueError(f"need 1 ≤ min_pixels ≤ max_pixels, got min_pixels={min_pixels}, max_pixels={max_pixels}")


# --- pictures → RGB ----------------------------------------------------------------------------------------------


def _to_8bit(image: Image.Image, name: str) -> Image.Image:
    """A mode I;16*, I (read as 0..65535) or F (read as 0..1) image → mode L, scaled and rounded, not clipped.

    A transparency key (a 16-bit PNG's tRNS) becomes white, as compositing that pixel on white would.
    """
    with np.errstate(invalid="ignore"):  # signalling NaNs warn when cast; they are refused below
        values = np.asarray(image).astype(np.float64)
    top = 1.0 if image.mode == "F" else 65535.0
    if values.size and not (np.isfinite(values).all() and 0 <= values.min() and values.max() <= top):
        raise ValueError(f"{name}: mode {image.mode} values span [{values.min()}, {values.max()}], outside "
                         f"0..{top:g}; convert the image to 8 bits yourself")
    scaled = np.rint(values * (255 / top)).astype(np.uint8)
    key = image.info.get("transparency")
    if isinstance(key, int):
        scaled[values == key] = 255
    return Image.fromarray(scaled)


def _rgb_image(image: Image.Image, name: str) -> Image.Image:
    """A mode RGB copy: transformers' ``convert_to_rgb`` for PIL images (transparency composited on white), after
    scaling high-bit-depth modes to 8 bits."""
    if image.mode == "F" or image.mode.startswith("I"):
        image = _to_8bit(image, name)
    try:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return image.convert("RGB")
    except PIL_ERRORS as err:
        raise ValueError(f"{name}: cannot convert a mode {image.mode} image to RGB: {err}") from err


def _rgb_array(image: Image.Image, name: str) -> np.ndarray:
    """(H, W, 3) uint8 of :func:`_rgb_image`."""
    return np.asarray(_rgb_image(image, name))


# --- images ------------------------------------------------------------------------------------------------------


def _check_regular(path: Path, name: str) -> None:
    """A file to decode must be a regular one: a FIFO would block, a device never end (one line naming it)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{name}: no such file: {path}") from None
    except OSError as err:
        raise ValueError(f"{name}: cannot read {path} ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{name}: {path} is {file_kind(mode)}, not a regular file")


def _open_image(path: Path, name: str, max_frame_pixels: int) -> Image.Image:
    """The decoded picture of an image file, EXIF orientation applied (as transformers' ``load_image``); its size
    is checked from the header first."""
    _check_regular(path, name)
    with decode_clock.counting():  # the header read and the pixels' decode: this thread's decoding
        try:
            im = Image.open(path)
        except UnidentifiedImageError as err:
            raise ValueError(f"{name}: cannot decode {path} as an image") from err
        except PIL_ERRORS as err:
            raise ValueError(f"{name}: cannot decode {path}: {err}") from err
        with im:
            check_frame_pixels(*im.size, f"{name} ({path})", max_frame_pixels)
            try:
                return ImageOps.exif_transpose(im)  # a loaded copy
            except PIL_ERRORS as err:
                raise ValueError(f"{name}: cannot decode {path}: {err}") from err


def _load_image(item: Any, index: int, max_frame_pixels: int) -> tuple[Image.Image, str | None]:
    """One image input as a mode RGB PIL image and its source name."""
    name = f"image {index}"
    if isinstance(item, (str, Path)):
        return _rgb_image(_open_image(Path(item), name, max_frame_pixels), f"{name} ({item})"), str(item)
    if isinstance(item, Image.Image):
        check_frame_pixels(*item.size, name, max_frame_pixels)
        return _rgb_image(item, name), getattr(item, "filename", None) or None
    if isinstance(item, np.ndarray):
        if item.dtype != np.uint8 or item.ndim != 3 or item.shape[2] != 3:
            raise ValueError(f"{name}: arrays must be HWC uint8 with 3 channels, got {item.dtype} {item.shape}")
        check_frame_pixels(item.shape[1], item.shape[0], name, max_frame_pixels)
        return Image.fromarray(item), None
    raise TypeError(f"{name}: expected a path, a PIL image or an HWC uint8 array, got {type(item).__name__}")


def _check_image_size(image: Image.Image, name: str, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's resize rule (an image counts as two frames), an error naming the image: (height, width)."""
    try:
        return smart_resize(image.height, image.width, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from err


def image_frames(images: Any, min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS, *,
                 max_frame_pixels: int = MAX_FRAME_PIXELS) -> VisionFrames:
    """Images (paths, PIL images or HWC uint8 arrays; one or a list) resized as ``Glm4vImageProcessorPil`` resizes
    them: its ``smart_resize`` size, PIL bicubic on the RGB picture; each a (1, H, W, 3) uint8 frame.

    One image at a time is decoded and resized: memory holds one decoded picture, whatever the number of images. A
    picture of more than ``max_frame_pixels`` (width × height, read from a file's header before decoding) is refused.
    """
    _check_pixel_bounds(min_pixels, max_pixels)
    if isinstance(images, (str, Path, Image.Image, np.ndarray)):
        images = [images]
    if not images:
        raise ValueError("process_images needs at least one image")
    frames, grids, sources = [], [], []
    for i, item in enumerate(images):
        image, source = _load_image(item, i, max_frame_pixels)
        height, width = _check_image_size(image, f"image {i}" + (f" ({source})" if source else ""), min_pixels,
                                          max_pixels)
        resized = np.array(image.resize((width, height), Image.Resampling.BICUBIC))  # writable: torch shares it
        del image
        frames.append(torch.from_numpy(resized[None]))
        grids.append([1, height // PATCH, width // PATCH])
        sources.append(source)
    return VisionFrames(frames, torch.tensor(grids), ["image"] * len(sources), [None] * len(sources), sources,
                        [None] * len(sources))


def process_images(images: Any, min_pixels: int = IMAGE_MIN_PIXELS, max_pixels: int = IMAGE_MAX_PIXELS, *,
                   max_frame_pixels: int = MAX_FRAME_PIXELS) -> VisionInputs:
    """Images (paths, PIL images or HWC uint8 arrays; one or a list) as ``Glm4vImageProcessorPil`` makes them,
    float32 rows (:func:`image_frames`, then :func:`rows_from_frames`)."""
    return image_frames(images, min_pixels, max_pixels, max_frame_pixels=max_frame_pixels).inputs()


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


def _normalised_levels() -> np.ndarray:
    """(3, 256) float32: what ``Glm4vImageProcessorPil`` makes of each uint8 level v in each channel c —
    v × 1/255 in float64, rounded to float32, then (x − mean_c) / std_c in float32."""
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return (scaled[None, :] - _MEAN[:, None]) / _STD[:, None]


# A uint8 channel has 256 levels, and every step after the resize acts on one value at a time: looking each
# resized value up in this table is bitwise the processor's float arithmetic, at a fraction of its cost (one
# gather instead of four passes over float64 and float32 copies of the frame).
_LEVELS = torch.from_numpy(_normalised_levels())


@functools.lru_cache(maxsize=None)
def _levels_on(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """:data:`_LEVELS` in ``dtype`` on ``device``, flat (3·256): moved there once."""
    return _LEVELS.to(device=device, dtype=dtype).reshape(-1)


_CHANNEL_VALUES = TEMPORAL * PATCH * PATCH  # the values of one channel in a row: a row is channel-major


def rows_from_frames(frames: torch.Tensor, kind: str, dtype: torch.dtype = torch.float32,
                     levels: torch.Tensor | None = None) -> torch.Tensor:
    """One item's (F, H, W, 3) uint8 resized frames (an image: F = 1) → its (rows, 1176) pixel rows in ``dtype``,
    on the frames' device: each value normalised by a lookup in ``levels`` ((3, 256): channel c's result for each
    uint8 level; None: the image processor's), patchified as :func:`patchify_image` / :func:`patchify_video`.

    Bitwise the same on every device: the uint8 values are only moved (patchify), then each becomes a copy of its
    table entry, and the table is cast to ``dtype`` before the gather, which equals casting the float32 rows after
    (a cast rounds each value alone). No arithmetic on the pixels runs on the device.
    """
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames must be (F, H, W, 3) uint8, got {str(frames.dtype).removeprefix('torch.')} "
                         f"{tuple(frames.shape)}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "image" and frames.shape[0] != 1:
        raise ValueError(f"an image is one frame, got {frames.shape[0]}")
    chw = frames.permute(0, 3, 1, 2)  # a view: patchify copies once, one byte a value
    rows = patchify_image(chw[0]) if kind == "image" else patchify_video(chw)
    table = _levels_on(frames.device, dtype) if levels is None else levels.to(frames.device, dtype).reshape(-1)
    offsets = torch.arange(0, 3 * 256, 256, dtype=torch.int32, device=frames.device)
    index = rows.int() + offsets.repeat_interleave(_CHANNEL_VALUES)
    # index_select on int32: on a CPU a fraction of advanced indexing's or torch.take's time
    return table.index_select(0, index.reshape(-1)).reshape(rows.shape)


# --- frame sampling ----------------------------------------------------------------------------------------------


def _check_rate(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be positive and finite, got {value}")


def _video_duration(total_frames: int, video_fps: float, duration: float | None) -> float:
    """Checks the metadata; the duration given, or total_frames / video_fps (what transformers' decoders report)."""
    if not 1 <= operator.index(total_frames) <= MAX_FRAMES:
        raise ValueError(f"a video needs at least one frame and at most {MAX_FRAMES:,}, got {total_frames}")
    _check_rate("video_fps", video_fps)
    if duration is None:
        return total_frames / video_fps
    _check_rate("duration", duration)
    return duration


def _unique_even(indices: Iterable[int]) -> list[int]:
    """De-duplicate keeping order; repeat the last index if the count is odd."""
    unique = list(dict.fromkeys(int(i) for i in indices))
    if len(unique) % 2:
        unique.append(unique[-1])
    return unique


def _ceil_steps(n: int, video_fps: float, fps: float, last: int) -> list[int]:
    """The distinct values of min(last, ceil(i · video_fps / fps)) for i < n, in order, computed as transformers does.

    At half a frame per sample or less every integer up to the largest value is hit, so that range is returned at
    once; otherwise the walk stops at ``last``. Either way the work stays within the frame count, whatever fps.
    """
    if video_fps / fps <= 0.5:
        return list(range(min(last, math.ceil((n - 1) * video_fps / fps)) + 1))
    indices: list[int] = []
    for i in range(n):
        indices.append(min(last, math.ceil(i * video_fps / fps)))
        if indices[-1] == last:
            break
    return indices


def sample_frame_indices_glm41v(total_frames: int, video_fps: float, fps: float = 2,
                                duration: float | None = None) -> list[int]:
    """GLM-4.1V's ``Glm4vVideoProcessor.sample_frames``: ``fps`` frames a second, at most 300 s of them.

    ``duration`` (seconds) is the metadata's; None means total_frames / video_fps, which is what transformers'
    decoders report. (Given metadata without a duration, transformers itself uses round((total − 1) / fps) + 1.)
    """
    duration = _video_duration(total_frames, video_fps, duration)
    _check_rate("fps", fps)
    max_duration, last = 300, total_frames - 1
    if duration <= max_duration:
        indices = _ceil_steps(max(math.floor(duration * fps), 1), video_fps, fps, last)
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


def _walk_seconds(total_frames: int, video_fps: float, target_fps: float, max_second: int, limit: int) -> list[int]:
    """The first frame at or after each step of 1 / (2·target_fps) seconds, until ``max_second``.

    Stops after ``limit`` + 1 frames: the caller then replaces the walk by a linspace, however long it would go.
    """
    frame_seconds = 1 / video_fps
    step = 1 / (TEMPORAL * target_fps)
    indices: list[int] = []
    current = 0.0
    for index in range(total_frames):
        if index * frame_seconds >= current:
            current += step
            indices.append(index)
            if current >= max_second or len(indices) > limit:
                break
    return indices


def sample_frame_indices_glm46v(total_frames: int, video_fps: float, duration: float | None = None) -> list[int]:
    """GLM-4.6V's ``Glm46VVideoProcessor.sample_frames``: 3, 1 or 0.5 fps by duration, at most 640 frames.

    ``duration`` as for :func:`sample_frame_indices_glm41v`.
    """
    duration = _video_duration(total_frames, video_fps, duration)
    last = total_frames - 1
    target_fps, extract_t = _glm46v_rate(duration)
    if total_frames < extract_t:
        indices = np.linspace(0, last, extract_t, dtype=int).tolist()
    else:
        indices = _walk_seconds(total_frames, video_fps, target_fps, int(duration), extract_t)
    if len(indices) < extract_t:
        start, end = (indices[0], indices[-1]) if indices else (0, last)
        indices = np.linspace(start, end, extract_t, dtype=int).tolist()
    elif len(indices) > extract_t:
        indices = np.linspace(0, last, extract_t, dtype=int).tolist()
    return _unique_even(indices)


# --- videos ------------------------------------------------------------------------------------------------------

Frame = np.ndarray  # (H, W, 3) uint8 RGB
Resizer = Callable[[Frame, int, int], np.ndarray]  # (frame, height, width) → (height, width, 3) uint8


@dataclass
class _Clip:
    """A video input before sampling: its name for errors, metadata, and a reader of chosen frames."""

    name: str
    source: str | None
    total_frames: int
    fps: float
    duration: float | None
    read: Callable[[list[int]], Iterator[tuple[int, Frame]]]  # distinct indices, increasing → (index, frame)


def _array_clip(frames: np.ndarray, video_fps: float | None, duration: float | None,
                max_frame_pixels: int) -> _Clip:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"video arrays must be (F, H, W, 3) uint8, got {frames.dtype} {frames.shape}")
    check_frame_pixels(frames.shape[2], frames.shape[1], "video (array)", max_frame_pixels)
    if video_fps is None:
        raise ValueError("a video given as an array needs video_fps (the frame rate of its frames)")
    return _Clip("video (array)", None, len(frames), video_fps, duration,
                 lambda indices: ((i, frames[i]) for i in sorted(set(indices))))


def _file_clip(path: Path, video_fps: float | None, duration: float | None, max_decoded_pixels: int,
               max_frame_pixels: int, info: VideoInfo | None) -> _Clip:
    """A video file: its own metadata (``info`` if the caller probed it, else probed here) unless the caller gives
    video_fps / duration."""
    _check_regular(path, "video")
    if info is None:
        info = video_files.probe(path, max_frame_pixels)
    else:  # the caller's probe may have had another bound
        check_frame_pixels(info.width, info.height, f"video {path}", max_frame_pixels, video_files.DecodeLimitError)
    fps = video_fps if video_fps is not None else info.fps
    if fps is None:
        raise ValueError(f"video {path}: the file states no frame rate (no frame durations); pass video_fps")
    if duration is None and video_fps is None:
        duration = info.duration

    def read(indices: list[int]) -> Iterator[tuple[int, Frame]]:
        for index, frame in video_files.decode(path, info, indices, max_decoded_pixels, max_frame_pixels):
            yield index, frame if isinstance(frame, np.ndarray) else _rgb_array(frame, f"video {path} frame {index}")

    return _Clip(f"video {path}", str(path), info.frames, fps, duration, read)


def _open_clip(video: Any, video_fps: float | None, duration: float | None, max_decoded_pixels: int,
               max_frame_pixels: int, info: VideoInfo | None) -> _Clip:
    if isinstance(video, (str, Path)):
        return _file_clip(Path(video), video_fps, duration, max_decoded_pixels, max_frame_pixels, info)
    if info is not None:
        raise ValueError("video: info describes a video file; frames given as an array take video_fps")
    if isinstance(video, np.ndarray):
        return _array_clip(video, video_fps, duration, max_frame_pixels)
    raise TypeError(f"video: expected a path or an (F, H, W, 3) uint8 array, got {type(video).__name__}")


def _sample(clip: _Clip, rule: str, fps: float | None) -> list[int]:
    try:
        if rule == "glm41v":
            indices = sample_frame_indices_glm41v(clip.total_frames, clip.fps, 2 if fps is None else fps, clip.duration)
        else:
            indices = sample_frame_indices_glm46v(clip.total_frames, clip.fps, clip.duration)
    except ValueError as err:
        raise ValueError(f"{clip.name}: {err}") from err
    if not indices:
        raise ValueError(f"{clip.name}: too short, no frame sampled")
    return indices


def _check_frame_count(clip: _Clip, frames: int, max_pixels: int) -> None:
    """Each sampled frame keeps one 28 × 28 token at least: beyond max_pixels / 784 frames, max_pixels cannot
    hold, and the frames alone would outgrow it (transformers goes on regardless)."""
    if frames * FACTOR * FACTOR > max_pixels:
        raise ValueError(f"{clip.name}: {frames:,} sampled frames need at least {frames:,}·28·28 = "
                         f"{frames * FACTOR * FACTOR:,} pixels, more than max_pixels={max_pixels:,}; sample fewer "
                         f"frames (a lower fps)")


def _pil_frame(frame: Frame, height: int, width: int) -> np.ndarray:
    """The resize of ``Glm4vImageProcessorPil``: PIL bicubic; (height, width, 3) uint8 (its normalisation is
    :data:`_LEVELS`)."""
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))


def _torchvision_resizer() -> tuple[Resizer, torch.Tensor]:
    """The video processors' steps: torchvision's antialiased bicubic on uint8, and the (3, 256) table of their fused
    normalisation (float32 (x − 255·mean) / (255·std), the factors built as theirs; elementwise, so their own call
    on the 256 levels gives each value's result exactly)."""
    try:
        from torchvision.transforms.v2 import functional as tvF
    except ImportError as err:
        raise ValueError("resize='torchvision' needs torchvision (pip install torchvision); or resize='pil'") from err
    mean = torch.tensor(OPENAI_CLIP_MEAN) * (1.0 / (1 / 255))
    std = torch.tensor(OPENAI_CLIP_STD) * (1.0 / (1 / 255))
    levels = tvF.normalize(torch.arange(256, dtype=torch.float32).repeat(3, 1, 1), mean, std).reshape(3, 256)

    def resize(frame: Frame, height: int, width: int) -> np.ndarray:
        chw = torch.from_numpy(np.array(frame.transpose(2, 0, 1), order="C"))  # a writable contiguous copy
        resized = tvF.resize(chw, [height, width], interpolation=tvF.InterpolationMode.BICUBIC, antialias=True)
        return resized.permute(1, 2, 0).numpy()

    return resize, levels


def _resample(clip: _Clip, indices: list[int], resizer: Resizer, min_pixels: int, max_pixels: int) -> np.ndarray:
    """(F, h, w, 3) uint8 resized frames for ``indices``, decoding and resizing one frame at a time."""
    slots = defaultdict(list)
    for k, index in enumerate(indices):
        slots[index].append(k)
    frames = clip.read(sorted(slots))
    first = next(frames)  # its size sets the resize for all: the video processors resize a stack of frames
    shape = first[1].shape
    height, width = _video_size(clip, shape, len(indices), min_pixels, max_pixels)
    out = np.empty((len(indices), height, width, 3), np.uint8)
    for index, frame in itertools.chain([first], frames):
        if frame.shape != shape:
            raise ValueError(f"{clip.name}: frame {index} is {frame.shape[1]}×{frame.shape[0]}, the first sampled "
                             f"frame {shape[1]}×{shape[0]}; the frames of one video must share a size")
        out[slots[index]] = resizer(frame, height, width)
    return out


def _video_size(clip: _Clip, shape: tuple[int, ...], frames: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    try:
        return smart_resize(shape[0], shape[1], frames, factor=FACTOR, min_pixels=min_pixels,
                            max_pixels=max_pixels, temporal_factor=TEMPORAL)
    except ValueError as err:
        raise ValueError(f"{clip.name}: {err}") from err


def _check_video_args(rule: str, fps: float | None, resize: str, min_pixels: int, max_pixels: int) -> None:
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "glm46v" and fps is not None:
        raise ValueError("rule 'glm46v' chooses its fps from the duration; leave fps as None")
    if resize not in RESIZES:
        raise ValueError(f"resize must be one of {RESIZES}, got {resize!r}")
    _check_pixel_bounds(min_pixels, max_pixels)


def video_frames(
    video: Any,
    fps: float | None = None,
    rule: str = "glm41v",
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    video_fps: float | None = None,
    *,
    duration: float | None = None,
    resize: str = "pil",
    max_decoded_pixels: int = MAX_DECODED_PIXELS,
    max_frame_pixels: int = MAX_FRAME_PIXELS,
    info: VideoInfo | None = None,
) -> VisionFrames:
    """:func:`process_video` stopped after the resize: the video item's (F, H, W, 3) uint8 frames, with its grid,
    timestamps, frame indices and the normalisation's table."""
    _check_video_args(rule, fps, resize, min_pixels, max_pixels)
    resizer, levels = (_pil_frame, None) if resize == "pil" else _torchvision_resizer()
    clip = _open_clip(video, video_fps, duration, max_decoded_pixels, max_frame_pixels, info)
    indices = _sample(clip, rule, fps)
    _check_frame_count(clip, len(indices), max_pixels)
    frames = _resample(clip, indices, resizer, min_pixels, max_pixels)
    _, height, width, _ = frames.shape
    return VisionFrames(
        frames=[torch.from_numpy(frames)],
        grid_thw=torch.tensor([[len(indices) // TEMPORAL, height // PATCH, width // PATCH]]),
        kinds=["video"],
        timestamps=[[indices[k] / clip.fps for k in range(0, len(indices), TEMPORAL)]],
        sources=[clip.source],
        frame_indices=[indices],
        levels=levels,
    )


def process_video(
    video: Any,
    fps: float | None = None,
    rule: str = "glm41v",
    min_pixels: int = IMAGE_MIN_PIXELS,
    max_pixels: int = VIDEO_MAX_PIXELS,
    video_fps: float | None = None,
    *,
    duration: float | None = None,
    resize: str = "pil",
    max_decoded_pixels: int = MAX_DECODED_PIXELS,
    max_frame_pixels: int = MAX_FRAME_PIXELS,
    info: VideoInfo | None = None,
) -> VisionInputs:
    """One video → one video item: a file (GIF/WebP through PIL; mp4, webm, mov, ... through PyAV, an optional
    dependency) or (F, H, W, 3) uint8 frames with ``video_fps``.

    ``rule`` picks the frame sampling: "glm41v" (``fps`` frames a second, default 2) or "glm46v" (its own fps).
    Metadata: a file's own (see :mod:`glmvit.video`), unless ``video_fps`` (frames per second of the input) or
    ``duration`` (seconds) are given; for transformers' ``VideoMetadata`` ``m``, pass ``video_fps=m.fps,
    duration=m.duration``. With the duration transformers had, frame indices, timestamps and grids equal its
    ``Glm4vVideoProcessor`` / ``Glm46VVideoProcessor``; without one, duration = frames / video_fps, which is what
    transformers' decoders report (transformers, given metadata without a duration, uses round((frames − 1) / fps)
    + 1 instead).

    ``resize``: "pil" (default: the image processor's steps, no torchvision needed) or "torchvision" (the video
    processors' steps: torchvision's antialiased bicubic on uint8 frames and their fused normalisation, which gives
    their pixels exactly). How far apart the two are depends on torchvision's kernel: measured with torch 2.13 and
    torchvision 0.28 on CPU (uint8 resized natively), at most 1 uint8 level (0.03 in normalised units, mean 1e-4)
    on the sample clip, photos and noise frames; torchvision's float kernel (float tensors, e.g. on a GPU) differs
    from PIL by up to 19 levels (about 0.3) on noise frames.

    Only frames up to the last sampled one are decoded, one at a time; decoding more than ``max_decoded_pixels``
    (frames × width × height), or a frame of more than ``max_frame_pixels``, is refused with
    :class:`glmvit.video.DecodeLimitError`, from the file's header before decoding where it tells.

    ``info``: the file's :func:`glmvit.video.probe`, when the caller has it (the file is then not probed again;
    it must be this file's, read for this call); None: the file is probed here.
    """
    return video_frames(video, fps, rule, min_pixels, max_pixels, video_fps, duration=duration, resize=resize,
                        max_decoded_pixels=max_decoded_pixels, max_frame_pixels=max_frame_pixels,
                        info=info).inputs()


SAMPLE_DATA = Path(__file__).resolve().parents[1] / "data"  # the repository's sample photographs and clip
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def sample_inputs(data: Path = SAMPLE_DATA, max_pixels: int | None = None) -> VisionInputs:
    """The sample photographs and the sample clip (data/, see data/README.md), as one batch: images, then the clip."""
    images = sorted(p for p in (data / "images").glob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images or not (data / "clip.gif").exists():
        raise FileNotFoundError(f"{data}: expected images/*.jpg and clip.gif (run from a checkout, or pass --data)")
    if max_pixels is None:
        return VisionInputs.concat([process_images(images), process_video(data / "clip.gif")])
    return VisionInputs.concat([process_images(images, max_pixels=max_pixels),
                                process_video(data / "clip.gif", max_pixels=max_pixels)])
