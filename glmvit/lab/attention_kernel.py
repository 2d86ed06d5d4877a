"""The Triton attention kernel's source, for notebook 10b to walk (``glmvit.lab.show`` prints each).

``glmvit.kernels.triton_attention`` keeps its ``@triton.jit`` functions private. This module names the plain Python
function under each decorator, so that ``inspect.getsource`` prints the kernel as written, under the interpreter
(``TRITON_INTERPRET=1``) or compiled alike: ``rotate`` (the rotary on loaded halves), ``key_scores`` (one key
block's scores), ``online_softmax_step`` (the running max, sum and output updated by one key block),
``attention_kernel`` (one program per row block and head) and ``launcher`` (the grid and the arguments it is launched
with).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from glmvit.kernels import triton_attention


def _undecorated(kernel: Any) -> Callable[..., Any]:
    """The Python function a ``@triton.jit`` decorator wrapped (the JIT and the interpreter both keep it as ``fn``)."""
    return kernel.fn


rotate = _undecorated(triton_attention._rotate)
key_scores = _undecorated(triton_attention._key_scores)
online_softmax_step = _undecorated(triton_attention._online_softmax_step)
attention_kernel = _undecorated(triton_attention._rope_varlen_attention_kernel)
launcher = triton_attention.rope_varlen_attention_triton

__all__ = ["attention_case", "attention_kernel", "attn_key", "best_by_variant", "key_scores", "launcher",
           "online_softmax_step", "plot_paths", "plot_sweep_slices", "plot_work_list", "poison_segments",
           "rotate", "rotation_rows", "sweep_grid", "table_fit", "unfused_reference"]


# ---- notebook 10b's set-up, check and record readers (CPU code; no kernel is timed here) ----

def attention_case(grids: Any, shape: Any = None, heads: int = 2, head_dim: int = 32, seed: int = 0,
                   device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Any, Any, Any, Any]:
    """A packed batch for one attention layer: (qkv, cos, sin, meta) for ``grids`` at ``shape`` (None: the tightest),
    qkv seeded standard normal of width 3·heads·head_dim, the rotary tables of the rows' (h, w) positions."""
    from ..metadata import build_metadata
    from ..rotary import inv_freq, rotary_cos_sin

    meta = build_metadata(grids, 2, shape).to(device)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(meta.shape.rows, 3 * heads * head_dim, generator=gen).to(device, dtype)
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(head_dim).to(device))
    return qkv, cos, sin, meta


def unfused_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: Any, heads: int) -> torch.Tensor:
    """glmvit's unfused path: ``apply_rotary`` on q and k, then the ``segments`` backend (one SDPA per segment)."""
    from ..attention import attend
    from ..rotary import apply_rotary

    rows = qkv.shape[0]
    q, k, v = qkv.view(rows, 3, heads, -1).unbind(1)
    return attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, meta, "segments").reshape(rows, -1)


