"""Encoded media made from frames, as a client sends it: JPEG pictures, MP4 clips (PyAV, the ``video`` extra) or
animated GIFs where PyAV is missing, and ``data:`` URLs of them (what ``bench-serve`` sends, and the tests).

A clip of F frames is written at :data:`CLIP_FPS` frames a second, so that GLM-4.1V's sampling (2 a second)
takes every frame: its grid is then the one random-mm draws for F frames of that size. A GIF's frames are first
rounded to a fixed 216-colour palette (six levels a channel), which GIF stores losslessly: PIL's own adaptive
palette costs about 20× more on noise frames (3 s against 0.14 s for sixteen 448² frames).
"""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

CLIP_FPS = 2  # frames a second of a written clip: the processor's sampling rate, so that each frame is sampled
MIME = {"jpeg": "image/jpeg", "png": "image/png", "gif": "image/gif", "mp4": "video/mp4"}


def mp4_available() -> bool:
    """Whether MP4 clips can be written here (PyAV with an MPEG-4 encoder)."""
    try:
        import av
    except ImportError:
        return False
    return "mpeg4" in av.codecs_available


def encode_image(frame: np.ndarray, fmt: str = "jpeg", quality: int = 90) -> bytes:
    """An (H, W, 3) uint8 picture as JPEG or PNG bytes."""
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format=fmt.upper(), **({"quality": quality} if fmt == "jpeg" else {}))
    return out.getvalue()


def encode_clip(frames: np.ndarray, fmt: str = "mp4", fps: int = CLIP_FPS) -> bytes:
    """(F, H, W, 3) uint8 frames as an MP4 (MPEG-4 part 2, yuv420p: H and W must be even) or an animated GIF (its
    frames rounded to :data:`GIF_PALETTE`, then stored exactly)."""
    if fmt == "gif":
        out = io.BytesIO()
        images = [_paletted(f) for f in frames]
        images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=1000 // fps, loop=0,
                       optimize=False)
        return out.getvalue()
    import av

    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = {"qscale": "3"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


_LEVELS = np.array([0, 51, 102, 153, 204, 255], np.uint8)  # the palette's six levels a channel, evenly spaced
GIF_PALETTE = np.stack(np.meshgrid(_LEVELS, _LEVELS, _LEVELS, indexing="ij"), -1).reshape(-1, 3)  # (216, 3)


def _paletted(frame: np.ndarray) -> Image.Image:
    """An (H, W, 3) uint8 frame as a "P" image of :data:`GIF_PALETTE` (each channel to level ⌊6·v/256⌋)."""
    level = (frame.astype(np.uint16) * 6 >> 8).astype(np.uint8)
    index = level[..., 0] * 36 + level[..., 1] * 6 + level[..., 2]
    image = Image.frombytes("P", (frame.shape[1], frame.shape[0]), np.ascontiguousarray(index).tobytes())
    image.putpalette(GIF_PALETTE.tobytes())
    return image


def data_url(data: bytes, fmt: str) -> str:
    """A base64 ``data:`` URL of ``data`` in format ``fmt`` (a key of MIME)."""
    return f"data:{MIME[fmt]};base64,{base64.b64encode(data).decode('ascii')}"
