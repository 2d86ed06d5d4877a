"""A/B: the attention's qkv matmul + q/k rotation as the model runs them against one Triton GEMM with a rotary epilogue.

For M rows of the model's shapes (K = 1536 in, 12 heads × 128 of q, k and v out of a [4608, 1536] ``qkv``; M = 256,
1024, 8192: 1×224², 4×224² and 8×448² images) and bf16 weights, each path computes x·Wᵀ with q and k of every head
rotated (``glmvit.rotary.apply_rotary``) and v as is:

- ``torch``: ``F.linear`` (cuBLAS), then ``glmvit.kernels.triton_attention.rotate_qk_triton`` (q̃, k̃ into a
  (M, 2·heads·d) scratch): what the model runs before a prerotated attention;
- ``compiled``: ``F.linear`` then ``apply_rotary``'s torch ops on q and k under ``torch.compile`` (cuBLAS, then
  inductor's own rotation kernel): what a compiler makes of the same two steps;
- ``linear_only``: the cuBLAS matmul alone, the floor a fused kernel's matmul has to stay near;
- ``triton@NAME``: ``glmvit.kernels.triton_qkv_rope_gemm.qkv_rope_linear_triton`` for each of its ``SWEEP_CONFIGS``.

Every output (q̃, k̃ and v) is checked against the float32 rotation of the float32 product of the same bf16 inputs
(max abs error within 2⁻⁶·max|ref|, and whether every element is within one bf16 rounding: :func:`check`); timing is
``glmvit.profiling.graph_time_us`` (20 calls in one CUDA graph, median of 50 replays), two rounds in alternating
order, the lower median kept and both recorded. A path that fails is one line, never a traceback. CUDA only (exit 2
elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/qkv_rope_ab.py --json data/sweeps/qkv_rope_ab_h100.json

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
DIM, HEADS, HEAD_DIM = 1536, 12, 128
REPLAYS = 50
BASELINE = "torch"


def check(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Max abs error; ``ok``: within 2⁻⁶·max|ref| (the band every path meets); ``one_rounding``: every element within
    2⁻⁸·|ref| + 2⁻¹²·max|ref|, one bf16 rounding of the float32 result (the fused kernel's contract; the unfused
    path rounds q and k before rotating them, which a rotation's cancellation can blow up relative to an element:
    tests/test_triton_qkv_rope_gemm.py)."""
    err = (out.float() - ref).abs()
    peak = ref.abs().max()
    max_err = err.max().item()
    return {"max_abs_err": max_err, "ok": max_err <= 2**-6 * peak.item(),
            "one_rounding": bool((err <= 2**-8 * ref.abs() + 2**-12 * peak).all())}


def reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """(M, 3·heads·d) float32: q and k of (x·Wᵀ in float32) rotated by ``apply_rotary`` in float32, v as is."""
    from glmvit.rotary import apply_rotary

    y = x.float() @ weight.float().T
    qk = y[:, : 2 * heads * cos.shape[1]]
    rotated = apply_rotary(qk.reshape(y.shape[0], 2 * heads, -1), cos, sin).reshape(qk.shape)
    return torch.cat([rotated, y[:, qk.shape[1]:]], dim=1)


