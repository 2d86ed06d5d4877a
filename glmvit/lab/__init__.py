"""The notebooks' GPU measurements as library functions, apart from the runtime path.

Each notebook result recorded in ``data/notebooks/NAME.json`` is computed by one function here, registered in
:data:`NOTEBOOK_RESULTS` as a :class:`LabResult`. A notebook calls ``run_or_replay(NAME, fn)`` with it (computed on
a CUDA GPU, replayed from the record elsewhere), and a recorder can call every ``compute`` in one process.
``profiles=True`` marks a function that attaches ``torch.profiler`` (CUPTI): it may slow every later launch in its
process, so no timing is taken in a function that profiles, and a recorder runs the timing results first.

The CPU code a notebook shows rather than inlines lives here too, one module per concept: the tape (``tape``), the
staging race and the two-thread interleaving (``staging``, ``threads``), the frame-sampling oracle
(``frame_oracle``), the seed's published numbers (``seed``), a benchmark record's tables, figures and rebuilt
batches (``bench_reading``), the kernel records' readings (``kernel_views``), the data-parallel runs
(``data_parallel``, ``dp_checks``, ``dp_hang``) and the serving pieces (``serving``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["LabResult", "NOTEBOOK_RESULTS", "show"]


@dataclass(frozen=True)
class LabResult:
    """One notebook result: its record name, the function computing its JSON-able dict, whether it profiles."""

    name: str
    compute: Callable[[], dict[str, Any]]
    profiles: bool


def show(fn: Callable[..., Any] | type) -> None:
    """Print the source of ``fn`` (a function or class of this package), for a notebook to show what it measures."""
    print(inspect.getsource(fn))


def _registry() -> dict[str, LabResult]:
    from . import benchmark, capture_replay, cuda_graphs, interpolation, static_forward, tour

    entries = [
        LabResult("00_kernel_count", tour.kernel_count, profiles=True),
        LabResult("02_interp_in_graph", interpolation.interp_in_graph, profiles=False),
        LabResult("02_interp_kernels", interpolation.interp_kernels, profiles=True),
        LabResult("03_capture_basics", cuda_graphs.graph_basics, profiles=False),
        LabResult("03_pools", cuda_graphs.pool_strategies, profiles=False),
        LabResult("03_host_syncs", cuda_graphs.host_syncs_on_gpu, profiles=False),
        LabResult("04_sync_checks", static_forward.sync_checks, profiles=False),
        LabResult("04_capture_on_a_replay_b", static_forward.capture_on_a_replay_b, profiles=False),
        LabResult("04_attention_backends", static_forward.attention_backends, profiles=False),
        LabResult("06_hand_vs_runner", capture_replay.hand_vs_runner, profiles=False),
        LabResult("06_staging_double", capture_replay.staging_double, profiles=False),
        LabResult("06_pools", capture_replay.one_pool_or_three, profiles=False),
        LabResult("06_timeline_times", capture_replay.tower_times, profiles=False),
        LabResult("06_timeline_launch", capture_replay.tower_timeline, profiles=True),
        LabResult("08_fusion", benchmark.fusion, profiles=False),
        LabResult("08_fusion_kernels", benchmark.fusion_kernels, profiles=True),
        LabResult("08_eager_busy", benchmark.eager_busy, profiles=False),
        LabResult("08_eager_kernels", benchmark.eager_kernels, profiles=True),
    ]
    return {entry.name: entry for entry in entries}


NOTEBOOK_RESULTS: dict[str, LabResult] = _registry()
