"""The checks every Triton launch configuration makes when it is built: tile sides a ``tl.dot`` can take (powers of
two, at least 16) and positive counts (warps, stages, groups). One line naming the field when one is not."""
from __future__ import annotations

from typing import Any


def check_launch(config: Any, tiles: tuple[str, ...], counts: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` naming the first of ``config``'s ``tiles`` fields that is not a power of two of at least
    16, or of its ``counts`` fields below 1."""
    for field in tiles:
        value = getattr(config, field)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{field}={value}: a tile side must be a power of two, at least 16 (a tl.dot tile)")
    for field in counts:
        if getattr(config, field) < 1:
            raise ValueError(f"{field}={getattr(config, field)}: must be at least 1")
