"""What a forward must cost at least: analytic FLOPs, the measured matmul rate and copy bandwidth, the floor."""
from __future__ import annotations

import statistics
from typing import Any

import numpy as np
import torch

from .config import VisionConfig
from .geometry import ItemSpec, grid_specs
from .timing import time_calls


def flops_breakdown(config: VisionConfig, grids: Any) -> dict[str, int]:
    """Analytic FLOPs of one encoder forward over ``grids`` (rows [t, h, w]), by part.

    Every matmul of an [M, K] by [K, N] product counts 2·M·N·K. With N = Σ t·h·w patch rows, T = N / m² output
    tokens (rows, tokens and Σ L² as :func:`glmvit.geometry.item_spec` counts them), H = hidden_size,
    F = out_hidden_size (GLM-4V's block MLP width), I = intermediate_size (merger), P = patch_dim (C·T·P² = 1176)
    and depth blocks:

    - patch_embed: 2·N·P·H (the Conv3d whose kernel is the whole patch is one matmul);
    - per block: qkv 2·N·H·3H, proj 2·N·H·H, MLP gate + up 2·2·N·H·F, down 2·N·F·H;
    - attention per block: 4·Σ_seg L²·H (QKᵀ and P·V, 2·L²·head_dim per head each), L = h·w: every temporal
      patch of every item is its own segment;
    - downsample: 2·T·(m²·H)·F (the 2×2 conv as a matmul);
    - merger: proj 2·T·F·F, gate + up 2·2·T·F·I, down 2·T·I·F.

    Not counted: norms, rotary, softmax, activations, the position-table interpolation, biases (all O(N·H)).
    Padding of a graph's budget is not counted either: these are the useful FLOPs of the request.
    """
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    c = config
    total = ItemSpec.total(grid_specs(g.tolist(), c.spatial_merge_size))
    n, tokens, seg_sq = total.rows, total.tokens, total.work
    h, f, i = c.hidden_size, c.out_hidden_size, c.intermediate_size
    parts = {
        "patch_embed": 2 * n * c.patch_dim * h,
        "qkv": c.depth * 2 * n * h * 3 * h,
        "proj": c.depth * 2 * n * h * h,
        "mlp": c.depth * 3 * 2 * n * h * f,
        "downsample": 2 * tokens * c.merge_area * h * f,
        "merger": 2 * tokens * f * f + 3 * 2 * tokens * f * i,
        "attention": c.depth * 4 * seg_sq * h,
    }
    parts["matmul"] = sum(v for k, v in parts.items() if k != "attention")
    parts["total"] = parts["matmul"] + parts["attention"]
    return parts


def encoder_flops(config: VisionConfig, grids: Any) -> int:
    """Total analytic FLOPs (matmuls + attention) of one forward over ``grids``; see :func:`flops_breakdown`."""
    return flops_breakdown(config, grids)["total"]


def measure_matmul_tflops(device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
                          n: int | None = None, runs: int = 10, warmup: int = 3) -> float:
    """Measured dense matmul rate in TFLOP/s: an n³ matmul (default 8192 on CUDA, 512 elsewhere), mean of ``runs``
    after ``warmup`` calls (CUDA events on a GPU)."""
    device = torch.device(device)
    n = n or (8192 if device.type == "cuda" else 512)
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    ms = statistics.mean(time_calls(lambda: torch.mm(a, b, out=out), device, runs, warmup, on_device=True))
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_copy_bandwidth(device: torch.device | str = "cuda", nbytes: int | None = None, runs: int = 10,
                           warmup: int = 3) -> float:
    """Measured device-to-device copy bandwidth in GB/s (10⁹ B/s), counting bytes read + written: a ``nbytes``
    buffer (default 2 GiB on CUDA, 64 MiB elsewhere) copied into another, mean of ``runs``."""
    device = torch.device(device)
    nbytes = nbytes or (2 * 2**30 if device.type == "cuda" else 64 * 2**20)
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = statistics.mean(time_calls(lambda: dst.copy_(src), device, runs, warmup, on_device=True))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and persistent buffer: what one forward must read at least once (counted from
    ``glmvit.gate_up.state_like``: no copy of anything)."""
    from .gate_up import state_like

    return sum(t.numel() * t.element_size() for t in state_like(model).values())


def tower_bytes(config: VisionConfig, dtype: torch.dtype) -> int:
    """:func:`weight_bytes` of a tower of ``config`` in ``dtype``, counted on the meta device (nothing allocated)."""
    from .model import GlmVisionEncoder

    with torch.device("meta"):
        return weight_bytes(GlmVisionEncoder(config).to(dtype))


def floor_ms(flops: int, nbytes: int, tflops: float, gbps: float) -> float:
    """max(compute time at the matmul rate, time to read the weights at the copy bandwidth), in ms."""
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e3
