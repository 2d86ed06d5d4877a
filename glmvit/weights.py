"""Load vision-tower weights from safetensors (a Hugging Face checkpoint directory or one file). Never unpickles."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

VISION_PREFIXES = ("model.visual.", "visual.", "vision_model.", "")


def _files(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"{path}: only .safetensors files are loaded (no pickle checkpoints)")
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint file or directory")
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no .safetensors files (pickle checkpoints such as .bin are not loaded)")
    return files


def _detect_prefix(keys: list[str], expected: set[str]) -> str:
    for prefix in VISION_PREFIXES:
        hits = sum(1 for k in keys if k.startswith(prefix) and k[len(prefix):] in expected)
        if hits:
            return prefix
    raise ValueError(
        "checkpoint holds no GLM-4V vision weights (looked for keys such as "
        f"'model.visual.{next(iter(sorted(expected)))}' under prefixes {VISION_PREFIXES})"
    )


def load_vision_weights(model: torch.nn.Module, path: str | Path) -> dict[str, list[str]]:
    """Copy the vision tower's weights from ``path`` into ``model``; returns {"missing": [...], "unexpected": [...]}.

    Raises if any vision weight is missing or has the wrong shape, naming the keys.
    """
    own = model.state_dict()
    files = _files(Path(path))
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    prefix = _detect_prefix(list(where), set(own))
    found = {k[len(prefix):]: k for k in where if k.startswith(prefix)}
    vision_like = ("embeddings.", "patch_embed.", "blocks.", "post_", "downsample.", "merger.")
    unexpected = sorted(k for k in found if k not in own and k.startswith(vision_like))
    missing = sorted(k for k in own if k not in found)
    if missing:
        raise KeyError(f"checkpoint {path} (prefix {prefix!r}) is missing vision weights: {missing[:8]}"
                       + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    wrong = []
    with torch.no_grad():
        for name, param in own.items():
            tensor = where[found[name]].get_tensor(found[name])
            if tuple(tensor.shape) != tuple(param.shape):
                wrong.append(f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}")
                continue
            param.copy_(tensor)
    if wrong:
        raise ValueError("vision weights with the wrong shape: " + "; ".join(wrong))
    return {"missing": missing, "unexpected": unexpected}