def plot_work_list(lengths: list[int], block_m: int) -> tuple[Any, list[int]]:
    """The programs of one head over segments of ``lengths`` packed rows, blocks of ``block_m``: blue a block in one
    segment, orange one that straddles two. Returns the figure and the straddling blocks' indices."""
    import matplotlib.pyplot as plt

    seg_of_row = np.repeat(np.arange(len(lengths)), lengths)
    fig, ax = plt.subplots(figsize=(10, 1.8))
    straddling = []
    for blk in range(-(-len(seg_of_row) // block_m)):
        rows = seg_of_row[blk * block_m:(blk + 1) * block_m]
        segs = sorted(set(rows.tolist()))
        if len(segs) > 1:
            straddling.append(blk)
        ax.barh(0, len(rows), left=blk * block_m, color=["C0", "C1", "C3"][min(len(segs), 3) - 1], edgecolor="k")
        ax.text(blk * block_m + len(rows) / 2, 0, f"prog {blk}\nseg {','.join(map(str, segs))}", ha="center",
                va="center", fontsize=8)
    for edge in np.cumsum(lengths)[:-1]:
        ax.axvline(edge, color="k", lw=2)
    ax.set_yticks([])
    ax.set_xlabel("packed row")
    ax.set_title("programs of one head: blue one segment, orange two (it loops over both)")
    fig.tight_layout()
    return fig, straddling


def poison_segments(attn: Callable[..., torch.Tensor], qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    meta: Any, heads: int) -> int:
    """Poison q, k and v of head 0 at each segment's first row in turn (a NaN) and run ``attn(qkv, cos, sin,
    segment_ids, cu_seqlens, heads)``: the segment must hold a NaN and every real row of every other segment must be
    bitwise what the clean run gave. Returns the poisonings checked; raises AssertionError naming the first that
    leaked or vanished."""
    clean = attn(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads)
    head_dim = qkv.shape[1] // (3 * heads)
    cu = meta.cu_seqlens.tolist()
    real = cu[-1]
    checked = 0
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        if b <= a:
            continue
        for part in range(3):
            bad = qkv.clone()
            bad[a, part * heads * head_dim] = float("nan")
            out = attn(bad, cos, sin, meta.segment_ids, meta.cu_seqlens, heads)
            others = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
            others[a:b] = False
            others[real:] = False  # padding rows are left as they were
            assert torch.equal(out[others], clean[others]), f"a NaN in 'qkv'[{part}] of rows {a}:{b} left them"
            assert out[a:b].isnan().any(), f"a NaN in 'qkv'[{part}] of rows {a}:{b} vanished"
            checked += 1
    return checked


def rotation_rows(tune: Any, config_for: Callable[[int], Any]) -> dict[str, dict[str, Any]]:
    """Per layout of a ``TuneSweep``: the best in-loop and prerotated times (µs, the latter with its rotation
    launch), the rotation launch, ``gain`` = 1 − prerotated / in-loop, ``saves`` = in-loop − (prerotated − rotation
    launch) (what the loop over plain keys saves), and whether ``config_for`` prerotates at its rows."""
    out = {}
    for lay, e in tune.attention.items():
        loop_us, pre_us = e["configs"][e["best_in_loop"]], e["configs"][e["best_prerotated"]]
        out[lay] = {"rows": e["rows"], "in_loop_us": loop_us, "prerotated_us": pre_us,
                    "rotation_us": e["rotation_launch_us"], "gain": 1 - pre_us / loop_us,
                    "saves": loop_us - (pre_us - e["rotation_launch_us"]),
                    "table_prerotates": bool(config_for(e["rows"]).prerotate)}
    return out


def plot_paths(rows: dict[str, dict[str, Any]]) -> Any:
    """Bars of ``rotation_rows``: the best in-loop and best prerotated time per layout, log scale, each labelled with
    its rows and the path the table takes. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = np.arange(len(rows))
    for off, key, label in ((-0.2, "in_loop_us", "rotated in the loop"), (0.2, "prerotated_us", "prerotated")):
        ax.bar(x + off, [r[key] for r in rows.values()], 0.4, label=label)
    ax.set_xticks(x, [f"{k}\n{r['rows']} rows\ntable: {'prerotated' if r['table_prerotates'] else 'in the loop'}"
                      for k, r in rows.items()])
    ax.set_title("best of each path (the prerotated one with its rotation launch)", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylabel("µs per layer (H200)")
    ax.legend()
    fig.tight_layout()
    return fig


def best_by_variant(tune: Any, variants: dict[str, Callable[[str], bool]]) -> dict[str, dict[str, float]]:
    """Per layout, per variant: the least time (µs) of the timed configurations whose key the variant keeps."""
    return {lay: {v: min(t for k, t in e["configs"].items() if isinstance(t, float) and keep(k))
                  for v, keep in variants.items()} for lay, e in tune.attention.items()}


def sweep_grid(entry: dict[str, Any], bms: list[int], bns: list[int], suffix: str) -> np.ndarray:
    """A sweep entry's times on the BLOCK_M × BLOCK_N grid for one warps/stages/path ``suffix``; NaN where untimed."""
    out = np.full((len(bms), len(bns)), np.nan)
    for i, bm in enumerate(bms):
        for j, bn in enumerate(bns):
            v = entry["configs"].get(f"{bm}x{bn}{suffix}")
            out[i, j] = v if isinstance(v, float) else np.nan
    return out


def plot_sweep_slices(tune: Any, panels: list[tuple[str, list[int], list[int], str, str]]) -> Any:
    """One heat map per (layout, BLOCK_M values, BLOCK_N values, key suffix, caption): µs per configuration.
    Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 3.6), squeeze=False)
    for ax, (lay, bms, bns, suffix, what) in zip(axes[0], panels, strict=True):
        g = sweep_grid(tune.attention[lay], bms, bns, suffix)
        ax.imshow(g, cmap="viridis_r")
        for i in range(len(bms)):
            for j in range(len(bns)):
                ax.text(j, i, f"{g[i, j]:.1f}", ha="center", va="center", color="w", fontsize=9)
        ax.set_xticks(range(len(bns)), [str(b) for b in bns])
        ax.set_yticks(range(len(bms)), [str(b) for b in bms])
        ax.set(xlabel="BLOCK_N", ylabel="BLOCK_M")
        ax.set_title(f"{lay} ({tune.attention[lay]['rows']} rows): µs, {what}", fontsize=9)
    fig.tight_layout()
    return fig


def attn_key(c: Any) -> str:
    """How ``tools/tune_kernels.py`` names an attention configuration, e.g. ``64x64w4s3r``."""
    return (f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}" + (f"k{c.split_k}" if c.split_k > 1 else "")
            + ("r" if c.prerotate else ""))


def table_fit(tune: Any, config_for: Callable[[int], Any]) -> dict[int, dict[str, Any]]:
    """Per row count of a ``TuneSweep``: its layouts, ``chosen`` (the table's configuration's worst time over them,
    as a multiple of each layout's best) and ``least`` (the least such worst any configuration timed on all of them
    reaches)."""
    def slowest(name: str, lays: list[str]) -> float:
        return max(tune.attention[lay]["configs"][name] / tune.attention[lay]["best_us"] for lay in lays)

    out = {}
    for rows in sorted({e["rows"] for e in tune.attention.values()}):
        lays = [lay for lay, e in tune.attention.items() if e["rows"] == rows]
        names = set.intersection(*({k for k, v in tune.attention[lay]["configs"].items() if isinstance(v, float)}
                                   for lay in lays))
        out[rows] = {"layouts": lays, "chosen": slowest(attn_key(config_for(rows)), lays),
                     "least": min(slowest(name, lays) for name in names)}
    return out
