"""The main job: encode the sample images and clip in data/ and print what each item became.

On CPU the embedded default is the tiny random-weight tower in float32 (runner: ``emulate``); with CUDA it is the
full GLM-4.1V vision tower in bfloat16 (runner: CUDA graphs). ``--weights`` loads a real checkpoint instead.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path

from .flags import Parser, add_model_args

WARMUP_CALLS, TIMED_CALLS = 2, 3


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m glmvit demo", description=__doc__)
    add_model_args(parser)
    parser.add_argument("--data", type=Path, default=None,
                        help="a folder with images/ and clip.gif (default: the repository's data/)")
    args = parser.parse_args(argv)  # before torch's import: --help and a bad flag answer at once
    import torch

    from ..encoder import build_encoder
    from ..geometry import ItemSpec
    from ..graphs import EncoderGraphRunner
    from ..modes import GraphMode, RunMode
    from ..packing import BudgetConfig
    from ..processing import SAMPLE_DATA, sample_inputs
    from ..timing import summarise, time_calls
    from .common import describe, model_from_args, plural, resolve_model_args

    resolve_model_args(parser, args)
    device = torch.device(args.device)
    try:
        inputs = sample_inputs(args.data or SAMPLE_DATA)  # before the model: a wrong --data fails at once
    except (ValueError, OSError) as err:
        parser.error(str(err))
    print(f"glmvit demo: {describe(args)}")
    model = model_from_args(args)

    print(f"\n{'item':<16} {'kind':<6} {'grid [t, h, w]':<16} {'tokens':>7} {'embedding':>14} {'eager ms':>9}")
    eager = []
    with torch.inference_mode():
        for name, kind, grid, pixels in zip(inputs.sources, inputs.kinds, inputs.grid_thw, inputs.split(),
                                            strict=True):
            pixels = pixels.to(device)
            out = model(pixels, grid[None])  # the first calls of a shape pay for kernel compilation and caches
            times = time_calls(partial(model, pixels, grid[None]), device, TIMED_CALLS, warmup=WARMUP_CALLS - 1)
            ms = summarise(times)["median_ms"]
            eager.append(out)
            label = Path(name).name if name else "(array)"
            print(f"{label:<16} {kind:<6} {str(grid.tolist()):<16} {out.shape[0]:>7} {str(tuple(out.shape)):>14} "
                  f"{ms:>9.2f}")

    print(f"eager ms: the median of {TIMED_CALLS} calls per item, after {WARMUP_CALLS} warm-up calls of its shape")

    specs = [ItemSpec.from_grid(g, model.config.spatial_merge_size) for g in inputs.grid_thw.tolist()]
    config = BudgetConfig.for_requests([specs])
    runner = build_encoder(model, RunMode.GRAPH, config)
    assert isinstance(runner, EncoderGraphRunner)
    pixel_values, runs = inputs.pixel_values.to(device), []
    ms = time_calls(lambda: runs.append(runner.run(pixel_values, inputs.grid_thw)), device, 1)[0]
    outs = runs[0]
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(outs, eager, strict=True))
    what = "CUDA graphs" if runner.mode is GraphMode.CUDA else "emulated (no CUDA graphs on CPU)"
    s = runner.stats
    print(f"\nwhole batch through EncoderGraphRunner, {what}: {ms:.2f} ms, budgets {list(config.token_budgets)}, "
          f"{plural(s.replays, 'replay')}, {plural(s.fallback_items, 'eager item')}, padding {s.padding_fraction:.1%}; "
          f"max |runner − eager| = {diff:.3g}")
    if runner.mode is GraphMode.EMULATE:
        print("  emulation runs the runner's packing and static-shape path eagerly on the CPU: a check that it gives "
              "the eager answer, not a speed claim (its time includes the padding and bookkeeping graphs would hide). "
              "Next: make demo on a CUDA machine, then python -m glmvit bench, to see what the graphs save")
    return 0
