"""CUDA-graph capture and replay of the encoder, one graph per token budget, with eager fallback.

``EncoderGraphRunner(model, budget_config, backend="cuda")`` captures ``forward_static`` once per budget
(largest first, into one shared memory pool). ``run(pixel_values, grid_thw)`` packs the items into batches
(``glmvit.packing.plan_batches``), and for each batch builds the host metadata, copies pixels and metadata into
the budget's static buffers, replays the graph and clones every item's rows out of the static output buffer.
The metadata goes through one pinned staging buffer per budget (no per-batch pinning), and is not rebuilt at all
when a batch has the same grids as the budget's previous one (a stream of same-sized images).
What no budget fits runs eagerly. ``backend="emulate"`` does the same bookkeeping on any device but calls
``forward_static`` where a graph would replay: the CPU teaching and test path (it never claims to be a graph, so it
takes any attention backend, the per-segment CPU default included; ``backend="cuda"`` needs a graph-safe one).
``torch_compile=True`` compiles ``forward_static`` before capture, by default in regions (``compile_scope="blocks"``:
the embedding, one block for all 24, the head), so a start compiles once for every budget; ``runner.stats.capture``
records per budget the seconds of capture and of the warm-up where compiling happens.
"""
from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .attention import GRAPH_SAFE
from .geometry import ItemSpec
from .metadata import BatchShape, EncoderMetadata, build_metadata
from .model import GlmVisionEncoder, StaticParts, run_block
from .packing import BudgetConfig, plan_batches

log = logging.getLogger(__name__)

BACKENDS = ("cuda", "emulate")
COMPILE_SCOPES = ("blocks", "model")
LAYOUT_CACHE_SIZE = 1024  # distinct request layouts (grids) whose plans are kept


@dataclass
class BudgetGraph:
    """Everything one budget owns: its static shape, buffers and (on CUDA) its graph."""

    budget: int
    shape: BatchShape
    pixels: torch.Tensor
    meta: EncoderMetadata
    output: torch.Tensor
    graph: "torch.cuda.CUDAGraph | None" = None
    staging: torch.Tensor | None = None  # pinned host copy of meta.packed (CUDA): one per budget, reused
    staged: "torch.cuda.Event | None" = None  # recorded after each copy out of ``staging``
    filled_rows: int = 0
    staged_grids: bytes | None = None  # the grids whose metadata ``meta.packed`` holds now
    pointers: tuple[int, ...] = ()
    capture_s: float = 0.0  # allocation, warm-up (compilation included) and capture
    warmup_s: float = 0.0  # the warm-up runs alone: with torch_compile, where tracing and compiling happen
    graph_bytes: int = 0
    buffer_bytes: int = 0

    def data_pointers(self) -> tuple[int, ...]:
        return (self.pixels.data_ptr(), self.meta.packed.data_ptr(), self.output.data_ptr())


@dataclass(frozen=True, eq=False)
class BatchStep:
    """One planned batch of a request: its items, their pixel rows and tokens, and the graph (None = eager)."""

    items: tuple[int, ...]
    tokens: int
    graph: BudgetGraph | None
    grids: np.ndarray
    rows: list[tuple[int, int]]
    item_tokens: list[int]


@dataclass
class RunnerStats:
    """Counters since construction (or ``reset()``): what ran how, and where time went."""

    runs: int = 0
    items: int = 0
    replays: int = 0
    eager_batches: int = 0
    fallback_items: int = 0
    real_tokens: int = 0
    budget_tokens: int = 0
    host_s: float = 0.0  # planning, metadata, copies and launches on the host
    total_s: float = 0.0  # wall time of run() up to the results being ready (synchronised on CUDA)
    capture: dict[int, dict] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        """Padded tokens / budget tokens over all replays (0 when nothing replayed)."""
        return 1 - self.real_tokens / self.budget_tokens if self.budget_tokens else 0.0

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k not in ("capture", "failed")}
        d["padding_fraction"] = self.padding_fraction
        d["capture"] = self.capture
        d["failed"] = self.failed
        return d


def _oom_request(err: BaseException) -> str:
    found = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", str(err))
    return found.group(1) if found else "an unknown amount"


