"""What the kernel A/B tools (``tools/tma_ab.py``, ``tools/swiglu_ab.py``, ``tools/qkv_rope_ab.py``) share: a failure
as one line, every path checked then timed in alternating rounds, and a kernel compiled for sm_90 without a GPU.

Timing: ``glmvit.profiling.graph_time_us`` (``repeats`` calls captured in one CUDA graph, median of ``replays``
replays), in ``rounds`` rounds whose order alternates (first to last, then last to first), so no path always runs
first; each path keeps every round's median (``us_rounds``) and the lowest (``us``).
"""
from __future__ import annotations

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
