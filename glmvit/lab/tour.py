"""Notebook 00's GPU measurement: the CUDA kernels of one eager forward of the full tower, ours and transformers'."""
from __future__ import annotations

from typing import Any

import torch

from ..processing import SAMPLE_DATA, process_images
from .shared import full_model

PHOTO = SAMPLE_DATA / "images" / "astronaut.jpg"
MAX_PIXELS = 2 * 224 * 224  # notebook 00's photo, resized to 224 × 224


def _cuda_kernels(net: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[int, int]:
    """(kernels, CUDA events with copies) of one eager call of net after one warm-up call, under torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        net(pixels, grid)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            net(pixels, grid)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(not e.name.startswith(("Memcpy", "Memset")) for e in events), len(events)


def kernel_count() -> dict[str, Any]:
    """CUDA kernels of one eager forward of the full GLM-4.1V tower, bf16, on the 224² photo: ours (the device's
    default attention) and transformers' ``Glm4vVisionModel`` (sdpa) with the same weights."""
    from ..oracle import hf_twin

    inputs = process_images(PHOTO, max_pixels=MAX_PIXELS)
    gpu = torch.device("cuda")
    pixels, grid = inputs.pixel_values.to(gpu, torch.bfloat16), inputs.grid_thw.to(gpu)
    ours_full = full_model()
    kernels, events = _cuda_kernels(ours_full, pixels, grid)
    hf_kernels, hf_events = _cuda_kernels(hf_twin(ours_full, attn="sdpa"), pixels, grid)
    return {"grid": inputs.grid_thw.tolist(), "glmvit_backend": ours_full.attention_backend(),
            "glmvit_kernels": kernels, "glmvit_events": events,
            "transformers_kernels": hf_kernels, "transformers_events": hf_events}


# --- notebook 00's CPU helpers: the map's names, the photo's patch grid, operator counts, the records' figure ------

ENTRY_POINTS: dict[str, list[str]] = {
    "glmvit.processing": ["process_images", "process_video", "sample_inputs"],
    "glmvit.geometry": ["smart_resize", "grid_for", "ItemSpec"],
    "glmvit.packing": ["BudgetConfig", "plan_batches", "default_ladder"],
    "glmvit.metadata": ["build_metadata", "BatchShape"],
    "glmvit.model": ["GlmVisionEncoder"],
    "glmvit.graphs": ["EncoderGraphRunner", "CapturedBudget"],
    "glmvit.costmodel": ["graph_memory", "LatencyTable", "predict_time"],
    "glmvit.deployment": ["recommend_budgets", "evaluate_budgets", "vllm_compilation_config"],
    "glmvit.records": ["load", "describe", "staleness"],
    "glmvit.rotary": ["rot_pos_ids", "rotary_cos_sin"],
    "glmvit.kernels": ["interpolate_pos_embed"],
    "glmvit.parallel": ["balance_items", "DataParallelEncoder"],
    "glmvit.lab.seed": ["load_seed", "seed_budget_config", "seed_rows", "seed_serve"],
}


def missing_entry_points(entry_points: dict[str, list[str]] | None = None) -> list[str]:
    """The ``module.name`` entries of ``entry_points`` (default :data:`ENTRY_POINTS`, the map's) that do not
    import; empty when every name the map points to exists."""
    import importlib

    missing = []
    for module, names in (ENTRY_POINTS if entry_points is None else entry_points).items():
        mod = importlib.import_module(module)
        missing += [f"{module}.{n}" for n in names if not hasattr(mod, n)]
    return missing


def plot_patch_grid(photo: Any, resized: Any, patch: int = 14, merge: int = 2) -> Any:
    """The original photo beside the resized one with its ``patch``-px grid and one ``merge`` × ``merge`` block
    outlined in red; returns the figure."""
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.5))
    axes[0].imshow(photo)
    axes[0].set_title(f"original {photo.width}×{photo.height}")
    axes[1].imshow(resized)
    for x in range(0, resized.width + 1, patch):
        axes[1].axvline(x - 0.5, color="white", lw=0.3)
    for y in range(0, resized.height + 1, patch):
        axes[1].axhline(y - 0.5, color="white", lw=0.3)
    side = patch * merge
    axes[1].add_patch(mpatches.Rectangle((-0.5, -0.5), side, side, fill=False, ec="red", lw=2))
    axes[1].set_title(f"{resized.width}×{resized.height}: {patch}-px patches, one {merge}×{merge} merge block in red")
    for ax in axes:
        ax.set_xticks([]), ax.set_yticks([])
    return fig


