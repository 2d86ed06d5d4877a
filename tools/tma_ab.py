"""A/B: the readable kernel's best long-segment configuration against the Hopper-shaped attention's, one command.

A: ``rope_varlen_attention_triton`` with ``AttnConfig(128, 64, 8, 3, prerotate=True)`` (128x64w8s3r: the rotation
launch, then the prerotated attention). B: the same rotation launch (``rotate_qk_triton``), then
``glmvit.kernels.triton_attention_tma.attend_prerotated_tma`` for each of its ``SWEEP_CONFIGS``; B's attention is
also timed alone on a rotated scratch made once, and the rotation launch alone, so A's attention is about A minus
the rotation. Layouts (``tools/attention_sweep.py``'s, 12 heads of 128, bf16): 8x1024, 1x5329, 4x256.

Every output is checked against the float32 reference with the sweep's bf16 bounds (max and RMS error); timing is
``glmvit.profiling.graph_time_us`` (20 calls in one CUDA graph, median of 50 replays), in two rounds in alternating
order (A first, then B first), the lower median kept and both recorded. A path that fails is one line, never a
traceback. CUDA only (exit 2 elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/tma_ab.py --json data/sweeps/tma_ab_h200.json

``--compile-only`` needs no GPU: it compiles every configuration for sm_90 with the installed Triton (its bundled
ptxas) at the A/B's sizes and prints what Hopper gets: shared memory, warps (a split loop has more than asked),
warp-group MMAs (``wgmma``) and tensor-memory copies (``cp.async.bulk.tensor``) in the PTX.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sweep's layouts, reference and error bounds
from ab_common import check_and_time, compile_sm90, one_line, write_record  # noqa: E402
from attention_sweep import HEAD_DIM, HEADS, LAYOUTS, REPLAYS, check, layout_inputs, layout_names  # noqa: E402

AB_LAYOUTS = ("8x1024", "1x5329", "4x256")
BASELINE = "readable@128x64w8s3r"


def ab_paths(qkv, cos, sin, segment_ids, cu) -> dict[str, Callable[[], torch.Tensor]]:
    """A, then B's configurations (rotation + attention, and attention alone), then the rotation alone."""
    from glmvit.kernels.triton_attention import AttnConfig, rope_varlen_attention_triton, rotate_qk_triton
    from glmvit.kernels.triton_attention_tma import SWEEP_CONFIGS, attend_prerotated_tma

    best = AttnConfig(128, 64, 8, 3, prerotate=True)
    out: dict[str, Callable[[], torch.Tensor]] = {
        BASELINE: lambda: rope_varlen_attention_triton(qkv, cos, sin, segment_ids, cu, HEADS, best)}
    scratch = rotate_qk_triton(qkv, cos, sin, cu, HEADS)  # for the attention-alone timings
    for config in SWEEP_CONFIGS:
        out[f"tma@{config.name}"] = (
            lambda c=config: attend_prerotated_tma(qkv, rotate_qk_triton(qkv, cos, sin, cu, HEADS), cu, HEADS, c))
        out[f"tma@{config.name}/attention"] = lambda c=config: attend_prerotated_tma(qkv, scratch, cu, HEADS, c)
    out["rotation_launch"] = lambda: rotate_qk_triton(qkv, cos, sin, cu, HEADS)
    return out


def measure(lengths: tuple[int, ...], rounds: int = 2) -> dict[str, Any]:
    inputs = layout_inputs(lengths)
    layout, qkv, cos, sin, cu, v, ref = (inputs.layout, inputs.qkv, inputs.cos, inputs.sin, inputs.cu, inputs.v,
                                         inputs.ref)
    segment_ids = inputs.meta.segment_ids
    n = layout.real_rows
    rows: dict[str, dict[str, Any]] = {}
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    try:
        fns = ab_paths(qkv, cos, sin, segment_ids, cu)
    except Exception as err:  # noqa: BLE001 - e.g. a Triton without what the new module needs: one line
        rows["tma"] = {"unavailable": one_line(err)}
    def checked(path: str, out: torch.Tensor) -> dict | None:
        return None if path == "rotation_launch" else check(out[:n].view(n, HEADS, HEAD_DIM), ref, v[:n])

    rows.update(check_and_time(fns, checked, rounds, REPLAYS))
    torch.cuda.empty_cache()
    return {"lengths": list(lengths), "rows": layout.rows, "paths": rows}


