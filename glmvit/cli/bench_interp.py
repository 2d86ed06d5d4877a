"""GPU benchmark: the Triton position-table interpolation (one launch per batch) against the grid_sample paths.

Three ways to compute the bicubic position embedding of a batch, bf16 576×1536 table on CUDA:

- ``triton``: :func:`glmvit.kernels.interpolate_pos_embed` on precomputed device metadata, one launch;
- ``per_item``: for each item build its normalised grid, ``F.grid_sample`` on the fp32 table, then concatenate;
- ``hf_batched``: what transformers 5.x's ``Glm4vVisionEmbeddings`` does: segment ids from the lengths, one
  ``grid_sample`` over the whole batch.

Each is timed with CUDA events (warm-up, then the median of ``--runs`` single calls)::

    python -m glmvit bench-interp --json data/bench/interp.json
"""
from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from ..kernels import interpolate_pos_embed, uses_triton
from ..metadata import build_metadata
from ..provenance import collect
from ..records import InterpRecord, make
from ..timing import time_calls
from .common import Parser, check_writable, int_in, output_path, write_record

# 224² → a 16×16 patch grid; 1024² → smart_resize rounds to 1036² = 74×74 patches (an even count per side).
CASES = {
    "1 x 224²": [[1, 16, 16]],
    "4 x 224²": [[1, 16, 16]] * 4,
    "16 x 224²": [[1, 16, 16]] * 16,
    "1 x 1024²": [[1, 74, 74]],
}
PATHS = ("triton", "per_item", "hf_batched")


def _fp32_image(table: torch.Tensor) -> torch.Tensor:
    """The table as the (1, D, G, G) fp32 image grid_sample reads (transformers converts it on every call)."""
    g = int(round(table.shape[0] ** 0.5))
    return table.view(g, g, -1).permute(2, 0, 1).unsqueeze(0).float()


def _sample(image: torch.Tensor, norm_w: torch.Tensor, norm_h: torch.Tensor) -> torch.Tensor:
    grid = torch.stack((norm_w, norm_h), dim=-1).unsqueeze(0).unsqueeze(2)
    out = F.grid_sample(image, grid, mode="bicubic", align_corners=False, padding_mode="border")
    return out.squeeze(0).squeeze(-1).permute(1, 0)


def per_item(table: torch.Tensor, items: list[tuple[torch.Tensor, torch.Tensor, int, int]]) -> torch.Tensor:
    """One grid_sample per item (h_idx, w_idx, h, w), concatenated, cast to the table's dtype."""
    image = _fp32_image(table)
    outs = [_sample(image, ((w_idx + 0.5) / w) * 2 - 1, ((h_idx + 0.5) / h) * 2 - 1) for h_idx, w_idx, h, w in items]
    return torch.cat(outs).to(table.dtype)


def hf_batched(table, h_coords, w_coords, lengths, image_shapes) -> torch.Tensor:
    """transformers' Glm4vVisionEmbeddings arithmetic: one grid_sample over the packed batch."""
    image = _fp32_image(table)
    positions = torch.arange(h_coords.shape[0], device=table.device)
    seq_ids = (positions.unsqueeze(0) >= lengths.cumsum(0).unsqueeze(1)).sum(0)
    target_h = image_shapes[seq_ids, 1].to(torch.float32)
    target_w = image_shapes[seq_ids, 2].to(torch.float32)
    norm_w = ((w_coords + 0.5) / target_w) * 2 - 1
    norm_h = ((h_coords + 0.5) / target_h) * 2 - 1
    return _sample(image, norm_w, norm_h).to(table.dtype)


def make_inputs(grids, device):
    """The arguments each path takes for one batch of [1, h, w] grids, on ``device``."""
    meta = build_metadata(grids).to(device)
    h_idx, w_idx = meta.h_idx.long(), meta.w_idx.long()
    starts = [0]
    for _, h, w in grids:
        starts.append(starts[-1] + h * w)
    items = [(h_idx[a:b], w_idx[a:b], h, w) for a, b, (_, h, w) in zip(starts, starts[1:], grids, strict=False)]
    lengths = torch.tensor([h * w for _, h, w in grids], device=device)
    shapes = torch.tensor(grids, device=device)
    return {
        "triton": (meta.h_idx, meta.w_idx, meta.target_h, meta.target_w),
        "per_item": (items,),
        "hf_batched": (h_idx, w_idx, lengths, shapes),
    }


def run_path(path: str, table: torch.Tensor, args: tuple) -> torch.Tensor:
    if path == "triton":
        h_idx, w_idx, target_h, target_w = args
        return interpolate_pos_embed(table, h_idx, w_idx, target_h, target_w, check_values=False)
    return (per_item if path == "per_item" else hf_batched)(table, *args)


def time_us(fn, warmup: int, runs: int) -> float:
    """Median of ``runs`` single calls in microseconds, each bracketed by CUDA events, after ``warmup`` calls.

    A single call's events bracket its launch too: this is the cost of one call issued alone, not the in-graph
    kernel time (which a profiler of a replay reports).
    """
    return 1000 * statistics.median(time_calls(fn, "cuda", runs, warmup, on_device=True))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = Parser(prog="python -m glmvit bench-interp", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--runs", type=int_in(100, 100_000), default=200,
                        help="timed calls per measurement (100…100,000; default 200)")
    parser.add_argument("--warmup", type=int_in(0, 100_000), default=25, help="untimed calls first (default 25)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write results and provenance to this JSON file")
    args = parser.parse_args(argv)
    if args.json:
        try:
            check_writable(args.json)
        except OSError as err:
            parser.error(str(err))
    if not torch.cuda.is_available():
        sys.exit("bench-interp needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.")
    table = torch.randn(576, 1536, generator=torch.Generator().manual_seed(0)).to("cuda", torch.bfloat16)
    if not uses_triton(table):
        sys.exit("the Triton kernel is not used for a CUDA table (Triton missing, or TRITON_INTERPRET is set).")

    results = []
    header = " ".join(f"{p + ' µs':>14}" for p in PATHS)
    print(f"{'case':<10} {'tokens':>6} {header}   speedup vs per_item, hf_batched")
    for name, grids in CASES.items():
        inputs = make_inputs(grids, "cuda")
        outputs = {path: run_path(path, table, inputs[path]) for path in PATHS}
        max_diff = max((outputs["triton"].float() - outputs[p].float()).abs().max().item() for p in PATHS[1:])
        times = {p: time_us(lambda p=p, x=inputs[p]: run_path(p, table, x), args.warmup, args.runs) for p in PATHS}
        speedup = {p: times[p] / times["triton"] for p in PATHS[1:]}
        results.append({"case": name, "grids": grids, "tokens": outputs["triton"].shape[0], "median_us": times,
                        "speedup": speedup, "max_abs_diff_bf16": max_diff})
        print(f"{name:<10} {outputs['triton'].shape[0]:>6} " + " ".join(f"{times[p]:>14.1f}" for p in PATHS)
              + f"   {speedup['per_item']:>6.1f}x, {speedup['hf_batched']:.1f}x")

    if args.json:
        command = " ".join([sys.executable, "-m", "glmvit", "bench-interp", *argv])
        write_record(args.json, make(InterpRecord, provenance=collect("cuda", command), table=[576, 1536],
                                     dtype="bfloat16", interpolation="bicubic", runs=args.runs, warmup=args.warmup,
                                     results=results))
    return 0
