"""Media requests for ``glmvit serve``: what a client sends (multipart files, or JSON content parts as vLLM's chat API
carries them), checked, decoded and preprocessed as ``glmvit encode`` does, within per-request bounds.

A JSON body is :class:`EncodeRequest`: ``{"content": [part, ...]}`` or a chat ``{"messages": [{"role": ...,
"content": [part, ...] or "text"}, ...]}``. A part is ``{"type": "image_url", "image_url": {"url": URL}}``,
``{"type": "video_url", "video_url": {"url": URL}}`` or ``{"type": "text", "text": ...}`` (ignored); each media part
is one item, in order. A URL is ``data:<type>;base64,<data>`` (image/jpeg, image/png, image/webp, image/gif,
video/mp4, video/webm, video/quicktime) or, only when the server names an allowed directory, ``file://`` a file
under it (symlinks resolved first; read once, into a copy the item's check, decoding and digest share);
http(s) URLs are refused (the server fetches nothing). An image_url must hold
an image and a video_url a video (an animated GIF or WebP is a video). Errors name the part, e.g.
``content[2].image_url.url: not a data URL``.

Bounds (:class:`MediaLimits`), each a 413 naming the item: a picture or frame of more than ``max_frame_pixels``,
refused from its header before it is decoded; the pixels a request decodes (each image's, each video's frames up
to its last sampled one) past ``max_request_pixels``, refused before the item that would pass it is decoded.
The time a request's decoding may take is the decode pool's (:mod:`glmvit.cli.decode_pool`).

:func:`prepare_item` runs in a decode worker, one task an item (a JSON body is parsed into its items in its first
item's task, :func:`prepare_first_item`), so that requests take turns in the decode pool item by item: it returns the
item's resized uint8 frames (a quarter of float32 rows' bytes), grid and record, the pixels it spent of the
request's budget, and where its time went (``decode``: each file's header and first frame checked and decoded;
``preprocess``: the rest of the decoding and the resizing), or raises :class:`MediaError`. The server runs a
request's items one after another, the budget left passed on, and makes the pixel rows on the model's device
(:meth:`RequestMedia.rows`). :func:`prepare_media` does a whole request in one process.

Rows made in the worker (``serve --rows host``: the tasks' ``rows``, the model dtype's name): after the resize the
worker makes the item's pixel rows itself (:func:`~glmvit.processing.rows_from_frames` in that dtype, a temporal
patch at a time, each written to the shared file as it is made) and hands over the rows instead of the frames
(:attr:`PreparedMedia.made`), their making counted in ``preprocess``; the engine then only maps them and copies
them to its device. Bitwise the rows the engine would make (rows_from_frames is bitwise the same on every device).
Only into a shared folder: rows are twice the bytes of the frames (bf16, a video; an image's four times), too many
for the pipe; without a folder, or where the write fails, the frames go as before.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import shutil
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Union
from urllib.parse import unquote, urlsplit

import numpy as np
import torch
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .. import decode_clock, video
from ..geometry import MAX_FRAME_PIXELS
from ..processing import TEMPORAL, VisionFrames, rows_from_frames
from .embedding_file import inputs_record
from .encode import check_file, load_frames
from .pixel_rows import PixelRows

DATA_TYPES = {"image/jpeg": ".jpg", "image/jpg": ".jpg", "image/png": ".png", "image/webp": ".webp",
              "image/gif": ".gif", "video/mp4": ".mp4", "video/webm": ".webm", "video/quicktime": ".mov"}
DEFAULT_FRAME_PIXELS = 4096 * 4096  # a 16-megapixel photo; the processor resizes every picture far below this
DEFAULT_REQUEST_PIXELS = 1 << 28  # e.g. eight seconds of 1080p at 30 fps decoded, or sixteen 4096² pictures


class MediaError(ValueError):
    """A media item the server refuses: ``status`` (400 bad, 413 too large) and one line naming the item."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # its status survives the decode worker's pipe
        return MediaError, (str(self), self.status)


@dataclass(frozen=True)
class MediaLimits:
    max_frame_pixels: int = DEFAULT_FRAME_PIXELS
    max_request_pixels: int = DEFAULT_REQUEST_PIXELS
    allowed_media_dir: str | None = None  # file:// URLs only under this directory; None: none


