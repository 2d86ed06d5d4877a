"""A/B: the MLP's gate_up matmul + SwiGLU as the model runs them against one Triton GEMM with a SwiGLU epilogue.

For M rows of the model's shapes (K = 1536 in, H = 4096 out of a [2·4096, 1536] ``gate_up_proj``; M = 256, 1024,
8192: 1×224², 4×224² and 8×448² images) and bf16 weights, each path computes silu(x·Wgᵀ)·(x·Wuᵀ):

- ``torch``: ``F.linear`` (cuBLAS, the whole 2·H columns), then ``glmvit.model.swiglu`` as torch ops: the eager
  graph's path, on the weight packed in tiles as the model stores it (``glmvit.gate_up``);
- ``compiled``: the same two lines under ``torch.compile`` (cuBLAS, then inductor's fused SwiGLU kernel): what the
  graph-compiled mode replays;
- ``gate_up_only``: the cuBLAS matmul alone, the floor a fused kernel's matmul has to stay near;
- ``triton@NAME``: ``glmvit.kernels.triton_swiglu_gemm.swiglu_linear_triton`` for each of its ``SWEEP_CONFIGS``
  (a packed configuration on the weight packed for its BLOCK_N, the others on the plain [gate; up] weight).

Every output is checked against the float32 SwiGLU of the same bf16 inputs (max abs error within 2⁻⁶·max|ref|, and
whether every element is within one bf16 rounding: :func:`check`); timing is ``glmvit.profiling.graph_time_us`` (20
calls in one CUDA graph, median of 50 replays), two rounds in alternating order, the lower median kept and both
recorded. A path that fails is one line, never a traceback. CUDA only (exit 2 elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/swiglu_ab.py --json data/sweeps/swiglu_ab_h200.json

``--compile-only`` needs no GPU: it compiles every configuration for sm_90 with the installed Triton (its bundled
ptxas) at M = 8192, specialised as a launch would be (aligned pointers, sizes multiples of 16), and prints what
Hopper gets: shared memory, warps, warp-group MMAs (``wgmma``), tensor-memory copies (``cp.async.bulk.tensor``) and
the pointer path's pipelined copies (``cp.async``) in the PTX.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import aligned_attrs, check_and_time, compile_sm90, gemm_ab_main, one_line  # noqa: E402

ROWS = (256, 1024, 8192)
DIM, HIDDEN = 1536, 4096
REPLAYS = 50
BASELINE = "compiled"


def check(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Max abs error; ``ok``: within 2⁻⁶·max|ref| (the band every path meets); ``one_rounding``: every element within
    2⁻⁸·|ref| + 2⁻¹²·max|ref|, one bf16 rounding of the float32 result (the fused kernel's contract; the unfused
    path's rounded gate need not meet it, tests/test_triton_swiglu_gemm.py says why)."""
    err = (out.float() - ref).abs()
    peak = ref.abs().max()
    max_err = err.max().item()
    return {"max_abs_err": max_err, "ok": max_err <= 2**-6 * peak.item(),
            "one_rounding": bool((err <= 2**-8 * ref.abs() + 2**-12 * peak).all())}


def ab_paths(x: torch.Tensor, weight: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each path's call on the same x and weight (module docstring)."""
    import torch.nn.functional as F

    from glmvit.gate_up import gate_up_tile, pack_gate_up
    from glmvit.model import swiglu

    tile = gate_up_tile(weight.shape[0] // 2)  # the model's layout: the unfused paths as the model runs them
    stored = pack_gate_up(weight, tile)

    def unfused(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return swiglu(F.linear(a, w), tile)

    compiled = torch.compile(unfused, dynamic=False)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "torch": lambda: unfused(x, stored), "compiled": lambda: compiled(x, stored),
        "gate_up_only": lambda: F.linear(x, weight)}
    try:
        from glmvit.kernels.triton_swiglu_gemm import SWEEP_CONFIGS, swiglu_linear_triton
    except Exception:  # noqa: BLE001 - no Triton, or one without what the module needs: the caller says so
        return out

    for config in SWEEP_CONFIGS:  # a packed configuration reads the weight re-laid once, outside the timing
        w = pack_gate_up(weight, config.block_n) if config.packed else weight
        out[f"triton@{config.name}"] = partial(swiglu_linear_triton, x, w, config)
    return out


def measure(rows: int, rounds: int = 2) -> dict[str, Any]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(2 * HIDDEN, DIM, device=dev, generator=gen) * DIM**-0.5).to(torch.bfloat16)
    gate, up = (x.float() @ weight.float().T).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    del gate, up
    paths: dict[str, dict[str, Any]] = {}
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    try:
        fns = ab_paths(x, weight)
    except Exception as err:  # noqa: BLE001
        paths["all"] = {"unavailable": one_line(err)}
    if fns and not any(p.startswith("triton@") for p in fns):
        paths["triton"] = {"unavailable": "glmvit.kernels.triton_swiglu_gemm does not import here"}
    paths.update(check_and_time(fns, lambda path, out: None if path == "gate_up_only" else check(out, ref),
                                rounds, REPLAYS))
    torch.cuda.empty_cache()
    return {"rows": rows, "dim": DIM, "hidden": HIDDEN, "paths": paths}


def compile_report(config, rows: int = 8192) -> dict[str, Any]:
    """Compile the kernel for sm_90 without a GPU (``--compile-only``); what its code holds, or one line why not."""
    from glmvit.kernels.triton_swiglu_gemm import TensorDescriptor, _swiglu_gemm_kernel

    x = torch.empty(rows, DIM, dtype=torch.bfloat16)
    weight = torch.empty(2 * HIDDEN, DIM, dtype=torch.bfloat16)
    y = torch.empty(rows, HIDDEN, dtype=torch.bfloat16)
    descs: list[Any] = [x, weight, weight, y]
    if config.tma:
        if TensorDescriptor is None:
            return {"unavailable": "this Triton has no triton.tools.tensor_descriptor"}
        bm, bn, bk = config.block_m, config.block_n, config.block_k
        descs = [TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(weight[:HIDDEN], [bn, bk]),
                 TensorDescriptor.from_tensor(weight[HIDDEN:], [bn, bk]), TensorDescriptor.from_tensor(y, [bm, bn])]
        if config.packed:
            descs[1] = descs[2] = TensorDescriptor.from_tensor(weight, [2 * bn, bk])
    args = dict(x_ptr=x, w_ptr=weight, y_ptr=y, x_desc=descs[0], wg_desc=descs[1], wu_desc=descs[2],
                y_desc=descs[3], M=rows, H=HIDDEN, K=DIM)
    constants = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                     TMA=config.tma, PERSISTENT=config.persistent, FLATTEN=config.flatten,
                     PACKED=config.packed, norm_ptr=None, eps=0.0, NORM=0)
    return compile_sm90(_swiglu_gemm_kernel, args, constants, config.num_warps, config.num_stages,
                        aligned_attrs(args))


def main(argv: list[str] | None = None) -> int:
    return gemm_ab_main(argv, tool="swiglu_ab", doc=__doc__, rows=ROWS, module="glmvit.kernels.triton_swiglu_gemm",
                        compile_report=compile_report, measure=measure, baseline=BASELINE, replays=REPLAYS)


if __name__ == "__main__":
    sys.exit(main())
