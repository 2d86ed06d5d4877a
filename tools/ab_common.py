"""What the A/B tools (``tools/tma_ab.py``, ``tools/swiglu_ab.py``, ``tools/qkv_rope_ab.py``, ``tools/blas_ab.py``)
share: a failure as one line, every path checked then timed in alternating rounds, a kernel compiled for sm_90
without a GPU, the ``--rows`` list, the record written with its provenance, and the two GEMM A/Bs' whole command.

Timing: ``glmvit.profiling.graph_time_us`` (``repeats`` calls captured in one CUDA graph, median of ``replays``
replays), in ``rounds`` rounds whose order alternates (first to last, then last to first), so no path always runs
first; each path keeps every round's median (``us_rounds``) and the lowest (``us``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable

import torch


def one_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message (at most 160 characters)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:160] if text else ''}"


def check_and_time(fns: dict[str, Callable[[], torch.Tensor]], check: Callable[[str, torch.Tensor], dict | None],
                   rounds: int, replays: int, repeats: int = 20) -> dict[str, dict[str, Any]]:
    """Each path's row: ``check(path, output)`` (its errors; None: nothing to check), then its timings (module
    docstring); a path that fails to run, to check or to time is ``{"unavailable": one line}``."""
    from glmvit.profiling import graph_time_us

    rows: dict[str, dict[str, Any]] = {}
    for path, fn in fns.items():
        try:
            row: dict[str, Any] = {"us_rounds": []}
            row.update(check(path, fn()) or {})
            torch.cuda.synchronize()
            rows[path] = row
        except Exception as err:  # noqa: BLE001 - a configuration this GPU or Triton refuses is one line
            rows[path] = {"unavailable": one_line(err)}
    timed = [p for p in fns if "unavailable" not in rows[p]]
    for round_ in range(rounds):
        for path in timed if round_ % 2 == 0 else timed[::-1]:
            if "unavailable" in rows[path]:
                continue
            try:
                rows[path]["us_rounds"].append(graph_time_us(fns[path], repeats=repeats, runs=replays))
            except Exception as err:  # noqa: BLE001
                rows[path] = {"unavailable": one_line(err)}
    for row in rows.values():
        if row.get("us_rounds"):
            row["us"] = min(row["us_rounds"])
    return rows


def compile_sm90(kernel: Any, args: dict[str, Any], constants: dict[str, Any], num_warps: int, num_stages: int,
                 attrs: dict | None = None) -> dict[str, Any]:
    """``kernel`` compiled for sm_90 with the installed Triton (its bundled ptxas), no GPU needed, for ``args``
    (example values: tensors, ints, descriptors) and ``constants``: its shared memory, warps, warp-group MMAs
    (``wgmma``), tensor-memory copies (``cp.async.bulk.tensor``) and pipelined copies (``cp.async``) in the PTX; or
    one line why not."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    signature = {**{k: mangle_type(v) for k, v in args.items()}, **{k: "constexpr" for k in constants}}
    try:
        compiled = triton.compile(ASTSource(kernel, signature, constants, attrs=attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as err:  # noqa: BLE001 - a configuration this Triton refuses: one line
        return {"unavailable": one_line(err)}
    ptx = compiled.asm["ptx"]
    return {"shared_bytes": compiled.metadata.shared, "warps": compiled.metadata.num_warps,
            "wgmma": ptx.count("wgmma.mma_async"), "tma_copies": ptx.count("cp.async.bulk.tensor"),
            "async_copies": ptx.count("cp.async.cg") + ptx.count("cp.async.ca")}


def aligned_attrs(args: dict[str, Any]) -> dict:
    """What a launch's specialisation tells the compiler about ``args``: 16-byte aligned pointers and sizes that are
    multiples of 16 (without it a pointer path's loads are neither vectorised nor pipelined)."""
    return {(i,): [["tt.divisibility", 16]] for i, v in enumerate(args.values())
            if isinstance(v, torch.Tensor) or (isinstance(v, int) and v % 16 == 0)}


def parse_rows(parser: argparse.ArgumentParser, text: str, multiple: int = 1, why: str = "") -> list[int]:
    """``--rows``'s comma list of M, each a positive multiple of ``multiple``; else ``parser.error`` in one line."""
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        parser.error(f"--rows {text!r}: a comma list of integers")
    if any(r < multiple or r % multiple for r in rows):
        parser.error(f"--rows {text!r}: every M must be " + (
            f"a positive multiple of {multiple}{why}" if multiple > 1 else "at least 1"))
    return rows


def whole_image_rows(argv: list[str] | None, doc: str | None, tool: str,
                     rows: tuple[int, ...]) -> tuple[argparse.Namespace, list[int]]:
    """The command line of an A/B over M rows of whole 224² images: ``--json`` (default ``TOOL.json``) and
    ``--rows`` (default ``rows``; multiples of 256, else the parser's one-line error). Returns the arguments and M."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default=f"{tool}.json", help="the record (default %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, rows)),
                        help="comma list of M, multiples of 256 (default %(default)s)")
    args = parser.parse_args(argv)
    return args, parse_rows(parser, args.rows, 256, " (whole 224² images)")


def cuda_here(tool: str, what: str) -> bool:
    """Whether CUDA runs here; if not, the one line saying that ``tool`` times ``what`` and needs it (stderr)."""
    if torch.cuda.is_available():
        return True
    print(f"{tool} times {what}: this machine has no CUDA device", file=sys.stderr)
    return False


def write_record(path: str, body: dict[str, Any]) -> None:
    """The A/B's JSON at ``path``: ``body`` after the provenance of this run (the GPU, versions, commit, command)."""
    from glmvit.provenance import collect

    record = {"provenance": collect("cuda", " ".join([sys.executable, *sys.argv])), **body}
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def print_gemm_table(results: list[dict[str, Any]], baseline: str) -> None:
    """A GEMM A/B's rows: per M and path, µs, the ratio to ``baseline``, the max error, ok and one rounding."""
    print(f"{'rows':>6} {'path':<36} {'µs':>8} {'vs ' + baseline:>11} {'max err':>9}  ok  one rounding")
    for result in results:
        paths = result["paths"]
        base = paths.get(baseline, {}).get("us")
        for path, row in paths.items():
            if "unavailable" in row:
                print(f"{result['rows']:>6} {path:<36} unavailable: {row['unavailable']}")
                continue
            ratio = f"{row['us'] / base:11.2f}" if base else " " * 11
            errors = (f"{row['max_abs_err']:9.2e}  {'yes' if row['ok'] else 'NO':<3} "
                      f"{'yes' if row['one_rounding'] else 'no'}" if "max_abs_err" in row else "")
            print(f"{result['rows']:>6} {path:<36} {row['us']:8.1f} {ratio} {errors}")


def gemm_ab_main(argv: list[str] | None, *, tool: str, doc: str | None, rows: tuple[int, ...], module: str,
                 compile_report: Callable[[Any], dict[str, Any]], measure: Callable[[int], dict[str, Any]],
                 baseline: str, replays: int) -> int:
    """The whole command of a fused-GEMM A/B (``tools/swiglu_ab.py``, ``tools/qkv_rope_ab.py``): ``--rows``,
    ``--json``, ``--compile-only`` (every ``SWEEP_CONFIGS`` entry of ``module`` compiled for sm_90, no GPU needed);
    on CUDA ``measure`` per M, the table, the record. Exit 2 without CUDA, 1 if ``module`` does not import."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", default=f"{tool}.json", help="the record (default %(default)s)")
    parser.add_argument("--rows", default=",".join(map(str, rows)), help="comma list of M (default %(default)s)")
    parser.add_argument("--compile-only", action="store_true", help="compile for sm_90 and report; no GPU needed")
    args = parser.parse_args(argv)
    chosen = parse_rows(parser, args.rows)
    if args.compile_only:
        try:
            configs = importlib.import_module(module).SWEEP_CONFIGS
        except Exception as err:  # noqa: BLE001
            print(f"{module}: {one_line(err)}", file=sys.stderr)
            return 1
        for config in configs:
            print(f"{config.name:<27} {compile_report(config)}")
        return 0
    if not torch.cuda.is_available():
        print(f"{tool} times CUDA kernels: this machine has no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference stays float32
    results = [measure(r) for r in chosen]
    print_gemm_table(results, baseline)
    write_record(args.json, {"replays": replays, "baseline": baseline, "results": results})
    return 0
