"""Notebook 04's GPU measurements on its tiny tower (2 heads of 32, transformers' random weights, seed 0): which
calls sync the host, a graph captured on batch A and replayed on batch B, and the attention backends' accuracy."""
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
