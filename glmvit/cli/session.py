"""What the jobs of one recording process share: the model, its transformers twin and the measured floor.

A record run measures every result in a few long-lived processes (:mod:`glmvit.cli.recorder`). Building the tower,
copying it into transformers' model and measuring the matmul rate and copy bandwidth once per process, not once per
result, is most of what that saves. Captured graphs and compiled code are *not* shared between jobs: each job
captures its own runners, as its command does alone, and :meth:`Session.end_job` clears torch.compile's state
between jobs (so one job's compiled specialisations never count against the next job's recompile limit).
"""
from __future__ import annotations

import argparse
import gc
from typing import Any, Callable, TypeVar

import torch

from ..model import GlmVisionEncoder

T = TypeVar("T")
ModelKey = tuple[str, str, str, str | None, int]


class Session:
    """Shared objects, built on first use. ``model(args)`` hands out one model per (config, dtype, device,
    weights, seed), with ``attn_backend`` set to the flags' (None: the device's default) on every call, so one job's
    backend never leaks into the next."""

    def __init__(self) -> None:
        self._models: dict[ModelKey, GlmVisionEncoder] = {}
        self._twins: dict[int, Any] = {}
        self._floors: dict[tuple[str, str, int | None], dict[str, Any]] = {}
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

    @staticmethod
    def end_job() -> None:
        """Between jobs: free what the last job left (graphs, pools) and forget torch.compile's specialisations;
        then freeze what is left (the session's objects, imported modules, compile caches) out of the cycle
        collector's reach, so the collections of later jobs (:func:`glmvit.timing.quiet_host` collects before
        every timed loop) scan only what those jobs made. Nothing a job made outlives it unfrozen: it is collected
        first. No GPU work in a process that has not initialised CUDA (a phase's process waiting for its turn)."""
        torch._dynamo.reset()
        gc.collect()
        gc.freeze()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
