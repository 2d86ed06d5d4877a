"""``python -m glmvit encode FILES...``: embeddings of image and video files (random weights unless --weights)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import VisionConfig
from .demo import IMAGE_SUFFIXES, build_model
from .processing import VisionInputs, process_images, process_video

VIDEO_SUFFIXES = (".gif", ".webp")


def load_inputs(files: list[Path]) -> VisionInputs:
    """Images by suffix; animated GIF/WebP files as videos (a still GIF/WebP is an image)."""
    parts = []
    for path in files:
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such file")
        suffix = path.suffix.lower()
        if suffix in VIDEO_SUFFIXES and _frames(path) > 1:
            parts.append(process_video(path))
        elif suffix in IMAGE_SUFFIXES + VIDEO_SUFFIXES:
            parts.append(process_images([path]))
        else:
            raise ValueError(f"{path}: unsupported file type {suffix!r} (images: {IMAGE_SUFFIXES}, videos: {VIDEO_SUFFIXES})")
    return VisionInputs.concat(parts)


def _frames(path: Path) -> int:
    from PIL import Image

    with Image.open(path) as im:
        return getattr(im, "n_frames", 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glmvit encode", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--weights", help="checkpoint directory or .safetensors file (default: random weights)")
    parser.add_argument("--config", choices=["tiny", "full"], default=None, help="default: full on CUDA, tiny on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="save the embeddings as a .safetensors file (item_0, item_1, ...)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    full = args.config == "full" or (args.config is None and (device.type == "cuda" or args.weights))
    config = VisionConfig.glm41v() if full else VisionConfig.tiny()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(config, device, dtype, args.weights)
    inputs = load_inputs(args.files)
    with torch.inference_mode():
        outs = [model(p.to(device), g[None]) for p, g in zip(inputs.split(), inputs.grid_thw)]
    for name, kind, grid, out in zip(inputs.sources, inputs.kinds, inputs.grid_thw.tolist(), outs):
        print(f"{name}: {kind} grid {grid} -> {tuple(out.shape)} {out.dtype}, mean {out.float().mean():+.4f}, "
              f"std {out.float().std():.4f}")
    if args.out:
        save_file({f"item_{i}": o.float().cpu().contiguous() for i, o in enumerate(outs)}, str(args.out))
        print(f"saved {len(outs)} embeddings to {args.out}")
    return 0
