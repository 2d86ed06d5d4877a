"""A/B: the graph-compiled forward with and without programmatic dependent launch (PDL) in Inductor's kernels.

On Hopper a kernel launched with PDL may start while the kernel before it on the stream is still finishing: its
blocks run their prologue and wait (``griddepcontrol.wait``) only before their first load of the previous kernel's
results. Inductor emits that for its own Triton kernels when ``torch._inductor.config.triton.enable_pdl`` is set
(off by default; ``torch.compile(..., options={"triton.enable_pdl": True})`` sets it for one compile). In a forward of
several hundred short kernels (one 224² image: about 1.5 ms of GPU time over about 270 kernels) each boundary's
ramp-down and ramp-up is a visible share, which PDL may hide; cuBLAS's matmuls and glmvit's own Triton kernels are
launched as before either way.

For M rows of 224² images (one 256-row segment each; M = 256, 1024, 8192), the full GLM-4.1V tower's
``forward_static`` (bf16, random weights, the default attention) compiled in regions as ``EncoderGraphRunner`` compiles
it (the embedding, one block for all 24, the head), per path:

- ``compiled``: Inductor's defaults;
- ``compiled+pdl``: the same compile with ``triton.enable_pdl``.

``compiled`` is checked against the uncompiled forward (max abs error within 2⁻⁴·max|out|: the compiled forward
rounds in other places, 24 blocks carry the difference), ``compiled+pdl`` against ``compiled`` (within 2⁻⁸·max|out|:
the same kernels, launched otherwise; a broken wait reads stale data and misses by the output's scale), and whether
the two are bitwise equal is recorded (PDL changes when a kernel starts, not what it computes). Each stage is
compiled for each row count's own shape (``dynamic=False``), where the runner compiles its second budget on with
symbolic sizes: the kernels' launches, not their shapes, are what this A/B compares. Timing:
``glmvit.profiling.graph_time_us`` through ``tools/ab_common.check_and_time`` (forwards captured in one CUDA graph,
median of replays, rounds in alternating order). A path this torch refuses (an Inductor
without the option) is one line. CUDA only (exit 2 elsewhere)::

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/pdl_ab.py --json data/sweeps/pdl_ab_h200.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the A/B tools' shared loop
from ab_common import check_and_time, cuda_here, one_line, whole_image_rows, write_record  # noqa: E402

ROWS = (256, 1024, 8192)
PATHS: dict[str, dict[str, Any]] = {"compiled": {}, "compiled+pdl": {"triton.enable_pdl": True}}  # Inductor options
REPLAYS = 20
ROUNDS = 2


def forwards_per_graph(rows: int) -> int:
    """Forwards captured in one timed graph: about 20 ms of GPU work at a forward's expected cost (one 224² image
    ≈ 1.5 ms, 8192 rows ≈ 25 ms), at least one."""
    return max(1, min(20, round(20 * 256 / rows)))


def compiled_forward(model: Any, options: dict[str, Any], attention: str) -> Callable[..., torch.Tensor]:
    """``model.forward_static`` with its three stages compiled in regions under Inductor ``options``, as
    ``glmvit.graphs.EncoderGraphRunner`` compiles them (``dynamic=False``: one specialisation per row count)."""
    from glmvit.model import run_block

    compile_ = partial(torch.compile, dynamic=False, options=dict(options)) if options else partial(
        torch.compile, dynamic=False)
    parts = (compile_(model.embed), compile_(run_block), compile_(model.head))
    return partial(model.forward_static, parts=parts, attention=attention)


def measure(rows: int, model: Any, forwards: dict[str, Callable[..., torch.Tensor]]) -> dict[str, Any]:
    from glmvit.metadata import BatchShape, build_metadata

    images = rows // 256
    meta = build_metadata([[1, 16, 16]] * images, 2, BatchShape(rows, images, rows)).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(rows)
    pixels = torch.randn(rows, model.config.patch_dim, device="cuda", generator=gen).to(torch.bfloat16)
    reference = model.forward_static(pixels, meta).float()
    outputs: dict[str, torch.Tensor] = {}

    scale = reference.abs().max().item()

    def checked(path: str, out: torch.Tensor) -> dict[str, Any]:
        outputs[path] = out.clone()
        err = (out.float() - reference).abs().max().item()
        if path == "compiled" or "compiled" not in outputs:
            return {"max_abs_err": err, "ok": err <= 2**-4 * scale}
        # the same kernels as ``compiled``, launched otherwise: a stale read misses by far more than a rounding
        apart = (out.float() - outputs["compiled"].float()).abs().max().item()
        return {"max_abs_err": err, "max_abs_err_vs_compiled": apart, "ok": apart <= 2**-8 * scale}

    fns: dict[str, Callable[[], torch.Tensor]] = {path: partial(forward, pixels, meta)
                                                   for path, forward in forwards.items()}
    paths = check_and_time(fns, checked, ROUNDS, REPLAYS, repeats=forwards_per_graph(rows))
    if len(outputs) == len(PATHS):
        paths["compiled+pdl"]["bitwise_equal_to_compiled"] = bool(
            torch.equal(outputs["compiled"], outputs["compiled+pdl"]))
    torch.cuda.empty_cache()
    return {"rows": rows, "forwards_per_graph": forwards_per_graph(rows), "paths": paths}


def print_table(results: list[dict[str, Any]], first_call: bool = False) -> None:
    """Per row count and path: µs, the ratio to ``compiled``, the max error, ok (and, given ``first_call``, each
    path's first call's seconds: compile and autotune)."""
    first = f" {'first s':>8}" if first_call else ""
    print(f"{'rows':>6} {'path':<18} {'µs':>9} {'vs compiled':>12} {'max err':>9}{first}  ok")
    for result in results:
        base = result["paths"].get("compiled", {}).get("us")
        for path, row in result["paths"].items():
            if "unavailable" in row:
                print(f"{result['rows']:>6} {path:<18} unavailable: {row['unavailable']}")
                continue
            ratio = f"{row['us'] / base:12.3f}" if base else " " * 12
            first = f" {row['first_call_s']:8.1f}" if first_call else ""
            print(f"{result['rows']:>6} {path:<18} {row['us']:9.1f} {ratio} {row['max_abs_err']:9.2e}{first}  "
                  f"{'yes' if row['ok'] else 'NO'}")


Measure = Callable[[int, Any, dict[str, Callable[..., torch.Tensor]]], dict[str, Any]]


def compare_compiles(argv: list[str] | None, doc: str | None, tool: str, paths: dict[str, dict[str, Any]],
                     measure: Measure, first_call: bool = False) -> int:
    """The whole command of an A/B of Inductor options (this tool, ``tools/autotune_ab.py``): ``--rows``, ``--json``;
    on CUDA the full tower compiled per path of ``paths`` (``compiled_forward``), ``measure(rows, model, forwards)``
    per row count, the table, the record. Exit 2 without CUDA."""
    args, rows = whole_image_rows(argv, doc, tool, ROWS)
    if not cuda_here(tool, "CUDA graphs"):
        return 2
    import torch._dynamo.config as dynamo_config

    from glmvit.config import VisionConfig
    from glmvit.random_weights import random_encoder

    model = random_encoder(VisionConfig.glm41v(), torch.device("cuda"), torch.bfloat16)
    attention = model.attention_backend()
    forwards: dict[str, Callable[..., torch.Tensor]] = {}
    refused: dict[str, str] = {}
    for path, options in paths.items():
        try:
            forwards[path] = compiled_forward(model, options, attention)
        except Exception as err:  # noqa: BLE001 - an Inductor without the option: one line
            refused[path] = one_line(err)
    limit = 2 * len(paths) * len(rows) + 8  # one specialisation per path and row count, per compiled stage
    knobs = {k: max(getattr(dynamo_config, k), limit) for k in ("cache_size_limit", "recompile_limit")
             if hasattr(dynamo_config, k)}
    with torch.inference_mode(), dynamo_config.patch(**knobs):
        results = [measure(r, model, forwards) for r in rows]
    for result in results:
        result["paths"].update({path: {"unavailable": why} for path, why in refused.items()})
    print_table(results, first_call)
    write_record(args.json, {"replays": REPLAYS, "rounds": ROUNDS, "attention": attention, "paths": paths,
                             "results": results})
    return 0


def main(argv: list[str] | None = None) -> int:
    return compare_compiles(argv, __doc__, "pdl_ab", PATHS, measure)


if __name__ == "__main__":
    sys.exit(main())
