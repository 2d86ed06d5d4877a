"""One interface to whatever encodes a batch: the :class:`Encoder` protocol, and :func:`build_encoder` to make one.

Two implementations: :class:`EagerEncoder` (one ``model.forward`` per batch) and
:class:`~glmvit.graphs.EncoderGraphRunner` (captured budgets, replayed). The scheduler, the data-parallel encoder and
the tools take an :class:`Encoder` and never ask which it is. An encoder's attention backend is fixed when it is
made: a later ``model.attn_backend = ...`` changes nothing it runs.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .costmodel import LatencyTable
from .graphs import EncoderGraphRunner
from .model import GlmVisionEncoder
from .modes import GraphMode, RunMode
from .packing import BudgetConfig
from .request import EncoderRequest
from .uniform import DENSE_MIN_ROWS


@runtime_checkable
class Encoder(Protocol):
    """Encodes the items of a validated request.

    ``encode(pixel_values, request, sync=...)`` takes the request's pixel rows (on any device, already checked
    finite: :meth:`GlmVisionEncoder.check_request <glmvit.model.GlmVisionEncoder.check_request>` is the boundary)
    and returns one [tokens_i, out_hidden_size] tensor per item, in order, owned by the caller. ``sync`` is
    explicit: True returns only once the outputs are computed (one host wait on CUDA), so any thread or stream may
    read them; False waits for nothing the encoder launched: the outputs are ready in the current stream's order.
    """

    @property
    def model(self) -> GlmVisionEncoder: ...

    @property
    def budgets(self) -> BudgetConfig | None: ...  # the batch limits (budgets, items, segments); None: none

    @property
    def run_mode(self) -> RunMode: ...

    @property
    def label(self) -> str: ...  # the name its results are reported under (RunMode.label)

    @property
    def attention(self) -> str: ...  # the attention backend, fixed when the encoder was made

    def encode(self, pixel_values: torch.Tensor, request: EncoderRequest, *, sync: bool) -> list[torch.Tensor]: ...


class EagerEncoder:
    """The eager baseline as an :class:`Encoder`: one ``model.forward`` per batch, split into per-item clones (no
    output keeps the batch's tensor alive, as the runner's do not). ``budgets``: the limits a runner would batch
    under, for a fair comparison (None: any batch, one forward); ``attention``: the backend (None: the model's
    now), checked here."""

    def __init__(self, model: GlmVisionEncoder, budgets: BudgetConfig | None = None, attention: str | None = None):
        if budgets is not None and not isinstance(budgets, BudgetConfig):
            raise TypeError(f"budgets must be a BudgetConfig, got {type(budgets).__name__}")
        self._model, self._budgets = model, budgets
        self._attention = model.attention_backend(attention)

    @property
    def model(self) -> GlmVisionEncoder:
        return self._model

    @property
    def budgets(self) -> BudgetConfig | None:
        return self._budgets

    @property
    def run_mode(self) -> RunMode:
        return RunMode.EAGER

    @property
    def label(self) -> str:
        return RunMode.EAGER.label(None)

    @property
    def attention(self) -> str:
        return self._attention

    def encode(self, pixel_values: torch.Tensor, request: EncoderRequest, *, sync: bool) -> list[torch.Tensor]:
        """See :class:`Encoder`."""
        with torch.inference_mode():
            out = self._model(pixel_values, request, check_finite=False, attention=self._attention)
            parts = [part.clone() for part in out.split(request.item_tokens)]
        if sync and out.device.type == "cuda":
            torch.cuda.current_stream(out.device).synchronize()
        return parts


def build_encoder(model: GlmVisionEncoder, mode: RunMode | str, budgets: BudgetConfig, *,
                  attention: str | None = None, latency_table: LatencyTable | None = None,
                  progress: bool = False, compile_scope: str = "blocks",
                  uniform_lengths: tuple[int, ...] = ()) -> EagerEncoder | EncoderGraphRunner:
    """The :class:`Encoder` of ``mode`` over ``model``, ready to encode: an :class:`EagerEncoder`, or a graph runner
    captured for ``budgets`` (real CUDA graphs on a CUDA device, emulated elsewhere: :meth:`GraphMode.for_device
    <glmvit.modes.GraphMode.for_device>`; its forward compiled for ``graph-compiled``), routing by
    ``latency_table`` when one is given, compiled in ``compile_scope``. ``attention`` (None: the model's backend
    now) is fixed for the encoder's life. A graph runner also captures uniform graphs for segments of each of
    ``uniform_lengths`` rows (``glmvit.graphs``; the dense attention), at the budgets where they hold
    :data:`~glmvit.uniform.DENSE_MIN_ROWS` rows or more. ValueError for an unknown mode or a backend
    that cannot run here."""
    run_mode = RunMode.parse(mode)
    if not run_mode.graphs:
        return EagerEncoder(model, budgets, attention)
    runner = EncoderGraphRunner(model, budgets, mode=GraphMode.for_device(model.device),
                                torch_compile=run_mode.compiled, latency_table=latency_table, progress=progress,
                                attention=attention, compile_scope=compile_scope, uniform_lengths=uniform_lengths,
                                uniform_min_rows=DENSE_MIN_ROWS if uniform_lengths else 0)
    return runner.capture()