def ulps(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest |got − expected| in units of ε · max|expected| (ε = 2⁻²³, float32's machine epsilon): not float32
    ulps, which are powers of two, but within a factor 2 of the ulp at expected's largest magnitude."""
    eps = torch.finfo(torch.float32).eps
    return ((got - expected).abs().max() / (eps * expected.abs().max())).item()


VIEW_OPS = frozenset({"aten::view", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::transpose",
                      "aten::permute", "aten::slice", "aten::select", "aten::unbind", "aten::expand", "aten::detach",
                      "aten::t", "aten::as_strided", "aten::alias", "aten::lift_fresh", "aten::resolve_conj",
                      "aten::resolve_neg"})
NOOP_TO = "aten::to (no-op)"  # how top_level_ops names an aten::to that returned its input: it launches nothing


def top_level_ops(fn: Any) -> dict[str, int]:
    """The top-level ``aten::`` operators (no ``aten::`` parent) of one call of ``fn()`` under ``torch.profiler``
    on the CPU, after one warm-up call, both without grad: ``{name: calls}``. An ``aten::to`` that called no other
    operator (the tensor already had that dtype and device: it returned its input) is counted as :data:`NOOP_TO`."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    counts: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and not (parent is not None and parent.name.startswith("aten::")):
            name = NOOP_TO if e.name == "aten::to" and not e.cpu_children else e.name
            counts[name] = counts.get(name, 0) + 1
    return counts


def work_ops(counts: dict[str, int]) -> int:
    """The calls in ``counts`` (as :func:`top_level_ops` returns) of operators that are neither views
    (:data:`VIEW_OPS`) nor conversions that returned their input (:data:`NOOP_TO`): the CPU proxy for kernel
    launches."""
    return sum(n for name, n in counts.items() if name not in VIEW_OPS and name != NOOP_TO)


def count_ops(config: Any, depth: int, pixels: torch.Tensor, grid: torch.Tensor, tower: str = "glmvit",
              hidden: int = 64, heads: int = 4) -> int:
    """:func:`work_ops` of one forward of a random-weight tower: ``config`` at ``depth``, ``hidden`` and ``heads``,
    as transformers' ``Glm4vVisionModel`` (sdpa attention; ``tower="transformers"``) or glmvit's encoder holding
    the same weights (``tower="glmvit"``)."""
    import dataclasses

    from ..oracle import encoder_like, hf_vision_model

    cfg = dataclasses.replace(config, depth=depth, hidden_size=hidden, num_heads=heads)
    ref = hf_vision_model(cfg, seed=0, attn="sdpa")
    net = encoder_like(ref, cfg) if tower == "glmvit" else ref
    return work_ops(top_level_ops(lambda: net(pixels, grid)))


def plot_bench_modes(bench: dict[str, Any], modes: list[str]) -> Any:
    """One bar panel per benchmark record of ``bench`` ({name: BenchRecord}): each mode's median ms per request,
    the floor dashed in red; returns the figure."""
    import matplotlib.pyplot as plt

    colors = ["tab:gray", "silver", "tab:blue", "tab:green", "tab:olive"]
    fig, axes = plt.subplots(1, len(bench), figsize=(10, 3.4))
    for ax, (name, run) in zip(axes, bench.items(), strict=True):
        ax.bar([m.replace("-", "-\n") for m in modes], [run.modes[m].median_ms for m in modes], color=colors)
        ax.axhline(run.floor["mean_ms"], color="red", ls="--", label="floor")
        ax.set(title=f"{name}: median ms per request ({run.provenance.short_commit})", ylabel="ms")
        ax.legend()
    fig.tight_layout()
    return fig


def pr_vs_glmvit(seed: dict[str, Any], bench_dir: Any, workloads: tuple[str, ...] = ("img1x224", "video8x224"),
                 gpus: tuple[str, ...] = ("1× RTX 4090", "2× RTX 4090, encoder data-parallel")) -> dict[str, Any]:
    """The PR's published mean ms (eager, graph) on each of ``gpus`` beside glmvit's GPU benchmark of the same
    configuration (``bench_dir/seed_<workload>.json``: eager, graph, graph-compiled, on the PR's budgets), per
    workload; prints one row each. Returns ``{"pr": {gpus: {workload: (eager, graph)}}, "glmvit": {workload: {mode:
    mean ms}}, "budgets": {workload: the budgets glmvit ran}}``."""
    from ..records import BenchRecord, load
    from .seed import seed_rows

    out: dict[str, Any] = {"pr": {g: {} for g in gpus}, "glmvit": {}, "budgets": {}}
    print(f"{'workload':<12}{'who (mean ms)':<36}{'eager':>8}{'graph':>8}{'compiled':>9}{'eager / graph':>14}")
    for name in workloads:
        own = load(bench_dir / f"seed_{name}.json", BenchRecord)
        out["budgets"][name] = tuple(own.settings.budgets)
        for g in gpus:
            e, gr = out["pr"][g][name] = tuple(seed_rows(seed, g)[name]["mean"])
            print(f"{name:<12}{'PR 40576, ' + g.split(',')[0]:<36}{e:>8.2f}{gr:>8.2f}{'-':>9}{e / gr:>13.2f}×")
        means = out["glmvit"][name] = {m: r.mean_ms for m, r in own.modes.items()}
        e, gr, c = (means.get(k, float("nan")) for k in ("eager", "graph", "graph-compiled"))
        who = f"glmvit, {str(own.provenance.gpu).removeprefix('NVIDIA ')}, the PR's budgets"
        print(f"{'':<12}{who:<36}{e:>8.2f}{gr:>8.2f}{c:>9.2f}{e / gr:>13.2f}×")
    return out
