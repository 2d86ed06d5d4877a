"""What the jobs of one recording process share: the model, its transformers twin, the measured floor, graph
runners and compiled code.

A record run measures every result in a few long-lived processes (:mod:`glmvit.cli.recorder`). Building the tower,
copying it into transformers' model and measuring the matmul rate and copy bandwidth once per process, not once per
result, is most of what that saves; the rest is capturing and compiling once:

- a graph runner is captured once for every job that asks for an identical one (:meth:`Session.runner`, keyed by
  everything that decides what is captured: :func:`runner_key`). Only the runners of jobs that say they share
  (:meth:`Session.begin_job`'s ``shares``) are kept, and each only while a later job of the phase shares the same
  name: its last user's :meth:`Session.end_job` frees it. A job's record says which job captured its runner;
- torch.compile's state (its compiled regions, :mod:`glmvit.graphs`) stays between jobs that keep it
  (``end_job(keep_compiled=True)``): a later compiled capture reuses what an earlier one compiled, and its record
  names the jobs whose compiled code it found. It is cleared after any other job — one that compiled something
  else (a whole forward per shape, a notebook's code) —, and never while a kept runner holds compiled
  graphs (their kernels live as long as the compiled code: the runner is freed first).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, TypeVar

import torch

from ..model import GlmVisionEncoder

if TYPE_CHECKING:
    from ..costmodel import LatencyTable
    from ..graphs import EncoderGraphRunner
    from ..packing import BudgetConfig

T = TypeVar("T")
ModelKey = tuple[str, str, str, str | None, int]
RunnerKey = tuple[Hashable, ...]


def runner_key(model: GlmVisionEncoder, mode: str, budgets: BudgetConfig, attention: str,
               table: LatencyTable | None, compile_scope: str = "blocks",
               uniform_lengths: tuple[int, ...] = ()) -> RunnerKey:
    """Everything that decides what a graph runner captures and how it routes: the model (its weights, config,
    dtype and device: one object per session), the run mode (graph or graph-compiled), whether graphs are real or
    emulated on its device, the budgets and batch limits, the attention backend, the compile scope, the segment
    lengths it captures uniform graphs for and from how many rows (:func:`~glmvit.encoder.build_encoder`'s), and
    the latency table it routes by (by content: the same table read twice is one key)."""
    from ..modes import GraphMode, RunMode
    from ..uniform import DENSE_MIN_ROWS

    routing = hashlib.sha256(repr(table).encode()).hexdigest() if table is not None else None
    uniform = (tuple(sorted(set(uniform_lengths))), DENSE_MIN_ROWS if uniform_lengths else 0)
    return (id(model), str(model.device), str(model.dtype), RunMode.parse(mode).value,
            GraphMode.for_device(model.device).value, budgets, attention, compile_scope, uniform, routing)


def capture_timed(build: Callable[[], EncoderGraphRunner], device: torch.device) -> tuple[EncoderGraphRunner,
                                                                                           float, int | None]:
    """``build()`` (a runner, captured), its seconds, and what the device's cache reserved for it (None off CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    before = torch.cuda.memory_reserved() if cuda else 0
    start = time.perf_counter()
    runner = build()
    seconds = time.perf_counter() - start
    return runner, seconds, (torch.cuda.memory_reserved() - before) if cuda else None


@dataclass
class SharedRunner:
    """A runner kept for later jobs, and where it came from (:meth:`Session.runner`'s ``source``)."""

    runner: EncoderGraphRunner
    source: dict[str, Any]
    shares: str
    users: list[str] = field(default_factory=list)
    units: dict[str, str] = field(default_factory=dict)  # the code its capture ran (glmvit.fingerprint)


class Session:
    """Shared objects, built on first use. ``model(args)`` hands out one model per (config, dtype, device,
    weights, seed), with ``attn_backend`` set to the flags' (None: the device's default) on every call, so one job's
    backend never leaks into the next."""

    def __init__(self) -> None:
        self._models: dict[ModelKey, GlmVisionEncoder] = {}
        self._twins: dict[int, Any] = {}
        self._floors: dict[tuple[str, str, int | None], dict[str, Any]] = {}
        self._runners: dict[RunnerKey, SharedRunner] = {}
        self._compiled_by: list[str] = []  # jobs whose compiled runners' code torch.compile holds now
        self._sources: dict[int, dict[str, Any]] = {}  # id(runner) → its source, for the runners of this job
        self.job: str | None = None  # the job running now (begin_job)
        self._shares: str | None = None
        self._later: frozenset[str] = frozenset()
        self.shared: dict[str, Any] = {}  # what jobs hand each other by name (the latency sweeps' eager runs)
        self.setup_units: dict[str, str] = {}  # the code that built what is shared: every job using it depends on it

    def _built(self, build: Callable[[], T]) -> T:
        """``build()``, with the code it ran added to :attr:`setup_units` (and to the job's scope, which is open)."""
        from .. import fingerprint

        with fingerprint.scope() as scope:
            built = build()
        self.setup_units.update(scope.units())
        return built

    def model(self, args: argparse.Namespace) -> GlmVisionEncoder:
        from .common import DTYPES, model_from_args

        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = (args.config, args.dtype, str(device), args.weights, args.seed)
        if key not in self._models:
            if args.config == "full" and not args.weights and device.type == "cuda":
                from ..lab.shared import full_model  # the lab's measurements share it: one tower in memory

                self._models[key] = self._built(lambda: full_model(DTYPES[args.dtype], args.seed))
            else:
                self._models[key] = self._built(lambda: model_from_args(args))
        model = self._models[key]
        model.attn_backend = getattr(args, "attn_backend", None)
        model.attention_backend()  # a clear error if the backend cannot run here
        return model.eval()

    def twin(self, model: GlmVisionEncoder) -> Any:
        """transformers' ``Glm4vVisionModel`` with ``model``'s weights (:func:`glmvit.oracle.hf_twin`), built once."""
        from ..oracle import hf_twin

        if id(model) not in self._twins:
            self._twins[id(model)] = self._built(lambda: hf_twin(model))
        return self._twins[id(model)]

    def floor(self, device: torch.device, dtype: torch.dtype, n: int | None) -> dict[str, Any]:
        """The measured matmul rate (TFLOP/s) and copy bandwidth (GB/s), once per (device, dtype, n)."""
        from ..floor import measure_copy_bandwidth, measure_matmul_tflops

        key = (str(device), str(dtype), n)
        if key not in self._floors:
            self._floors[key] = self._built(lambda: {"matmul_tflops": measure_matmul_tflops(device, dtype, n=n),
                                                     "copy_gbps": measure_copy_bandwidth(device)})
        return dict(self._floors[key])

    def begin_job(self, name: str, shares: str | None = None, later: frozenset[str] = frozenset()) -> None:
        """``name`` runs now. ``shares``: the name under which it keeps the runners it captures for later jobs
        (None: it keeps none, though it takes any runner still kept); ``later``: the ``shares`` names of the jobs
        after it in its phase (a kept runner lives while one of them may ask for it)."""
        self.job, self._shares, self._later = name, shares, frozenset(later)

    def runner(self, key: RunnerKey, build: Callable[[], EncoderGraphRunner],
               device: torch.device) -> tuple[EncoderGraphRunner, dict[str, Any]]:
        """The runner ``key`` names (:func:`runner_key`): the one kept by an earlier job, its counters zeroed, or
        ``build()`` (it captures) timed by :func:`capture_timed` and kept if this job shares. Also where it came
        from, for the record: ``captured_by`` (the job that captured it), ``reused`` (whether that was an
        earlier job), ``capture_s`` and ``capture_reserved_bytes`` of that capture, and ``compiled_after`` (for a
        compiled runner: the jobs whose compiled code torch.compile held when it was captured; empty: it compiled
        from nothing, as its command alone does)."""
        from .. import fingerprint

        kept = self._runners.get(key)
        if kept is not None:
            kept.runner.stats.reset()
            kept.users.append(self.job or "?")
            fingerprint.add_to_open(kept.units)  # the code that captured it is code this job's result depends on
            print(f"[runner] {self.job}: reusing the {kept.runner.label} runner {kept.source['captured_by']} "
                  f"captured in {kept.source['capture_s']:.1f} s", file=sys.stderr, flush=True)
            self._sources[id(kept.runner)] = {**kept.source, "reused": True}
            return kept.runner, {**kept.source, "reused": True}
        compiled_after = list(self._compiled_by)
        with fingerprint.scope() as scope:
            runner, seconds, reserved = capture_timed(build, device)
        source = {"captured_by": self.job, "reused": False, "capture_s": seconds, "capture_reserved_bytes": reserved,
                  "compiled_after": compiled_after if runner.compiled else []}
        if runner.compiled and self.job not in self._compiled_by:
            self._compiled_by.append(self.job or "?")
        if self._shares is not None:
            self._runners[key] = SharedRunner(runner, source, self._shares, [self.job or "?"], scope.units())
        self._sources[id(runner)] = source
        return runner, {**source}

    def source_of(self, runner: EncoderGraphRunner) -> dict[str, Any] | None:
        """Where a runner this job had from :meth:`runner` came from (its ``source``); None for any other."""
        source = self._sources.get(id(runner))
        return None if source is None else {**source}

    def kept_runners(self) -> dict[RunnerKey, SharedRunner]:
        """The runners kept for later jobs now (a copy)."""
        return dict(self._runners)

    def end_job(self, keep_compiled: bool = False) -> None:
        """Between jobs: free the kept runners no later job shares and what the last job left (graphs, pools);
        unless ``keep_compiled``, forget torch.compile's specialisations (after freeing every kept compiled
        runner: its graphs' kernels die with them). Then freeze what is left (the session's objects, imported
        modules, compile caches) out of the cycle collector's reach, so the collections of later jobs
        (:func:`glmvit.timing.quiet_host` collects before every timed loop) scan only what those jobs made.
        Nothing a job made outlives it unfrozen: it is collected first. No GPU work in a process that has not
        initialised CUDA (a phase's process waiting for its turn)."""
        freed = False
        for key, kept in list(self._runners.items()):
            compiled_lost = not keep_compiled and kept.runner.compiled
            if kept.shares not in self._later or compiled_lost:
                if kept.shares in self._later:
                    print(f"[runner] {self.job}: freeing the {kept.runner.label} runner {kept.source['captured_by']} "
                          f"captured (torch.compile's state is cleared after this job)", file=sys.stderr, flush=True)
                del self._runners[key]
                freed = True
        if freed:
            gc.unfreeze()  # a kept runner was frozen with the session: collectable again
        if not keep_compiled:
            torch._dynamo.reset()
            self._compiled_by.clear()
        self.job, self._shares = None, None
        self._sources.clear()
        self.collect()

    def close(self) -> None:
        """The phase is over: every kept runner and compiled specialisation freed (:meth:`end_job` with no job
        after it)."""
        self._later = frozenset()
        self.end_job()

    @staticmethod
    def collect() -> None:
        """What a job left, freed (its graphs, pools), and everything left frozen out of later collections."""
        gc.collect()
        gc.freeze()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
