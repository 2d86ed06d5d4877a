"""The checks every Triton launch configuration makes when it is built: tile sides a ``tl.dot`` can take (powers of
two, at least 16) and positive counts (warps, stages, groups); and those a launch through host-built tensor
descriptors (TMA) makes of its operands. One line naming the field or operand when one is not."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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


def check_tma_operands(name: str, operands: tuple[tuple[str, "torch.Tensor"], ...]) -> None:
    """Raise ``ValueError`` naming (after ``name``, the configuration's) the first of ``operands`` — (label, 2-D
    tensor) pairs — that a tensor descriptor cannot take: rows of a multiple of 16 bytes, a 16-byte aligned start."""
    for label, t in operands:
        if (t.shape[1] * t.element_size()) % 16:
            raise ValueError(f"{name}: TMA needs rows of a multiple of 16 bytes: {label} rows of "
                             f"{t.shape[1]} {t.dtype} are {t.shape[1] * t.element_size()} bytes")
        if t.data_ptr() % 16:
            raise ValueError(f"{name}: TMA needs 16-byte aligned tensors: {label} is not")
