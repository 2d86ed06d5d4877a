"""A/B of whole replays: captured blocks with their two residual adds in the matmuls before them (cuBLASLt's C
operand through nvmath-python: ``glmvit.model.project_residual``, what a captured half-precision forward runs) against
the same blocks with the matmul, then the add (``glmvit.model.RESIDUAL_IN_MATMUL`` off).

``tools/residual_gemm_ab.py`` times the two matmuls alone; in the compiled forward inductor fuses the add after
``proj`` with the next norm, so what a block saves is less than the shapes' gain. This tool measures the whole tower:
two graph-compiled runners over one random GLM-4.1V tower in this process (dynamo's caches reset between, so each
compiles its own blocks); per workload each replays its budget's graph, checked against the other (within
2⁻⁴·max|out|: two forwards that round the residual sums differently, carried through 24 blocks; a dropped residual
misses by the scale), then timed as ``tools/skeleton_bound.py`` times the model: from idle (``--burst`` replays,
each after a rest) and back to back (``--seconds``), the two runners in turn. CUDA with nvmath-python only (exit 2
elsewhere)::

    python tools/lt_block_ab.py --json data/sweeps/lt_block_ab_h100.json
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared pieces
from ab_common import write_record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import glmvit.model  # noqa: E402
from glmvit.kernels.lt_gemm import nvmath_installed  # noqa: E402

WORKLOADS = {"1x224": [[1, 16, 16]], "clip8x224": [[4, 16, 16]], "8x448": [[1, 32, 32]] * 8}


def runners(workloads: dict[str, list[list[int]]]) -> dict[str, dict[str, Callable[[], Any]]]:
    """Per path (``model``: the adds apart; ``lt``: in the matmuls) and workload: a call that stages the workload's
    batch and replays once (returns the output), and the captured graph's bare replay; both runners over one
    tower."""
    from glmvit.config import VisionConfig
    from glmvit.encoder import build_encoder
    from glmvit.geometry import ItemSpec, grid_specs
    from glmvit.modes import RunMode
    from glmvit.packing import BudgetConfig
    from glmvit.random_weights import random_encoder
    from glmvit.workloads import random_batch

    config = VisionConfig.glm41v()
    model = random_encoder(config, "cuda", torch.bfloat16)
    tokens = {n: ItemSpec.total(grid_specs(g, config.spatial_merge_size)).tokens for n, g in workloads.items()}
    items = max(len(g) for g in workloads.values())
    budgets = BudgetConfig(tuple(sorted(set(tokens.values()))), min(items, min(tokens.values())), items)
    batches = {n: random_batch(g, config, seed=1) for n, g in workloads.items()}
    out: dict[str, dict[str, Callable[[], Any]]] = {}
    original = glmvit.model.RESIDUAL_IN_MATMUL
    for path in ("model", "lt"):
        torch._dynamo.reset()  # each runner compiles its own blocks
        glmvit.model.RESIDUAL_IN_MATMUL = path == "lt"
        try:
            runner = build_encoder(model, RunMode.GRAPH_COMPILED, budgets)
        finally:
            glmvit.model.RESIDUAL_IN_MATMUL = original
        for n, (pixels, grid) in batches.items():
            out.setdefault(n, {})[f"{path}:stage"] = partial(runner.replay, tokens[n], pixels.to("cuda", model.dtype),
                                                             grid)
            out[n][path] = runner.graphs[tokens[n]].graph.replay
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from gap_probe import timed
    from skeleton_bound import one_replay, summary

    results: dict[str, Any] = {}
    with torch.inference_mode():
        calls = runners(WORKLOADS)
        for n, c in calls.items():
            ref, got = c["model:stage"]().clone(), c["lt:stage"]().clone()
            err = (got.float() - ref.float()).abs().max().item()
            scale = ref.float().abs().max().item()
            if not err <= 2**-4 * scale:
                raise RuntimeError(f"{n}: the lt forward is {err:.3g} from the model's (scale {scale:.3g})")
            burst: dict[str, dict[str, list]] = {p: {"device_ms": [], "sm_mhz": [], "power_w": []}
                                                 for p in ("model", "lt")}
            for _ in range(args.burst):
                for path in ("model", "lt"):
                    time.sleep(args.rest_s)
                    for key, value in one_replay(c[path]).items():
                        burst[path][key].append(value)
            sustained = {}
            for path in ("model", "lt"):
                time.sleep(args.rest_s)
                one = timed(c[path], 1)
                sustained[path] = summary(timed(c[path], max(2, round(args.seconds * 1e3 / one["device_ms"][0]))),
                                          sustained=True)
            results[n] = {"grids": WORKLOADS[n], "max_abs_diff": err, "scale": scale,
                          "burst": {p: summary(r, sustained=False) for p, r in burst.items()}, "sustained": sustained}
            b, s = results[n]["burst"], sustained
            print(f"{n:<10} from idle: model {b['model']['ms']:.3f} ms, lt {b['lt']['ms']:.3f} | back to back: "
                  f"model {s['model']['ms']:.3f}, lt {s['lt']['ms']:.3f}  (diff {err:.2g} of {scale:.2g})")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default="lt_block_ab.json", help="the record (default %(default)s)")
    parser.add_argument("--burst", type=int, default=15, help="replays from idle per path and workload")
    parser.add_argument("--rest-s", type=float, default=0.3, help="idle seconds before each replay from idle")
    parser.add_argument("--seconds", type=float, default=3.0, help="back-to-back seconds per path and workload")
    args = parser.parse_args(argv)
    if args.burst < 1 or args.rest_s < 0 or args.seconds <= 0:
        parser.error("--burst must be at least 1, --rest-s at least 0 and --seconds above 0")
    if not torch.cuda.is_available() or not nvmath_installed():
        print("lt_block_ab times CUDA graphs with cuBLASLt through nvmath-python: this machine has "
              + ("no CUDA device" if not torch.cuda.is_available() else "no nvmath-python"), file=sys.stderr)
        return 2
    results = measure(args)
    write_record(args.json, {"burst": args.burst, "rest_s": args.rest_s, "seconds": args.seconds,
                             "workloads": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
