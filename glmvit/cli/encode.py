"""``python -m glmvit encode FILES...``: embeddings of image and video files, saved with what made them.

Every file is checked before the model is loaded — it exists, is a non-empty readable regular file of a
supported type, states a frame size within ``glmvit.geometry.MAX_FRAME_PIXELS``, its first frame decodes (a video:
its container's metadata reads), and has a size GLM-4V's resize accepts — and a bad one stops the command with one
line naming it. Then the files are read and encoded one at a time, so memory holds one file's pixels whatever the
number of files (a video decodes only the frames it samples, within a pixel budget). ``--out`` and ``--json`` are
checked writable first and written atomically when everything is done.

Each item is encoded alone and eagerly: its embedding is the model's own output for it, with no packing or
padding. The graph runner pays off for a stream of requests (capturing costs seconds and GPU memory; on a CPU it
only emulates); here the time goes mostly to decoding and resizing.

``--out`` is a safetensors file of float32 tensors ``item_0``, ``item_1``, … [tokens, out_hidden], whose metadata
(strings; every value is JSON) says what they are::

    item_<i>        {"source", "sha256", "kind", "grid_thw", "tokens", "frame_indices", "timestamps"}
    vision_config   the tower's configuration        dtype, device, description   how the model ran
    weights         {"path", "files", "hashed_json", "sha256"} of the checkpoint, or {"random": true, "seed"}
    provenance      versions, git commit, command, date

``source`` is the file's absolute path and ``sha256`` its content's hash; ``timestamps``: for a video, the time in
seconds of the first frame of each temporal patch (null for an image).
``frame_indices`` are the sampled frames of a video (null for an image).
"""
from __future__ import annotations

import argparse
import hashlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from safetensors.torch import save
from tqdm.auto import tqdm

from .. import video
from ..geometry import MAX_FRAME_PIXELS, check_frame_pixels, smart_resize
from ..model import GlmVisionEncoder
from ..processing import IMAGE_SUFFIXES, VisionFrames, VisionInputs, image_frames, video_frames
from ..provenance import collect, weights_identity
from . import one_line
from .common import (
    Parser,
    add_model_args,
    atomic_output,
    check_writable,
    describe,
    model_from_args,
    output_path,
    plural,
    refuse_outputs_over_inputs,
    remove_folders,
    removed_on_failure,
    resolve_model_args,
    write_json,
)
from .embedding_file import file_metadata, inputs_record

ANIMATION_SUFFIXES = (".gif", ".webp")  # animated ones are videos; a still GIF or WebP is an image
VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".m4v", ".avi")  # through PyAV (pip install av)
SUFFIXES = tuple(sorted(set(IMAGE_SUFFIXES + ANIMATION_SUFFIXES + VIDEO_SUFFIXES)))


@dataclass(frozen=True)
class CheckedFile:
    """What :func:`check_file` found: the file's ``kind`` ("image" or "video") and, for a video, ``info``, what it
    says about itself (:func:`glmvit.video.probe`; None for an image). Passing ``info`` on to :func:`load` reads a
    video's metadata once: its check, its cost and its sampling use one answer."""

    kind: str
    info: video.VideoInfo | None = None


def check_file(path: Path, max_frame_pixels: int = MAX_FRAME_PIXELS) -> CheckedFile:
    """The kind of ``path`` (and a video's metadata) once it is known to load: otherwise one line naming it. A
    picture or frame of more than ``max_frame_pixels`` is refused from the header, before a pixel is decoded.

    PIL's decompression-bomb warning is silenced here: it fires above 89 M pixels, and MAX_FRAME_PIXELS (64 M)
    refuses every such picture with one line of its own.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return _check_file(path, max_frame_pixels)


def _check_file(path: Path, max_frame_pixels: int) -> CheckedFile:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {suffix or '(no suffix)'!r} (images: "
                         f"{', '.join(IMAGE_SUFFIXES)}; videos: {', '.join(VIDEO_SUFFIXES)}, animated "
                         f"{', '.join(ANIMATION_SUFFIXES)})")
    if path.stat().st_size == 0:
        raise ValueError(f"{path}: empty file")
    if suffix in VIDEO_SUFFIXES:  # container metadata only; decoding (bounded) comes with processing
        return CheckedFile("video", video.probe(path, max_frame_pixels))
    animated, (width, height), fmt = _first_frame(path, max_frame_pixels)
    check_frame_pixels(width, height, str(path), max_frame_pixels)
    try:
        smart_resize(height, width)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    if suffix in ANIMATION_SUFFIXES and animated:
        return CheckedFile("video", video.probe(path, max_frame_pixels))
    if fmt in video.ANIMATIONS:  # its block structure whole, so that a cut animation is refused, never shortened
        video.probe(path, max_frame_pixels)
    return CheckedFile("image")


def _first_frame(path: Path, max_frame_pixels: int) -> tuple[bool, tuple[int, int], str | None]:
    """Decode the first frame (a truncated or corrupt image fails here), once its stated size is known to be within
    ``max_frame_pixels``; whether a second frame follows, the size and PIL's format. An animation's blocks are
    checked whole by :func:`glmvit.video.probe` (not by counting its frames here: for a GIF that is a pass over the
    whole file), and its frames decoded, within a pixel budget, only when sampled."""
    try:
        with Image.open(path) as im:
            size = im.size
            if size[0] * size[1] <= max_frame_pixels:
                im.load()
            return bool(getattr(im, "is_animated", False)), size, im.format
    except PermissionError:
        raise ValueError(f"{path}: cannot read it (permission denied)") from None
    except UnidentifiedImageError:
        raise ValueError(f"{path}: not an image or animation that PIL can decode") from None
    except Image.DecompressionBombError as err:
        raise ValueError(f"{path}: too many pixels ({err})") from None
    except video.PIL_ERRORS as err:  # truncated or corrupt data, PIL looking for an animation's second frame included
        raise ValueError(f"{path}: cannot decode it ({type(err).__name__}: {err})") from None


def load(path: Path, kind: str, max_frame_pixels: int = MAX_FRAME_PIXELS,
         max_decoded_pixels: int = video.MAX_DECODED_PIXELS, *, info: video.VideoInfo | None = None) -> VisionInputs:
    """One checked file through the processor, within the pixel bounds (a video's frames decoded, sampled or not,
    count against ``max_decoded_pixels``); an error still names the file. ``info``: the video's metadata from
    :func:`check_file` (:attr:`CheckedFile.info`), else the video is probed again."""
    return load_frames(path, kind, max_frame_pixels, max_decoded_pixels, info=info).inputs()


def load_frames(path: Path, kind: str, max_frame_pixels: int = MAX_FRAME_PIXELS,
                max_decoded_pixels: int = video.MAX_DECODED_PIXELS, *,
                info: video.VideoInfo | None = None) -> VisionFrames:
    """:func:`load` stopped after the resize: the item's uint8 frames (:class:`~glmvit.processing.VisionFrames`)."""
    try:
        if kind == "video":
            return video_frames(path, max_frame_pixels=max_frame_pixels, max_decoded_pixels=max_decoded_pixels,
                                info=info)
        return image_frames([path], max_frame_pixels=max_frame_pixels)
    except (ValueError, OSError) as err:  # a decode bound's refusal stays one (the server answers it 413)
        text = str(err) if str(path) in str(err) else f"{path}: {err}"
        raise (video.DecodeLimitError if isinstance(err, video.DecodeLimitError) else ValueError)(text) from None