class EncoderGraphRunner:
    """Serve any batch of images and video frames from a few captured budgets (see module docstring)."""

    def __init__(
        self,
        model: GlmVisionEncoder,
        budget_config: BudgetConfig,
        backend: str = "cuda",
        packer: str = "ffd",
        check_pointers: bool = False,
        progress: bool = False,
        torch_compile: bool = False,
        compile_dynamic: bool | None = None,
        compile_scope: str = "blocks",
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "cuda" and model.device.type != "cuda":
            raise ValueError("backend='cuda' needs the model on a CUDA device; use backend='emulate' elsewhere")
        attn = model.attention_backend()
        if backend == "cuda" and attn not in GRAPH_SAFE:  # emulation replays nothing: any backend is correct
            raise ValueError(f"attention backend {attn!r} is not graph-safe; use one of {GRAPH_SAFE}")
        self.model = model
        self.config = budget_config
        self.backend = backend
        self.packer = packer
        self.check_pointers = check_pointers
        self.progress = progress
        # torch.compile fuses the small elementwise kernels (norms, SwiGLU, residual adds) before capture: faster
        # replays, with bf16 rounding that differs from the uncompiled forward. compile_scope "blocks" compiles the
        # three stages apart (embed, one block that all 24 share, head): tracing and compiling are ~1/24 of the
        # whole model's, for one more kernel per block (a block's last add and the next block's norm are no longer
        # fused). "model" compiles forward_static whole. compile_dynamic: None (torch's default) compiles the first
        # budget for its shape and the second once with symbolic sizes that every later budget reuses; False
        # compiles every budget for its own shape; True compiles once, symbolically, from the start.
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"compile_scope must be one of {COMPILE_SCOPES}, got {compile_scope!r}")
        self.compiled = torch_compile
        self.forward_static: Callable[[torch.Tensor, EncoderMetadata], torch.Tensor] = model.forward_static
        if torch_compile and compile_scope == "model":
            self.forward_static = torch.compile(model.forward_static, dynamic=compile_dynamic)
        elif torch_compile:
            compile_ = partial(torch.compile, dynamic=compile_dynamic)
            parts: StaticParts = (compile_(model.embed), compile_(run_block), compile_(model.head))
            self.forward_static = partial(model.forward_static, parts=parts)
        self.graphs: dict[int, BudgetGraph] = {}
        self.pool: Any = None  # the shared memory pool handle, from the first capture on
        self.stats = RunnerStats()
        self._layouts: dict[bytes, list[BatchStep]] = {}  # plans by the request's grids; reset by capture()

    # ---- capture -------------------------------------------------------------------------------------------
    def batch_shape(self, budget: int) -> BatchShape:
        """Static shape of a budget: rows = budget·m², segment slots = min(max_segments, budget) (≥ 1 token each)."""
        rows = budget * self.model.config.merge_area
        return BatchShape(rows=rows, segments=min(self.config.max_segments, budget), max_seqlen=rows)

    def _allocate(self, budget: int) -> BudgetGraph:
        cfg, dev = self.model.config, self.model.device
        shape = self.batch_shape(budget)
        pixels = torch.zeros(shape.rows, cfg.patch_dim, dtype=self.model.dtype, device=dev)
        meta = build_metadata(np.zeros((0, 3), np.int64), cfg.spatial_merge_size, shape).to(dev)
        output = torch.zeros(budget, cfg.out_hidden_size, dtype=self.model.dtype, device=dev)
        nbytes = sum(t.numel() * t.element_size() for t in (pixels, meta.packed, output))
        bg = BudgetGraph(budget, shape, pixels, meta, output, buffer_bytes=nbytes)
        if dev.type == "cuda":
            bg.staging = torch.empty_like(meta.packed, device="cpu").pin_memory()
            bg.staged = torch.cuda.Event()
            bg.staged.record()
        return bg

    def _capture_one(self, bg: BudgetGraph) -> None:
        if self.backend == "emulate":
            bg.output.copy_(self.forward_static(bg.pixels, bg.meta))
            return
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(2 if self.compiled else 1):  # warm-up: compilation, autotuning, lazy init
                bg.output.copy_(self.forward_static(bg.pixels, bg.meta))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        bg.warmup_s = time.perf_counter() - start
        torch.cuda.empty_cache()  # torch.cuda.graph empties the cache on entry too: measure from the same point
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        try:
            # The outer stream context restores the caller's stream even if torch.cuda.graph's __exit__ fails in
            # capture_end() (it would then skip restoring the stream and leave the capture stream current).
            with torch.cuda.stream(torch.cuda.current_stream()), torch.cuda.graph(graph, pool=self.pool):
                bg.output.copy_(self.forward_static(bg.pixels, bg.meta))
        except BaseException:
            # A failure mid-capture (e.g. out of memory) leaves a partial graph holding a share of the pool: drop it
            # now rather than when the traceback dies. If no captured graph shares the pool, its use count falls to
            # 0 and the allocator refuses to share it again, so the next capture must start a fresh pool.
            del graph
            if not self.graphs:
                self.pool = None
            raise
        torch.cuda.synchronize()
        bg.graph = graph
        bg.graph_bytes = torch.cuda.memory_reserved() - before

    @torch.inference_mode()
    def capture(self) -> "EncoderGraphRunner":
        """Capture every budget, largest first into one pool; a budget that runs out of memory is skipped."""
        budgets = sorted(self.config.token_budgets, reverse=True)
        self._layouts.clear()  # plans name the graphs they replay
        if self.compiled:  # one compiled specialisation per budget shape
            import torch._dynamo.config as dynamo_config

            for knob in ("cache_size_limit", "recompile_limit"):
                if hasattr(dynamo_config, knob):
                    setattr(dynamo_config, knob, max(getattr(dynamo_config, knob), 2 * len(budgets) + 8))
        label = "capturing" if self.backend == "cuda" else "preparing (emulated, no graphs)"
        bar = tqdm(budgets, desc=label, unit="budget", disable=not self.progress)
        for budget in bar:
            bar.set_postfix_str(f"{budget} tokens{', compiling' if self.compiled else ''}")
            start = time.perf_counter()
            try:
                bg = self._allocate(budget)
                self._capture_one(bg)
            except torch.OutOfMemoryError as err:
                self.stats.failed[budget] = (
                    f"budget {budget} tokens: out of memory while capturing (it asked for {_oom_request(err)}; "
                    f"{torch.cuda.mem_get_info()[0] / 2**30:.2f} GiB free); this budget falls back to eager"
                )
                bg = None
            if bg is None:
                # Outside the except block, so the traceback (and the failed budget's buffers and partial graph it
                # kept alive) is gone: finish the failed work, then hand its cached memory back to the driver.
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                continue
            bg.capture_s = time.perf_counter() - start
            bg.pointers = bg.data_pointers()
            self.graphs[budget] = bg
            self.stats.capture[budget] = {
                "seconds": bg.capture_s,
                "warmup_seconds": bg.warmup_s,
                "graph_bytes": bg.graph_bytes,
                "buffer_bytes": bg.buffer_bytes,
                "rows": bg.shape.rows,
                "segments": bg.shape.segments,
            }
        for message in self.stats.failed.values():
            log.warning(message)
        return self

    # ---- replay --------------------------------------------------------------------------------------------
    def _fit(self, tokens: int, segments: int) -> BudgetGraph | None:
        """Smallest captured budget whose token and segment capacity hold the batch."""
        for budget in sorted(self.graphs):
            bg = self.graphs[budget]
            if tokens <= budget and segments <= bg.shape.segments:
                return bg
        return None

    def _replay(self, bg: BudgetGraph, pixels: list[torch.Tensor], grids: np.ndarray) -> torch.Tensor:
        if self.check_pointers and bg.data_pointers() != bg.pointers:
            raise RuntimeError(f"budget {bg.budget}: a captured buffer was rebound (data pointer changed)")
        offset = 0
        for chunk in pixels:
            bg.pixels[offset : offset + chunk.shape[0]].copy_(chunk, non_blocking=True)
            offset += chunk.shape[0]
        if bg.filled_rows > offset:
            bg.pixels[offset : bg.filled_rows].zero_()
        bg.filled_rows = offset
        key = grids.tobytes()
        if key != bg.staged_grids:  # same grids as this budget's last batch ⇒ its metadata is already in place
            host = build_metadata(grids, self.model.config.spatial_merge_size, bg.shape)
            if bg.staging is None or bg.staged is None:
                bg.meta.packed.copy_(torch.from_numpy(host.packed))
            else:
                bg.staged.synchronize()  # the previous copy out of the staging buffer has run (a replay follows it)
                bg.staging.numpy()[:] = host.packed
                bg.meta.packed.copy_(bg.staging, non_blocking=True)
                bg.staged.record()
            bg.staged_grids = key
        if bg.graph is not None:
            bg.graph.replay()
        else:
            bg.output.copy_(self.forward_static(bg.pixels, bg.meta))
        return bg.output

    @torch.inference_mode()
    def replay(self, budget: int, pixel_values: torch.Tensor, grid_thw: Any) -> torch.Tensor:
        """Run one batch in the graph of ``budget`` (it must fit there), whatever smaller budget would also fit.

        Returns the budget's static output buffer [budget, out_hidden_size] (padded tokens are zero); the next replay
        of this budget overwrites it, so clone what you keep. For measuring one budget on any layout.
        """
        grids = self.model.check_inputs(pixel_values, grid_thw)
        bg = self.graphs.get(budget)
        if bg is None:
            raise ValueError(f"budget {budget} is not captured (captured: {sorted(self.graphs)})")
        tokens, segments = int((grids.prod(axis=1)).sum()) // self.model.config.merge_area, int(grids[:, 0].sum())
        if tokens > budget or segments > bg.shape.segments:
            raise ValueError(f"a batch of {tokens} tokens in {segments} segments does not fit budget {budget} "
                             f"({bg.shape.segments} segment slots)")
        return self._replay(bg, [pixel_values], grids)

    def _layout(self, grids: np.ndarray) -> list[BatchStep]:
        """The batches of a request with these grids: planned once per distinct grids, then reused."""
        key = grids.tobytes()
        steps = self._layouts.get(key)
        if steps is not None:
            return steps
        merge_area = self.model.config.merge_area
        item_rows = (grids[:, 0] * grids[:, 1] * grids[:, 2]).astype(np.int64)
        row_start = np.concatenate([[0], np.cumsum(item_rows)])
        items = [ItemSpec(int(r) // merge_area, int(t)) for r, t in zip(item_rows, grids[:, 0], strict=True)]
        plan = plan_batches(items, self.config, packer=self.packer) if items else None
        steps = []
        for batch in plan.batches if plan else []:
            idx = tuple(batch.item_indices)
            graph = self._fit(batch.tokens, batch.segments) if batch.budget is not None else None
            rows = [(int(row_start[i]), int(row_start[i + 1])) for i in idx]
            steps.append(BatchStep(idx, batch.tokens, graph, grids[list(idx)], rows, [items[i].tokens for i in idx]))
        if len(self._layouts) >= LAYOUT_CACHE_SIZE:
            self._layouts.clear()
        self._layouts[key] = steps
        return steps

    @torch.inference_mode()
    def run(self, pixel_values: torch.Tensor, grid_thw, check_finite: bool = True) -> list[torch.Tensor]:
        """Encode a batch of images/videos; returns one [tokens_i, out_hidden_size] tensor per item, in order.

        ``check_finite=False`` skips the NaN/Inf pixel check (``model.check_inputs``) for pixels validated already.
        """
        start = time.perf_counter()
        model = self.model
        grids = model.check_inputs(pixel_values, grid_thw, check_finite)
        steps = self._layout(grids)
        results: list[torch.Tensor | None] = [None] * len(grids)
        host_s = time.perf_counter() - start
        for step in steps:
            chunks = [pixel_values[a:b] for a, b in step.rows]
            if step.graph is None:
                out = model.forward(torch.cat(chunks).to(model.device), step.grids, check_finite=False)
                self.stats.eager_batches += 1
                self.stats.fallback_items += len(step.items)
            else:
                t0 = time.perf_counter()
                out = self._replay(step.graph, chunks, step.grids)
                host_s += time.perf_counter() - t0
                self.stats.replays += 1
                self.stats.real_tokens += step.tokens
                self.stats.budget_tokens += step.graph.budget
            offset = 0
            for i, n in zip(step.items, step.item_tokens, strict=False):
                results[i] = out[offset : offset + n].clone()
                offset += n
        if self.backend == "cuda":
            torch.cuda.current_stream().synchronize()  # the caller needs the results; makes total_s honest
        self.stats.runs += 1
        self.stats.items += len(grids)
        self.stats.host_s += host_s
        self.stats.total_s += time.perf_counter() - start
        return [out for out in results if out is not None]  # every item was filled in by its batch
