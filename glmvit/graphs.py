"""CUDA-graph capture and replay of the encoder, one graph per token budget, with per-batch routing.

``EncoderGraphRunner(model, budget_config, mode="cuda")`` captures ``forward_static`` once per budget (largest
first, into one shared memory pool). ``run(pixel_values, grid_thw)``:

1. validates the request once, on the host (shapes and grids; grids equal to ones validated before, as an integer
   array or CPU tensor, are looked up, not checked again: :class:`~glmvit.request.RequestCache`);
2. plans it once per distinct grids (:meth:`EncoderGraphRunner.plan`): :func:`glmvit.packing.plan_batches` over the
   budgets actually captured — one decision, so the plan names the graph that replays — and *routes* every batch.
   Without a latency table a batch replays whenever a budget holds it, as vLLM does; with one
   (``latency_table=``, measured for this runner's mode) it replays only where the table predicts the replay is
   no slower than an eager forward of the same batch;
3. per replayed batch: one copy of its pixel rows into the budget's static buffer (padded rows are left as they
   are: ``embed`` masks them), its metadata written straight into one of two pinned staging buffers (alternating,
   so the host never waits for the previous copy) and sent with one host→device copy — nothing at all when the
   budget already holds this batch's grids —, the replay, and one clone of the batch's real tokens;
4. returns per-item views of those clones, owned by the caller. One clone per batch, not one per item: one copy
   kernel instead of one per item; the price is that an item keeps its batch's clone alive.

The NaN/Inf pixel check stays on by default without a device sync per request: one sum per pixel row is taken on
the device as each batch is copied in, the sums come back in one copy after every batch is launched, and the call's
single host wait (an event, before reading them) happens there. ``check_finite=False`` skips it, and then ``run``
waits for nothing: the results are ready in stream order.

The runner is safe to share between threads: a lock gives its static buffers one owner at a time (``run``,
``replay`` and ``capture`` hold it). ``mode="emulate"`` does the same bookkeeping on any device but calls
``forward_static`` where a graph would replay: the CPU teaching and test path (it never claims to be a graph, so it
takes any attention backend; ``mode="cuda"`` needs a graph-safe one). ``torch_compile=True`` compiles
``forward_static`` before capture, by default in regions (``compile_scope="blocks"``: the embedding, one block for
all 24, the head), so a start compiles once for every budget; ``runner.captures`` records per budget the seconds
of capture and of the warm-up where compiling happens.

Uniform graphs (``uniform_lengths=(L, …)``, default none: exactly the behaviour above). For every captured budget
and every L it also captures a graph at the *uniform* shape ``BatchShape(⌊rows/L⌋·L, slots, L, uniform=True)``
(:meth:`EncoderGraphRunner.uniform_shape`; ``glmvit.metadata``), whose attention is ``uniform_attention`` (default
``dense``: one SDPA over whole L-row segments, ``glmvit.attention``). Planning packs and routes as before; a batch
that replays in a budget and whose frames all have h·w = L then replays in that budget's L graph instead (it always
fits: its n·L rows are at most the budget's, so n ≤ ⌊rows/L⌋). The check is made once per layout, with the plan;
``stats.uniform_replays`` counts those replays, ``runner.uniform_captures`` their captures. The emulated mode
routes the same way and runs ``uniform_attention`` there, so CPU tests cover the routing. ``uniform_min_rows``
leaves out the budgets whose uniform shape would hold fewer rows, and the batches that hold fewer (where the dense
attention does not pay: ``glmvit.uniform.DENSE_MIN_ROWS``); those replay in their budget's own graph.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from functools import cached_property, partial
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from .attention import GRAPH_SAFE, UNIFORM_ONLY
from .costmodel import LatencyTable
from .geometry import ItemSpec
from .metadata import BatchShape, EncoderMetadata, build_metadata
from .model import GlmVisionEncoder, StaticParts, run_block
from .modes import GraphMode, RunMode
from .packing import BudgetConfig, plan_batches
from .request import EncoderRequest, RequestCache
from .routing import Router
from .uniform import uniform_length

log = logging.getLogger(__name__)

MODES = tuple(m.value for m in GraphMode)
COMPILE_SCOPES = ("blocks", "model")
LAYOUT_CACHE_SIZE = 1024  # distinct request layouts (grids) whose plans are kept


@dataclass
class CapturedBudget:
    """Everything one budget owns: its static shape and buffers, and on CUDA its graph and pinned staging."""

    budget: int
    shape: BatchShape
    pixels: torch.Tensor
    meta: EncoderMetadata
    output: torch.Tensor
    graph: "torch.cuda.CUDAGraph | None" = None
    staging: tuple[torch.Tensor, ...] = ()  # pinned host copies of meta.packed (CUDA): two, used in turn
    staged: tuple["torch.cuda.Event", ...] = ()  # recorded after each copy out of the staging buffer of that index
    next_staging: int = 0
    staged_grids: bytes | None = None  # the grids whose metadata ``meta.packed`` holds now
    pointers: tuple[int, ...] = ()

    def __repr__(self) -> str:
        """The budget and its static shape, not its buffers."""
        return f"CapturedBudget(budget={self.budget}, {self.shape}, graph={'captured' if self.graph else 'none'})"

    def data_pointers(self) -> tuple[int, ...]:
        return (self.pixels.data_ptr(), self.meta.packed.data_ptr(), self.output.data_ptr())


@dataclass(frozen=True)
class Capture:
    """What preparing one budget cost: seconds (allocation, warm-up, capture), of which the warm-up alone (where
    ``torch.compile`` traces and compiles), the pool growth of its graph, and its static buffers."""

    budget: int
    rows: int
    segments: int
    seconds: float
    warmup_seconds: float
    graph_bytes: int
    buffer_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, eq=False)
class BatchStep:
    """One planned batch of a request: its items, their pixel rows and tokens, its budget and its route.

    ``captured`` is the captured budget that holds the batch, or that budget's uniform graph when every frame of
    the batch has the one h·w it was captured for (None: none does; ``budget`` is its token count);
    ``replay`` says whether it replays there or runs eagerly; ``predicted_ms`` is the latency table's time for that
    route (None without a table), as :class:`~glmvit.routing.Router` decided both.
    """

    items: tuple[int, ...]
    tokens: int
    segment_rows2: int
    captured: CapturedBudget | None
    replay: bool
    predicted_ms: float | None
    grids: np.ndarray
    rows: tuple[tuple[int, int], ...]  # the items' pixel row ranges in the request, in batch order
    row_index: torch.Tensor | None  # their rows as one gather index on the device; None when one contiguous range
    item_tokens: tuple[int, ...]
    request: EncoderRequest  # the batch's items as a request of their own (validated with the whole request)

    @cached_property
    def num_rows(self) -> int:
        return sum(b - a for a, b in self.rows)

    @cached_property
    def span(self) -> tuple[int, int]:
        """The request rows [a, b) from the first item's first to the last item's last (the batch's rows when they
        are one contiguous range, ``row_index`` None)."""
        return self.rows[0][0], self.rows[-1][1]

    @property
    def budget(self) -> int | None:
        """The token budget that holds the batch (None: none does)."""
        return None if self.captured is None else self.captured.budget

    def __repr__(self) -> str:
        """The batch's items, tokens, budget and route: what a reader of a plan wants, not its tensors."""
        where = "no budget" if self.budget is None else f"budget={self.budget}"
        if self.captured is not None and self.captured.shape.uniform:
            where += f", uniform {self.captured.shape.max_seqlen}-row segments"
        route = "replay" if self.replay else "eager"
        predicted = "" if self.predicted_ms is None else f", predicted_ms={self.predicted_ms:.3f}"
        return f"BatchStep(items={self.items}, tokens={self.tokens}, {where}, route={route}{predicted})"


