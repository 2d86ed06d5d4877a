"""Video files → the sampled frames only, in bounded memory: what a file says about itself, then its frames.

Two readers:

- **PIL** for animated GIF and WebP. Frame rate = frames / total of the per-frame durations, read from the file's
  blocks without decoding a frame (GIF graphic control extensions, WebP ``ANMF`` chunks: what PIL reports as each
  frame's ``info["duration"]``). Decoding seeks frame by frame up to each sampled index (a GIF or WebP frame is
  drawn over the previous one, so every frame before the last sampled one is decoded, one canvas at a time).
- **PyAV** (optional: ``pip install av``) for everything else PyAV opens (mp4, webm, mov, mkv, ...). Metadata by the
  rules of transformers' ``read_video_pyav``: frames = the stream's frame count, fps = its ``average_rate``,
  duration = frames / fps. Containers that store no frame count (WebM, Matroska: PyAV reports 0, and
  transformers' samplers then fail) get the count of the stream's packets, read without decoding. Frames are
  decoded in order, converted with ``to_ndarray(format="rgb24")`` as transformers does, and decoding stops after
  the last sampled index.

Two bounds, both checked from the file's header before any decoding and again on every decoded frame, so a tiny
file that claims or grows huge frames fails with a clear error instead of running for minutes or exhausting
memory: each frame at most ``max_frame_pixels`` (:data:`glmvit.geometry.MAX_FRAME_PIXELS`), and every frame
decoded, sampled or not, costs its width × height against ``max_decoded_pixels`` (last sampled index + 1 frames of
the stated size, before decoding). FFmpeg is also given the per-frame bound (its ``max_pixels`` option, with room
for its row alignment), so it refuses to allocate a frame whose bitstream is larger than its header says; PIL's own
decompression-bomb check stays in force. Only one decoded frame is held at a time (FFmpeg's frame threads hold one
each).
"""
from __future__ import annotations

import io
import mmap
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from PIL import Image, UnidentifiedImageError

from . import decode_clock
from .geometry import MAX_FRAME_PIXELS, check_frame_pixels

__all__ = ["MAX_DECODED_PIXELS", "DecodeLimitError", "VideoInfo", "probe", "decode"]

# GLM-4.6V samples at most 2400 s of a video; decoding that much 1080p at 30 fps is the default allowance.
MAX_DECODED_PIXELS = 2400 * 30 * 1920 * 1080
ANIMATIONS = ("GIF", "WEBP")  # PIL formats read as videos
# What PIL raises on corrupt or truncated data (struct.error: short headers; IndexError: short palettes).
PIL_ERRORS = (OSError, EOFError, SyntaxError, ValueError, struct.error, IndexError, Image.DecompressionBombError)
PYAV_HINT = "reading it needs PyAV, which is not installed: pip install av"


class DecodeLimitError(ValueError):
    """Decoding a video would cost more than ``max_decoded_pixels``."""


@dataclass(frozen=True)
class VideoInfo:
    """What a video file says about itself before any frame is decoded.

    ``fps`` and ``duration`` are None when the file states no timing (a GIF or WebP without frame durations, a
    stream without a frame rate): the caller must then give ``video_fps``.
    """

    frames: int
    fps: float | None
    duration: float | None
    width: int
    height: int
    reader: str  # "pil" or "pyav"


def probe(path: Path, max_frame_pixels: int = MAX_FRAME_PIXELS) -> VideoInfo:
    """Frame count, rate, duration and frame size of a video file, without decoding a frame; a stated frame size
    above ``max_frame_pixels`` is a :class:`DecodeLimitError`.

    The file is read on every call: a caller that needs the answer again passes it along rather than probing
    twice (a file can change between two calls)."""
    info = _probe(path, max_frame_pixels)
    check_frame_pixels(info.width, info.height, f"video {path}", max_frame_pixels, DecodeLimitError)
    return info


def _probe(path: Path, max_frame_pixels: int) -> VideoInfo:
    fmt = _pil_format(path)
    if fmt is None:
        return _probe_pyav(path, max_frame_pixels)
    if fmt not in ANIMATIONS:
        raise ValueError(f"video {path}: PIL reads it as a still {fmt} image, not a video "
                         f"(animations: GIF, WebP; other videos through PyAV)")
    return _probe_animation(path, fmt)


