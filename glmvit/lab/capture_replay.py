"""Notebook 06's GPU measurements: a runner written by hand against EncoderGraphRunner on the full tower, the
staging race, one pool or three, and the tower's timeline (timed, and profiled apart)."""
from __future__ import annotations

import copy
import time
from typing import Any, Callable

import numpy as np
import torch

from ..config import VisionConfig
from ..geometry import grid_specs
from ..graphs import EncoderGraphRunner
from ..metadata import BatchShape, build_metadata
from ..packing import BudgetConfig
from ..profiling import traced_spans
from ..timing import time_calls
from ..workloads import random_batch
from .shared import full_model


class HandRunner:
    """One budget, one graph: static buffers, warm-up, capture; per batch one copy in, replay, one clone out."""

    def __init__(self, model, budget, max_segments):
        cfg, dev, rows = model.config, model.device, budget * model.config.merge_area
        self.model, self.merge = model, cfg.spatial_merge_size
        self.shape = BatchShape(rows=rows, segments=min(max_segments, budget), max_seqlen=rows)
        self.pixels = torch.zeros(rows, cfg.patch_dim, dtype=model.dtype, device=dev)
        self.meta = build_metadata(np.zeros((0, 3), np.int64), self.merge, self.shape).to(dev)

    @torch.no_grad()
    def capture(self, tape=None):
        """A CUDA graph on a GPU; on a CPU the emulated capture ``tape`` (notebook 03's Tape class) records it."""
        if self.model.device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                # warm-up, outside the capture; captured=True: the forward a graph records (model.project_residual)
                self.model.forward_static(self.pixels, self.meta, captured=True)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # as EncoderGraphRunner measures: what the capture adds is its pool
            before = torch.cuda.memory_reserved()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=side):  # the warmed-up stream: notebook 03 §6 says why
                self.output = self.model.forward_static(self.pixels, self.meta, captured=True)
            torch.cuda.synchronize()
            self.graph_bytes = torch.cuda.memory_reserved() - before
        elif tape is None:
            raise ValueError("HandRunner.capture on a CPU needs tape, the class of an emulated capture")
        else:
            with tape() as self.graph:
                self.output = self.model.forward_static(self.pixels, self.meta)
        return self

    @torch.no_grad()
    def run(self, pixel_values, grid_thw):
        grids = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        batch = self.pixels[: pixel_values.shape[0]]
        batch.copy_(pixel_values, non_blocking=True)  # 1. one copy in, never a rebind; padded rows keep old data
        row_sums = batch.sum(dim=1, dtype=torch.float32)  # 2. the finite check, on the device
        host = build_metadata(grids, self.merge, self.shape)
        self.meta.packed.copy_(torch.from_numpy(host.packed))  # 3. from pageable memory: the host waits for it
        self.graph.replay()  # 4.
        tokens = [spec.tokens for spec in grid_specs(grids.tolist(), self.model.config.spatial_merge_size)]
        out = self.output[: sum(tokens)].clone()  # 5. one clone per batch
        if not torch.isfinite(row_sums).all():  # 6. the one host read, after the launch
            raise ValueError("pixel_values hold NaN or Inf (or a row whose sum overflows)")
        return list(out.split(tokens))  # 7. per-item views of that clone


class NoWait:
    """An 'event' that never waits: a staging buffer without its guard."""

    def record(self, *args):
        pass

    def synchronize(self):
        pass


