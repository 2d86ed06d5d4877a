"""A/B: a block's residual add inside the matmul that feeds it (cuBLASLt's C operand) against a matmul, then an add.

Each block ends its two halves with ``x + proj(attention)`` and ``x + down(mlp)``. The compiled forward runs each
matmul through cuBLAS and the add as an elementwise kernel (fused with the next norm where inductor can): at eight
448² images three such kernels are about 8 % of a replay (``data/bench/kernels.json``), bound by memory. cuBLASLt
computes D = A·B + β·C with C and D apart, so the add can ride in the matmul's epilogue: C is read once, in the tile
that writes D, and no kernel of its own reads and writes the rows again. torch's ``addmm`` reaches cuBLASLt only with
C = D, after copying the residual into the output (``residual_add`` in ``glmvit.model`` explains why the model
avoids it). nvmath-python (NVIDIA's binding of cuBLASLt) takes C apart, and every algorithm cuBLASLt's heuristic
ranks for the shape (``tools/skeleton_bound.py`` found up to 18 % per shape in them).

Paths per matmul (``proj``: M×1536 → 1536, ``down``: M×4096 → 1536) and row count M (256, 1024, 8192):

- ``linear``: ``F.linear`` alone (cuBLAS): what the matmul costs without the add;
- ``linear+add``: ``F.linear(x, w) + r``: the matmul, then the add kernel (the model's two launches);
- ``addmm``: ``torch.addmm(r, x, w.T)``: the residual copied into the output, then the matmul onto it;
- ``lt#K+c``: nvmath-python's ``Matmul(x, w.T, c=r, beta=1)`` with the K-th algorithm cuBLASLt ranks (the best
  of them is the row to read);
- ``lt#K``: the same without C (the matmul alone, cuBLASLt's own ranking).

Every path is checked against float32 (within 2⁻⁶·max|ref|: a few roundings of the output's scale). Weights and
residuals as a forward reads them: each call of a graph uses the next of 24 weights and 24 residuals (one per block),
so neither stays in the 50 MB L2 between calls; x is one tensor, as the rows a matmul reads were just written.
Timing: ``glmvit.profiling.graph_time_us`` (24 calls in one CUDA graph, median of the replays), best of two
alternating rounds (``tools/ab_common.check_and_time``). CUDA only (exit 2 elsewhere); without nvmath-python the
``lt`` paths are left out (the record says why)::

    python tools/residual_gemm_ab.py --json data/sweeps/residual_gemm_ab_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import check_and_time, cuda_here, one_line, parse_rows, write_record  # noqa: E402

ROWS = (256, 1024, 8192)
SHAPES = {"proj": (1536, 1536), "down": (4096, 1536)}  # (in, out) of GLM-4.1V's two residual matmuls
BLOCKS = 24  # distinct weights and residuals, one per block: what a forward streams from DRAM
LT_ALGOS = 8  # cuBLASLt heuristic algorithms tried per shape (the heuristic returned 8 on the H100)
REPLAYS = 30


def in_turn(items: list[Any]) -> Callable[[], Any]:
    """A call that returns the next of ``items`` each time (round robin): the per-call operand of a timed graph."""
    cycle = itertools.cycle(items)
    return lambda: next(cycle)


def lt_paths(x: torch.Tensor, weights: list[torch.Tensor], residuals: list[torch.Tensor], limit: int,
             with_c: bool) -> dict[str, Callable[[], torch.Tensor]]:
    """``lt#K`` (or ``lt#K+c``) paths: per ranked algorithm K, one nvmath-python plan per block weight (its
    residual bound as C when ``with_c``), called in turn. ImportError without nvmath-python."""
    from nvmath.linalg.advanced import Matmul

    def plan(i: int, algorithms: Any = None) -> tuple[Any, list[Any]]:
        mm = Matmul(x, weights[i].T, c=residuals[i] if with_c else None, beta=1.0 if with_c else None)
        found = mm.plan(algorithms=algorithms) if algorithms else mm.plan(preferences={"limit": limit})
        return mm, found

    _, ranked = plan(0)
    paths = {}
    for k, algorithm in enumerate(ranked):
        plans = [plan(i, [algorithm])[0] for i in range(len(weights))]
        step = in_turn(plans)
        paths[f"lt#{k}{'+c' if with_c else ''}"] = (
            lambda step=step: step().execute(stream=torch.cuda.current_stream()))
    return paths


def measure(name: str, rows: int, gen: torch.Generator, lt_algos: int) -> dict[str, Any]:
    """Every path for matmul ``name`` at ``rows`` rows: checked, timed; unavailable ones named with one line."""
    import torch.nn.functional as F

    k, n = SHAPES[name]
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    weights = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16) for _ in range(BLOCKS)]
    residuals = [torch.randn(rows, n, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(BLOCKS)]
    refs = [x.float() @ w.float().T + r.float() for w, r in zip(weights, residuals, strict=True)]
    paths: dict[str, Callable[[], torch.Tensor]] = {}

    def torch_path(fn: Callable[[int], torch.Tensor]) -> Callable[[], torch.Tensor]:
        block = in_turn(list(range(BLOCKS)))  # each path its own turn: its first call is block 0's
        return lambda: fn(block())

    paths["linear"] = torch_path(lambda i: F.linear(x, weights[i]))
    paths["linear+add"] = torch_path(lambda i: F.linear(x, weights[i]) + residuals[i])
    paths["addmm"] = torch_path(lambda i: torch.addmm(residuals[i], x, weights[i].T))
    missing = {}  # why the lt paths with C (``+c``) or without it are left out, each apart
    for with_c in (True, False):
        try:
            paths.update(lt_paths(x, weights, residuals, lt_algos, with_c))
        except Exception as err:  # noqa: BLE001 - no nvmath-python, or a plan cuBLASLt refuses: torch's paths run
            missing["lt+c" if with_c else "lt"] = one_line(err)

    def check(path: str, out: torch.Tensor) -> dict[str, Any]:
        """The path's first call (block 0) against float32: with the residual, or without it for a matmul alone."""
        with_residual = path.endswith(("+add", "+c")) or path == "addmm"
        ref = refs[0] if with_residual else refs[0] - residuals[0].float()
        err = (out.float() - ref).abs().max().item()
        if err > 2**-6 * ref.abs().max().item():
            raise ValueError(f"max error {err:.3g} against float32")
        return {"max_abs_err": err}

    timed = check_and_time(paths, check, rounds=2, replays=REPLAYS, repeats=BLOCKS)  # a graph: one turn
    return {"matmul": name, "rows": rows, "in": k, "out": n, "paths": timed, "lt_missing": missing}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default="residual_gemm_ab.json",
                        help="the record (default %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma list of M (default %(default)s)")
    parser.add_argument("--lt-algos", type=int, default=LT_ALGOS, help="cuBLASLt algorithms tried per shape")
    args = parser.parse_args(argv)
    chosen = parse_rows(parser, args.rows, 4, " (whole merged patches)")
    if args.lt_algos < 1:
        parser.error(f"--lt-algos must be at least 1, got {args.lt_algos}")
    if not cuda_here("residual_gemm_ab", "cuBLAS and cuBLASLt matmuls"):
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = [measure(name, rows, gen, args.lt_algos) for rows in chosen for name in SHAPES]
    for result in results:  # the matmul alone and with the add, each against its own torch path: what the
        paths = result["paths"]  # algorithm choice gains apart from what moving the add into the epilogue gains
        timed = {p: r["us"] for p, r in paths.items() if "us" in r}
        best = {kind: min((us for p, us in timed.items() if p.startswith("lt#") and p.endswith("+c") == (kind == "c")),
                          default=None) for kind in ("alone", "c")}
        line = (f"{result['matmul']:<5} {result['rows']:>6} rows: linear {timed.get('linear', 0):7.1f} µs, best lt "
                f"{best['alone'] or 0:7.1f} | linear+add {timed.get('linear+add', 0):7.1f}, addmm "
                f"{timed.get('addmm', 0):7.1f}, best lt+c {best['c'] or 0:7.1f}")
        print(line + (f"  [{result['lt_missing']}]" if result["lt_missing"] else ""))
        for path, row in paths.items():
            if "unavailable" in row:
                print(f"    {path}: {row['unavailable']}")
    write_record(args.json, {"replays": REPLAYS, "blocks": BLOCKS, "lt_algos": args.lt_algos, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
