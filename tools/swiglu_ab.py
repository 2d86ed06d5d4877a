"""A/B: the MLP's gate_up matmul + SwiGLU as the model runs them against one Triton GEMM with a SwiGLU epilogue.

For M rows of the model's shapes (K = 1536 in, H = 4096 out of a [2·4096, 1536] ``gate_up_proj``; M = 256, 1024,
8192: 1×224², 4×224² and 8×448² images) and bf16 weights, each path computes silu(x·Wgᵀ)·(x·Wuᵀ):

- ``torch``: ``F.linear`` (cuBLAS, the whole 2·H columns), then ``glmvit.model.swiglu`` as torch ops: the eager
  graph's path;
- ``compiled``: the same two lines under ``torch.compile`` (cuBLAS, then inductor's fused SwiGLU kernel): what the
  graph-compiled mode replays;
- ``gate_up_only``: the cuBLAS matmul alone, the floor a fused kernel's matmul has to stay near;
- ``triton@NAME``: ``glmvit.kernels.triton_swiglu_gemm.swiglu_linear_triton`` for each of its ``SWEEP_CONFIGS``.

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

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import check_and_time, compile_sm90, one_line  # noqa: E402

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

    from glmvit.model import swiglu

    def unfused(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return swiglu(F.linear(a, w))

    compiled = torch.compile(unfused, dynamic=False)
    out: dict[str, Callable[[], torch.Tensor]] = {
        "torch": lambda: unfused(x, weight), "compiled": lambda: compiled(x, weight),
        "gate_up_only": lambda: F.linear(x, weight)}
    try:
        from glmvit.kernels.triton_swiglu_gemm import SWEEP_CONFIGS, swiglu_linear_triton
    except Exception:  # noqa: BLE001 - no Triton, or one without what the module needs: the caller says so
        return out
    for config in SWEEP_CONFIGS:
        out[f"triton@{config.name}"] = partial(swiglu_linear_triton, x, weight, config)
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
    args = dict(x_ptr=x, w_ptr=weight, y_ptr=y, x_desc=descs[0], wg_desc=descs[1], wu_desc=descs[2],
                y_desc=descs[3], M=rows, H=HIDDEN, K=DIM)
    constants = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                     TMA=config.tma, PERSISTENT=config.persistent)
    # What a launch's specialisation tells the compiler: 16-byte aligned pointers, sizes that are multiples of 16
    # (without it the pointer loads are neither vectorised nor pipelined).
    aligned = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(args.values())
               if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0)}
    return compile_sm90(_swiglu_gemm_kernel, args, constants, config.num_warps, config.num_stages, aligned)


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'rows':>6} {'path':<36} {'µs':>8} {'vs ' + BASELINE:>11} {'max err':>9}  ok  one rounding")
    for result in results:
        paths = result["paths"]
        base = paths.get(BASELINE, {}).get("us")
        for path, row in paths.items():
            if "unavailable" in row:
                print(f"{result['rows']:>6} {path:<36} unavailable: {row['unavailable']}")
                continue
            ratio = f"{row['us'] / base:11.2f}" if base else " " * 11
            errors = (f"{row['max_abs_err']:9.2e}  {'yes' if row['ok'] else 'NO':<3} "
                      f"{'yes' if row['one_rounding'] else 'no'}" if "max_abs_err" in row else "")
            print(f"{result['rows']:>6} {path:<36} {row['us']:8.1f} {ratio} {errors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default="swiglu_ab.json", help="the record (default %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of M (default %(default)s)")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: a comma list of integers")
    if any(r < 1 for r in rows):
        parser.error(f"--rows {args.rows!r}: every M must be at least 1")
    if args.compile_only:
        try:
            from glmvit.kernels.triton_swiglu_gemm import SWEEP_CONFIGS
        except Exception as err:  # noqa: BLE001
            print(f"glmvit.kernels.triton_swiglu_gemm: {one_line(err)}", file=sys.stderr)
            return 1
        for config in SWEEP_CONFIGS:
            print(f"{config.name:<27} {compile_report(config)}")
        return 0
    if not torch.cuda.is_available():
        print("swiglu_ab times CUDA kernels: this machine has no CUDA device", file=sys.stderr)
        return 2
    from glmvit.provenance import collect

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    results = [measure(r) for r in rows]
    print_table(results)
    record = {"provenance": collect("cuda", " ".join([sys.executable, *sys.argv])), "replays": REPLAYS,
              "baseline": BASELINE, "results": results}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