def decode(path: Path, info: VideoInfo, indices: list[int], max_decoded_pixels: int = MAX_DECODED_PIXELS,
           max_frame_pixels: int = MAX_FRAME_PIXELS) -> Iterator[tuple[int, Image.Image | np.ndarray]]:
    """(index, frame) for each distinct index in ``indices``, in increasing order, one frame alive at a time.

    PIL frames come as the loaded ``Image`` (valid until the next item); PyAV frames as (H, W, 3) uint8 RGB. The time
    spent producing them counts as this thread's decoding (:mod:`glmvit.decode_clock`).
    Raises :class:`DecodeLimitError` before decoding when a frame of the stated size exceeds ``max_frame_pixels``
    or the frames up to the last index exceed ``max_decoded_pixels``, and while decoding when a frame does.
    """
    check_frame_pixels(info.width, info.height, f"video {path}", max_frame_pixels, DecodeLimitError)
    wanted = sorted(set(indices))
    if not wanted or wanted[0] < 0 or wanted[-1] >= info.frames:
        raise ValueError(f"video {path}: frame indices must lie in [0, {info.frames}), got {indices[:3]}...")
    needed = (wanted[-1] + 1) * info.width * info.height
    if needed > max_decoded_pixels:
        raise DecodeLimitError(
            f"video {path}: decoding frames 0..{wanted[-1]} of {info.width}×{info.height} is {needed:,} pixels, "
            f"more than max_decoded_pixels={max_decoded_pixels:,} (raise it for a file you trust)")
    budget = _PixelBudget(path, max_decoded_pixels, max_frame_pixels)
    reader = _decode_animation if info.reader == "pil" else _decode_pyav
    return decode_clock.counted(reader(path, wanted, budget))  # the time producing each frame: decoding


class _PixelBudget:
    """Running total of decoded pixels; raises once it passes the limit, or a frame passes the per-frame one."""

    def __init__(self, path: Path, limit: int, frame_limit: int) -> None:
        self.path, self.limit, self.frame_limit, self.used = path, limit, frame_limit, 0

    def spend(self, width: int, height: int) -> None:
        check_frame_pixels(width, height, f"video {self.path}: a decoded frame", self.frame_limit, DecodeLimitError)
        self.used += width * height
        if self.used > self.limit:
            raise DecodeLimitError(f"video {self.path}: the decoded frames pass max_decoded_pixels="
                                   f"{self.limit:,} (frames grow beyond the size the file states)")


@contextmanager
def _decode_errors(path: Path, errors: tuple[type[BaseException], ...], hint: str = "") -> Iterator[None]:
    """Decoder errors → one ValueError naming the file (our own DecodeLimitError passes through)."""
    try:
        yield
    except DecodeLimitError:
        raise
    except errors as err:
        raise ValueError(f"video {path}: cannot decode it: {err}{hint}") from err


# --- PIL animations ----------------------------------------------------------------------------------------------


def _pil_format(path: Path) -> str | None:
    """PIL's format name for the file, or None when PIL does not recognise it."""
    try:
        with Image.open(path) as im:
            return im.format or "unknown"
    except UnidentifiedImageError:
        return None
    except PIL_ERRORS as err:
        raise ValueError(f"video {path}: cannot read it: {err}") from err


def _probe_animation(path: Path, fmt: str) -> VideoInfo:
    """An animation's metadata from its blocks. A GIF's frames are counted by :func:`_gif_delays`, which refuses
    every block structure that PIL's own walk would read otherwise (so PIL's ``n_frames``, a second pass over the
    whole file in Python, would say the same); a WebP's count, from its header, is checked against its ``ANMF``
    chunks."""
    with _decode_errors(path, PIL_ERRORS):
        with Image.open(path) as im:
            width, height = im.size
            stated = None if fmt == "GIF" else getattr(im, "n_frames", 1)
        with path.open("rb") as fp:
            delays = _gif_delays(fp) if fmt == "GIF" else _webp_delays(fp)
    frames = len(delays)
    if stated is not None and stated != frames:
        raise ValueError(f"video {path}: PIL sees {stated} frame{'s' * (stated != 1)} but the file's blocks "
                         f"describe {frames}")
    seconds = sum(delays) / 1000
    fps = frames / seconds if seconds > 0 else None
    return VideoInfo(frames, fps, seconds if seconds > 0 else None, width, height, "pil")


