"""Sweep the launch configurations of glmvit's Triton kernels on this GPU; the winners become the tables in
``glmvit.kernels`` (``tests/test_kernel_tables.py`` checks the tables against the recorded sweep).

- attention: BLOCK_M × BLOCK_N × warps × stages × key splits, rotated in the loop or prerotated, on the benchmark
  layouts (one layer, 12 heads of 128), plus the best in-loop kernel without the keys' rotation (what rotating in the
  loop costs) and the prerotated path's rotation launch alone;
- skinny matmuls: split-K tile × split × pointer or TMA loads (``t``) on every matmul shape of the encoder at
  64–1024 rows, against cuBLAS.

Each timing is ``glmvit.profiling.graph_time_us`` (20 calls in one CUDA graph, median of 10 replays). CUDA only.

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/tune_kernels.py --json data/bench/tune_h200.json
"""
import argparse
import dataclasses
import itertools
import sys
from functools import partial

import torch
import torch.nn.functional as F

from glmvit.config import VisionConfig
from glmvit.kernels.triton_attention import AttnConfig, rope_varlen_attention_triton, rotate_qk_triton
from glmvit.kernels.triton_gemm import SplitK, splitk_linear_triton
from glmvit.metadata import build_metadata
from glmvit.profiling import encoder_gemms, graph_time_us
from glmvit.provenance import collect
from glmvit.records import TuneSweep, make, to_json
from glmvit.rotary import inv_freq, rotary_cos_sin

ATTN_LAYOUTS = {
    "1x224": [[1, 16, 16]],
    "4x224": [[1, 16, 16]] * 4,
    "16x112": [[1, 8, 8]] * 16,
    "8x448": [[1, 32, 32]] * 8,
    "1x1024": [[1, 74, 74]],
}
# rotated in the loop: block sizes, warps and stages (BLOCK_N 128 never came within 10 % of the best at 32b661e);
# key splits and 16-row blocks lost on every layout at 8d3b0f1, so only a sample of each is kept, for notebook 10
IN_LOOP = [AttnConfig(bm, bn, w, s) for bm, bn, w, s in
           itertools.product((32, 64, 128), (32, 64), (4, 8), (1, 2, 3)) if bm >= 64 or w == 4] + [
           AttnConfig(bm, 64, 4, 1, split_k=k) for bm in (32, 64) for k in (2, 4)] + [
           AttnConfig(16, bn, 4, s) for bn, s in ((32, 1), (32, 2), (32, 3), (64, 2))]
# prerotated: what the unrotated loop gains from pipelining (deeper stages, wider key blocks)
PREROTATED = [AttnConfig(bm, bn, w, s, prerotate=True) for bm, bn, w, s in
              itertools.product((32, 64, 128), (64, 128), (4, 8), (1, 2, 3, 4)) if bm >= 64 or w == 4]
ATTN_CONFIGS = IN_LOOP + PREROTATED


def attn_key(c: AttnConfig) -> str:
    """``64x64w4s1`` (``k4`` for four key splits, ``r`` prerotated): how tests/test_kernel_tables.py names one."""
    return (f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}" + (f"k{c.split_k}" if c.split_k > 1 else "")
            + ("r" if c.prerotate else ""))
GEMM_ROWS = (64, 256, 1024)
TILES = ((64, 64, 64, 4), (64, 128, 64, 4), (128, 64, 64, 4), (64, 64, 128, 4), (128, 128, 64, 8))
SPLITS = (1, 2, 3, 4, 6, 8)


def timed(fn):
    try:
        return graph_time_us(fn)
    except Exception as err:  # noqa: BLE001 - a configuration that does not fit (shared memory) is skipped
        return f"{type(err).__name__}: {str(err)[:80]}"


def sweep_attention(config: VisionConfig) -> dict:
    out = {}
    heads, d = config.num_heads, config.head_dim
    for name, grids in ATTN_LAYOUTS.items():
        meta = build_metadata(grids, 2).to("cuda")
        qkv = torch.randn(meta.shape.rows, 3 * heads * d, device="cuda", dtype=torch.bfloat16)
        cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(d).cuda())
        args = (qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads)
        rows = {attn_key(c): timed(partial(rope_varlen_attention_triton, *args, config=c)) for c in ATTN_CONFIGS}
        ok = {k: v for k, v in rows.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        in_loop = min((attn_key(c) for c in IN_LOOP if attn_key(c) in ok), key=ok.get)
        prerotated = min((attn_key(c) for c in PREROTATED if attn_key(c) in ok), key=ok.get)
        no_rot = dataclasses.replace(next(c for c in IN_LOOP if attn_key(c) == in_loop), rotate_k=False)
        out[name] = {"rows": meta.shape.rows, "configs": rows, "best": best, "best_us": ok[best],
                     "best_in_loop": in_loop, "best_prerotated": prerotated,
                     "best_without_key_rotation_us": timed(partial(rope_varlen_attention_triton, *args, config=no_rot)),
                     "rotation_launch_us": timed(partial(rotate_qk_triton, qkv, cos, sin, meta.cu_seqlens, heads))}
        print(f"attention {name:>8}: best {best} {ok[best]:.1f} µs; rotated in the loop {in_loop} {ok[in_loop]:.1f}, "
              f"without the keys' rotation {out[name]['best_without_key_rotation_us']:.1f}; prerotated {prerotated} "
              f"{ok[prerotated]:.1f} (its rotation launch alone {out[name]['rotation_launch_us']:.1f})", flush=True)
    return out


def sweep_gemm(config: VisionConfig) -> list:
    out = []
    shapes = {(k, n) for _, _, k, n, _ in encoder_gemms(config, 4)}
    for (k, n), m in itertools.product(sorted(shapes), GEMM_ROWS):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w)
        row = {"m": m, "k": k, "n": n, "cublas_us": timed(partial(F.linear, x, w)), "configs": {}}
        for (bm, bn, bk, warps), split, tma in itertools.product(TILES, SPLITS, (False, True)):
            if split > 1 and k // split < bk:
                continue
            c = SplitK(bm, bn, bk, split, warps, 3, tma=tma)
            key = f"{bm}x{bn}x{bk}w{warps}k{split}" + ("t" if tma else "")
            try:
                err = (splitk_linear_triton(x, w, c).float() - ref.float()).abs().max().item()
            except Exception as e:  # noqa: BLE001
                row["configs"][key] = f"{type(e).__name__}"
                continue
            row["configs"][key] = {"us": timed(partial(splitk_linear_triton, x, w, c)), "max_abs_err": err}
        ok = {kk: v["us"] for kk, v in row["configs"].items() if isinstance(v, dict) and isinstance(v["us"], float)}
        row["best"] = min(ok, key=ok.get)
        row["best_us"] = ok[row["best"]]
        print(f"gemm m={m:>5} k={k:>5} n={n:>5}: cuBLAS {row['cublas_us']:.1f} µs, best split-K {row['best']} "
              f"{row['best_us']:.1f} µs", flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--parts", default="attention,gemm")
    args = p.parse_args()
    config = VisionConfig.glm41v()
    command = " ".join([sys.executable, *sys.argv])
    result: dict = {}
    if "attention" in args.parts:
        result["attention"] = sweep_attention(config)
    if "gemm" in args.parts:
        result["gemm"] = sweep_gemm(config)
    with open(args.json, "w") as f:
        f.write(to_json(make(TuneSweep, provenance=collect("cuda", command), **result)))


if __name__ == "__main__":
    main()
