"""Notebook 04's GPU measurements on its tiny tower (2 heads of 32, transformers' random weights, seed 0): which
calls sync the host, a graph captured on batch A and replayed on batch B, and the attention backends' accuracy.
Then the notebook's CPU views (the layout and padding-work figures, the latency sweep's reading, the records' tables)
and its exercises' solutions (a switchable input guard, a plain masked SDPA, a graph-safe attention in fixed slots)."""
from __future__ import annotations

import contextlib
import dataclasses
from functools import lru_cache
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from .. import attention as attention_module
from ..attention import attend, attend_qkv, available_backends
from ..config import VisionConfig
from ..metadata import BatchShape, build_metadata
from ..oracle import encoder_like, flatten_video_grids, hf_twin, hf_vision_model
from ..workloads import random_batch

GRIDS = [[1, 4, 6], [2, 2, 4], [1, 8, 4]]  # notebook 04's batch: an image, a 2-temporal-patch video, another image
AB_SHAPE = BatchShape(rows=160, segments=4, max_seqlen=160)
GRIDS_A, GRIDS_B = [[1, 8, 8], [1, 8, 8]], [[1, 4, 8], [1, 12, 8]]
BIG_GRIDS = [[1, 16, 16], [1, 12, 20], [2, 8, 8], [1, 4, 4]]


def tiny_config() -> VisionConfig:
    """The tiny tower with 2 heads of 32: a head_dim glmvit's Triton attention (the CUDA default) can run."""
    return dataclasses.replace(VisionConfig.tiny(), num_heads=2)


@lru_cache(maxsize=1)
def _oracle() -> Any:
    """transformers' Glm4vVisionModel of :func:`tiny_config`, random weights (seed 0), eager attention, on the CPU."""
    return hf_vision_model(tiny_config(), seed=0)


def sdpa_rows(q, k, v):
    """SDPA on (rows, heads, d) tensors."""
    return F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)


def frozen_loop(bounds):
    """An attention whose loop bounds were fixed when it was "captured": what a replay of a Python loop repeats."""
    def attend_frozen(q, k, v, meta, backend):
        out = torch.zeros_like(q)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            if b > a:
                out[a:b] = sdpa_rows(q[a:b], k[a:b], v[a:b])
        return out
    return attend_frozen


def _sync_cases(net, hf_gpu, px, grid, meta_gpu) -> dict[str, Any]:
    """Notebook 04's table of calls, each to run once under ``set_sync_debug_mode("error")``."""
    gpu = px.device
    xg = torch.randn(16, device=gpu)
    counts_g = torch.full((16,), 2, device=gpu)
    flat = flatten_video_grids(grid).to(gpu)

    def static(backend):
        def run():
            net.attn_backend = backend
            return net.forward_static(px, meta_gpu)
        return run

    def event_wait():
        event = torch.cuda.Event()
        event.record()
        event.synchronize()

    return {"transformers forward": lambda: hf_gpu(px, flat),
            "glmvit forward": lambda: net(px, grid),
            "glmvit forward(check_finite=False)": lambda: net(px, grid, check_finite=False),
            "forward_static, triton": static("triton"),
            "forward_static, varlen": static("varlen"),
            "forward_static, sdpa_masked": static("sdpa_masked"),
            "forward_static, segments": static("segments"),
            "x[x > 0]": lambda: xg[xg > 0],
            "torch.nonzero(x)": lambda: torch.nonzero(xg),
            "x.repeat_interleave(counts)": lambda: xg.repeat_interleave(counts_g),
            "torch.masked_select(x, x > 0)": lambda: torch.masked_select(xg, xg > 0),
            "torch.unique(x)": lambda: torch.unique(xg),
            'x.to("cpu")': lambda: xg.to("cpu"),
            "torch.cuda.synchronize()": torch.cuda.synchronize,
            "Event.synchronize()": event_wait}