def compile_report(config, rows: int = 8192, segments: int = 64, rotated: bool = False) -> dict[str, Any]:
    """Compile the attention for sm_90 without a GPU (``--compile-only``); what its code holds, or one line why not.
    ``rotated``: q̃, k̃ read from qkv itself (row stride 3·heads·d), as after the fused rotary qkv GEMM."""
    import triton

    from glmvit.kernels.triton_attention_tma import TensorDescriptor, _varlen_attention_tma_kernel

    qkv = torch.empty(rows, 3 * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    qk = qkv if rotated else torch.empty(rows, 2 * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    srcs: list[Any] = [qk, qk, qkv]
    if config.descriptors == "host":
        blocks = (config.block_m, config.block_n, config.block_n)
        srcs = [TensorDescriptor.from_tensor(t, [b, HEAD_DIM]) for t, b in zip(srcs, blocks, strict=True)]
    cu = torch.zeros(segments + 1, dtype=torch.int32)
    out = torch.empty(rows, HEADS * HEAD_DIM, dtype=torch.bfloat16)
    args = dict(q_src=srcs[0], k_src=srcs[1], v_src=srcs[2], cu_seqlens_ptr=cu, out_ptr=out, qk_scale=0.1, ROWS=rows)
    constants = dict(SEGMENTS=segments, SLOTS=triton.next_power_of_2(segments), HEADS=HEADS, D=HEAD_DIM,
                     QK_STRIDE=qk.shape[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                     NUM_STAGES=config.num_stages,
                     WARP_SPECIALIZE=config.warp_specialize, DESCRIPTORS=config.descriptors)
    return compile_sm90(_varlen_attention_tma_kernel, args, constants, config.num_warps, config.num_stages)


def print_table(layouts: dict[str, Any]) -> None:
    print(f"{'layout':>8} {'path':<32} {'µs':>8} {'vs A':>6} {'max err':>9} {'rms rel':>8}  ok")
    for name, layout in layouts.items():
        paths = layout["paths"]
        base = paths.get(BASELINE, {}).get("us")
        for path, row in paths.items():
            if "unavailable" in row:
                print(f"{name:>8} {path:<32} unavailable: {row['unavailable']}")
                continue
            ratio = f"{row['us'] / base:6.2f}" if base and "/" not in path and path != "rotation_launch" else " " * 6
            errors = (f"{row['max_abs_err']:9.2e} {row['rms_rel_err']:8.1e}  {'yes' if row['ok'] else 'NO'}"
                      if "max_abs_err" in row else "")
            print(f"{name:>8} {path:<32} {row['us']:8.1f} {ratio} {errors}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default="tma_ab.json", help="the record (default %(default)s)")
    parser.add_argument("--layouts", default=",".join(AB_LAYOUTS), help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    args = parser.parse_args(argv)
    if args.compile_only:
        from glmvit.kernels.triton_attention_tma import SWEEP_CONFIGS

        for config in SWEEP_CONFIGS:
            print(f"{config.name:<20} {compile_report(config)}")
            print(f"{config.name + ' @qkv':<20} {compile_report(config, rotated=True)}")
        return 0
    names = layout_names(parser, args.layouts)
    if not torch.cuda.is_available():
        print("tma_ab times CUDA kernels: this machine has no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    import triton

    layouts = {n: measure(LAYOUTS[n]) for n in names}
    print_table(layouts)
    write_record(args.json, {"triton": triton.__version__, "heads": HEADS, "head_dim": HEAD_DIM, "replays": REPLAYS,
                             "baseline": BASELINE, "layouts": layouts})
    return 0


if __name__ == "__main__":
    sys.exit(main())