def gpu_batch(grids: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel rows for ``grids`` in bf16 on the GPU, and the grids (a long tensor on the CPU)."""
    pixels, grid = random_batch(grids, VisionConfig.glm41v(), seed=seed)
    return pixels.to("cuda", torch.bfloat16), grid


def _items(px: torch.Tensor, grid: Any) -> list[torch.Tensor]:
    """The pixel rows of each item of a packed batch."""
    starts = np.cumsum([0] + [t * h * w for t, h, w in np.asarray(grid).tolist()])
    return [px[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _clean_outputs(runner: EncoderGraphRunner, requests: dict, result: dict) -> tuple[dict, torch.Tensor]:
    """Each request's items from clean replays of its planned batches, one batch at a time (plans recorded in
    ``result``), and the race's signature: batch 1's pixels under batch 3's metadata."""
    clean, signature = {}, None
    for name, (r_px, r_grid) in requests.items():
        steps = runner.plan(r_grid)  # planned now: the timed runs find the plan cached
        result["plans"][name] = [{"items": list(s.items), "tokens": s.tokens, "replay": s.replay,
                                  "budget": s.budget} for s in steps]
        r_items = _items(r_px, r_grid)
        outs: dict[int, torch.Tensor] = {}
        for s in steps:
            out = runner.replay(64, torch.cat([r_items[i] for i in s.items]), s.grids)[: s.tokens].clone()
            outs.update(zip(s.items, out.split(list(s.item_tokens)), strict=True))
        clean[name] = [outs[i] for i in range(len(r_items))]
        if name == "three":
            first, last = steps[0], steps[-1]
            rows = torch.cat([r_items[i] for i in first.items])[: last.num_rows]
            signature = runner.replay(64, rows, last.grids)[: first.tokens].clone()
        runner.run(r_px, r_grid, check_finite=False)  # warm: the allocator caches this request's blocks
    assert signature is not None
    return clean, signature


