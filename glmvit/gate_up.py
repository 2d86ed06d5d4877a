"""The MLP's gate and up projections held as one weight, packed in tiles.

transformers (and every checkpoint) keeps two matrices, ``gate_proj.weight`` and ``up_proj.weight``, each
[hidden, dim]. glmvit holds them as ONE parameter ``gate_up_proj.weight`` [2·hidden, dim], so the two matmuls are one
(:func:`fuse_gate_up`), laid out in tiles of ``tile`` rows: tile j's ``tile`` gate rows, then the same ``tile`` up
rows, for j = 0 … hidden/tile − 1 (:func:`pack_gate_up`). That is the layout the fused SwiGLU GEMM's packed
configurations read (``glmvit.kernels.triton_swiglu_gemm``: one TMA tile and one dot of 2·BLOCK_N columns per K step,
BLOCK_N = ``tile``), so the model runs them with no repacking per call. A tile of ``hidden`` rows is the plain
layout [gate; up]: what the blocks' MLP uses when its width is not a multiple of ``PACK_TILE`` (the tiny test
configs), and what the merger's MLP uses always (:func:`gate_up_tile`).

The output of ``x @ gate_up_proj.weight.T`` is packed the same way along its last dim; :func:`swiglu` reads gate
and up out of it. ``state_dict()`` is transformers': its hooks unpack on save and pack on load, so the saved
tensors are copies of a packed weight (views when the tile is the whole width): fill a model in place through
:func:`writable_state`, not through ``state_dict()``, and ask :func:`state_like` for what it holds (names, shapes,
dtypes) without making those copies.

Torch only (no Triton import): the model and the weight loader import it on every platform.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.fused_gemm_table import PACK_TILE  # thresholds only: no Triton import


def gate_up_tile(hidden: int) -> int:
    """The tile of the blocks' MLP of width ``hidden``: ``PACK_TILE`` (the packed configurations' BLOCK_N) when it
    divides ``hidden``, else ``hidden`` (one tile: the plain [gate; up] layout, which the two-dot configurations
    read)."""
    return PACK_TILE if hidden % PACK_TILE == 0 else hidden


def is_packed(tile: int, hidden: int) -> bool:
    """Whether a weight of ``hidden`` gate (and up) rows in tiles of ``tile`` is read by the fused GEMM's packed
    configurations (``tile`` is ``PACK_TILE`` and smaller than ``hidden``) rather than its two-dot ones (``tile`` is
    ``hidden``: plain [gate; up]). Any other tile is a layout no configuration reads: ValueError."""
    if tile == hidden:
        return False
    if tile == PACK_TILE and hidden % tile == 0:
        return True
    raise ValueError(f"gate_up weight of {hidden} rows a half in tiles of {tile}: the fused SwiGLU GEMM reads tiles "
                     f"of {PACK_TILE} (packed) or of the whole width (plain)")


def _tiles(weight: torch.Tensor, tile: int, what: str) -> tuple[int, int]:
    """(hidden / tile, dim) of a [2·hidden, dim] weight; ValueError unless hidden is a multiple of ``tile``."""
    if weight.dim() != 2 or tile <= 0 or weight.shape[0] % (2 * tile):
        raise ValueError(f"{what}: weight {tuple(weight.shape)} does not stack gate and up halves of a multiple of "
                         f"tile={tile} rows")
    return weight.shape[0] // (2 * tile), weight.shape[1]


def pack_gate_up(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``weight`` (2·H, K) stacked plainly (gate rows 0 … H−1, then up rows H … 2H−1) re-laid in tiles of ``tile``:
    gate rows j·tile … (j+1)·tile − 1, then the same up rows, for j = 0 … H/tile − 1 (what a ``packed`` configuration
    of ``block_n = tile`` reads). A new contiguous tensor; H must be a multiple of ``tile``."""
    tiles, k = _tiles(weight, tile, "pack_gate_up")
    gate, up = weight.view(2, tiles, tile, k).unbind(0)
    return torch.stack((gate, up), dim=1).reshape(2 * tiles * tile, k)


