"""A/B: the rotation launch before cuDNN's attention (``rotate_qk_triton``) in other shapes of its grid.

For M rows of the model's q and k (12 heads × 128, bf16; M = 256, 1024, 8192, 16384), each path writes q̃, k̃ of
every head into a (M, 2·1536) scratch from the (M, 3·1536) qkv projection:

- ``copy_only``: ``torch``'s copy of the same q and k columns into the scratch, no rotation (torch's strided copy: a
  reference, not a floor; the rotation launch beat it from 1024 rows on);
- ``rotate@ROWSxHEADSwWARPS``: ``rotate_qk_triton`` with ``block`` rows and ``heads_per_program`` heads a program
  and ``num_warps`` warps; ``rotate@32x1w4`` is what the model runs (``ROTATE_ROWS``, one head a program).

Every rotation is checked against ``glmvit.rotary.apply_rotary`` in float32 on the same bf16 inputs (within one bf16
rounding: 2⁻⁸·|ref| + 2⁻¹²·max|ref|), and against the model's grid (``rotate@32x1w4``) bit for bit (the same
arithmetic per element);
timing is ``glmvit.profiling.graph_time_us`` (20 calls in one CUDA graph, median of 50 replays), two rounds in
alternating order, the lower median kept. CUDA only::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/rotate_ab.py --json data/sweeps/rotate_ab_h100.json
"""
from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import check_and_time, parse_rows, print_gemm_table, write_record  # noqa: E402

ROWS = (256, 1024, 8192, 16384)
HEADS, HEAD_DIM = 12, 128
REPLAYS = 50
BASELINE = "rotate@32x1w4"
SHAPES = ((32, 1, 4), (64, 1, 4), (128, 1, 8), (16, 2, 4), (32, 2, 4), (64, 2, 8), (32, 4, 4), (32, 1, 2))


def measure(rows: int, rounds: int = 2) -> dict[str, Any]:
    from glmvit.kernels.triton_attention import rotate_qk_triton
    from glmvit.rotary import apply_rotary

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    width = HEADS * HEAD_DIM
    qkv = torch.randn(rows, 3 * width, device=dev, generator=gen).to(torch.bfloat16)
    angles = torch.rand(rows, HEAD_DIM // 2, device=dev, generator=gen) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1).contiguous()
    sin = torch.cat([angles.sin(), angles.sin()], -1).contiguous()
    cu_seqlens = torch.tensor([0, rows], dtype=torch.int32, device=dev)
    q, k = qkv.float()[:, :2 * width].view(rows, 2, HEADS, HEAD_DIM).unbind(1)
    ref = torch.stack([apply_rotary(t, cos, sin) for t in (q, k)], 1).reshape(rows, 2 * width)
    peak = ref.abs().max()
    scratch = torch.empty(rows, 2 * width, device=dev, dtype=torch.bfloat16)
    fns: dict[str, Callable[[], torch.Tensor]] = {"copy_only": lambda: scratch.copy_(qkv[:, :2 * width])}
    for block, heads, warps in SHAPES:
        fns[f"rotate@{block}x{heads}w{warps}"] = partial(rotate_qk_triton, qkv, cos, sin, cu_seqlens, HEADS, block,
                                                         heads, warps)
    first = fns[BASELINE]()

    def check(path: str, out: torch.Tensor) -> dict[str, Any] | None:
        if path == "copy_only":
            return None
        err = (out.float() - ref).abs()
        return {"max_abs_err": err.max().item(), "ok": bool(torch.equal(out, first)),
                "one_rounding": bool((err <= 2**-8 * ref.abs() + 2**-12 * peak).all())}

    paths = check_and_time(fns, check, rounds, REPLAYS)
    return {"rows": rows, "heads": HEADS, "head_dim": HEAD_DIM, "paths": paths}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default="rotate_ab.json", help="the record (default %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of M (default %(default)s)")
    args = parser.parse_args(argv)
    chosen = parse_rows(parser, args.rows)
    if not torch.cuda.is_available():
        print("rotate_ab times CUDA kernels: this machine has no CUDA device", file=sys.stderr)
        return 2
    results = [measure(r) for r in chosen]
    print_gemm_table(results, BASELINE)
    write_record(args.json, {"replays": REPLAYS, "baseline": BASELINE, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