def item_metadata(path: Path, inputs: VisionInputs, embedding: torch.Tensor) -> dict[str, Any]:
    """What one encoded item is: its file (absolute path, sha256), its grid, its sampled frames' times."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):  # in chunks: a video can be large
            digest.update(chunk)
    return inputs_record(str(path.resolve()), digest.hexdigest(), inputs, embedding.shape[0])


def model_metadata(args: argparse.Namespace, model: GlmVisionEncoder) -> dict[str, Any]:
    weights = weights_identity(args.weights) if args.weights else {"random": True, "seed": args.seed}
    return {"vision_config": vars(model.config), "dtype": str(model.dtype).removeprefix("torch."),
            "weights": weights, "device": args.device, "description": describe(args)}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m glmvit encode", description=(__doc__ or "").split("\n\n")[0],
                    formatter_class=argparse.RawDescriptionHelpFormatter, epilog=(__doc__ or "").split("\n\n", 1)[1])
    parser.add_argument("files", nargs="+", type=Path, help=f"images and animations ({', '.join(SUFFIXES)})")
    add_model_args(parser)
    o = parser.add_argument_group("output")
    o.add_argument("--out", type=output_path, help="save the embeddings and their metadata as this .safetensors file "
                   "(-: standard output, status text then goes to stderr)")
    o.add_argument("--json", type=output_path, help="write a summary (items, model, provenance) as JSON (-: standard "
                   "output)")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_args(parser, args)
    outputs = [p for p in (args.out, args.json) if p]
    refuse_outputs_over_inputs(parser, {"--out": args.out, "--json": args.json},
                               {f"the input {path}": path for path in args.files})
    created: list[Path] = []  # the outputs' folders the check makes
    try:
        for path in outputs:
            check_writable(path, created)
    except OSError as err:
        remove_folders(created)
        parser.error(str(err))
    with removed_on_failure(created):
        return _encode(args, argv)


def _encode(args: argparse.Namespace, argv: list[str]) -> int:
    bar = {"file": sys.stderr, "disable": args.quiet or len(args.files) == 1, "unit": "file"}
    with tqdm(args.files, desc="checking", **bar) as files:  # closes the bar before an error is printed
        checked = [check_file(path) for path in files]
    print(f"glmvit encode: {describe(args)}")
    if not args.weights:
        print("  (random weights: the embeddings only exercise the pipeline; --weights DIR loads a checkpoint)")
    model = model_from_args(args)
    device = torch.device(args.device)
    items, tensors = [], {}
    with torch.inference_mode(), tqdm(list(zip(args.files, checked, strict=True)), desc="encoding", **bar) as todo:
        for i, (path, found) in enumerate(todo):
            kind = found.kind
            inputs = load(path, kind, info=found.info)  # one file's pixels at a time
            out = model(inputs.pixel_values.to(device), inputs.grid_thw).float().cpu()
            tensors[f"item_{i}"] = out.contiguous()
            items.append(item_metadata(path, inputs, out))
            tqdm.write(f"{one_line(str(path))}: {kind} grid {items[-1]['grid_thw']} -> {tuple(out.shape)}, "
                       f"mean {out.mean():+.4f}, std {out.std():.4f}", file=sys.stdout)
    info = model_metadata(args, model)
    provenance = collect(device, " ".join([sys.executable, "-m", "glmvit", "encode", *argv]))
    if args.out:
        with atomic_output(args.out) as f:
            f.write(save(tensors, metadata=file_metadata(items, info, provenance)))  # bytes: save_file would replace
        print(f"saved {plural(len(items), 'embedding')} to {args.out}")
    if args.json:
        write_json(args.json, {"out": str(args.out) if args.out else None, "items": items, **info,
                               "provenance": provenance})
    return 0
