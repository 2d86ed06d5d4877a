"""A/B: the block's RMSNorm before its MLP as its own kernel, against the norm inside the fused SwiGLU GEMM.

For M rows of the model's shapes (K = 1536, H = 4096, the weight packed in tiles of ``PACK_TILE`` as the model stores
it; M = 256, 1024, 8192, 16384: 1×224², 4×224², 8×448² and sixteen 8-frame clips) and bf16 tensors, each path
computes silu(n·Wgᵀ)·(n·Wuᵀ) with n = RMSNorm(x):

- ``compiled``: what the graph-compiled mode replays today: ``glmvit.model.RMSNorm`` under ``torch.compile``
  (inductor's norm kernel), then the ``glmvit::swiglu_linear`` op on its output (the launch table's configuration);
- ``norm_only`` and ``swiglu_only``: the two halves of that path alone;
- ``fused@NAME#MODE``: ``swiglu_linear_triton(x, weight, config, norm_weight, eps, MODE)``: the norm inside the
  GEMM, for the launch table's two packed configurations and the 4-stage persistent one; MODE 1 sums each row's
  squares across every K tile as it passes, MODE 2 accumulates them elementwise and sums once after the loop.

Every output is checked against the float32 norm and SwiGLU of the same bf16 inputs (max abs error within
2⁻⁶·max|ref|, the band of ``tools/swiglu_ab.py``); timing as there (``glmvit.profiling.graph_time_us``: 20 calls in
one CUDA graph, median of 50 replays; two rounds in alternating order, the lower median kept). CUDA only::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/norm_swiglu_ab.py --json data/sweeps/norm_swiglu_ab_h100.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import aligned_attrs, check_and_time, compile_sm90, gemm_ab_main, one_line  # noqa: E402

ROWS = (256, 1024, 8192, 16384)
DIM, HIDDEN = 1536, 4096
EPS = 1e-5
REPLAYS = 50
BASELINE = "compiled"
MODES = (1, 2)


def check(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Max abs error; ``ok``: within 2⁻⁶·max|ref|; ``one_rounding``: every element within 2⁻⁸·|ref| + 2⁻¹²·max|ref|
    (no path here promises it: x·g is rounded before the matmul, as the norm's output is)."""
    err = (out.float() - ref).abs()
    peak = ref.abs().max()
    max_err = err.max().item()
    return {"max_abs_err": max_err, "ok": max_err <= 2**-6 * peak.item(),
            "one_rounding": bool((err <= 2**-8 * ref.abs() + 2**-12 * peak).all())}


def ab_paths(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each path's call on the same x, weight (plain [gate; up]) and norm weight (module docstring)."""
    from glmvit.gate_up import gate_up_tile, pack_gate_up
    from glmvit.kernels.fused_gemm_table import PACK_TILE, swiglu_config
    from glmvit.kernels.triton_swiglu_gemm import SwigluConfig, swiglu_linear_triton
    from glmvit.model import RMSNorm, swiglu_linear

    tile = gate_up_tile(HIDDEN)
    stored = pack_gate_up(weight, tile)
    norm = RMSNorm(DIM, EPS).to(x.device, x.dtype)
    norm.weight.data.copy_(norm_weight)
    compiled_norm = torch.compile(norm, dynamic=False)
    normed = compiled_norm(x)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "compiled": lambda: swiglu_linear(compiled_norm(x), stored, tile),
        "norm_only": lambda: compiled_norm(x),
        "swiglu_only": lambda: swiglu_linear(normed, stored, tile)}
    table = swiglu_config(x.shape[0], True)
    configs = [table, SwigluConfig(128, PACK_TILE, 64, 8, 4, persistent=True, packed=True)]
    if table.persistent:
        configs = [swiglu_config(1, True), *configs]
    for config in dict.fromkeys(configs):
        for mode in MODES:
            out[f"fused@{config.name}#{mode}"] = partial(swiglu_linear_triton, x, stored, config, norm_weight, EPS,
                                                         mode)
    return out


def measure(rows: int, rounds: int = 2) -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(rows, DIM, device=dev, generator=gen) * 4).to(torch.bfloat16)  # a residual stream's scale
    weight = (torch.randn(2 * HIDDEN, DIM, device=dev, generator=gen) * DIM**-0.5).to(torch.bfloat16)
    norm_weight = (1 + 0.5 * torch.rand(DIM, device=dev, generator=gen)).to(torch.bfloat16)
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)) * norm_weight.float()
    gate, up = (n @ weight.float().T).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    del gate, up, n, xf
    paths: dict[str, dict[str, Any]] = {}
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    try:
        fns = ab_paths(x, weight, norm_weight)
    except Exception as err:  # noqa: BLE001
        paths["all"] = {"unavailable": one_line(err)}
    paths.update(check_and_time(fns, lambda path, out: None if path == "norm_only" else check(out, ref),
                                rounds, REPLAYS))
    torch.cuda.empty_cache()
    return {"rows": rows, "dim": DIM, "hidden": HIDDEN, "paths": paths}


def compile_report(config, rows: int = 8192) -> dict[str, Any]:
    """A packed configuration compiled for sm_90 with the norm inside (``--compile-only``), no GPU needed."""
    from glmvit.kernels.triton_swiglu_gemm import TensorDescriptor, _swiglu_gemm_kernel

    if not config.packed:
        return {"skipped": "the norm runs inside packed configurations only"}
    if TensorDescriptor is None:
        return {"unavailable": "this Triton has no triton.tools.tensor_descriptor"}
    x = torch.empty(rows, DIM, dtype=torch.bfloat16)
    weight = torch.empty(2 * HIDDEN, DIM, dtype=torch.bfloat16)
    y = torch.empty(rows, HIDDEN, dtype=torch.bfloat16)
    g = torch.empty(DIM, dtype=torch.bfloat16)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    packed = TensorDescriptor.from_tensor(weight, [2 * bn, bk])
    args = dict(x_ptr=x, w_ptr=weight, y_ptr=y, x_desc=TensorDescriptor.from_tensor(x, [bm, bk]), wg_desc=packed,
                wu_desc=packed, y_desc=TensorDescriptor.from_tensor(y, [bm, bn]), M=rows, H=HIDDEN, K=DIM,
                norm_ptr=g, eps=EPS)
    constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m, TMA=True,
                     PERSISTENT=config.persistent, FLATTEN=config.flatten, PACKED=True, NORM=1)
    # aligned_attrs numbers the hints by the arguments' order here; the kernel's own order puts norm_ptr and eps
    # after the constants, so each hint is moved to its parameter's index in the kernel
    names = list(args)
    attrs = {(_swiglu_gemm_kernel.arg_names.index(names[i]),): hint for (i,), hint in aligned_attrs(args).items()}
    return compile_sm90(_swiglu_gemm_kernel, args, constants, config.num_warps, config.num_stages, attrs)


def main(argv: list[str] | None = None) -> int:
    return gemm_ab_main(argv, tool="norm_swiglu_ab", doc=__doc__, rows=ROWS,
                        module="glmvit.kernels.triton_swiglu_gemm", compile_report=compile_report, measure=measure,
                        baseline=BASELINE, replays=REPLAYS)


if __name__ == "__main__":
    sys.exit(main())