# ---- the JSON body ------------------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class MediaUrl(_Strict):
    url: str


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: MediaUrl


class VideoPart(_Strict):
    type: Literal["video_url"]
    video_url: MediaUrl


class TextPart(_Strict):
    type: Literal["text"]
    text: str = ""


Part = Annotated[Union[ImagePart, VideoPart, TextPart], Field(discriminator="type")]


class Message(_Strict):
    role: str
    content: Union[str, list[Part]]


class EncodeRequest(_Strict):
    """One request: ``content`` parts, or chat ``messages`` whose parts are taken in order (exactly one of them)."""

    content: list[Part] | None = None
    messages: list[Message] | None = None

    def media(self) -> list[tuple[str, str, str]]:
        """(where, kind, url) of every media part in order; where names it as an error should."""
        if (self.content is None) == (self.messages is None):
            raise MediaError("the body must hold exactly one of content (a list of parts) and messages (a chat)")
        parts: list[tuple[str, Any]] = []
        if self.content is not None:
            parts = [(f"content[{k}]", p) for k, p in enumerate(self.content)]
        else:
            for m, message in enumerate(self.messages or []):
                if not isinstance(message.content, str):
                    parts += [(f"messages[{m}].content[{k}]", p) for k, p in enumerate(message.content)]
        return [(f"{where}.image_url", "image", p.image_url.url) if isinstance(p, ImagePart) else
                (f"{where}.video_url", "video", p.video_url.url) for where, p in parts if not isinstance(p, TextPart)]


def _where(loc: tuple[int | str, ...]) -> str:
    """pydantic's location of an error as a path (``content[2].image_url.url``), without the union's tag."""
    out = ""
    previous: int | str | None = None
    for key in loc:
        if isinstance(key, int):
            out += f"[{key}]"
        elif isinstance(previous, int) and key in ("image_url", "video_url", "text", "str", "list[...]"):
            pass  # the discriminator's tag (or the union's branch), which pydantic puts after the index
        else:
            out += f".{key}" if out else key
        previous = key
    return out or "the body"


def parse_request(body: bytes) -> list[tuple[str, str, str]]:
    """The media parts of a JSON body (:meth:`EncodeRequest.media`); a bad body is a MediaError naming the part."""
    try:
        request = EncodeRequest.model_validate_json(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise MediaError(f"the body is not JSON ({first['msg']})") from None
        raise MediaError(f"{_where(first['loc'])}: {first['msg'].lower()}") from None
    items = request.media()
    if not items:
        raise MediaError("the request holds no image_url or video_url parts")
    return items


# ---- one item -----------------------------------------------------------------------------------------------------
@dataclass
class _Budget:
    left: int
    decode_s: float = 0.0
    preprocess_s: float = 0.0


def data_url(where: str, url: str) -> tuple[str, bytes]:
    """(suffix, bytes) of a base64 ``data:`` URL of a type :data:`DATA_TYPES` names."""
    head, comma, payload = url.partition(",")
    if not head.lower().startswith("data:") or not comma:
        raise MediaError(f"{where}: not a data URL")
    kind, *params = head[5:].split(";")
    if "base64" not in (p.strip().lower() for p in params):
        raise MediaError(f"{where}: a data URL must be base64 (data:<type>;base64,...)")
    suffix = DATA_TYPES.get(kind.strip().lower())
    if suffix is None:
        raise MediaError(f"{where}: media type {kind.strip()[:40]!r} is not one of {', '.join(DATA_TYPES)}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: the data URL's payload is not valid base64") from None
    if not data:
        raise MediaError(f"{where}: the data URL holds no data")
    return suffix, data


def _scheme(url: str) -> str:
    """A URL's scheme, lower-cased ("" without one), read from its first bytes: a data URL is megabytes long, and
    lower-casing or splitting it whole would copy it."""
    head, colon, _ = url[:16].partition(":")
    return head.lower() if colon else ""


def file_url(where: str, url: str, allowed: str | None) -> Path:
    """The file a ``file://`` URL names, if it resolves under ``allowed``."""
    if allowed is None:
        raise MediaError(f"{where}: file:// URLs are off (the server takes them only under --allowed-media-dir)")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{where}: a file:// URL names a file on this machine (file:///path)")
    name = unquote(parts.path)
    if "\0" in name:
        raise MediaError(f"{where}: the path holds a NUL byte")
    root = Path(allowed).resolve()
    path = Path(name).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"{where}: the file is not under the allowed media directory", 403)
    return path