def sync_checks() -> dict[str, Any]:
    """Which calls ``torch.cuda.set_sync_debug_mode("error")`` flags, on the tiny bf16 tower and on small tensors,
    and the tower's default attention backend on CUDA."""
    gpu, config = torch.device("cuda"), tiny_config()
    pixels, grid = random_batch(GRIDS, config, seed=0)
    net = encoder_like(_oracle(), config).to(gpu, torch.bfloat16)
    cases = _sync_cases(net, hf_twin(net, attn="sdpa"), pixels.to(gpu, torch.bfloat16), grid,
                        build_metadata(grid).to(gpu))
    verdict = {}
    with torch.no_grad():
        for name, fn in cases.items():
            fn()  # warm-up, outside the debug mode
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                verdict[name] = "no sync flagged"
            except RuntimeError as err:
                verdict[name] = "sync: " + str(err).strip().splitlines()[0][:160]
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    net.attn_backend = None
    return {"verdict": verdict, "cuda_default_backend": net.attention_backend()}


def _capture_on_a(net, backend: str, patch: Any, truth_backend: str) -> tuple[float, float]:
    """Capture forward_static on batch A's metadata, replay it on batch B's buffers: (max |replay − eager B|, the
    output's scale), on B's first 32 tokens."""
    gpu, dt, config = torch.device("cuda"), torch.bfloat16, net.config
    px_a, _ = random_batch(GRIDS_A, config, seed=2)
    px_b, grid_b = random_batch(GRIDS_B, config, seed=3)
    host_b = build_metadata(grid_b, 2, AB_SHAPE)
    net.attn_backend = backend
    static_px = torch.zeros(AB_SHAPE.rows, config.patch_dim, device=gpu, dtype=dt)
    static_px[:128] = px_a.to(gpu, dt)
    static_meta = build_metadata(GRIDS_A, 2, AB_SHAPE).to(gpu)
    with patch, torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            net.forward_static(static_px, static_meta)  # warm-up outside the capture (Triton compiles here)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # the outer stream context restores the caller's stream even if a failed capture skips it
        with torch.cuda.stream(torch.cuda.current_stream()), torch.cuda.graph(graph):
            static_out = net.forward_static(static_px, static_meta)
    static_px[:128] = px_b.to(gpu, dt)  # batch B into the same buffers, as a runner does
    static_meta.packed.copy_(torch.from_numpy(host_b.packed).to(gpu))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        net.attn_backend = truth_backend
        truth = net.forward_static(static_px, host_b.to(gpu))
    return (static_out[:32].float() - truth[:32].float()).abs().max().item(), truth[:32].float().abs().max().item()


def capture_on_a_replay_b() -> dict[str, Any]:
    """The tiny bf16 tower captured on batch A, replayed on batch B: triton, varlen, and a host-copy loop (bounds
    read at capture); then a capture of the ``segments`` backend, which syncs."""
    net = encoder_like(_oracle(), tiny_config()).to(torch.device("cuda"), torch.bfloat16)

    def host_copy_loop(q, k, v, meta, backend):  # the loop with bounds from meta.host: no device read
        return frozen_loop(meta.host.cu_seqlens.tolist())(q, k, v, meta, backend)

    result = {"triton": _capture_on_a(net, "triton", contextlib.nullcontext(), "triton"),
              "varlen": _capture_on_a(net, "varlen", contextlib.nullcontext(), "varlen"),
              "host-copy loop": _capture_on_a(
                  net, "varlen", mock.patch.object(attention_module, "attend", host_copy_loop), "varlen")}
    try:
        _capture_on_a(net, "segments", contextlib.nullcontext(), "segments")
        segments = "captured"
    except Exception as err:  # the shipped backend reads cu_seqlens from the device: a sync inside the capture
        segments = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:160]}"
    torch.cuda.synchronize()
    return {"max_abs_diff": {k: v[0] for k, v in result.items()},
            "output_scale": min(v[1] for v in result.values()), "segments_capture": segments}


