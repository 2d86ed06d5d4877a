"""A/B: the encoder's matmuls through cuBLAS (what torch runs by default) against cuBLASLt, per shape and per forward.

torch routes every bf16 ``F.linear`` through ``at::cuda::blas::gemm``; ``torch.backends.cuda.preferred_blas_library``
picks the library behind it: ``cublas`` (what torch's ``default`` setting uses on CUDA unless
``TORCH_BLAS_PREFER_CUBLASLT`` says otherwise) or ``cublaslt``, whose heuristics choose among other kernels (split-K
and stream-K ones included) for skinny shapes. A matmul with a bias (the patch embedding's and the downsample's) may
take cuBLASLt's bias epilogue whatever the setting; those two are timed with their bias, as the model runs them.
At one 224² image the encoder's matmuls are parallelism-bound (a few tens of tiles for 132 multiprocessors), where
such kernels may win; at 8192 rows they should not matter. The choice is a process-wide switch read when a matmul is
launched, so a CUDA graph keeps the library it was captured with.

Paths, per row count M (256, 1024, 8192: 1×224², 4×224², 8×448²):

- ``gemm@NAME/LIB``: each matmul shape of one forward (``glmvit.profiling.encoder_gemms``), ``F.linear`` of
  random bf16 operands, checked against float32 (max abs error within 2⁻⁶·max|ref|);
- ``forward/LIB``: the full GLM-4.1V tower's ``forward_static`` (bf16, random weights, the default attention) on
  a batch of M rows of 224² images, checked against the cuBLAS forward (within 2⁻⁴·max|out|: two libraries sum in
  other orders, and 24 blocks carry the difference; a wrong result misses by the output's scale).

Timing: ``glmvit.profiling.graph_time_us`` through ``tools/ab_common.check_and_time`` (20 calls in one CUDA graph,
median of 50 replays, two rounds in alternating order). Per M the record also sums each library's matmul times over
one forward (each shape × how many times the forward runs it). CUDA only (exit 2 elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/blas_ab.py --json data/sweeps/blas_ab_h200.json
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import check_and_time, cuda_here, one_line, whole_image_rows, write_record  # noqa: E402

ROWS = (256, 1024, 8192)
LIBRARIES = ("cublas", "cublaslt")
BIASED = ("patch_embed", "downsample")  # the model's matmuls with a bias (glmvit.model: embed, head)
ENVIRONMENT = ("TORCH_BLAS_PREFER_CUBLASLT", "CUBLASLT_WORKSPACE_SIZE", "CUBLAS_WORKSPACE_CONFIG")
REPLAYS = 50


def with_library(library: str, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` run with ``library`` behind torch's matmuls (set at each call: a captured graph keeps what its calls
    launched), the previous choice restored after."""
    def call() -> torch.Tensor:
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            return fn()
        finally:
            torch.backends.cuda.preferred_blas_library(before)
    return call


def per_forward_us(times: dict[str, float], gemms: list[tuple[str, int, int, int, int]]) -> float:
    """One forward's matmul time: Σ over its shapes of (µs per call of that shape × how many times it runs)."""
    return sum(times[name] * count for name, _, _, _, count in gemms)


def gemm_paths(rows: int, gen: torch.Generator) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, Any]]:
    """Each of one forward's matmul shapes under each library, and the float32 references to check them by."""
    import torch.nn.functional as F

    from glmvit.config import VisionConfig
    from glmvit.profiling import encoder_gemms

    fns: dict[str, Callable[[], torch.Tensor]] = {}
    refs: dict[str, torch.Tensor] = {}
    for name, m, k, n, _ in encoder_gemms(VisionConfig.glm41v(), rows):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if name in BIASED else None
        refs[name] = x.float() @ w.float().T + (b.float() if b is not None else 0.0)
        def linear(x: torch.Tensor = x, w: torch.Tensor = w, b: torch.Tensor | None = b) -> torch.Tensor:
            return F.linear(x, w, b)

        for library in LIBRARIES:
            fns[f"gemm@{name}/{library}"] = with_library(library, linear)
    return fns, refs