def snapshot(label: str, origin: Path, copy: Path) -> bytes:
    """``origin``'s bytes, copied to ``copy`` through one open file and returned: the item's check, decoding and
    sha256 all read this one copy, so a file rewritten while its request is in flight gives the answer of the
    bytes read, never frames of one version with the metadata or digest of another. A file whose size or
    change time moved while it was copied is refused (retry), as is anything but a regular file."""
    try:
        fd = os.open(origin, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MediaError(f"{label}: no such file") from None
    except OSError as err:
        raise MediaError(f"{label}: cannot read it ({err.strerror or type(err).__name__})") from None
    before = os.fstat(fd)
    if not stat.S_ISREG(before.st_mode):  # before fdopen, which refuses a directory with an OSError of its own
        os.close(fd)
        raise MediaError(f"{label}: not a regular file")
    with os.fdopen(fd, "rb") as source:
        with copy.open("wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
            copied = target.tell()
        after = os.fstat(fd)
    if copied != after.st_size or any(getattr(before, k) != getattr(after, k)
                                      for k in ("st_size", "st_mtime_ns", "st_ctime_ns")):
        raise MediaError(f"{label}: the file changed while it was read; retry")
    return copy.read_bytes()


def _header_pixels(path: Path, info: video.VideoInfo | None) -> int:
    """What decoding ``path`` will cost at most, from its header alone: an image's pixels, or a video's every
    frame's from its ``info`` (frames × width × height; its sampled frames end sooner)."""
    if info is not None:
        return info.frames * info.width * info.height
    with Image.open(path) as im:
        return im.size[0] * im.size[1]


def _load_item(label: str, path: Path, want: str | None, limits: MediaLimits, budget: _Budget) -> VisionFrames:
    """The item at ``path`` checked, decoded and resized into its frames; its time into ``budget``: ``decode_s`` the
    header's check and the media's decoding (:mod:`glmvit.decode_clock`), ``preprocess_s`` the rest (the resize)."""
    start, decoding = time.perf_counter(), decode_clock.seconds()
    try:
        checked = check_file(path, limits.max_frame_pixels)  # a video's one probe, carried to its decoding
        kind, info = checked.kind, checked.info
        if want is not None and kind != want:
            raise MediaError(f"{label}: the {want}_url holds {'an image' if kind == 'image' else 'a video'}: "
                             f"send it as {kind}_url")
        cost = _header_pixels(path, info)
        if kind == "image" and cost > budget.left:
            raise MediaError(f"{label}: decoding it would pass the request's max_request_pixels="
                             f"{limits.max_request_pixels:,} ({cost:,} pixels, {budget.left:,} left)", 413)
        mid = time.perf_counter()
        inputs = load_frames(path, kind, limits.max_frame_pixels,
                             budget.left if kind == "video" else video.MAX_DECODED_PIXELS, info=info)
        if info is not None:  # a video: its frames up to the last sampled one were decoded
            indices = inputs.frame_indices[0] if inputs.frame_indices else None
            cost = (max(indices) + 1) * info.width * info.height if indices else cost
    except video.DecodeLimitError as err:
        raise MediaError(_named(err, path, label), 413) from None
    except MediaError:
        raise
    except (ValueError, OSError) as err:
        message = _named(err, path, label)
        too_large = "more than max_frame_pixels" in message or "too many pixels" in message  # PIL's own bound
        raise MediaError(message, 413 if too_large else 400) from None
    decoded = decode_clock.seconds() - decoding  # inside load_frames (the check_file probe is before mid)
    budget.decode_s += mid - start + decoded
    budget.preprocess_s += max(0.0, time.perf_counter() - mid - decoded)
    budget.left -= cost
    return inputs


def _named(err: BaseException, path: Path, label: str) -> str:
    """An error's message on one line, the file's (temporary) path replaced by the item's label."""
    text = " ".join(str(err).split()).replace(f"video {path}", label).replace(str(path), label)
    return text if text.startswith(label) else f"{label}: {text}"


# ---- the worker's task --------------------------------------------------------------------------------------------
@dataclass
class PreparedMedia:
    """A request's items resized: ``frames`` every item's (F, H, W, 3) uint8 frames (``shapes``; an image's F = 1),
    one after another, flat, as :class:`~glmvit.cli.pixel_rows.PixelRows` — or, where ``made`` names a dtype, the
    items' (rows, 1176) pixel rows in that dtype, made by the worker (:func:`_host_rows`); their grids, records and
    the worker's time (seconds)."""

    frames: PixelRows
    shapes: list[tuple[int, int, int, int]]
    kinds: list[str]
    grid_thw: np.ndarray
    records: list[dict[str, Any]]
    timing: dict[str, float] = field(default_factory=dict)
    pixels: int = 0  # what their decoding spent of the request's max_request_pixels
    made: str | None = None  # the dtype (torch's name) of the rows ``frames`` holds; None: it holds the frames

    def rows(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """The items' pixel rows in ``dtype`` on ``device``, bitwise ``glmvit encode``'s rows cast to ``dtype``
        (:func:`~glmvit.processing.rows_from_frames`): the frames cross to the device once, as uint8, and become
        rows there; rows made in the worker are mapped and copied to the device as they are (no kernel runs). Rows
        made in another dtype than ``dtype`` are a ValueError, never cast."""
        if self.made is not None:
            return self._made_rows(dtype).to(device)
        flat = self.frames.tensor().to(device)
        sizes = [int(np.prod(shape)) for shape in self.shapes]
        rows = [rows_from_frames(f.reshape(shape), kind, dtype)
                for f, shape, kind in zip(torch.split(flat, sizes), self.shapes, self.kinds, strict=True)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _made_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """The rows the worker made, mapped (their file unlinked), if they are in ``dtype`` and the grids' count."""
        want = str(dtype).removeprefix("torch.")
        if self.made != want:
            self.frames.discard()
            raise ValueError(f"the decode worker made the pixel rows in {self.made}, the model takes {want}: "
                             "the server's rows dtype and its model's differ")
        count = int(self.grid_thw.prod(axis=1).sum())
        if self.frames.dtype != want or len(self.frames.shape) != 2 or self.frames.shape[0] != count:
            self.frames.discard()
            raise ValueError(f"rows made in the worker hold {self.frames.shape} {self.frames.dtype}, not the "
                             f"{count} rows in {want} their grids say")
        return self.frames.tensor()


Item = tuple[str, str, Union[str, None], Any]  # (label, name for the record, the kind its part asks for, its source)


def media_items(kind: str, payload: Any, max_items: int | None = None) -> list[Item]:
    """A request's items in order (``kind`` "json": a JSON body's bytes, each item's source its URL; "files": a
    multipart request's [(name, bytes)], each item's source its bytes); a request of no items, or of more than
    ``max_items`` (413, before any is decoded), is a MediaError. A JSON body is parsed in a decode worker, in its
    first item's task (:func:`prepare_first_item`): the server never parses one."""
    if kind == "json":
        items: list[Item] = [(where, where, want, url) for where, want, url in parse_request(payload)]
    elif not payload:
        raise MediaError("the request holds no files (send each image or video as a multipart file part)")
    else:
        items = [(f"file {k} ({name})", name, None, data) for k, (name, data) in enumerate(payload)]
    if max_items is not None and len(items) > max_items:
        raise MediaError(f"{len(items)} items in one request: at most {max_items}", 413)
    return items


def _load(k: int, item: Item, scratch: str, limits: MediaLimits, budget: _Budget, merge_area: int
          ) -> tuple[VisionFrames, dict[str, Any]]:
    """The ``k``-th item of its request decoded and resized (its files under ``scratch``), and its record."""
    label, name, want, source = item
    scheme = _scheme(source) if isinstance(source, str) else None
    if scheme == "file":
        origin = file_url(f"{label}.url", source, limits.allowed_media_dir)
        name = str(origin)
        path = Path(scratch).resolve() / f"{k}{origin.suffix.lower()}"
        data = snapshot(label, origin, path)
    else:
        if isinstance(source, str):
            if scheme in ("http", "https"):
                raise MediaError(f"{label}.url: http(s) URLs are not fetched (the server has no network "
                                 "access): send the media as a data: URL")
            suffix, data = data_url(f"{label}.url", source)
        else:
            suffix, data = PurePosixPath(name).suffix.lower(), source
        path = Path(scratch).resolve() / f"{k}{suffix}"
        path.write_bytes(data)
    inputs = _load_item(label, path, want, limits, budget)
    tokens = int(inputs.grid_thw[0].prod()) // merge_area
    return inputs, inputs_record(name, hashlib.sha256(data).hexdigest(), inputs, tokens)


def _host_rows(frames: list[torch.Tensor], kinds: list[str], rows: str, folder: str) -> PixelRows | None:
    """The items' pixel rows in ``rows`` (a torch dtype's name), made here as the engine would make them on its
    device (:meth:`PreparedMedia.rows`), one item at a time and a video a temporal patch at a time (rows are
    temporal patch major: the patches' rows one after another are the video's), each written to a new file under
    ``folder`` as it is made (:meth:`PixelRows.streamed`): this process holds the frames and one patch's rows at
    most. None where the write failed: the caller hands over the frames."""
    dtype = getattr(torch, rows, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"rows must name a floating torch dtype, got {rows!r}")
    chunks = (rows_from_frames(f[start:start + step], kind, dtype)
              for f, kind in zip(frames, kinds, strict=True)
              for step in (1 if kind == "image" else TEMPORAL,) for start in range(0, f.shape[0], step))
    return PixelRows.streamed(chunks, folder)


def _prepared(loaded: list[VisionFrames], records: list[dict[str, Any]], folder: str | None, budget: _Budget,
              pixels: int, parse_s: float = 0.0, rows: str | None = None) -> PreparedMedia:
    """What a task hands back: the items' rows made here when ``rows`` names their dtype and ``folder`` is given
    (:func:`_host_rows`, their time counted in ``preprocess``), else their frames."""
    frames = [f for item in loaded for f in item.frames]
    kinds = [k for item in loaded for k in item.kinds]
    shapes = [(f.shape[0], f.shape[1], f.shape[2], f.shape[3]) for f in frames]
    start = time.perf_counter()
    made = _host_rows(frames, kinds, rows, folder) if rows is not None and folder is not None else None
    budget.preprocess_s += time.perf_counter() - start
    handed = made if made is not None else PixelRows.of(
        frames[0].reshape(-1) if len(frames) == 1 else torch.cat([f.reshape(-1) for f in frames]), folder)
    return PreparedMedia(handed, shapes, kinds, torch.cat([item.grid_thw for item in loaded]).numpy(), records,
                         {"decode": parse_s + budget.decode_s, "preprocess": budget.preprocess_s}, pixels,
                         rows if made is not None else None)


def prepare_item(k: int, item: Item, limits: MediaLimits, left: int, merge_area: int, folder: str | None = None,
                 rows: str | None = None) -> PreparedMedia:
    """The ``k``-th item of a request (:func:`media_items`) decoded and resized, ``left`` pixels of the request's
    ``max_request_pixels`` still to spend (its ``pixels`` say what it spent); a refused item raises MediaError.
    ``rows`` (a torch dtype's name): its pixel rows made here in that dtype where ``folder`` is given (the module
    docstring). A decode worker's task: the server runs a request's items one after another
    (:mod:`glmvit.cli.serve_app`)."""
    budget = _Budget(left)
    with tempfile.TemporaryDirectory(prefix="glmvit-serve-") as scratch, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.TiffImagePlugin")  # as below
        inputs, record = _load(k, item, scratch, limits, budget, merge_area)
    return _prepared([inputs], [record], folder, budget, left - budget.left, rows=rows)


def prepare_first_item(body: bytes, limits: MediaLimits, max_items: int | None, merge_area: int,
                       folder: str | None = None, rows: str | None = None) -> tuple[PreparedMedia, list[Item]]:
    """A JSON request's first task in a decode worker: its ``body`` parsed into its items (:func:`media_items`;
    a bad body, or one of more than ``max_items`` items, refused before any is decoded), the first of them decoded
    and resized as :func:`prepare_item` does (the parse's time counted in its ``decode``), and the items after it,
    each a task of its own. So the parse never runs on the server's event loop, and a one-item request takes one
    turn in the decode pool, not two."""
    start = time.perf_counter()
    items = media_items("json", body, max_items)
    del body
    parse_s = time.perf_counter() - start
    first = prepare_item(0, items[0], limits, limits.max_request_pixels, merge_area, folder, rows)
    first.timing["decode"] = first.timing.get("decode", 0.0) + parse_s
    return first, items[1:]


def prepare_media(kind: str, payload: Any, limits: MediaLimits, merge_area: int, max_items: int | None = None,
                  folder: str | None = None, rows: str | None = None) -> PreparedMedia:
    """Every item of a request decoded and resized in this process (``kind`` and ``payload`` as
    :func:`media_items` takes them); a refused item raises MediaError (the module docstring), and so does a request
    of more than ``max_items`` items (413, before any is decoded). The uint8 frames go to a file under ``folder``
    if given — or, where ``rows`` names a dtype, the pixel rows made here in it (:func:`prepare_item`)."""
    start = time.perf_counter()
    budget = _Budget(limits.max_request_pixels)
    loaded, records = [], []
    with tempfile.TemporaryDirectory(prefix="glmvit-serve-") as scratch, warnings.catch_warnings():
        # as the CLI does: a client's corrupt EXIF is no reason for lines of PIL's warnings in the server's log
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.TiffImagePlugin")
        items = media_items(kind, payload, max_items)
        parse_s = time.perf_counter() - start
        for k, item in enumerate(items):
            inputs, record = _load(k, item, scratch, limits, budget, merge_area)
            records.append(record)
            loaded.append(inputs)
    return _prepared(loaded, records, folder, budget, limits.max_request_pixels - budget.left, parse_s, rows)


@dataclass
class RequestMedia:
    """A request's items as decode workers handed them over, one :class:`PreparedMedia` an item, in order."""

    items: list[PreparedMedia]

    @property
    def grid_thw(self) -> np.ndarray:
        return np.concatenate([m.grid_thw for m in self.items])

    @property
    def records(self) -> list[dict[str, Any]]:
        return [r for m in self.items for r in m.records]

    @property
    def timing(self) -> dict[str, float]:
        return {key: sum(m.timing.get(key, 0.0) for m in self.items) for key in ("decode", "preprocess")}

    def rows(self, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """Every item's rows (:meth:`PreparedMedia.rows`), one after another."""
        rows = [m.rows(device, dtype) for m in self.items]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def discard(self) -> None:
        """Remove the shared files of frames (or rows) nobody will take (their request failed or was cancelled)."""
        for m in self.items:
            m.frames.discard()


def warm_worker() -> None:
    """A decode worker's first-use costs, paid before it takes a request (:mod:`glmvit.cli.decode_pool` runs this
    as the worker starts): a tiny picture and a tiny clip, made here, decoded and resized as a request's media are.
    A fresh worker's first 8-frame 224² clip otherwise takes several times its later ones (the codec's and the
    resizer's first calls), and under load every worker's first request pays it."""
    import json

    from ..config import VisionConfig
    from .media_files import data_url, encode_clip, encode_image, mp4_available

    pixels = np.random.default_rng(0).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    fmt = "mp4" if mp4_available() else "gif"
    parts = [{"type": "image_url", "image_url": {"url": data_url(encode_image(pixels[0]), "jpeg")}},
             {"type": "video_url", "video_url": {"url": data_url(encode_clip(pixels, fmt), fmt)}}]
    limits = MediaLimits(max_request_pixels=2**40)
    for part in parts:
        prepare_first_item(json.dumps({"content": [part]}).encode(), limits, None, VisionConfig().merge_area)


__all__ = ["MAX_FRAME_PIXELS", "EncodeRequest", "MediaError", "MediaLimits", "PreparedMedia", "RequestMedia",
           "media_items", "parse_request", "prepare_first_item", "prepare_item", "prepare_media"]