def _attention_alone(cuda_meta, rows: int, backends: list[str]) -> dict[str, Any]:
    """bf16 attention, 12 heads × 128, each backend against an fp32 reference, and its time per call (20 calls)."""
    from ..rotary import apply_rotary, inv_freq, rotary_cos_sin

    gpu, heads, head_dim = cuda_meta.packed.device, 12, 128
    assert all(b in available_backends(gpu, torch.bfloat16, head_dim) for b in backends)
    gen = torch.Generator(device=gpu).manual_seed(0)
    qkv = torch.randn(rows + 64, 3 * heads * head_dim, generator=gen, device=gpu).to(torch.bfloat16)
    cos, sin = rotary_cos_sin(cuda_meta.h_idx, cuda_meta.w_idx, inv_freq(head_dim).to(gpu))
    q, k, v = qkv.view(-1, 3, heads, head_dim).unbind(1)
    reference = attend(apply_rotary(q, cos, sin).float(), apply_rotary(k, cos, sin).float(), v.float(), cuda_meta,
                       "segments").reshape(-1, heads * head_dim)[:rows]
    errors, times = {}, {}
    for backend in backends:
        out = attend_qkv(qkv, cos, sin, cuda_meta, backend, heads)  # also the warm-up (Triton compiles here)
        errors[backend] = (out[:rows].float() - reference).abs().max().item()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            attend_qkv(qkv, cos, sin, cuda_meta, backend, heads)
        end.record()
        torch.cuda.synchronize()
        times[backend] = start.elapsed_time(end) / 20 * 1e3
    return {"attention_vs_fp32": errors, "v_scale": v[:rows].float().abs().max().item(), "attention_us": times}