def _sleep_ms(cycles: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def staging_double() -> dict[str, Any]:
    """The runner's pinned staging buffers on the full tower: a request queued behind a sleeping GPU, with and
    without the events that guard the buffers, with two buffers and with one; the host time of run() and whether
    every item came out right."""
    full, sleep_cycles = full_model(), 200_000_000
    with torch.inference_mode():
        runner = EncoderGraphRunner(full, BudgetConfig((64,), max_items=4, max_segments=4)).capture()
        cb = runner.graphs[64]
        px, grid = gpu_batch([[1, 16, 16], [1, 16, 12], [1, 8, 16], [1, 8, 8]], 1)  # 64, 48, 32 and 16 tokens
        item_px = _items(px, grid)
        requests = {"three": (px, grid), "two": (torch.cat([item_px[0], item_px[2]]), grid[[0, 2]])}
        result: dict[str, Any] = {"sleep_cycles": sleep_cycles, "plans": {}}
        clean, signature = _clean_outputs(runner, requests, result)
        torch.cuda.synchronize()
        result["sleep_ms"] = _sleep_ms(sleep_cycles)

        def timed(name, staging, staged):
            saved = cb.staging, cb.staged
            cb.staging, cb.staged, cb.staged_grids = staging, staged, None
            try:
                torch.cuda.synchronize()
                torch.cuda._sleep(sleep_cycles)  # the GPU is busy: what follows queues up behind it
                t0 = time.perf_counter()
                outs = runner.run(*requests[name], check_finite=False)  # waits for nothing itself
                host_ms = (time.perf_counter() - t0) * 1e3
            finally:
                cb.staging, cb.staged = saved
            correct = [torch.equal(o, c) for o, c in zip(outs, clean[name], strict=True)]
            got = {"host_ms": host_ms, "items_correct": correct}
            if name == "three":
                got["first_batch_is_the_signature"] = torch.equal(outs[0], signature)
            return got

        one = (cb.staging[0], cb.staging[0]), (cb.staged[0], cb.staged[0])
        result["three_with_events"] = timed("three", cb.staging, cb.staged)
        result["three_without_events"] = timed("three", cb.staging, (NoWait(), NoWait()))
        result["two_with_two_buffers"] = timed("two", cb.staging, cb.staged)
        result["two_with_one_buffer"] = timed("two", *one)
    torch.cuda.synchronize()
    return result


def _runs_against_eager(full, exact, hand: HandRunner, runner: EncoderGraphRunner, result: dict) -> None:
    """Four requests through both runners: bitwise agreement, and per item the runner against eager bf16 and eager
    against the exact fp32 tower (appended to ``result``)."""
    for k, grids in enumerate(result["requests"]):
        px, grid = gpu_batch(grids, 10 + k)
        by_hand, by_runner = hand.run(px, grid), runner.run(px, grid)
        result["bitwise_hand_vs_runner"].append(all(torch.equal(x, y) for x, y in zip(by_hand, by_runner, strict=True)))
        with torch.inference_mode():
            for i, item in enumerate(_items(px, grid)):
                eager = full(item, grid[i : i + 1]).float()
                truth = exact(item.float(), grid[i : i + 1])
                result["items"].append({"request": k, "item": i, "scale": eager.abs().max().item(),
                                        "runner_vs_eager": (by_runner[i].float() - eager).abs().max().item(),
                                        "eager_vs_fp32": (eager - truth).abs().max().item()})


def _failures(full, hand: HandRunner, runner: EncoderGraphRunner) -> dict[str, Any]:
    """A rebound pixel buffer read stale, check_pointers refusing one, the output buffer overwritten by the next
    replay, and a NaN pixel refused by both runners."""
    cb, result = runner.graphs[64], dict[str, Any]()
    first_px, one = gpu_batch([[1, 16, 16]], 20)
    second_px, _ = gpu_batch([[1, 16, 16]], 21)
    first = hand.run(first_px, one)[0]
    captured = hand.pixels
    hand.pixels = torch.zeros_like(captured)  # rebound after capture
    second = hand.run(second_px, one)[0]
    hand.pixels = captured
    with torch.inference_mode():
        meant = full(second_px, one)
    result["rebound"] = {"equals_previous_answer": torch.equal(second, first),
                         "max_abs_vs_own_answer": (second - meant).abs().max().item(),
                         "scale": meant.abs().max().item()}
    saved, cb.pixels = cb.pixels, torch.zeros_like(cb.pixels)
    try:
        runner.run(second_px, one)
        result["check_pointers"] = None
    except RuntimeError as err:
        result["check_pointers"] = str(err)
    finally:
        cb.pixels = saved
    with torch.inference_mode():
        view = runner.replay(64, first_px, one)
        kept = view.clone()
        owned = runner.run(first_px, one)[0]
        runner.replay(64, second_px, one)
        result["output_buffer"] = {"returned_buffer_changed": not torch.equal(view, kept),
                                   "run_result_kept": torch.equal(owned, kept)}
    nan_px, nan_grid = gpu_batch([[1, 8, 8], [1, 8, 8]], 30)
    nan_px[70, 3] = float("nan")  # a pixel of item 1
    result["nan_refused"] = {}
    for name, r in (("hand", hand), ("runner", runner)):
        try:
            r.run(nan_px, nan_grid)
            result["nan_refused"][name] = None
        except ValueError as err:
            result["nan_refused"][name] = str(err)
    return result


def hand_vs_runner() -> dict[str, Any]:
    """HandRunner against EncoderGraphRunner (check_pointers=True) on the full bf16 tower, budget 64: outputs
    bitwise, against eager, stable addresses, then the failures (:func:`_failures`)."""
    full = full_model()
    exact = copy.deepcopy(full).float()  # the same bf16 weights, held exactly in fp32
    hand = HandRunner(full, 64, 8).capture()
    with torch.inference_mode():
        runner = EncoderGraphRunner(full, BudgetConfig((64,), max_items=4, max_segments=8),
                                    check_pointers=True).capture()
    cb = runner.graphs[64]
    requests = [[[1, 16, 16]], [[1, 8, 8]] * 4, [[2, 8, 8], [1, 8, 16]], [[4, 8, 8]]]
    result: dict[str, Any] = {"requests": requests, "bitwise_hand_vs_runner": [], "items": []}
    hand_addresses = (hand.pixels.data_ptr(), hand.meta.packed.data_ptr(), hand.output.data_ptr())
    _runs_against_eager(full, exact, hand, runner, result)
    result["addresses_stable"] = (cb.data_pointers() == cb.pointers and hand_addresses ==
                                  (hand.pixels.data_ptr(), hand.meta.packed.data_ptr(), hand.output.data_ptr()))
    result.update(_failures(full, hand, runner))
    torch.cuda.synchronize()
    return result


def one_pool_or_three() -> dict[str, Any]:
    """Budgets 64, 256, 1024 of the full tower: EncoderGraphRunner's one shared pool (and scrambled replays against
    eager) against three HandRunners with a private pool each. Reserved memory after each side (it counts static
    buffers and whatever the allocator caches) and, the comparable number, each capture's pool growth: the memory
    reserved across the capture alone, warmed up and with the cache emptied first, on both sides."""
    full = full_model()
    budgets, sides = (64, 256, 1024), {64: 16, 256: 32, 1024: 64}  # one square image fills each budget
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    with torch.inference_mode():
        runner = EncoderGraphRunner(full, BudgetConfig(budgets, max_items=4, max_segments=8)).capture()
    torch.cuda.synchronize()
    result: dict[str, Any] = {"budgets": list(budgets), "shared_reserved_bytes": torch.cuda.memory_reserved() - before,
                              "shared_growth_per_capture": {str(b): runner.captures[b].graph_bytes for b in budgets}}
    worst = 0.0
    with torch.inference_mode():
        batches = {b: gpu_batch([[1, sides[b], sides[b]]], b) for b in budgets}
        eager = {b: full(*batches[b]) for b in budgets}
        for b in (64, 1024, 256, 64, 1024):
            out = runner.replay(b, *batches[b])
            worst = max(worst, (out - eager[b]).abs().max().item() / eager[b].abs().max().item())
    result["scrambled_replays_max_rel_vs_eager"] = worst
    del runner, out
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    hands = [HandRunner(full, b, 8).capture() for b in sorted(budgets, reverse=True)]
    torch.cuda.synchronize()
    result["own_pools_reserved_bytes"] = torch.cuda.memory_reserved() - before
    result["own_growth_per_capture"] = {str(hand.shape.rows // full.config.merge_area): hand.graph_bytes
                                        for hand in hands}
    del hands
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return result


def _tower_calls() -> tuple[Callable[[], None], Callable[[], None], torch.cuda.CUDAGraph]:
    """The full tower on one 224² image: an eager forward, runner.run through a one-budget runner, and its graph."""
    full = full_model()
    with torch.inference_mode():
        runner = EncoderGraphRunner(full, BudgetConfig((64,), max_items=1, max_segments=1)).capture()
    px, grid = gpu_batch([[1, 16, 16]], 30)

    def eager():
        with torch.inference_mode():
            full(px, grid)

    def run():
        runner.run(px, grid)

    graph = runner.graphs[64].graph
    assert graph is not None  # captured above
    return eager, run, graph


def tower_times() -> dict[str, Any]:
    """With no profiler in the process: the wall time of an eager forward and of runner.run (median of 50), the
    host time of graph.replay() itself (median of 50), and the replay's GPU time (CUDA events)."""
    eager, run, graph = _tower_calls()
    result: dict[str, Any] = {label: {"wall_ms_median": float(np.median(time_calls(fn, "cuda", runs=50, warmup=5)))}
                              for label, fn in (("eager", eager), ("run", run))}
    launch_us = []
    for _ in range(50):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()  # returns once the whole graph is handed to the driver
        launch_us.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    result["graph_launch_host_us_median"] = float(np.median(launch_us))
    result["replay_gpu_ms_median"] = float(np.median(time_calls(graph.replay, "cuda", runs=50, warmup=5,
                                                                on_device=True)))
    return result


HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")  # torch.profiler's (Kineto's) categories of host CUDA API calls
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_once(fn: Callable[[], Any], label: str, name_chars: int = 40) -> dict[str, Any]:
    """One call of fn under torch.profiler: host CUDA API calls and GPU work as [start_us, dur_us, name] rows from
    the call's start, and the categories the host calls came under."""
    spans = traced_spans(fn, warmup=3, label=label)
    marks = [e["ts"] for e in spans if e.get("name") == label]
    t0 = min(marks) if marks else min(e["ts"] for e in spans)
    host = [e for e in spans if (e.get("cat") in HOST_CATEGORIES or e["name"].startswith("cudaGraphLaunch"))
            and e.get("cat") not in GPU_CATEGORIES and e["name"] != "cudaDeviceSynchronize"]  # not the profiler's
    gpu = [e for e in spans if e.get("cat") in GPU_CATEGORIES]

    def rows(events):
        return sorted([round(e["ts"] - t0, 2), round(e["dur"], 2), e["name"][:name_chars]] for e in events)

    categories = {e["name"][:name_chars]: e.get("cat") for e in host}
    return {"host": rows(host), "gpu": rows(gpu), "host_categories": categories}


def tower_timeline() -> dict[str, Any]:
    """The eager forward and runner.run of :func:`tower_times`, each once under torch.profiler: host CUDA calls and
    GPU work on a timeline. Nothing timed here (:func:`tower_times` times them with no profiler attached)."""
    eager, run, _ = _tower_calls()
    return {label: profile_once(fn, label) for label, fn in (("eager", eager), ("run", run))}


# ---- notebook 06's CPU helpers: comparisons, printed lines and figures (no GPU work) ----

def fp32_close(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """max |got − ref| ≤ 1e-4 · max(1, max |ref|). float32 rounds each operation by ≤ 2⁻²⁴ ≈ 6e-8 and another batch
    shape differs by a few such roundings per operation, far below 1e-4 over a tiny tower; a wrong layout or a stale
    buffer is off by O(1)."""
    return (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


@torch.no_grad()
def eager_items(model: Any, pixels: torch.Tensor, grid: Any) -> list[torch.Tensor]:
    """``model.forward`` on each item of a packed batch alone: the per-item eager answer a runner is checked against."""
    grid = torch.as_tensor(np.asarray(grid), dtype=torch.long).reshape(-1, 3)
    return [model(rows, grid[i : i + 1]) for i, rows in enumerate(_items(pixels, grid))]


def refusals(runners: dict[str, Any], pixels: torch.Tensor, grid: Any) -> dict[str, str | None]:
    """``runner.run(pixels, grid)`` for each named runner: the ValueError's message where it refused, else None."""
    out: dict[str, str | None] = {}
    for name, runner in runners.items():
        try:
            runner.run(pixels, grid)
            out[name] = None
        except ValueError as err:
            out[name] = str(err)
    return out


def plot_staging(serve: Callable[..., Any], batches: list[Any], cases: list[tuple[int, bool]]) -> Any:
    """One lane chart per ``(buffers, guard)`` case of ``serve(batches, buffers, guard)``: host writes above, stream
    reads below, green where a replay saw its own batch's metadata, red where it saw another's. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cases), 1, figsize=(10, 1.55 * len(cases)), sharex=True, squeeze=False)
    for ax, (buffers, guard) in zip(axes[:, 0], cases, strict=True):
        seen, log, waits = serve(batches, buffers, guard)
        for x, (lane, k, value, what) in enumerate(log):
            y = 1 if lane == "host" else 0
            colour = "C0" if lane == "host" else ("C2" if value == k + 1 else "C3")
            ax.add_patch(plt.Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, color=colour))
            ax.text(x + 0.5, y + 0.5, f"batch {k + 1}\n{what} {value}", ha="center", va="center", fontsize=6.5,
                    color="white")
        ax.set_xlim(0, len(log))
        ax.set_ylim(0, 2)
        ax.set_yticks([0.5, 1.5], ["stream", "host"])
        ax.set_title(f"{buffers} staging buffer{'s' if buffers > 1 else ''}, {'with' if guard else 'without'} the "
                     f"guard: the replays saw {[v[0] for v in seen]}; the host waited {waits}×", fontsize=9)
    axes[-1, 0].set_xlabel("order in which things happen (green: the batch's own metadata, red: another batch's)")
    fig.tight_layout()
    return fig


def staging_lines(staged: dict[str, Any]) -> list[str]:
    """The ``06_staging_double`` record as lines: each request's batches as ``runner.plan`` packed them, then per
    case the host's time in ``run()`` and which items came out correct."""
    lines = [f"{name}-batch request: " + "; ".join(f"items {s['items']} → budget {s['budget']}" for s in plan)
             for name, plan in staged["plans"].items()]
    for key in ("three_with_events", "three_without_events", "two_with_two_buffers", "two_with_one_buffer"):
        r = staged[key]
        extra = (f"; batch 1 saw batch 3's metadata: {r['first_batch_is_the_signature']}"
                 if "first_batch_is_the_signature" in r else "")
        lines.append(f"{key:<21}: host {r['host_ms']:6.1f} ms in run(); items correct {r['items_correct']}{extra}")
    return lines


def bf16_ulp(scale: float) -> float:
    """Spacing of bf16 numbers at magnitude ``scale``: 2^(floor(log2 scale) − 7) (8 significant bits)."""
    return float(2.0 ** (np.floor(np.log2(scale)) - 7))


def item_bound(item: dict[str, Any]) -> float:
    """A bf16 runner's allowance on one item of the ``06_hand_vs_runner`` record: 3E + 1 ulp at the item's scale,
    E = max |eager − fp32| on that item (a runner at most twice as wrong as eager is within 3E of eager)."""
    return 3 * item["eager_vs_fp32"] + bf16_ulp(item["scale"])


def graph_launch(lane: dict[str, Any]) -> tuple[float, float, str]:
    """The one ``cudaGraphLaunch`` host call of a profiled lane of ``06_timeline_launch``: (start µs, µs, name).
    Raises ValueError unless there is exactly one."""
    found = [tuple(h) for h in lane["host"] if h[2].startswith("cudaGraphLaunch")]
    if len(found) != 1:
        raise ValueError(f"expected one cudaGraphLaunch in the lane, found {len(found)}")
    start, us, name = found[0]
    return float(start), float(us), str(name)


def plot_tower_timeline(timeline: dict[str, Any], times: dict[str, Any]) -> Any:
    """Two lanes per call (host CUDA calls above, GPU kernels and copies below) for the ``eager`` and ``run`` entries
    of ``06_timeline_launch``, ``cudaGraphLaunch`` in red, labelled with its profiled and (``06_timeline_times``)
    unprofiled host time; titles give ``06_timeline_times``' median wall time.
    Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 4.2))
    for ax, label in zip(axes, ("eager", "run"), strict=True):
        r = timeline[label]
        for s, d, name in r["host"]:
            launch = name.startswith("cudaGraphLaunch")
            ax.broken_barh([(s / 1e3, d / 1e3)], (1.1, 0.8), color="C3" if launch else "C1")
            if launch:  # the profiler inflates the launch: its unprofiled time beside it, where recorded
                without = times.get("graph_launch_host_us_median")
                text = f"{name}: {d:.0f} µs under the profiler" + (f", {without:.0f} µs without" if without else "")
                ax.annotate(text, (s / 1e3 + d / 2e3, 1.95), ha="center", va="bottom", fontsize=8, color="C3")
        ax.broken_barh([(s / 1e3, d / 1e3) for s, d, _ in r["gpu"]], (0.1, 0.8), color="C0")
        ax.set_yticks([0.5, 1.5], ["GPU kernels, copies", "host CUDA calls"])
        ax.set_ylim(0, 2.4)
        busy = sum(d for _, d, _ in r["gpu"]) / 1e3
        ax.set_title(f"{'model.forward' if label == 'eager' else 'runner.run'}: {len(r['host'])} host calls, "
                     f"{len(r['gpu'])} kernels and copies ({busy:.2f} ms busy); "
                     f"{times[label]['wall_ms_median']:.2f} ms per call (median of 50, no profiler)", fontsize=9)
        ax.set_xlabel("ms from the start of the call, under the profiler")
    fig.suptitle("full GLM-4.1V tower, bf16, one 224² image", fontsize=10)
    fig.tight_layout()
    return fig
