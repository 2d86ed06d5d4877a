"""Random but non-trivial weights, drawn the same way on every device: the embedded default model of the demo,
the benchmark and the tests (which load the same draw into transformers' tower). :func:`random_encoder` builds it."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeVar

import torch

from .gate_up import state_like, writable_state

if TYPE_CHECKING:
    from .config import VisionConfig
    from .model import GlmVisionEncoder

Module = TypeVar("Module", bound=torch.nn.Module)


def randomize_(model: Module, seed: int = 0) -> Module:
    """Overwrite every parameter in place: norm weights 1 + 0.5·N, biases 0.1·N, 1-D parameters and the position
    table N, matrices N / sqrt(fan-in). Drawn in float32 on each parameter's device from one seeded generator per
    device, in sorted state-dict key order (on CPU the values do not depend on the model's dtype). The keys, not the
    parameters: glmvit stores gate and up as one fused parameter (packed in tiles: ``glmvit.gate_up``) whose
    state-dict entries are transformers' two keys, so both models draw the same values for the same names; each is
    written through ``glmvit.gate_up.writable_state`` (the state dict's halves of a packed weight are copies), the
    names and shapes read from ``glmvit.gate_up.state_like`` (which makes none of those copies)."""
    generators: dict[torch.device, torch.Generator] = {}
    buffers = {name for name, _ in model.named_buffers()}
    targets = writable_state(model)
    with torch.no_grad():
        for name, p in sorted(state_like(model).items()):
            if name in buffers:
                continue
            device = targets[name].device
            gen = generators.setdefault(device, torch.Generator(device=device).manual_seed(seed))
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=device)
            if "norm" in name and name.endswith("weight"):
                value = 1 + 0.5 * noise
            elif name.endswith("bias"):
                value = 0.1 * noise
            elif p.ndim == 1 or "position_embedding" in name:
                value = noise
            else:
                value = noise / math.sqrt(p[0].numel())
            targets[name].copy_(value.view(targets[name].shape))
    return model


def random_encoder(config: "VisionConfig", device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> "GlmVisionEncoder":
    """The embedded default: a :class:`~glmvit.model.GlmVisionEncoder` of ``config`` with seeded random weights
    (:func:`randomize_`, drawn in float32, then cast to ``dtype``) on ``device``, in eval mode."""
    from .model import GlmVisionEncoder

    with torch.device(device):
        model = GlmVisionEncoder(config)
    return randomize_(model, seed).to(dtype).eval()