def _gif_delays(fp: BinaryIO) -> list[int]:
    """Each GIF frame's delay in ms (0 without a graphic control extension), as PIL sets ``info["duration"]``.

    Stricter than PIL, which skips bytes it does not know: every block must start with an introducer (``!``, ``,``)
    and the file must reach its trailer (``;``), so a cut or corrupt file is refused, never read in part. Refused
    too, since PIL's walk (``GifImageFile._seek`` in Pillow 13) would lose its place in them and count other frames
    than these blocks describe: an extension of no data sub-block other than a comment (PIL reads the block after
    it as a length), a NETSCAPE2.0 extension before the first image without its loop sub-block (PIL reads one
    sub-block more there), and a graphic control block of fewer than its 4 bytes (PIL indexes byte 3). The file is
    mapped, not read, and walked by offset (a clip's data is thousands of 255-byte sub-blocks)."""
    with _mapped(fp) as data:
        return _walk_gif(data)


def _walk_gif(data: Any) -> list[int]:
    if len(data) < 13 or data[:3] != b"GIF":
        raise ValueError("not a GIF header")
    pos = 13 + _color_table_bytes(data[10])
    delays: list[int] = []
    delay = 0
    while True:
        if pos >= len(data):  # every GIF ends with its trailer: a cut one never reaches it
            frames = len(delays)
            raise ValueError(f"cut short: the file ends before the GIF trailer, {frames} frame{'s' * (frames != 1)} in")
        byte, pos = data[pos], pos + 1
        if byte == 0x3B:  # ";" the trailer
            return delays
        if byte == 0x21:  # "!" extension: label, then data sub-blocks
            at, label = pos - 1, data[pos] if pos < len(data) else None
            first, blocks, pos = _sub_blocks(data, pos + 1)
            if blocks == 0 and label != 0xFE:
                raise ValueError(f"corrupt: the extension at offset {at:,} holds no data")
            if label == 0xF9:
                if len(first) < 4:
                    raise ValueError(f"corrupt: the graphic control block at offset {at:,} has {len(first)} of "
                                     f"its 4 bytes")
                delay = int.from_bytes(first[1:3], "little") * 10
            elif label == 0xFF and not delays and first.startswith(b"NETSCAPE2.0") and blocks < 2:
                raise ValueError(f"corrupt: the NETSCAPE2.0 extension at offset {at:,} has no loop sub-block")
        elif byte == 0x2C:  # "," image descriptor, local colour table, LZW code size, image data
            descriptor = data[pos:pos + 9]
            pos += 9 + _color_table_bytes(descriptor[8] if len(descriptor) == 9 else 0) + 1
            _, _, pos = _sub_blocks(data, pos)
            delays.append(delay)
            delay = 0
        else:
            raise ValueError(f"corrupt: byte {byte:#04x} at offset {pos - 1:,} starts no GIF block")


@contextmanager
def _mapped(fp: BinaryIO) -> Iterator[Any]:
    """``fp``'s bytes from where it stands: a file at its start mapped read-only (a multi-gigabyte GIF is not read
    into memory), anything else read."""
    try:
        fd = fp.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        fd = None
    if fd is None or fp.tell() != 0 or os.fstat(fd).st_size == 0:
        yield fp.read()
        return
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as data:
        yield data


def _color_table_bytes(flags: int) -> int:
    return 3 << ((flags & 7) + 1) if flags & 0x80 else 0


def _sub_blocks(data: Any, pos: int) -> tuple[bytes, int, int]:
    """The chain of data sub-blocks at ``pos`` up to its terminator (or the end of the data): its first block's
    bytes, how many blocks it holds, and the offset after the terminator."""
    first, blocks = b"", 0
    while pos < len(data) and (size := data[pos]):
        if not blocks:
            first = data[pos + 1:pos + 1 + size]
        blocks += 1
        pos += 1 + size
    return first, blocks, pos + 1


def _webp_delays(fp: BinaryIO) -> list[int]:
    """Each WebP frame's duration in ms: the ``ANMF`` chunks' 24-bit field; a still WebP is one frame of 0 ms."""
    header = fp.read(12)
    if len(header) < 12 or header[:4] != b"RIFF" or header[8:] != b"WEBP":
        raise ValueError("not a WebP header")
    stated, size = 8 + int.from_bytes(header[4:8], "little"), fp.seek(0, 2)
    if size < stated:
        raise ValueError(f"cut short: {size:,} bytes where the RIFF header states {stated:,}")
    fp.seek(12)
    delays: list[int] = []
    while len(chunk := fp.read(8)) == 8:
        size = int.from_bytes(chunk[4:], "little")
        if chunk[:4] == b"ANMF":
            frame = fp.read(16)
            delays.append(int.from_bytes(frame[12:15], "little"))
            size -= len(frame)
        fp.seek(size + (size & 1), 1)
    return delays or [0]


