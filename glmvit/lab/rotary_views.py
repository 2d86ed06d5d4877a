"""Notebook 01's pictures and stopwatch: the merge-block token order, the rotary cos/sin per head dimension, the
distinct values per dimension, and a best-of-repeats timer. CPU only; each plot returns its figure."""
from __future__ import annotations

import timeit
from typing import Any, Callable, Sequence

import numpy as np


def best_time(fn: Callable[[], Any], number: int, repeat: int = 3) -> float:
    """Seconds per call of ``fn()``: the fastest of ``repeat`` runs of ``number`` calls each."""
    if number < 1 or repeat < 1:
        raise ValueError(f"number and repeat must be positive, got {number}, {repeat}")
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def plot_token_order(h_idx: np.ndarray, w_idx: np.ndarray, h: int, w: int, m: int = 2) -> Any:
    """Token k of an ``h × w`` grid drawn at its patch ``(h_idx[k], w_idx[k])``: its number, its merge block's colour
    (tokens ``m²·b … m²·b + m² − 1`` share block b) and an arrow to token k + 1. Returns the figure."""
    import matplotlib.pyplot as plt

    if len(h_idx) != h * w or len(w_idx) != h * w:
        raise ValueError(f"need {h * w} ids for a {h} × {w} grid, got {len(h_idx)} and {len(w_idx)}")
    fig, ax = plt.subplots(figsize=(4.5, 5.5))
    image = np.zeros((h, w))
    image[h_idx, w_idx] = np.arange(h * w) // (m * m)
    ax.imshow(image, cmap="tab20", vmin=0, vmax=19)
    for k in range(h * w):
        ax.text(w_idx[k], h_idx[k] + 0.3, str(k), ha="center", va="center", fontsize=9)
        if k + 1 < h * w:
            ax.annotate("", xy=(w_idx[k + 1], h_idx[k + 1] - 0.1), xytext=(w_idx[k], h_idx[k] - 0.1),
                        arrowprops=dict(arrowstyle="->", lw=0.6, color="black", alpha=0.6))
    ax.set_xticks(range(w)), ax.set_yticks(range(h))
    ax.set_xlabel("w_idx (column)"), ax.set_ylabel("h_idx (row)")
    ax.set_title(f"token order on an {h}×{w} grid (h × w)")
    return fig


def plot_rotary(cos: Any, bands: Sequence[str] = ("h", "w", "h", "w")) -> Any:
    """``cos`` (tokens × head_dim) as an image, head dimensions down, split into ``len(bands)`` equal labelled bands
    (glmvit's ``[h | w | h | w]``). Returns the figure."""
    import matplotlib.pyplot as plt

    n, d = cos.shape
    if d % len(bands):
        raise ValueError(f"head_dim {d} does not split into {len(bands)} bands")
    width = d // len(bands)
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.imshow(np.asarray(cos).T, aspect="auto", cmap="RdBu", vmin=-1, vmax=1)
    for i, label in enumerate(bands):
        if i:
            ax.axhline(i * width - 0.5, color="black", lw=1)
        ax.text(n + 0.5, i * width + width / 2, label, va="center", fontsize=12)
    ax.set_xlabel("token k (block order)"), ax.set_ylabel("head dimension")
    ax.set_title("cos θ per token and dimension: rows of the head are [" + " | ".join(bands) + "]")
    return fig


def distinct_per_column(values: Any) -> list[int]:
    """How many distinct values each column of a 2-D array or tensor holds."""
    array = np.asarray(values)
    if array.ndim != 2:
        raise ValueError(f"need a 2-D array, got shape {array.shape}")
    return [len(np.unique(array[:, j])) for j in range(array.shape[1])]


def plot_distinct(series: dict[str, list[int]], title: str) -> Any:
    """One line per named series of per-dimension counts (``distinct_per_column``). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 2.6))
    for i, (label, counts) in enumerate(series.items()):
        ax.plot(counts, ".-", label=label, alpha=1.0 if i == 0 else 0.6)
    ax.set(xlabel="head dimension j", ylabel="distinct values", title=title)
    ax.legend()
    return fig