def attention_backends() -> dict[str, Any]:
    """The graph-safe CUDA backends: attention alone against fp32 (:func:`_attention_alone`), and the tiny bf16
    tower's forward_static with each against transformers in fp32 on the CPU."""
    gpu, config, backends = torch.device("cuda"), tiny_config(), ["triton", "varlen", "sdpa_masked"]
    big_pixels, big_grid = random_batch(BIG_GRIDS, config, seed=1)
    rows = big_pixels.shape[0]
    big_shape = BatchShape(rows=rows + 64, segments=8, max_seqlen=rows + 64)
    big_buf = torch.zeros(rows + 64, config.patch_dim)
    big_buf[:rows] = big_pixels
    with torch.no_grad():
        expected_big = _oracle()(big_pixels, flatten_video_grids(big_grid)).pooler_output
    cuda_meta = build_metadata(big_grid, 2, big_shape).to(gpu)
    result = _attention_alone(cuda_meta, rows, backends)
    gpu_model = encoder_like(_oracle(), config).to(gpu, torch.bfloat16)
    encoder_errors = {}
    with torch.no_grad():
        for backend in backends:
            gpu_model.attn_backend = backend
            out = gpu_model.forward_static(big_buf.to(gpu, torch.bfloat16), cuda_meta)[: rows // 4].float().cpu()
            encoder_errors[backend] = (out - expected_big).abs().max().item()
    return {**result, "encoder_vs_transformers_fp32": encoder_errors, "output_scale": expected_big.abs().max().item()}


# ---- notebook 04's CPU views: the layout picture, the padding work, the latency sweep, the backend tables ----

def padded(pixels: torch.Tensor, rows: int) -> torch.Tensor:
    """A zero buffer of ``rows`` pixel rows with ``pixels`` copied into its head: a captured input buffer."""
    if pixels.shape[0] > rows:
        raise ValueError(f"{pixels.shape[0]} pixel rows do not fit a buffer of {rows}")
    buf = pixels.new_zeros(rows, pixels.shape[1])
    buf[: pixels.shape[0]] = pixels
    return buf


def sync_message(fn: Any) -> str | None:
    """None if ``fn()`` runs under ``torch.no_grad()`` inside ``forbid_host_syncs()``, else the guard's message."""
    from ..testing import forbid_host_syncs

    try:
        with torch.no_grad(), forbid_host_syncs():
            fn()
    except AssertionError as err:
        return str(err)
    return None


def value_error(fn: Any) -> str | None:
    """The message of the ``ValueError`` that ``fn()`` raises, None if it returns; other exceptions propagate."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def plot_packed_layout(meta: Any) -> tuple[Any, torch.Tensor]:
    """Left, the packed rows of device metadata ``meta`` by segment (its ``cu_seqlens``), the padded rows past the
    last boundary hatched; right, the mask ``sdpa_masked`` builds from ``segment_ids`` (rows of one id attend to each
    other). Returns (the figure, that boolean rows × rows mask)."""
    import matplotlib.pyplot as plt

    seg, cu = meta.segment_ids, meta.cu_seqlens.tolist()
    rows, real = seg.shape[0], cu[-1]
    mask = seg[:, None] == seg[None, :]
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4.6), gridspec_kw={"width_ratios": [1, 4]})
    colours = plt.get_cmap("tab10")
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        if b > a:
            ax0.add_patch(plt.Rectangle((0, a), 1, b - a, color=colours(s), ec="black"))
            ax0.text(0.5, (a + b) / 2, f"seg {s}\n{b - a} rows", ha="center", va="center")
    ax0.add_patch(plt.Rectangle((0, real), 1, rows - real, color="lightgray", hatch="//", ec="black"))
    ax0.text(0.5, (real + rows) / 2, "padding:\nno segment", ha="center", va="center")
    ax0.set_xlim(0, 1), ax0.set_ylim(rows, 0), ax0.set_xticks([])
    ax0.set_ylabel("packed row"), ax0.set_title("packed layout")
    ax1.imshow(mask.numpy(), cmap="Greys", interpolation="nearest")
    ax1.set_title("attention mask of sdpa_masked (black = may attend)")
    ax1.set_xlabel("key row"), ax1.set_ylabel("query row")
    fig.tight_layout()
    return fig, mask


def dummy_segment_work(grids: list[list[int]], shape: BatchShape) -> int:
    """The attention work Σ L² of ``grids`` in ``shape`` had every padded row gone into one dummy segment: the
    work of :func:`glmvit.metadata.attention_work` plus the padded rows squared."""
    from ..metadata import attention_work

    padding = shape.rows - sum(t * h * w for t, h, w in grids)
    return attention_work(build_metadata(grids, 2, shape)) + padding**2


def plot_padding_work(shape: BatchShape) -> tuple[Any, dict[str, list[int]]]:
    """Attention work of one square image of s × s patches (s even, every size that fits ``shape``) plus padding:
    padding outside every segment (``build_metadata``) and in one dummy segment. Returns (the figure,
    ``{"sides", "padded_rows", "outside", "dummy"}``)."""
    import matplotlib.pyplot as plt

    from ..metadata import attention_work

    sides = list(range(2, int(shape.rows**0.5) + 1, 2))
    work = {"sides": sides, "padded_rows": [shape.rows - s * s for s in sides],
            "outside": [attention_work(build_metadata([[1, s, s]], 2, shape)) for s in sides],
            "dummy": [dummy_segment_work([[1, s, s]], shape) for s in sides]}
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(work["padded_rows"], [w / 1e6 for w in work["dummy"]], label="padding in one dummy segment")
    ax.plot(work["padded_rows"], [w / 1e6 for w in work["outside"]],
            label="padding outside every segment (build_metadata)")
    ax.set(xlabel=f"padded rows in a budget of {shape.rows} rows", ylabel="attention work Σ L² (10⁶ rows²)",
           title="one image plus padding: what a varlen kernel computes")
    ax.legend()
    fig.tight_layout()
    return fig, work


def sweep_layouts(sweep: Any) -> dict[int, dict[str, Any]]:
    """A latency sweep's (``records.LatencySweep``) layouts: budget tokens → layout name → ``LatencyLayout``."""
    return {b.tokens: {x.name: x for x in b.layouts} for b in sweep.budgets}


def dummy_segment_ms(sweep: Any, attention_ms: float) -> dict[int, float]:
    """Per budget with a ``one-small`` layout: its replay time plus its padded rows squared at ``attention_ms`` per
    10⁶ rows², a prediction for the same batch with its padding in one dummy segment (4 rows per token)."""
    return {t: lay["one-small"].graph_ms + attention_ms * (4 * t - 4 * lay["one-small"].real_tokens) ** 2 / 1e6
            for t, lay in sweep_layouts(sweep).items() if "one-small" in lay}


LAYOUTS = ["full", "full-many", "half", "one-small", "many-small", "video"]


def plot_latency_sweep(sweep: Any, predicted: dict[int, float]) -> Any:
    """Replay time per budget, one line per layout of :data:`LAYOUTS`, ``one-small`` run eagerly, and ``predicted``
    (:func:`dummy_segment_ms`) dashed, on log axes. Returns the figure."""
    import matplotlib.pyplot as plt

    layout = sweep_layouts(sweep)
    budgets = list(layout)
    fig, ax = plt.subplots(figsize=(8, 4))
    for n in LAYOUTS:
        ax.plot(budgets, [layout[t][n].graph_ms if n in layout[t] else float("nan") for t in budgets],
                "o-" if n == "full" else ".-", label=f"replay: {n}", lw=2 if n == "full" else 1)
    small = {t: lay["one-small"] for t, lay in layout.items() if "one-small" in lay}
    ax.plot(list(small), [x.eager_ms for x in small.values()], "k^:", label="eager: one-small")
    ax.plot(list(predicted), list(predicted.values()), "r--", label="one-small with a dummy segment (predicted)")
    ax.set(xscale="log", yscale="log", xlabel="captured budget (tokens)", ylabel="ms (median)",
           title=f"replaying one budget with different batches ({sweep.provenance.gpu}, {sweep.attn_backend})")
    ax.set_xticks(budgets, [str(b) for b in budgets], rotation=45)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def latency_lines(sweep: Any, predicted: dict[int, float]) -> list[str]:
    """One line per budget: the full layout's and the slowest layout's replay; for ``one-small``, its replay, its
    eager run and ``predicted`` (:func:`dummy_segment_ms`)."""
    layout, lines = sweep_layouts(sweep), []
    for b in sweep.budgets:
        x = layout[b.tokens].get("one-small")
        line = (f"budget {b.tokens:>5}: full {b.full_graph_ms:7.2f} ms, slowest layout {b.graph_ms:7.2f} ms "
                f"({b.worst_layout_vs_full:.2f}× full)")
        if x is not None:
            line += (f"; one 224² image {x.graph_ms:6.2f} ms replayed, {x.eager_ms:6.2f} ms eager, "
                     f"{predicted[b.tokens]:6.1f} ms predicted with a dummy segment")
        lines.append(line)
    return lines


def capture_lines(captured: dict[str, Any]) -> list[str]:
    """The record of :func:`capture_on_a_replay_b` as lines: per backend, max |replay − eager B|; then the
    ``segments`` capture's outcome."""
    return [f"captured on A, replayed on B, {name:<15}: max |replay − eager B| = {diff:.3g} "
            f"(outputs up to {captured['output_scale']:.2f})" for name, diff in captured["max_abs_diff"].items()] + [
        f"capturing the shipped segments backend: {captured['segments_capture']}"]


def backend_lines(ab: dict[str, Any]) -> list[str]:
    """The record of :func:`attention_backends` as lines: attention alone against fp32 (error, time per call), then
    the tiny tower against transformers in fp32."""
    lines = [f"attention, bf16, 12 heads × 128, {b:<11}: max |out − fp32 reference| = {err:.2e} "
             f"(|v| up to {ab['v_scale']:.2f}); {ab['attention_us'][b]:5.0f} µs per call"
             for b, err in ab["attention_vs_fp32"].items()]
    encoder = ab["encoder_vs_transformers_fp32"]
    return lines + [f"tiny encoder, bf16 ({b:<11}) vs transformers fp32: max abs diff {err:.2e} "
                    f"(outputs up to {ab['output_scale']:.2f})" for b, err in encoder.items()]


def time_forward_static(net: Any, buf: torch.Tensor, meta: Any, backends: list[str]) -> dict[str, Any]:
    """``net.forward_static(buf, meta)`` with each backend: backend → (output, best seconds per forward of 3 × 3
    calls). Restores the net's default backend."""
    import timeit

    results = {}
    with torch.no_grad():
        for backend in backends:
            net.attn_backend = backend
            out = net.forward_static(buf, meta)
            results[backend] = (out, min(timeit.repeat(lambda: net.forward_static(buf, meta), number=3, repeat=3)) / 3)
    net.attn_backend = None
    return results


# ---- notebook 04's exercise 2: the input guard and the mask, each switchable ----


def plain_masked(q, k, v, meta, backend):
    """One SDPA call masked by ``segment_ids`` on (rows, heads, d) tensors, nothing else: no guard against NaN."""
    m = meta.segment_ids[:, None] == meta.segment_ids[None, :]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m)[0].transpose(0, 1)