def _decode_animation(path: Path, wanted: list[int], budget: _PixelBudget) -> Iterator[tuple[int, Image.Image]]:
    with _decode_errors(path, PIL_ERRORS), Image.open(path) as im:
        budget.spend(*im.size)
        for index in wanted:
            while im.tell() < index:
                im.seek(im.tell() + 1)
                budget.spend(*im.size)
            im.load()
            yield index, im


# --- PyAV --------------------------------------------------------------------------------------------------------

# FFmpeg's frame threads for a video's decoding: the same frames, sooner for one video on an idle machine. A pool of
# processes that each decode one video at a time (glmvit serve's decode workers) turns them off: its parallelism is
# its processes, and threads on top cost throughput once every CPU is busy (two processes decoding 8-frame 224² MP4s
# on two CPUs: 650-680 clips/s with them, 740-780 without)
frame_threads = True


def _import_av(path: Path) -> Any:
    try:
        import av
    except ImportError as err:
        raise ValueError(f"video {path}: not a GIF/WebP that PIL reads; {PYAV_HINT}") from err
    return av


def _open_pyav(av: Any, path: Path, frame_limit: int) -> Any:
    """``av.open(path)``, FFmpeg told the per-frame bound (its ``max_pixels``, twice ours: it counts rows padded to
    its alignment) for every stream known before probing (PyAV 18.1 on hands ``options`` to each of them: raw H.264
    and MPEG-TS included), so the frames it decodes while probing the streams are bounded too. A format whose
    streams appear only while probing (MPEG-PS) has none to hand it to: its probe is unbounded, its decode is not
    (:func:`_decode_pyav` sets the bound on the stream it decodes)."""
    return av.open(str(path), options={"max_pixels": str(2 * frame_limit)})


def _probe_pyav(path: Path, frame_limit: int) -> VideoInfo:
    av = _import_av(path)
    with _decode_errors(path, (av.FFmpegError, OSError)), _open_pyav(av, path, frame_limit) as container:
        if not container.streams.video:
            raise ValueError(f"video {path}: no video stream")
        stream = container.streams.video[0]
        frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        rate = Fraction(stream.average_rate) if stream.average_rate else None
        width, height = stream.codec_context.width, stream.codec_context.height
    if frames < 1:
        raise ValueError(f"video {path}: the video stream holds no frames")
    fps, duration = (float(rate), float(frames / rate)) if rate else (None, None)
    return VideoInfo(frames, fps, duration, width, height, "pyav")


def _decode_pyav(path: Path, wanted: list[int], budget: _PixelBudget) -> Iterator[tuple[int, np.ndarray]]:
    av = _import_av(path)
    targets = iter(wanted)
    target, decoded = next(targets), 0
    hint = (f" (a corrupt stream, or a frame larger than its header states: FFmpeg refuses frames above "
            f"max_frame_pixels={budget.frame_limit:,})")
    # one converter for every frame: frame.to_ndarray(format=...) builds a new swscale context per frame, which cost
    # more than decoding (8 frames of 224² on one CPU: 7-30 ms a clip that way, 3-4 ms with one; the same bytes)
    rgb = av.video.reformatter.VideoReformatter()
    with _decode_errors(path, (av.FFmpegError, OSError), hint), _open_pyav(av, path, budget.frame_limit) as container:
        stream = container.streams.video[0]
        if frame_threads:
            stream.thread_type = "AUTO"  # frame threads: same frames, faster for one video
        stream.codec_context.options = {"max_pixels": str(2 * budget.frame_limit)}  # as _open_pyav's
        for frame in container.decode(stream):
            budget.spend(frame.width, frame.height)
            if decoded == target:
                yield decoded, rgb.reformat(frame, format="rgb24").to_ndarray()
                if (target := next(targets, -1)) < 0:
                    return
            decoded += 1
    raise ValueError(f"video {path}: decoding ended after {decoded} frame{'s' * (decoded != 1)}, before sampled "
                     f"frame {target}")
