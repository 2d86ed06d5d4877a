"""``python -m glmvit encode FILES...``: embeddings of image and video files (random weights unless --weights)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save

from ..processing import VisionInputs, process_images, process_video
from .common import add_model_args, check_writable, model_from_args, resolve_model_args, write_atomic
from .demo import IMAGE_SUFFIXES

VIDEO_SUFFIXES = (".gif", ".webp")


def load_inputs(files: list[Path]) -> VisionInputs:
    """Images by suffix; animated GIF/WebP files as videos (a still GIF/WebP is an image)."""
    parts = []
    for path in files:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        suffix = path.suffix.lower()
        if suffix in VIDEO_SUFFIXES and _frames(path) > 1:
            parts.append(process_video(path))
        elif suffix in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
            parts.append(process_images([path]))
        else:
            raise ValueError(f"{path}: unsupported file type {suffix!r} "
                             f"(images: {', '.join(IMAGE_SUFFIXES)}; videos: {', '.join(VIDEO_SUFFIXES)})")
    return VisionInputs.concat(parts)


def _frames(path: Path) -> int:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return getattr(im, "n_frames", 1)
    except UnidentifiedImageError as err:
        raise ValueError(f"{path}: cannot decode it as an image or animation") from err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glmvit encode", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    add_model_args(parser)
    parser.add_argument("--out", type=Path, help="save the embeddings as a .safetensors file (item_0, item_1, ...)")
    args = parser.parse_args(argv)
    resolve_model_args(parser, args)
    if args.out:
        check_writable(args.out)
    inputs = load_inputs(args.files)
    model = model_from_args(args)
    device = torch.device(args.device)
    with torch.inference_mode():
        outs = [model(p.to(device), g[None]) for p, g in zip(inputs.split(), inputs.grid_thw, strict=True)]
    for name, kind, grid, out in zip(inputs.sources, inputs.kinds, inputs.grid_thw.tolist(), outs, strict=True):
        print(f"{name}: {kind} grid {grid} -> {tuple(out.shape)} {out.dtype}, mean {out.float().mean():+.4f}, "
              f"std {out.float().std():.4f}")
    if args.out:
        write_atomic(args.out, save({f"item_{i}": o.float().cpu().contiguous() for i, o in enumerate(outs)}))
        print(f"saved {len(outs)} embeddings to {args.out}")
    return 0
