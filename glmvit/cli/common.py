"""What every command shares: the device / config / dtype policy, the model, JSON output with provenance."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import VisionConfig
from ..model import GlmVisionEncoder
from ..random_weights import randomize_

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--device, --config, --dtype, --weights, --seed: the same flags and defaults for every command."""
    g = parser.add_argument_group("model")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--config", choices=["auto", "tiny", "full"], default="auto",
                   help="random weights only: auto = the full GLM-4.1V tower on CUDA, the tiny test tower on CPU "
                        "(with --weights the checkpoint's config.json decides)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    g.add_argument("--weights", default=None,
                   help="a checkpoint directory or .safetensors file (default: random weights, seeded)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs (default 0)")


def resolve_model_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the policy defaults (device, config, dtype) in place; reject what cannot run (parser.error)."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device (use cuda, cuda:N or cpu)")
    if device.type not in ("cuda", "cpu"):
        parser.error(f"--device {args.device!r}: only cuda and cpu are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA GPU is available here (torch.cuda.is_available() is False)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if args.seed < 0:
        parser.error("--seed must be ≥ 0")
    if args.weights and args.config != "auto":
        parser.error("--config applies to random weights; with --weights the checkpoint's config.json decides")
    if args.config == "auto":
        args.config = "checkpoint" if args.weights else "full" if device.type == "cuda" else "tiny"
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"


def vision_config(name: str) -> VisionConfig:
    return VisionConfig.glm41v() if name == "full" else VisionConfig.tiny()


def build_model(config: VisionConfig, device: torch.device | str, dtype: torch.dtype,
                seed: int = 0) -> GlmVisionEncoder:
    """The embedded default: a model with seeded random weights on ``device`` in ``dtype`` (eval mode)."""
    with torch.device(device):
        model = GlmVisionEncoder(config)
    return randomize_(model, seed).to(dtype).eval()


def model_from_args(args: argparse.Namespace) -> GlmVisionEncoder:
    """The model the resolved flags describe: a checkpoint's tower (its own config) or random weights."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.weights:
        return GlmVisionEncoder.from_pretrained(args.weights, dtype=dtype, device=device)
    return build_model(vision_config(args.config), device, dtype, args.seed)


def describe(args: argparse.Namespace) -> str:
    towers = {"full": "GLM-4.1V vision tower", "tiny": "tiny test tower", "checkpoint": "checkpoint's vision tower"}
    tower = towers[args.config]
    weights = f"from {args.weights}" if args.weights else f"random weights (seed {args.seed})"
    return f"{tower}, {args.dtype}, on {args.device}, {weights}"


def check_writable(path: str | Path) -> Path:
    """Fail now, before any work, if ``path`` cannot be written (its folder is created if missing)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory, not an output file")
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(f"{path}: cannot write here")
    return path


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it: no half-written output on failure."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """JSON (indent 1) written atomically; prints where it went."""
    write_atomic(check_writable(path), (json.dumps(data, indent=1) + "\n").encode())
    print(f"wrote {path}")
