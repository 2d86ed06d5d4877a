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
from ab_common import check_and_time  # noqa: E402
from pdl_ab import REPLAYS, ROUNDS, compare_compiles, forwards_per_graph  # noqa: E402

PATHS: dict[str, dict[str, Any]] = {
    "compiled": {},
    "compiled+autotune": {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"},
}


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


def main(argv: list[str] | None = None) -> int:
    return compare_compiles(argv, __doc__, "autotune_ab", PATHS, measure, first_call=True)


if __name__ == "__main__":
    sys.exit(main())