def forward_static_with(net: Any, pixels: torch.Tensor, meta: Any, guard: str) -> torch.Tensor:
    """``net.forward_static(pixels, meta)`` rewritten step by step with a switchable input guard: ``"where"``
    replaces invalid pixel rows by zeros (as glmvit does), ``"multiply"`` multiplies them by 0 (NaN stays NaN)."""
    from ..kernels import interpolate_pos_embed
    from ..rotary import rotary_cos_sin

    if guard not in ("where", "multiply"):
        raise ValueError(f"guard {guard!r}: expected 'where' or 'multiply'")
    cfg = net.config
    valid_rows = meta.token_valid[:, None].expand(-1, cfg.merge_area).reshape(-1, 1) != 0
    pixels = torch.where(valid_rows, pixels, 0) if guard == "where" else pixels * valid_rows
    conv = net.patch_embed.proj
    x = net.post_conv_layernorm(F.linear(pixels, conv.weight.view(cfg.hidden_size, -1), conv.bias))
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, net.rotary_pos_emb.inv_freq)
    x = x + interpolate_pos_embed(net.embeddings.position_embedding.weight, meta.h_idx, meta.w_idx,
                                  meta.target_h, meta.target_w, check_values=False)
    for block in net.blocks:
        x = block(x, cos, sin, meta, net.attention_backend())
    x = net.post_layernorm(x)
    x = x.view(-1, cfg.merge_area, cfg.hidden_size).transpose(1, 2).reshape(-1, cfg.merge_area * cfg.hidden_size)
    x = net.merger(F.linear(x, net.downsample.weight.view(cfg.out_hidden_size, -1), net.downsample.bias))
    return x.masked_fill(meta.token_valid[:, None] == 0, 0)


