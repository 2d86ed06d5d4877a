"""The flags every command shares, defined without importing torch so that ``--help`` answers at once: one-line
argument errors, the budgets (within :mod:`glmvit.packing`'s bounds) and the model flags (:mod:`glmvit.cli.common`
re-exports every name)."""
from __future__ import annotations

import argparse
import math
from typing import Callable, Iterable, NoReturn

from ..messages import shown
from ..packing import MAX_BUDGET_TOKENS, MAX_BUDGETS, check_budgets, parse_budgets  # noqa: F401  (re-exported)
from . import one_line

DTYPE_NAMES = ("bf16", "fp16", "fp32")  # --dtype's choices: glmvit.cli.common.DTYPES maps each to its torch dtype
SEED_MAX = 2**32 - 1  # 32-bit seeds: what every generator accepts (numpy's legacy RandomState stops here)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: message``, exit status 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi] (hi None: no upper bound); anything else is a one-line error."""
    def parse(text: str) -> int:
        digits = text.strip().removeprefix("-").removeprefix("+")
        if len(digits) > 40 and digits.isascii() and digits.isdigit():  # past every bound; int() stops at 4,300
            raise argparse.ArgumentTypeError(f"{text[:12]}… ({len(digits):,} digits) is far out of range")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in [{lo:,}, {hi:,}]" if hi is not None else f"≥ {lo:,}"
            raise argparse.ArgumentTypeError(f"{value:,} is not {bound}")
        return value

    return parse


def float_in(lo: float, hi: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not a number") from None
        if not (math.isfinite(value) and lo <= value <= hi):
            raise argparse.ArgumentTypeError(f"{text if len(text) <= 24 else shown(text)} is not in [{lo:g}, {hi:g}]")
        return value

    return parse


def budgets_arg(text: str) -> tuple[int, ...] | None:
    """An argparse ``type``: budgets as text (``"64, 256"``; ``"auto"`` → None), checked by :func:`check_budgets`."""
    try:
        return check_budgets(parse_budgets(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--device, --config, --dtype, --weights, --seed: the same flags and defaults for every command."""
    g = parser.add_argument_group("model")
    g.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    g.add_argument("--config", choices=["auto", "tiny", "full"], default="auto",
                   help="random weights only: auto = the full GLM-4.1V tower on CUDA, the tiny test tower on CPU "
                        "(with --weights the checkpoint's config.json decides)")
    g.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default bf16 on CUDA, fp32 on CPU")
    g.add_argument("--weights", default=None,
                   help="a checkpoint directory or .safetensors file (default: random weights, seeded)")
    g.add_argument("--seed", type=int_in(0, SEED_MAX), default=0,
                   help="seed of the random weights and inputs (default 0)")


def output_path(text: str) -> str:
    """An argparse ``type`` for an output file: any path but the empty one (``-``: standard output)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: name a file (or - for standard output)")
    return text


def refuse_given_with(parser: argparse.ArgumentParser, args: argparse.Namespace, flag: str, names: Iterable[str],
                      why: str) -> None:
    """A usage error (one line: the flags, ``--flag``, ``why``) when ``args.<flag>`` is set and any of ``names`` was
    given too (not None); names the command does not define are skipped."""
    if not getattr(args, flag, None):
        return
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name, None) is not None]
    if given:
        parser.error(f"{', '.join(given)} with --{flag.replace('_', '-')}: {why}")