@dataclass
class RunnerStats:
    """Counters since construction or :meth:`reset`: what ran how, how routing chose, and where time went.

    ``routed_eager`` counts batches a captured budget held but the latency table sent to eager. ``predicted_ms``
    and ``measured_ms`` add up the table's prediction and the GPU time measured (CUDA events; wall time when
    emulating) over the ``timed_batches`` whose timing has completed.
    """

    runs: int = 0
    items: int = 0
    replays: int = 0
    uniform_replays: int = 0  # of the replays, those in a uniform graph (every segment one length)
    eager_batches: int = 0
    fallback_items: int = 0
    routed_eager: int = 0
    real_tokens: int = 0
    budget_tokens: int = 0
    host_s: float = 0.0  # run() on the host up to the last launch: planning, metadata, copies, launches
    wait_s: float = 0.0  # run()'s one host wait, for the finite check's sums (0 with check_finite=False)
    timed_batches: int = 0
    predicted_ms: float = 0.0
    measured_ms: float = 0.0

    @property
    def padding_fraction(self) -> float:
        """Padded tokens / budget tokens over all replays (0 when nothing replayed)."""
        return 1 - self.real_tokens / self.budget_tokens if self.budget_tokens else 0.0

    @property
    def prediction_error(self) -> float | None:
        """Σ predicted / Σ measured − 1 over the timed batches (None before any)."""
        return self.predicted_ms / self.measured_ms - 1 if self.measured_ms else None

    def reset(self) -> None:
        """Zero every counter (the captures are the runner's, not the stats')."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    def as_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "padding_fraction": self.padding_fraction,
                "prediction_error": self.prediction_error}


def _oom_request(err: BaseException) -> str:
    found = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(err))
    return found.group(1) if found else "an unknown amount"


@contextmanager
def _dynamo_limits(recompiles: int, held: int = 0) -> Iterator[None]:
    """Room for one compiled specialisation per budget shape while capturing, on top of the ``held`` ones the
    process compiled for the same code before (earlier runners': a limit hit would silently run those frames
    uncompiled); torch's own limits again after."""
    import torch._dynamo.config as dynamo_config

    knobs = {k: max(getattr(dynamo_config, k), held + recompiles) for k in ("cache_size_limit", "recompile_limit")
             if hasattr(dynamo_config, k)}
    with dynamo_config.patch(**knobs):
        yield


