"""A/B: the graph-compiled forward with Inductor's matmuls as they are (cuBLAS through ATen) against Inductor's GEMM
autotuning (``max_autotune_gemm``), which times its own Triton matmul templates (persistent and TMA ones on Hopper,
split-K "decompose-K" ones for a long K) beside ATen's and keeps the fastest per shape.

At one 224² image the encoder's matmuls are parallelism-bound (a few tens of output tiles for 132 multiprocessors),
where a template with smaller tiles or a split K may fill the GPU better than cuBLAS's pick; at 8192 rows they
should not matter. The price is compile time: every matmul shape is benchmarked when the forward is compiled, so
``first_call_s`` (compile and autotune of the three stages at that row count, on a process's warm caches only for
the shapes an earlier row count shared) is recorded beside the time.

For M rows of 224² images (one 256-row segment each; M = 256, 1024, 8192), the full GLM-4.1V tower's
``forward_static`` (bf16, random weights, the default attention) compiled in regions as ``EncoderGraphRunner``
compiles it (``tools/pdl_ab.py``'s ``compiled_forward``: one specialisation per row count), per path:

- ``compiled``: Inductor's defaults;
- ``compiled+autotune``: the same compile with ``max_autotune_gemm`` over the ATEN and TRITON backends.

Both are checked against the uncompiled forward (max abs error within 2⁻⁴·max|out|: the compiled forward rounds in
other places, other matmul kernels sum in other orders, 24 blocks carry the difference; a wrong result misses by
the output's scale). Timing: ``glmvit.profiling.graph_time_us`` through ``tools/ab_common.check_and_time`` (forwards
captured in one CUDA graph, median of replays, rounds in alternating order). A path this torch refuses is one line.
CUDA only (exit 2 elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/autotune_ab.py --json data/sweeps/autotune_ab_h200.json
"""
from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import check_and_time, cuda_here, one_line, whole_image_rows, write_record  # noqa: E402
from pdl_ab import compiled_forward, forwards_per_graph  # noqa: E402

ROWS = (256, 1024, 8192)
PATHS: dict[str, dict[str, Any]] = {
    "compiled": {},
    "compiled+autotune": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"},
}
REPLAYS = 20
ROUNDS = 2


def measure(rows: int, model: Any, forwards: dict[str, Callable[..., torch.Tensor]]) -> dict[str, Any]:
    """Each path at ``rows`` rows: its first call's seconds (compile and autotune), its error against the
    uncompiled forward, its time."""
    from glmvit.metadata import BatchShape, build_metadata

    images = rows // 256
    meta = build_metadata([[1, 16, 16]] * images, 2, BatchShape(rows, images, rows)).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    pixels = torch.randn(rows, model.config.patch_dim, device="cuda", generator=gen).to(torch.bfloat16)
    reference = model.forward_static(pixels, meta).float()
    scale = reference.abs().max().item()
    first_call_s: dict[str, float] = {}

    def checked(path: str, out: torch.Tensor) -> dict[str, Any]:
        err = (out.float() - reference).abs().max().item()
        return {"max_abs_err": err, "ok": err <= 2**-4 * scale, "first_call_s": first_call_s[path]}

    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for path, forward in forwards.items():
        fn = partial(forward, pixels, meta)
        start = time.perf_counter()
        try:
            fn()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - check_and_time's call fails the same way and says it in one line
            pass
        first_call_s[path] = time.perf_counter() - start
        fns[path] = fn
    paths = check_and_time(fns, checked, ROUNDS, REPLAYS, repeats=forwards_per_graph(rows))
    torch.cuda.empty_cache()
    return {"rows": rows, "forwards_per_graph": forwards_per_graph(rows), "paths": paths}


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'rows':>6} {'path':<18} {'µs':>9} {'vs compiled':>12} {'max err':>9} {'first s':>8}  ok")
    for result in results:
        base = result["paths"].get("compiled", {}).get("us")
        for path, row in result["paths"].items():
            if "unavailable" in row:
                print(f"{result['rows']:>6} {path:<18} unavailable: {row['unavailable']}")
                continue
            ratio = f"{row['us'] / base:12.3f}" if base else " " * 12
            print(f"{result['rows']:>6} {path:<18} {row['us']:9.1f} {ratio} {row['max_abs_err']:9.2e} "
                  f"{row['first_call_s']:8.1f}  {'yes' if row['ok'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    args, rows = whole_image_rows(argv, __doc__, "autotune_ab", ROWS)
    if not cuda_here("autotune_ab", "CUDA graphs"):
        return 2
    import torch._dynamo.config as dynamo_config

    from glmvit.config import VisionConfig
    from glmvit.random_weights import random_encoder

    model = random_encoder(VisionConfig.glm41v(), torch.device("cuda"), torch.bfloat16)
    attention = model.attention_backend()
    forwards: dict[str, Callable[..., torch.Tensor]] = {}
    refused: dict[str, str] = {}
    for path, options in PATHS.items():
        try:
            forwards[path] = compiled_forward(model, options, attention)
        except Exception as err:  # noqa: BLE001 - an Inductor without the option: one line
            refused[path] = one_line(err)
    limit = 2 * len(PATHS) * len(rows) + 8  # one specialisation per path and row count, per compiled stage
    knobs = {k: max(getattr(dynamo_config, k), limit) for k in ("cache_size_limit", "recompile_limit")
             if hasattr(dynamo_config, k)}
    with torch.inference_mode(), dynamo_config.patch(**knobs):
        results = [measure(r, model, forwards) for r in rows]
    for result in results:
        result["paths"].update({path: {"unavailable": why} for path, why in refused.items()})
    print_table(results)
    write_record(args.json, {"replays": REPLAYS, "rounds": ROUNDS, "attention": attention, "paths": PATHS,
                             "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
