"""Where uniform graphs pay: which segment lengths get graphs of their own, and from how many rows.

A uniform graph (:mod:`glmvit.graphs`: a budget captured again for batches whose segments all have L rows) runs the
``dense`` attention (:mod:`glmvit.attention`): the Triton rotation launch, then one SDPA over whole L-row segments,
cuDNN's dense kernel. The rule here is read off the attention sweep recorded on the H200
(``data/sweeps/attention_sweep_h200.json``, ``tools/attention_sweep.py``); ``tools/uniform_ab.py`` measures whole
runners with and without uniform graphs. Measured on CUDA in half precision only (:func:`uniform_graphs_pay`):
elsewhere the dense path is another computation (``apply_rotary``, then whatever SDPA kernel the device has) that
nothing here timed. A module of its own, importing nothing: commands that plan a runner (bench, serve) read it
without Triton installed.
"""
from __future__ import annotations

from typing import Iterable

# In the sweep the dense SDPA call alone takes 87 µs at eight 1024-row segments against the Triton kernel's 166 (rotary
# inside), 31 against 49 at two, 20 against 43 at sixteen 256-row segments, 9.1 against 15.5 at four; at one 256-row
# segment 8.5 against 8.8, which the rotation launch (about 30 µs at 8192 rows, a few at 256) more than eats. So
# uniform graphs are captured only where their shape holds this many rows or more, and only for segment lengths that
# make up a large share of the workload's rows (each length captures every budget once more: capture time and graph
# memory). A share of at least a quarter admits at most four lengths.
DENSE_MIN_ROWS = 1024
UNIFORM_MIN_SHARE = 0.25  # a length's share of the workload's rows for it to get graphs of its own


def uniform_lengths_for(frames: Iterable[tuple[int, int]]) -> tuple[int, ...]:
    """The segment lengths to capture uniform graphs for, ascending: of ``frames`` — (h·w rows of a frame, how many
    such frames), one pair per item of the expected workload — the lengths holding at least
    :data:`UNIFORM_MIN_SHARE` of all rows (so at most four); none for no rows."""
    rows: dict[int, int] = {}
    for length, count in frames:
        rows[length] = rows.get(length, 0) + length * count
    total = sum(rows.values())
    return tuple(sorted(length for length, r in rows.items() if r >= UNIFORM_MIN_SHARE * total))


def uniform_length(frame_rows: Iterable[int], rows: int, min_rows: int) -> int | None:
    """The segment length L of the uniform graph a batch replays in: the one h·w of its frames (``frame_rows``, one
    per item), when they all share it and the batch holds at least ``min_rows`` rows (the dense kernel computes its
    padding blocks too, so a part-full graph is judged by the rows it holds); None: its budget's ragged graph. The
    rule the runner plans by (``EncoderGraphRunner.uniform_graph``) and the one a record is read by
    (``glmvit.lab.budget_views.UniformGraphs``)."""
    lengths = set(frame_rows)
    if len(lengths) != 1 or rows < min_rows:
        return None
    return lengths.pop()


def planned_uniform_lengths(frames: Iterable[tuple[int, int]], device_type: str, dtype: str,
                            attn_backend: str | None = None) -> tuple[int, ...]:
    """What a runner planned for a known workload captures uniform graphs for by default, as ``bench`` does
    (``glmvit.cli.bench.uniform_lengths`` with ``--uniform-graphs auto``): the workload's lengths
    (:func:`uniform_lengths_for`, ``frames`` as there) where the rule was measured (:func:`uniform_graphs_pay`) and
    with the device's own attention backend; none when an ``attn_backend`` is named (that kernel everywhere) or
    elsewhere."""
    if attn_backend or not uniform_graphs_pay(device_type, dtype):
        return ()
    return uniform_lengths_for(frames)


def uniform_graphs_pay(device_type: str, dtype: str) -> bool:
    """Whether the rule above was measured where a runner would apply it: a CUDA device (``device_type``) in
    ``float16`` or ``bfloat16`` (``dtype``, torch's name), where the dense path is the Triton rotation launch and
    cuDNN's dense SDPA. Elsewhere a default leaves uniform graphs out."""
    return device_type == "cuda" and dtype in ("float16", "bfloat16")
