"""Does the GPU keep the matmul rate the floor divides by? The burst rate against the sustained one, with the SM clock.

``glmvit.floor.measure_matmul_tflops`` measures the rate every floor divides by in a burst: 8192³ bf16 matmuls,
3 warm-up calls and 10 timed, tens of milliseconds of work. A replay of eight 448² images runs about as long as
that whole burst, back to back for seconds under load, and a GPU at its power cap lowers its SM clock
(``tools/gap_probe.py`` reads it beside each replay). This probe runs the floor's own matmul back to back for
``--seconds``, in windows of ``--window-s``, and reports each window's rate, SM clock and board power; then the
burst rate as the floor measures it, after a rest. The sustained rate (the median of the second half of the windows)
bounds from below what any kernel can do in a long replay: a workload's matmul FLOPs at that rate are printed
beside the same FLOPs at the burst rate (the floor's). CUDA only (exit 2 elsewhere)::

    python tools/sustained_floor.py --seconds 20 --json /tmp/sustained_floor.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from statistics import median
from typing import Any, Callable

import torch

N = 8192  # the floor's matmul: n³, bf16 (glmvit.floor.measure_matmul_tflops)
WORKLOADS = {"img1x224": [[1, 16, 16]], "video8x224": [[4, 16, 16]], "img8x448": [[1, 32, 32]] * 8}


def _read(fn: Callable[[], float]) -> float | None:
    try:
        return float(fn())
    except Exception:  # noqa: BLE001 - pynvml missing or refusing: no reading, the rest still measured
        return None


def window_tflops(flops_per_call: int, calls: int, elapsed_ms: float) -> float:
    """TFLOP/s of ``calls`` matmuls of ``flops_per_call`` each that took ``elapsed_ms`` on the device."""
    if calls <= 0 or elapsed_ms <= 0:
        raise ValueError(f"a window needs calls > 0 and time > 0, not {calls} calls in {elapsed_ms} ms")
    return flops_per_call * calls / (elapsed_ms * 1e-3) / 1e12


def sustained(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sustained rate: the median TFLOP/s (and SM clock, power) of the second half of the windows, when the
    clock has settled; with the first window's, for the ramp."""
    if len(windows) < 2:
        raise ValueError(f"at least 2 windows are needed to tell a ramp from a steady rate, not {len(windows)}")
    late = windows[len(windows) // 2:]

    def med(key: str, rows: list[dict[str, Any]]) -> float | None:
        values = [w[key] for w in rows if w.get(key) is not None]
        return median(values) if values else None

    return {"tflops": med("tflops", late), "sm_mhz": med("sm_mhz", late), "power_w": med("power_w", late),
            "first_window": {k: windows[0].get(k) for k in ("tflops", "sm_mhz", "power_w")}}


def run_windows(seconds: float, window_s: float) -> list[dict[str, Any]]:
    """The floor's matmul back to back for ``seconds``: per window its rate, and the SM clock and power read on
    the host while the window's last matmuls run."""
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(N, N, device="cuda", dtype=torch.bfloat16)
    flops = 2 * N**3
    for _ in range(3):
        torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    start_one = torch.cuda.Event(enable_timing=True)
    end_one = torch.cuda.Event(enable_timing=True)
    start_one.record()
    torch.mm(a, b, out=out)
    end_one.record()
    end_one.synchronize()
    calls = max(1, round(window_s * 1e3 / start_one.elapsed_time(end_one)))  # matmuls per window, at burst speed
    windows, stop = [], time.perf_counter() + seconds
    while time.perf_counter() < stop:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        end.record()
        clock, power = _read(torch.cuda.clock_rate), _read(lambda: torch.cuda.power_draw() / 1e3)
        end.synchronize()
        windows.append({"tflops": window_tflops(flops, calls, start.elapsed_time(end)), "sm_mhz": clock,
                        "power_w": power, "calls": calls})
    return windows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the matmuls run back to back")
    parser.add_argument("--window-s", type=float, default=0.5, help="seconds per measured window")
    parser.add_argument("--rest-s", type=float, default=10.0, help="idle seconds before the burst measurement")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("sustained_floor: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.seconds < 2 * args.window_s:
        parser.error("--seconds must hold at least two windows")

    from glmvit.config import VisionConfig
    from glmvit.floor import flops_breakdown, measure_matmul_tflops

    windows = run_windows(args.seconds, args.window_s)
    steady = sustained(windows)
    time.sleep(args.rest_s)
    burst = measure_matmul_tflops("cuda")
    config = VisionConfig.glm41v()
    bounds = {}
    for name, grids in WORKLOADS.items():
        flops = flops_breakdown(config, grids)["matmul"]
        bounds[name] = {"matmul_gflop": flops / 1e9, "ms_at_burst": flops / (burst * 1e12) * 1e3,
                        "ms_at_sustained": flops / (steady["tflops"] * 1e12) * 1e3}
    result = {"matmul": f"{N}³ bf16", "burst_tflops": burst, "sustained": steady, "windows": windows,
              "matmul_ms": bounds}
    print(f"burst (the floor's measurement, after {args.rest_s:g} s idle): {burst:.0f} TFLOP/s")
    first = steady["first_window"]
    print(f"back to back for {args.seconds:g} s: first window {first['tflops']:.0f} TFLOP/s at {first['sm_mhz']} MHz; "
          f"second half {steady['tflops']:.0f} TFLOP/s at {steady['sm_mhz']} MHz, {steady['power_w']} W "
          f"({steady['tflops'] / burst:.2f}× the burst)")
    for name, b in bounds.items():
        print(f"  {name:<11} matmuls {b['matmul_gflop']:8.0f} GFLOP: {b['ms_at_burst']:.2f} ms at the burst rate, "
              f"{b['ms_at_sustained']:.2f} ms at the sustained rate")
    if args.json:
        from glmvit.provenance import collect

        command = " ".join(["python", "tools/sustained_floor.py", *(sys.argv[1:] if argv is None else argv)])
        result["provenance"] = collect("cuda", command)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
