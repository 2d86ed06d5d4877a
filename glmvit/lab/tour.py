"""Notebook 00's GPU measurement: the CUDA kernels of one eager forward of the full tower, ours and transformers'."""
from __future__ import annotations

from typing import Any

import torch

from ..processing import SAMPLE_DATA, process_images
from .shared import full_model

PHOTO = SAMPLE_DATA / "images" / "astronaut.jpg"
MAX_PIXELS = 2 * 224 * 224  # notebook 00's photo, resized to 224 × 224


def _cuda_kernels(net: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[int, int]:
    """(kernels, CUDA events with copies) of one eager call of net after one warm-up call, under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        net(pixels, grid)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            net(pixels, grid)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(not e.name.startswith(("Memcpy", "Memset")) for e in events), len(events)


def kernel_count() -> dict[str, Any]:
    """CUDA kernels of one eager forward of the full GLM-4.1V tower, bf16, on the 224² photo: ours (the device's
    default attention) and transformers' ``Glm4vVisionModel`` (sdpa) with the same weights."""
    from ..oracle import hf_twin

    inputs = process_images(PHOTO, max_pixels=MAX_PIXELS)
    gpu = torch.device("cuda")
    pixels, grid = inputs.pixel_values.to(gpu, torch.bfloat16), inputs.grid_thw.to(gpu)
    ours_full = full_model()
    kernels, events = _cuda_kernels(ours_full, pixels, grid)
    hf_kernels, hf_events = _cuda_kernels(hf_twin(ours_full, attn="sdpa"), pixels, grid)
    return {"grid": inputs.grid_thw.tolist(), "glmvit_backend": ours_full.attention_backend(),
            "glmvit_kernels": kernels, "glmvit_events": events,
            "transformers_kernels": hf_kernels, "transformers_events": hf_events}