def _held_specialisations(functions: tuple[Callable[..., Any], ...]) -> int:
    """The most compiled specialisations torch.compile holds now for the code of any of ``functions`` (0 where
    this torch cannot say)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:
        return 0
    held = 0
    for fn in functions:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is not None:
            held = max(held, len(_debug_get_cache_entry_list(code)))
    return held


class EncoderGraphRunner:
    """Serve any batch of images and video frames from a few captured budgets (see module docstring)."""

    def __init__(
        self,
        model: GlmVisionEncoder,
        budget_config: BudgetConfig,
        mode: GraphMode | str = GraphMode.CUDA,
        packer: str = "ffd",
        latency_table: LatencyTable | None = None,
        check_pointers: bool = False,
        progress: bool = False,
        torch_compile: bool = False,
        compile_dynamic: bool | None = None,
        compile_scope: str = "blocks",
        attention: str | None = None,
        uniform_lengths: tuple[int, ...] = (),
        uniform_attention: str = "dense",
        uniform_min_rows: int = 0,
    ):
        mode = GraphMode.parse(mode)
        if mode is GraphMode.CUDA and model.device.type != "cuda":
            raise ValueError("mode='cuda' needs the model on a CUDA device; use mode='emulate' elsewhere")
        # The attention backend is fixed here: the graphs capture it, and the eager fallback runs it too, whatever
        # model.attn_backend says later. None: the model's backend now.
        attn = model.attention_backend(attention)
        if mode is GraphMode.CUDA and attn not in GRAPH_SAFE:  # emulation replays nothing: any backend is correct
            raise ValueError(f"attention backend {attn!r} is not graph-safe; use one of {GRAPH_SAFE}")
        self.uniform_lengths = _uniform_lengths(uniform_lengths, model.config.merge_area)
        if isinstance(uniform_min_rows, bool) or not isinstance(uniform_min_rows, int) or uniform_min_rows < 0:
            raise ValueError(f"uniform_min_rows must be a non-negative integer, got {uniform_min_rows!r}")
        self.uniform_min_rows = uniform_min_rows
        uniform_attn = uniform_attention if uniform_attention in UNIFORM_ONLY else model.attention_backend(
            uniform_attention)
        if mode is GraphMode.CUDA and uniform_attn not in GRAPH_SAFE:
            raise ValueError(f"uniform attention backend {uniform_attn!r} is not graph-safe; use one of {GRAPH_SAFE}")
        self.uniform_attention = uniform_attn
        # torch.compile fuses the small elementwise kernels (norms, SwiGLU, residual adds) before capture: faster
        # replays, with bf16 rounding that differs from the uncompiled forward. compile_scope "blocks" compiles the
        # three stages apart (embed, one block that all 24 share, head): tracing and compiling are ~1/24 of the
        # whole model's, for a few more kernels per block (a block's last add and the next block's norm are no
        # longer fused). "model" compiles forward_static whole. compile_dynamic: None (torch's default) compiles the
        # first budget for its shape and the second once with symbolic sizes that every later budget reuses; False
        # compiles every budget for its own shape; True compiles once, symbolically, from the start.
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {compile_scope!r}")
        self.model = model
        self._budgets = budget_config
        self.mode = mode
        self._attention = attn
        self.packer = packer
        self.check_pointers = check_pointers
        self.progress = progress
        self.compiled = torch_compile
        self.latency_table = latency_table
        if latency_table is not None:
            _check_table(latency_table, self.table_mode, attn)
        self.router = Router(latency_table)  # replay or eager, per batch: the rule predict_time predicts with
        forward: Callable[..., torch.Tensor] = model.forward_static
        if torch_compile and compile_scope == "model":
            forward = torch.compile(model.forward_static, dynamic=compile_dynamic)
        elif torch_compile:
            compile_ = partial(torch.compile, dynamic=compile_dynamic)
            parts: StaticParts = (compile_(model.embed), compile_(run_block), compile_(model.head))
            forward = partial(model.forward_static, parts=parts)
        # captured: real graphs record this forward, so host work per op is paid once (model.project_residual)
        captured = mode is GraphMode.CUDA
        self.forward_static: Callable[[torch.Tensor, EncoderMetadata], torch.Tensor] = partial(
            forward, attention=attn, captured=captured)
        self._uniform_forward: Callable[[torch.Tensor, EncoderMetadata], torch.Tensor] = partial(
            forward, attention=uniform_attn, captured=captured)
        self.graphs: dict[int, CapturedBudget] = {}
        self.captures: dict[int, Capture] = {}
        self.failed: dict[int, str] = {}
        # Uniform graphs by (budget, L): the budget whose batches they take, the segment length they take.
        self.uniform_graphs: dict[tuple[int, int], CapturedBudget] = {}
        self.uniform_captures: dict[tuple[int, int], Capture] = {}
        self.uniform_failed: dict[tuple[int, int], str] = {}
        self.pool: Any = None  # the shared memory pool handle, from the first capture on
        self._capture_stream: Any = None  # the side stream every warm-up and capture runs on (_capture_one)
        self.stats = RunnerStats()
        self._layouts: dict[bytes, list[BatchStep]] = {}  # plans by the request's grids; reset by capture()
        self._requests = RequestCache(LAYOUT_CACHE_SIZE)  # run()'s requests by the grids given: validated once
        self._pending: list[tuple[float, Any, Any]] = []  # (predicted ms, start, end event) not yet resolved
        self._lock = threading.Lock()

    @property
    def table_mode(self) -> RunMode:
        """The latency-table mode this runner replays as: ``graph-compiled`` or ``graph``."""
        return RunMode.GRAPH_COMPILED if self.compiled else RunMode.GRAPH

    @property
    def run_mode(self) -> RunMode:
        """The :class:`~glmvit.modes.RunMode` this runner implements (its table mode)."""
        return self.table_mode

    @property
    def label(self) -> str:
        """The name its results are reported under (``graph``, ``graph-emulated``, ``graph-compiled``…)."""
        return self.run_mode.label(self.mode)

    @property
    def attention(self) -> str:
        """The attention backend every forward of this runner uses: fixed when it was made."""
        return self._attention

    @property
    def budgets(self) -> BudgetConfig:
        """The budgets and batch limits this runner was made for."""
        return self._budgets

    # ---- capture -------------------------------------------------------------------------------------------
    def batch_shape(self, budget: int) -> BatchShape:
        """Static shape of a budget: rows = budget·m², its segment slots (:meth:`BudgetConfig.slots`)."""
        rows = budget * self.model.config.merge_area
        return BatchShape(rows=rows, segments=self._budgets.slots(budget), max_seqlen=rows)

    def uniform_shape(self, budget: int, length: int) -> BatchShape | None:
        """Static shape of a budget's uniform graph for segments of ``length`` rows: the ⌊rows/L⌋ whole segments its
        rows hold (every batch of such segments the budget holds fits), its slots capped there (None: not one fits,
        or they hold fewer than ``uniform_min_rows`` rows: that budget's batches replay in its ragged graph).
        """
        blocks = budget * self.model.config.merge_area // length
        if blocks == 0 or blocks * length < self.uniform_min_rows:
            return None
        return BatchShape(blocks * length, min(self._budgets.slots(budget), blocks), length, uniform=True)

    def _forward_of(self, cb: CapturedBudget) -> Callable[[torch.Tensor, EncoderMetadata], torch.Tensor]:
        """The forward ``cb`` captures and runs: the uniform attention's on a uniform shape, the runner's elsewhere."""
        return self._uniform_forward if cb.shape.uniform else self.forward_static

    def _allocate(self, budget: int, length: int | None = None) -> CapturedBudget:
        cfg, dev = self.model.config, self.model.device
        shape = self.batch_shape(budget) if length is None else self.uniform_shape(budget, length)
        assert shape is not None, "only budgets with a uniform shape are captured for it"
        pixels = torch.zeros(shape.rows, cfg.patch_dim, dtype=self.model.dtype, device=dev)
        empty = build_metadata(np.zeros((0, 3), np.int64), cfg.spatial_merge_size, shape)
        meta = EncoderMetadata.from_packed(torch.from_numpy(empty.packed).to(dev), shape, cfg.merge_area)
        tokens = shape.rows // cfg.merge_area  # the budget itself, or a uniform graph's whole segments
        output = torch.zeros(tokens, cfg.out_hidden_size, dtype=self.model.dtype, device=dev)
        cb = CapturedBudget(tokens, shape, pixels, meta, output)
        if dev.type == "cuda":
            cb.staging = tuple(torch.empty_like(meta.packed, device="cpu").pin_memory() for _ in range(2))
            cb.staged = tuple(torch.cuda.Event() for _ in range(2))
            for event in cb.staged:
                event.record()
        return cb

    def _capture_one(self, cb: CapturedBudget) -> tuple[float, int]:
        """Warm up and capture ``cb``'s graph: (warm-up seconds, pool growth in bytes)."""
        forward = self._forward_of(cb)
        if self.mode is GraphMode.EMULATE:
            cb.output.copy_(forward(cb.pixels, cb.meta))
            return 0.0, 0
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            # One side stream for every warm-up and every capture of this runner. Library state made per stream on
            # a stream's first use (cuBLAS's workspace: aten/src/ATen/cuda/CublasHandlePool.cpp) is then made in
            # the first warm-up, outside every graph and its pool, and each capture finds it made: not once per
            # budget, and never inside a capture, where it would stay in the pool for good.
            self._capture_stream = torch.cuda.Stream()
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(2 if self.compiled else 1):  # warm-up: compilation, autotuning, lazy init
                cb.output.copy_(forward(cb.pixels, cb.meta))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - start
        torch.cuda.empty_cache()  # torch.cuda.graph empties the cache on entry too: measure from the same point
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            # The outer stream context restores the caller's stream even if torch.cuda.graph's __exit__ fails in
            # capture_end() (it would then skip restoring the stream and leave the capture stream current).
            with torch.cuda.stream(torch.cuda.current_stream()), torch.cuda.graph(graph, pool=self.pool,
                                                                                  stream=stream):
                cb.output.copy_(forward(cb.pixels, cb.meta))
        except BaseException:
            # A failure mid-capture (e.g. out of memory) leaves a partial graph holding a share of the pool: drop it
            # now rather than when the traceback dies. If no captured graph shares the pool, its use count falls to
            # 0 and the allocator refuses to share it again, so the next capture must start a fresh pool.
            del graph
            if not self.graphs:
                self.pool = None
            raise
        torch.cuda.synchronize()
        cb.graph = graph
        return warmup_s, torch.cuda.memory_reserved() - before

    @torch.inference_mode()
    def capture(self) -> "EncoderGraphRunner":
        """Capture every budget, largest first into one pool, then each captured budget's uniform graphs (largest
        first); a budget that runs out of memory is skipped (its batches then plan into the budgets that were
        captured, or run eagerly), and so is a uniform graph (its batches replay in their budget's graph)."""
        with self._lock:
            budgets = sorted(self._budgets.token_budgets, reverse=True)
            self._layouts.clear()  # plans name the budgets they replay
            label = "capturing" if self.mode is GraphMode.CUDA else "preparing (emulated, no graphs)"
            uniform = [(b, n) for b in budgets for n in self.uniform_lengths if self.uniform_shape(b, n) is not None]
            jobs: list[tuple[int, int | None]] = [(b, None) for b in budgets] + list(uniform)
            bar = tqdm(jobs, desc=label, unit="graph", disable=not self.progress)
            regions = (self.model.forward_static, self.model.embed, run_block, self.model.head)
            with _dynamo_limits(2 * len(jobs) + 8, _held_specialisations(regions)) if self.compiled else _nothing():
                for budget, length in bar:
                    if length is not None and budget not in self.graphs:
                        continue  # its budget's batches never replay: neither would these
                    shown = f"{budget} tokens" + ("" if length is None else f", uniform {length}-row segments")
                    bar.set_postfix_str(f"{shown}{', compiling' if self.compiled else ''}")
                    self._capture_budget(budget, length)
            for message in [*self.failed.values(), *self.uniform_failed.values()]:
                log.warning(message)
        return self

    def _capture_budget(self, budget: int, length: int | None = None) -> None:
        start = time.perf_counter()
        try:
            cb = self._allocate(budget, length)
            warmup_s, graph_bytes = self._capture_one(cb)
        except torch.OutOfMemoryError as err:
            asked = (f"out of memory while capturing (it asked for {_oom_request(err)}; "
                     f"{torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB free)")
            if length is None:
                self.failed[budget] = (f"budget {budget} tokens: {asked}; its batches plan into other budgets or "
                                       "run eagerly")
            else:
                self.uniform_failed[budget, length] = (f"budget {budget} tokens, uniform {length}-row segments: "
                                                       f"{asked}; its batches replay in the budget's graph")
            cb = None
        if cb is None:
            # Outside the except block, so the traceback (and the failed budget's buffers and partial graph it kept
            # alive) is gone: finish the failed work, then hand its cached memory back to the driver.
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            return
        cb.pointers = cb.data_pointers()
        buffers = sum(t.numel() * t.element_size() for t in (cb.pixels, cb.meta.packed, cb.output))
        capture = Capture(cb.budget, cb.shape.rows, cb.shape.segments, time.perf_counter() - start, warmup_s,
                          graph_bytes, buffers)
        if length is None:
            self.graphs[budget], self.captures[budget] = cb, capture
        else:
            self.uniform_graphs[budget, length], self.uniform_captures[budget, length] = cb, capture

    # ---- planning ------------------------------------------------------------------------------------------
    def captured_config(self) -> BudgetConfig | None:
        """The budget config the runner plans with: the captured budgets and the same limits (None: none)."""
        if not self.graphs:
            return None
        return BudgetConfig.capped(self.graphs, self._budgets.max_items, self._budgets.max_segments)

    def plan(self, grid_thw: Any) -> list[BatchStep]:
        """The batches of a request with these grids (or of an :class:`~glmvit.request.EncoderRequest`), routed:
        planned once per distinct grids, then reused. The list is the caller's own: changing it leaves the plan
        the runner runs as it was."""
        return list(self._planned(self.model.request_of(grid_thw)))

    def _planned(self, request: EncoderRequest) -> list[BatchStep]:
        """``plan`` for a request validated already (``_run`` checks a request once, with its pixels)."""
        key = request.key()
        steps = self._layouts.get(key)
        if steps is None:
            steps = self._plan(request)
            if len(self._layouts) >= LAYOUT_CACHE_SIZE:
                self._layouts.clear()
            self._layouts[key] = steps
        return steps

    def _plan(self, request: EncoderRequest) -> list[BatchStep]:
        items, grids = request.items, request.grids
        config = self.captured_config()
        groups: list[tuple[tuple[int, ...], int | None]]
        if config is None:  # nothing captured: every item alone, eagerly
            groups = [((i,), None) for i in range(len(items))]
        else:
            groups = [(b.item_indices, b.budget) for b in plan_batches(items, config, packer=self.packer).batches]
        steps = []
        for idx, budget in groups:
            batch = ItemSpec.total(items[i] for i in idx)
            tokens, work = batch.tokens, batch.work
            captured = self.graphs[budget] if budget else None
            if budget and self.uniform_graphs:  # a batch of one segment length: that length's graph
                captured = self.uniform_graph(budget, grids[list(idx)]) or captured
            # routed by the graph it would replay in: a uniform graph's own (smaller) budget, not the ladder's
            replay, predicted = self.router.route(None if captured is None else captured.budget, tokens, work)
            rows = tuple(request.row_range(i) for i in idx)
            contiguous = all(a == prev_b for (_, prev_b), (a, _) in zip(rows, rows[1:], strict=False))
            index = None if contiguous else torch.from_numpy(  # pageable source: staged before the call returns
                np.concatenate([np.arange(a, b) for a, b in rows])).to(self.model.device, non_blocking=True)
            steps.append(BatchStep(tuple(idx), tokens, work, captured, replay, predicted, grids[list(idx)], rows,
                                   index, tuple(items[i].tokens for i in idx), request.select(idx)))
        assert sum(s.num_rows for s in steps) == request.rows, "every row planned once"
        return steps

    def uniform_graph(self, budget: int, grids: np.ndarray) -> CapturedBudget | None:
        """The uniform graph of ``budget`` for a batch whose frames all have one h·w (None: they do not, the batch
        holds fewer than ``uniform_min_rows`` rows — the dense kernel computes its padding blocks too, so a part-full
        graph is judged by the rows it holds — or no graph was captured for it). Every batch the budget holds fits
        there (:meth:`uniform_shape`)."""
        frames = grids[:, 1] * grids[:, 2]
        length = uniform_length(frames.tolist(), int((grids[:, 0] * frames).sum()), self.uniform_min_rows)
        return None if length is None else self.uniform_graphs.get((budget, length))

    # ---- replay --------------------------------------------------------------------------------------------
    def _stage_metadata(self, cb: CapturedBudget, request: EncoderRequest) -> None:
        """Put the batch's metadata in ``cb.meta.packed``, unless it holds these grids already."""
        key = request.key()
        if key == cb.staged_grids:  # the same grids as this budget's last batch (a stream of equal images)
            return
        merge = request.merge
        if not cb.staging:  # not CUDA: the buffer is host memory, write it in place
            build_metadata(request, merge, cb.shape, out=cb.meta.packed.numpy())
        else:
            k = cb.next_staging
            cb.staged[k].synchronize()  # the copy out of this buffer, two batches ago, has run (it almost always has)
            build_metadata(request, merge, cb.shape, out=cb.staging[k].numpy())
            cb.meta.packed.copy_(cb.staging[k], non_blocking=True)
            cb.staged[k].record()
            cb.next_staging = 1 - k
        cb.staged_grids = key

    def _copy_pixels(self, dst: torch.Tensor, src: torch.Tensor, step: BatchStep) -> None:
        if step.row_index is None:
            a, b = step.span
            dst.copy_(src if a == 0 and b == src.shape[0] else src[a:b], non_blocking=True)
        else:
            dst.copy_(src.index_select(0, step.row_index), non_blocking=True)

    def _replay(self, cb: CapturedBudget, request: EncoderRequest) -> torch.Tensor:
        if self.check_pointers and cb.data_pointers() != cb.pointers:
            raise RuntimeError(f"budget {cb.budget}: a captured buffer was rebound (data pointer changed)")
        self._stage_metadata(cb, request)
        if cb.graph is not None:
            cb.graph.replay()
        else:
            cb.output.copy_(self._forward_of(cb)(cb.pixels, cb.meta))
        return cb.output

    @torch.inference_mode()
    def replay(self, budget: int, pixel_values: torch.Tensor, grid_thw: Any, uniform: bool = False) -> torch.Tensor:
        """Run one batch in the graph of ``budget`` (it must fit there), whatever smaller budget would also fit;
        ``uniform=True``: in that budget's uniform graph for the batch's one frame length (it must have one).

        Returns the graph's static output buffer (padded tokens are zero); the next replay of that graph overwrites
        it, so clone what you keep. For measuring one budget on any layout.
        """
        with self._lock:
            request = self.model.check_request(pixel_values, grid_thw)
            cb = self.graphs.get(budget)
            if cb is None:
                raise ValueError(f"budget {budget} is not captured (captured: {sorted(self.graphs)})")
            if uniform:
                cb = self.uniform_graph(budget, np.asarray(request.grids))
                if cb is None:
                    raise ValueError(f"budget {budget} has no uniform graph for these frames (captured: "
                                     f"{sorted(self.uniform_graphs)}, as (budget, rows per frame))")
            spec = request.total
            if spec.tokens > budget or spec.segments > cb.shape.segments:
                raise ValueError(f"a batch of {spec.tokens} tokens in {spec.segments} segments does not fit budget "
                                 f"{budget} ({cb.shape.segments} segment slots)")
            cb.pixels[: pixel_values.shape[0]].copy_(pixel_values, non_blocking=True)
            return self._replay(cb, request)

    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, grid_thw: Any, check_finite: bool = True) -> list[torch.Tensor]:
        """Encode a batch of images/videos; returns one [tokens_i, out_hidden_size] tensor per item, in order.

        ``grid_thw``: grids, or an :class:`~glmvit.request.EncoderRequest` (validated already: only the pixels are
        checked against it). ``check_finite=False`` skips the NaN/Inf pixel check for pixels validated already (and
        with it the call's only host wait). Safe to call from several threads: calls run one at a time.
        """
        with self._lock:
            return self._run(pixel_values, grid_thw, check_finite)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, request: EncoderRequest, *, sync: bool) -> list[torch.Tensor]:
        """:class:`~glmvit.encoder.Encoder`: ``run`` on pixels checked already (finite, from the request's
        boundary), one [tokens_i, out_hidden_size] tensor per item, owned by the caller. ``sync=True`` waits (one
        event on CUDA) until they are computed, so any thread or stream may read them; ``sync=False`` waits for
        nothing: they are ready in the current stream's order."""
        with self._lock:
            outs = self._run(pixel_values, request, check_finite=False)
        if sync and self.model.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        return outs

    def _run(self, pixel_values: torch.Tensor, grid_thw: Any, check_finite: bool) -> list[torch.Tensor]:
        start = time.perf_counter()
        model, device, stats = self.model, self.model.device, self.stats
        request = self._requests.of(grid_thw, model.request_of)  # grids seen before are not validated again
        model.check_request(pixel_values, request, check_finite=False)  # the pixels, against them
        n_items = len(request.items)  # Python-level __len__s cost a call each: counted once
        if n_items == 0:
            return []
        steps = self._planned(request)
        if self._pending:
            self._resolve_timings(wait=False)
        on_device = pixel_values if pixel_values.device == device or all(s.row_index is None for s in steps) \
            else pixel_values.to(device, non_blocking=True)  # gathers read it on the device: copy the request once
        sums = torch.empty(request.rows, dtype=torch.float32, device=device) if check_finite else None
        summed = 0  # rows whose sums are taken, in batch order
        results: list[torch.Tensor | None] = [None] * n_items
        for step in steps:  # what a plan fixes (row counts, spans, split sizes) is computed once, in its steps
            timing = None if step.predicted_ms is None else self._start_timing(step)
            n = step.num_rows
            src = on_device if step.row_index is not None else pixel_values
            cb = step.captured
            if step.replay:
                assert cb is not None
                batch = cb.pixels if n == cb.shape.rows else cb.pixels[:n]
            else:
                batch = torch.empty(n, model.config.patch_dim, dtype=model.dtype, device=device)
            self._copy_pixels(batch, src, step)
            if sums is not None:
                rows = sums if n == request.rows else sums[summed : summed + n]
                torch.sum(batch, dim=1, dtype=torch.float32, out=rows)
                summed += n
            if step.replay:
                assert cb is not None
                static = self._replay(cb, step.request)
                out = (static if step.tokens == cb.budget else static[: step.tokens]).clone()
                stats.replays += 1
                stats.uniform_replays += cb.shape.uniform
                stats.real_tokens += step.tokens
                stats.budget_tokens += cb.budget
            else:
                out = model.forward(batch, step.request, check_finite=False, attention=self._attention)
                stats.eager_batches += 1
                stats.fallback_items += len(step.items)
                stats.routed_eager += step.budget is not None
            if timing is not None:
                self._end_timing(step, timing)
            if len(step.items) == 1:
                results[step.items[0]] = out
            else:
                for i, part in zip(step.items, out.split_with_sizes(step.item_tokens), strict=True):
                    results[i] = part
        stats.host_s += time.perf_counter() - start
        if sums is not None:
            self._check_sums(sums, steps, pixel_values, request)
        stats.runs += 1
        stats.items += n_items
        out_list = [r for r in results if r is not None]
        assert len(out_list) == n_items, "every item was filled in by its batch"
        return out_list

    def _check_sums(self, sums: torch.Tensor, steps: list[BatchStep], pixel_values: torch.Tensor,
                    request: EncoderRequest) -> None:
        """The finite check's one host wait: every batch is launched; read the row sums and refuse non-finite items.

        A row whose sum is not finite holds a NaN or an Inf, or finite values whose sum overflowed: only such rows are
        then checked value by value (rare, so its syncs do not matter), and only those holding NaN/Inf refuse."""
        wait = time.perf_counter()
        if sums.device.type == "cuda":
            host = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
        else:
            host = sums
        self.stats.wait_s += time.perf_counter() - wait
        if self._pending:
            self._resolve_timings(wait=False)
        finite = np.isfinite(host.numpy())
        if finite.all():
            return
        batch_order = np.concatenate([np.arange(a, b) for s in steps for a, b in s.rows])  # request row of each sum
        suspects = batch_order[~finite]
        sync_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
        if sync_mode:
            torch.cuda.set_sync_debug_mode(0)  # the refusal path may read the device freely
        try:
            rows = pixel_values[torch.from_numpy(np.sort(suspects)).to(pixel_values.device)].to(self.model.dtype)
            bad_rows = np.sort(suspects)[~torch.isfinite(rows).all(dim=1).cpu().numpy()]
        finally:
            if sync_mode:
                torch.cuda.set_sync_debug_mode(sync_mode)
        bad = sorted(set(np.searchsorted(request.row_starts[1:], bad_rows, side="right").tolist()))
        if bad:
            raise ValueError(f"pixel_values of item(s) {bad} hold NaN or Inf (in {self.model.dtype}, the model's "
                             "dtype); fix or drop those items")

    # ---- timing for the routing statistics -----------------------------------------------------------------
    def _start_timing(self, step: BatchStep) -> Any:
        if step.predicted_ms is None:
            return None
        if self.model.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _end_timing(self, step: BatchStep, start: Any) -> None:
        if start is None or step.predicted_ms is None:
            return
        if isinstance(start, float):
            self.stats.timed_batches += 1
            self.stats.predicted_ms += step.predicted_ms
            self.stats.measured_ms += (time.perf_counter() - start) * 1e3
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((step.predicted_ms, start, end))

    def _resolve_timings(self, wait: bool) -> None:
        """Add the batches whose GPU timing has completed to the stats (``wait``: wait for every one)."""
        keep = []
        for predicted, start, end in self._pending:
            if wait:
                end.synchronize()
            if end.query():
                self.stats.timed_batches += 1
                self.stats.predicted_ms += predicted
                self.stats.measured_ms += start.elapsed_time(end)
            else:
                keep.append((predicted, start, end))
        self._pending = keep

    def settle_stats(self) -> RunnerStats:
        """The stats with every pending GPU timing included (waits for the GPU): read this, not ``stats``, to see
        the routing's predicted-vs-measured error right after a run."""
        with self._lock:
            self._resolve_timings(wait=True)
            return self.stats


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _uniform_lengths(lengths: Any, merge_area: int) -> tuple[int, ...]:
    """The distinct segment lengths of ``uniform_lengths``, ascending: positive multiples of ``merge_area`` (a
    frame's h·w is one), else a one-line ValueError naming the bad one."""
    out = set()
    for length in lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0 or length % merge_area:
            raise ValueError(f"uniform length {length!r} must be a positive multiple of {merge_area} (a frame's h·w)")
        out.add(length)
    return tuple(sorted(out))


def _check_table(table: LatencyTable, mode: str, attention: str) -> None:
    """A routing table must have measured this runner's mode and attention backend (or say nothing of them)."""
    mode = str(mode)  # a RunMode prints as its value; its repr would name the enum
    if table.mode is not None and table.mode != mode:
        raise ValueError(f"latency table {table.describe()} measured {table.mode!r}, but this runner replays as "
                         f"{mode!r}: route with a table of its own mode (python -m glmvit latency"
                         f"{' --compile' if mode == 'graph-compiled' else ''})")
    if table.attention is not None and table.attention != attention:
        raise ValueError(f"latency table {table.describe()} measured attention {table.attention!r}, but the model "
                         f"runs {attention!r}")