# ---- notebook 04's exercise 3: a graph-safe attention in fixed slots ----


def sdpa_blocks(q, k, v, meta, backend=None):
    """Attention on (rows, heads, d) tensors with device tensors only (no host sync): every segment of ``meta``
    scattered into a ``[segments + 1, max_seqlen]`` slot layout (the spare slot holds rows outside every segment),
    one batched SDPA with a key mask, gathered back; rows outside every segment give 0. Work: (segments + 1) ×
    max_seqlen² scores per head, whatever the segments' lengths."""
    rows, heads, d = q.shape
    slots, width = meta.shape.segments, meta.shape.max_seqlen
    cu = meta.cu_seqlens.long()
    pos = torch.arange(rows, device=q.device)
    inside = pos < cu[-1]  # the last entry is the number of real rows
    slot = torch.where(inside, meta.segment_ids.long(), slots)  # outside rows → the spare slot
    offset = torch.where(inside, pos - cu[slot.clamp(max=slots)], 0)
    lengths = cu[1: slots + 1] - cu[:slots]
    key_ok = torch.arange(width, device=q.device)[None, :] < lengths[:, None]  # [slots, width]
    key_ok = torch.cat([key_ok, torch.zeros(1, width, dtype=torch.bool, device=q.device)])
    key_ok[:, 0] |= ~key_ok.any(1)  # an empty slot attends to its first (zero) key rather than to nothing

    def scatter(t):
        out = t.new_zeros(slots + 1, width, heads, d)
        out[slot, offset] = t
        return out.permute(0, 2, 1, 3)  # [slots + 1, heads, width, d]

    o = F.scaled_dot_product_attention(scatter(q), scatter(k), scatter(v), attn_mask=key_ok[:, None, None, :])
    return torch.where(inside[:, None, None], o.permute(0, 2, 1, 3)[slot, offset], 0)