def unpack_gate_up(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """The inverse of :func:`pack_gate_up`: [gate; up] from a weight packed in tiles of ``tile``. A view of
    ``weight`` when ``tile`` is the whole width (nothing to move), else a new contiguous tensor."""
    tiles, k = _tiles(weight, tile, "unpack_gate_up")
    return weight.view(tiles, 2, tile, k).transpose(0, 1).reshape(2 * tiles * tile, k)


def gate_up_rows(weight: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate rows and the up rows of a weight packed in tiles of ``tile``, as views of it, each
    (hidden / tile, tile, dim): gate row i is ``gate[i // tile, i % tile]``."""
    tiles, k = _tiles(weight, tile, "gate_up_rows")
    gate, up = weight.view(tiles, 2, tile, k).unbind(1)
    return gate, up


def fuse_gate_up(module: nn.Module, dim: int, hidden: int, tile: int) -> None:
    """Give ``module`` one ``gate_up_proj`` [2·hidden, dim] in place of transformers' ``gate_proj`` and ``up_proj``,
    packed in tiles of ``tile`` rows (``module.gate_up_tile``; ``hidden``: plain [gate; up]).

    A matmul of a few hundred rows by 4096 columns fills about half of an H200's multiprocessors; 8192 columns fill
    them all, and the input is read once. The checkpoint (and transformers) keeps two matrices: a load pre-hook
    concatenates ``gate_proj.weight`` and ``up_proj.weight`` and packs them; a state-dict post-hook unpacks the
    fused weight and splits it into the two keys, in transformers' key order. So ``state_dict()`` is key-for-key and
    value-for-value transformers', ``load_state_dict(strict=True)`` takes theirs, and a save → load round trip is
    exact. The saved halves are copies of a packed weight (views of it only when ``tile == hidden``): write into
    the module through :func:`writable_state`.
    """
    if tile <= 0 or hidden % tile:
        raise ValueError(f"fuse_gate_up: tile {tile} does not divide hidden {hidden}")
    module.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=False)
    module.gate_up_tile = tile  # type: ignore[assignment]  # Module's __setattr__ is typed for tensors; ints are kept
    module.register_state_dict_post_hook(_split_gate_up)
    module.register_load_state_dict_pre_hook(_merge_gate_up)


def _tile_of(module: nn.Module) -> int:
    """The tile :func:`fuse_gate_up` gave ``module`` (a plain attribute: ``vars``, not Module's typed lookup)."""
    return int(vars(module)["gate_up_tile"])


def _split_gate_up(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    keys = list(state)
    fused_key = prefix + "gate_up_proj.weight"
    after = keys[keys.index(fused_key) + 1 :]  # the module's later entries (down_proj), kept after the two halves
    fused = state.pop(fused_key)
    tail = {k: state.pop(k) for k in after}
    gate, up = unpack_gate_up(fused, _tile_of(module)).chunk(2)
    state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = gate, up
    state.update(tail)


def _merge_gate_up(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
    gate, up = prefix + "gate_proj.weight", prefix + "up_proj.weight"
    if gate in state and up in state:
        plain = torch.cat([state.pop(gate), state.pop(up)])
        state[prefix + "gate_up_proj.weight"] = pack_gate_up(plain, _tile_of(module))


def swiglu(gate_up: torch.Tensor, tile: int) -> torch.Tensor:
    """silu(gate) · up of a fused [.., 2·hidden] projection whose last dim is packed in tiles of ``tile``
    (:func:`pack_gate_up`'s layout, ``gate_up_proj``'s output): [.., hidden] in plain column order. With ``tile``
    the whole width this is ``gate, up = gate_up.chunk(2, -1)``: the same elementwise ops on the same values."""
    g = gate_up.unflatten(-1, (-1, 2, tile))
    return (F.silu(g[..., 0, :]) * g[..., 1, :]).flatten(-2)


def writable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state-dict names (and its non-persistent buffers) mapped to tensors that share its storage: what
    a loader or an initialiser fills in place. Parameters and buffers by name, detached, except that each
    ``gate_up_proj.weight`` of :func:`fuse_gate_up` is replaced by its ``gate_proj.weight`` and ``up_proj.weight``
    rows as views of the packed weight, shaped (hidden / tile, tile, dim) (:func:`gate_up_rows`). ``state_dict()``
    cannot serve: its halves of a packed weight are copies, and writes into them are lost. Write a value of the
    state-dict's shape with ``target.copy_(value.view(target.shape))``."""
    state = {name: t.detach() for name, t in (*module.named_parameters(), *module.named_buffers())}
    for name, sub in module.named_modules():
        tile = getattr(sub, "gate_up_tile", None)
        if tile is None:
            continue
        prefix = f"{name}." if name else ""
        weight = state.pop(prefix + "gate_up_proj.weight")
        state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = gate_up_rows(weight, tile)
    return state


def state_like(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()``'s entries as meta tensors: the same names in the same order, shapes and dtypes, and no
    copy of anything (``state_dict()`` unpacks a copy of every packed ``gate_up_proj.weight``: about 600 MB of bf16
    on the model's device for the GLM-4.1V tower, held at once by a caller that takes the whole dict). What
    ``_save_to_state_dict`` saves: each module's parameters, then its buffers but the non-persistent ones, module
    by module in registration order (shared modules under every name), each fused weight of :func:`fuse_gate_up`
    as its two halves in its place (the post-hook's split). No module's ``get_extra_state`` nor any other state-dict
    hook is mirrored: glmvit's modules have none."""
    state: dict[str, torch.Tensor] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        skipped: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        entries = [*sub._parameters.items(), *((n, b) for n, b in sub._buffers.items() if n not in skipped)]
        for key, tensor in entries:
            if tensor is not None:
                state[prefix + key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    for name, sub in module.named_modules(remove_duplicate=False):
        if "gate_up_tile" in vars(sub):
            _split_gate_up(sub, state, f"{name}." if name else "", None)  # the post-hook itself, on meta tensors
    return state