def forward_paths(model: Any, rows: int, gen: torch.Generator) -> dict[str, Callable[[], torch.Tensor]]:
    """The tower's forward_static on M rows of 224² images (one 256-row segment each), under each library."""
    from glmvit.metadata import BatchShape, build_metadata

    images = rows // 256
    meta = build_metadata([[1, 16, 16]] * images, 2, BatchShape(rows, images, rows)).to("cuda")
    pixels = torch.randn(rows, model.config.patch_dim, device="cuda", generator=gen).to(torch.bfloat16)
    return {f"forward/{library}": with_library(library, lambda: model.forward_static(pixels, meta))
            for library in LIBRARIES}


def measure(rows: int, model: Any, rounds: int = 2) -> dict[str, Any]:
    from glmvit.config import VisionConfig
    from glmvit.profiling import encoder_gemms

    gen = torch.Generator(device="cuda").manual_seed(rows)
    paths: dict[str, dict[str, Any]] = {}
    try:
        fns, refs = gemm_paths(rows, gen)
        forwards = forward_paths(model, rows, gen)
    except Exception as err:  # noqa: BLE001 - one line, never a traceback
        return {"rows": rows, "paths": {"all": {"unavailable": one_line(err)}}}
    baseline_out: dict[str, torch.Tensor] = {}

    def checked(path: str, out: torch.Tensor) -> dict[str, Any]:
        if path.startswith("gemm@"):
            ref = refs[path.split("@", 1)[1].rsplit("/", 1)[0]]
            err = (out.float() - ref).abs().max().item()
            return {"max_abs_err": err, "ok": err <= 2**-6 * ref.abs().max().item()}
        if path == "forward/cublas":
            baseline_out["forward"] = out.float().clone()
            return {"max_abs_err": 0.0, "ok": True}
        if "forward" not in baseline_out:
            raise RuntimeError("no cuBLAS forward to check against (forward/cublas did not run)")
        ref = baseline_out["forward"]
        err = (out.float() - ref).abs().max().item()
        return {"max_abs_err": err, "ok": err <= 2**-4 * ref.abs().max().item()}

    paths.update(check_and_time({**fns, **forwards}, checked, rounds, REPLAYS))
    gemms = encoder_gemms(VisionConfig.glm41v(), rows)
    sums: dict[str, float | None] = {}
    for library in LIBRARIES:
        times = {name: paths.get(f"gemm@{name}/{library}", {}).get("us") for name, *_ in gemms}
        timed = {name: t for name, t in times.items() if t is not None}
        sums[library] = per_forward_us(timed, gemms) if len(timed) == len(times) else None
    torch.cuda.empty_cache()
    from glmvit.attention import resolve

    return {"rows": rows, "attention": resolve(model.attention_backend(), rows), "paths": paths,
            "matmuls_per_forward_us": sums}


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"{'rows':>6} {'path':<34} {'µs':>9} {'max err':>9}  ok")
    for result in results:
        for path, row in result["paths"].items():
            if "unavailable" in row:
                print(f"{result['rows']:>6} {path:<34} unavailable: {row['unavailable']}")
                continue
            print(f"{result['rows']:>6} {path:<34} {row['us']:9.1f} {row['max_abs_err']:9.2e}  "
                  f"{'yes' if row['ok'] else 'NO'}")
        sums = result.get("matmuls_per_forward_us", {})
        print(f"{result['rows']:>6} matmuls of one forward: " + ", ".join(
            f"{lib} {us / 1e3:.3f} ms" if us is not None else f"{lib} n/a" for lib, us in sums.items()))


def main(argv: list[str] | None = None) -> int:
    args, rows = whole_image_rows(argv, __doc__, "blas_ab", ROWS)
    if not cuda_here("blas_ab", "CUDA matmuls"):
        return 2
    from glmvit.config import VisionConfig
    from glmvit.random_weights import random_encoder

    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references stay float32
    before = torch.backends.cuda.preferred_blas_library()
    model = random_encoder(VisionConfig.glm41v(), torch.device("cuda"), torch.bfloat16)
    with torch.inference_mode():
        results = [measure(r, model) for r in rows]
    print_table(results)
    write_record(args.json, {"replays": REPLAYS, "libraries": list(LIBRARIES), "preferred_at_start": str(before),
                             "attention": model.attention_backend(),
                             "environment": {name: os.environ.get(name) for name in ENVIRONMENT}, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
