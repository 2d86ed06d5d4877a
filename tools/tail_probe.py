"""Where does the runner's latency tail come from? A GPU diagnostic of the P99/median ratios the records show.

For one 224² image through the compiled runner (full GLM-4.1V tower, bf16, budget 64), it records per request:
the wall time (synchronised), the host time before the replay (``RunnerStats.host_s``), the GPU time of the
replay (CUDA events around ``graph.replay()``) and the SM clock, then prints percentiles, the means over the
slowest 2% vs the rest, and the correlation of wall time with host and with GPU time.

    GLMVIT_GIT_COMMIT=$(git rev-parse HEAD) python tools/tail_probe.py --requests 3000 --json tail.json
"""
import argparse
import json
import time

import numpy as np
import torch

from glmvit.config import VisionConfig
from glmvit.graphs import EncoderGraphRunner
from glmvit.model import GlmVisionEncoder
from glmvit.packing import BudgetConfig
from glmvit.provenance import git_state
from glmvit.random_weights import randomize_


class TimedGraph:
    """Wraps a captured graph: CUDA events around every replay."""

    def __init__(self, graph):
        self.graph, self.events = graph, []

    def replay(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.events.append((start, end))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--no-compile", action="store_true", help="plain CUDA graphs instead of torch.compile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = VisionConfig.glm41v()
    model = randomize_(GlmVisionEncoder(config)).to("cuda", torch.bfloat16).eval()
    grids = np.array([[1, 16, 16]])
    pixels = torch.randn(256, config.patch_dim, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        runner = EncoderGraphRunner(model, BudgetConfig((64,), 1, 1), torch_compile=not args.no_compile).capture()
        timed = runner.graphs[64].graph = TimedGraph(runner.graphs[64].graph)
        for _ in range(100):
            runner.run(pixels, grids)
        torch.cuda.synchronize()
        timed.events.clear()
        wall, host, clock = [], [], []
        for _ in range(args.requests):
            torch.cuda.synchronize()
            host0, t0 = runner.stats.host_s, time.perf_counter()
            runner.run(pixels, grids)
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            host.append((runner.stats.host_s - host0) * 1e3)
            clock.append(torch.cuda.clock_rate())
        gpu = [start.elapsed_time(end) for start, end in timed.events]
    series = {"wall_ms": np.array(wall), "host_ms": np.array(host), "gpu_ms": np.array(gpu),
              "sm_clock_mhz": np.array(clock, dtype=float)}
    tail = series["wall_ms"] > np.percentile(series["wall_ms"], 98)
    result = {name: {"p50": float(np.median(v)), "p99": float(np.percentile(v, 99)),
                     "slowest_2pct_mean": float(v[tail].mean()), "rest_mean": float(v[~tail].mean())}
              for name, v in series.items()}
    result["wall_p99_over_p50"] = result["wall_ms"]["p99"] / result["wall_ms"]["p50"]
    result["corr_wall_host"] = float(np.corrcoef(series["wall_ms"], series["host_ms"])[0, 1])
    result["corr_wall_gpu"] = float(np.corrcoef(series["wall_ms"], series["gpu_ms"])[0, 1])
    result["provenance"] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **git_state(),
                            "compiled": not args.no_compile, "requests": args.requests}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
