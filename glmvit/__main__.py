"""``python -m glmvit COMMAND``: demo (the main job), encode, plan, bench, bench-interp."""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "demo": ("glmvit.demo", "encode the sample images and clip with the embedded default model"),
    "encode": ("glmvit.encode", "encode image/video files and print (or save) their embeddings"),
    "plan": ("glmvit.budget_cli", "pack a workload into token budgets and print the plan statistics"),
    "bench": ("glmvit.bench", "benchmark transformers vs eager vs CUDA graphs vs the GPU's floor"),
    "bench-interp": ("glmvit.kernel_bench", "benchmark the Triton interpolation kernel vs per-item grid_sample"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="python -m glmvit")
        parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
        parser.parse_args(argv[:1])
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
