"""The main job: encode the sample images and clip in data/ and print what each item became.

On CPU the embedded default is the tiny random-weight config in float32 (runner: ``emulate``); with CUDA it is the
full GLM-4.1V vision tower in bfloat16 (runner: CUDA graphs). ``--weights`` loads a real checkpoint instead.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .budget import BudgetConfig
from .config import VisionConfig
from .graphs import EncoderGraphRunner
from .model import GlmVisionEncoder
from .processing import VisionInputs, process_images, process_video
from .testing import randomize_
from .weights import load_vision_weights

DATA = Path(__file__).resolve().parent.parent / "data"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


def sample_inputs(data: Path = DATA, max_pixels: int | None = None) -> VisionInputs:
    """The sample photographs and the sample clip, as one batch (images first, then the clip)."""
    images = sorted(p for p in (data / "images").glob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not images or not (data / "clip.gif").exists():
        raise FileNotFoundError(f"{data}: expected images/*.jpg and clip.gif (run from a checkout, or pass --data)")
    limits = {} if max_pixels is None else {"max_pixels": max_pixels}
    return VisionInputs.concat([process_images(images, **limits), process_video(data / "clip.gif", **limits)])


def build_model(config: VisionConfig, device: torch.device, dtype: torch.dtype, weights: str | None, seed: int = 0):
    """A model on ``device``: random weights (seeded), or a checkpoint's vision tower when ``weights`` is given."""
    with torch.device(device):
        model = GlmVisionEncoder(config)
    if weights:
        load_vision_weights(model, weights)
    elif device.type == "cpu":
        randomize_(model, seed)
    else:  # same distribution as randomize_, drawn on the GPU (the full tower is 892 M parameters)
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith("weight"):
                    p.normal_(1, 0.5)
                elif name.endswith("bias"):
                    p.normal_(0, 0.1)
                elif p.ndim == 1 or "position_embedding" in name:
                    p.normal_()
                else:
                    p.normal_(0, 1 / math.sqrt(p[0].numel()))
    return model.to(dtype).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glmvit demo", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", choices=["auto", "tiny", "full"], default="auto",
                        help="auto: full GLM-4.1V on CUDA, tiny on CPU")
    parser.add_argument("--weights", help="a checkpoint directory or .safetensors file (default: random weights)")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    full = args.config == "full" or (args.config == "auto" and device.type == "cuda")
    config = VisionConfig.glm41v() if full else VisionConfig.tiny()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print(f"glmvit demo: {'GLM-4.1V vision tower' if full else 'tiny config'} ({dtype}) on {device}, "
          f"{'weights from ' + args.weights if args.weights else 'random weights'}")
    model = build_model(config, device, dtype, args.weights)
    inputs = sample_inputs(args.data)

    print(f"\n{'item':<16} {'kind':<6} {'grid [t, h, w]':<16} {'tokens':>7} {'embedding':>14} {'eager ms':>9}")
    eager = []
    with torch.inference_mode():
        for name, kind, grid, pixels in zip(inputs.sources, inputs.kinds, inputs.grid_thw, inputs.split()):
            pixels = pixels.to(device)
            model(pixels, grid[None])  # warm-up
            _sync(device)
            start = time.perf_counter()
            out = model(pixels, grid[None])
            _sync(device)
            ms = (time.perf_counter() - start) * 1e3
            eager.append(out)
            label = Path(name).name if name else "(array)"
            print(f"{label:<16} {kind:<6} {str(grid.tolist()):<16} {out.shape[0]:>7} {str(tuple(out.shape)):>14} {ms:>9.2f}")

    backend = "cuda" if device.type == "cuda" else "emulate"
    largest = max(o.shape[0] for o in eager)
    budgets = sorted({64, 256, 1024, 2 ** math.ceil(math.log2(max(largest, 64)))})
    runner = EncoderGraphRunner(model, BudgetConfig(budgets, max_items=4, max_frames=32), backend=backend)
    runner.capture()
    start = time.perf_counter()
    outs = runner.run(inputs.pixel_values.to(device), inputs.grid_thw)
    ms = (time.perf_counter() - start) * 1e3
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, eager))
    what = "CUDA graphs" if backend == "cuda" else "emulated (no CUDA graphs on CPU)"
    s = runner.stats
    print(f"\nwhole batch through EncoderGraphRunner, {what}: {ms:.2f} ms, budgets {budgets}, "
          f"{s.replays} replays, {s.fallback_items} eager items, padding {s.padding_fraction:.1%}; "
          f"max |runner − eager| = {diff:.3g}")
    return 0