def as_qkv(out: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A path's output as one (M, 3·heads·d) tensor: the unfused paths give (qkv, q̃k̃) with v in qkv."""
    if isinstance(out, torch.Tensor):
        return out
    qkv, qk = out
    return torch.cat([qk, qkv[:, qk.shape[1]:]], dim=1)


def ab_paths(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Each path's call on the same x, weight, cos and sin (module docstring)."""
    import torch.nn.functional as F

    from glmvit.kernels.triton_attention import rotate_qk_triton
    from glmvit.rotary import apply_rotary

    rows = x.shape[0]
    cu_seqlens = torch.tensor([0, rows], dtype=torch.int32, device=x.device)
    width = 2 * HEADS * HEAD_DIM

    def unfused(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv = F.linear(a, w)
        return qkv, rotate_qk_triton(qkv, cos, sin, cu_seqlens, HEADS)

    def torch_rotation(a: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qkv = F.linear(a, w)
        qk = apply_rotary(qkv[:, :width].reshape(rows, 2 * HEADS, HEAD_DIM), cos, sin)
        return qkv, qk.reshape(rows, width)

    compiled = torch.compile(torch_rotation, dynamic=False)
    out: dict[str, Callable[[], Any]] = {
        "torch": lambda: unfused(x, weight), "compiled": lambda: compiled(x, weight),
        "linear_only": lambda: F.linear(x, weight)}
    try:
        from glmvit.kernels.triton_qkv_rope_gemm import SWEEP_CONFIGS, qkv_rope_linear_triton
    except Exception:  # noqa: BLE001 - no Triton, or one without what the module needs: the caller says so
        return out
    for config in SWEEP_CONFIGS:
        out[f"triton@{config.name}"] = partial(qkv_rope_linear_triton, x, weight, cos, sin, HEADS, config)
    return out


def measure(rows: int, rounds: int = 2) -> dict[str, Any]:
    from glmvit.rotary import inv_freq, rotary_cos_sin

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(rows, DIM, device=dev, dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(3 * HEADS * HEAD_DIM, DIM, device=dev, generator=gen) * DIM**-0.5).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, rows), device=dev, generator=gen)  # patch rows and columns of large images
    cos, sin = rotary_cos_sin(ids[0], ids[1], inv_freq(HEAD_DIM).to(dev))
    ref = reference(x, weight, cos, sin, HEADS)
    paths: dict[str, dict[str, Any]] = {}
    fns: dict[str, Callable[[], Any]] = {}
    try:
        fns = ab_paths(x, weight, cos, sin)
    except Exception as err:  # noqa: BLE001
        paths["all"] = {"unavailable": one_line(err)}
    if fns and not any(p.startswith("triton@") for p in fns):
        paths["triton"] = {"unavailable": "glmvit.kernels.triton_qkv_rope_gemm does not import here"}
    paths.update(check_and_time(fns, lambda path, out: None if path == "linear_only" else check(as_qkv(out), ref),
                                rounds, REPLAYS))
    torch.cuda.empty_cache()
    return {"rows": rows, "dim": DIM, "heads": HEADS, "head_dim": HEAD_DIM, "paths": paths}


def compile_report(config, rows: int = 8192) -> dict[str, Any]:
    """Compile the kernel for sm_90 without a GPU (``--compile-only``); what its code holds, or one line why not."""
    from glmvit.kernels.triton_qkv_rope_gemm import TensorDescriptor, _qkv_rope_gemm_kernel, descriptors

    x = torch.empty(rows, DIM, dtype=torch.bfloat16)
    weight = torch.empty(3 * HEADS * HEAD_DIM, DIM, dtype=torch.bfloat16)
    y = torch.empty(rows, 3 * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    cos = torch.empty(rows, HEAD_DIM)
    descs: tuple = (x, weight, y)
    if config.tma:
        if TensorDescriptor is None:
            return {"unavailable": "this Triton has no triton.tools.tensor_descriptor"}
        descs = descriptors(x, weight, y, HEAD_DIM, config)
    args = dict(x_ptr=x, w_ptr=weight, y_ptr=y, cos_ptr=cos, sin_ptr=cos, x_desc=descs[0], w_desc=descs[1],
                y_desc=descs[2], M=rows, K=DIM)
    constants = dict(HEADS=HEADS, HALF=HEAD_DIM // 2, BLOCK_M=config.block_m, BLOCK_K=config.block_k,
                     GROUP_M=config.group_m, TMA=config.tma, ONE_DOT=config.one_dot, PERSISTENT=config.persistent,
                     HPT=config.heads_per_tile, EQ=config.equal_halves)
    return compile_sm90(_qkv_rope_gemm_kernel, args, constants, config.num_warps, config.num_stages,
                        aligned_attrs(args))


def main(argv: list[str] | None = None) -> int:
    return gemm_ab_main(argv, tool="qkv_rope_ab", doc=__doc__, rows=ROWS, module="glmvit.kernels.triton_qkv_rope_gemm",
                        compile_report=compile_report, measure=measure, baseline=BASELINE, replays=REPLAYS)


if __name__ == "__main__":
    sys.exit(main())
