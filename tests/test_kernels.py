"""Position-table interpolation against F.grid_sample: torch fallback, Triton under the interpreter, Triton on GPU.

The oracle is exactly what transformers does: the table viewed as a (1, D, G, G) fp32 image, a normalised fp32
grid built from the patch indices, and ``F.grid_sample(align_corners=False, padding_mode="border")``.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from conftest import run_interpreted
from glmvit.kernels import interpolate_pos_embed, interpolate_pos_embed_torch

MODES = ["bicubic", "bilinear"]


def indices(grids, device="cpu"):
    """int32 h_idx, w_idx, target_h, target_w for every patch of every (h, w) grid, items packed one after another."""
    cols = [[torch.zeros(0, dtype=torch.long)] for _ in range(4)]
    for h, w in grids:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        for col, values in zip(cols, (hh, ww, torch.full((h, w), h), torch.full((h, w), w)), strict=False):
            col.append(values.flatten())
    return tuple(torch.cat(c).to(device=device, dtype=torch.int32) for c in cols)


def oracle(table, h_idx, w_idx, target_h, target_w, mode):
    """transformers' computation: F.grid_sample on the table as an fp32 G×G image → [N, D] fp32."""
    g = int(round(table.shape[0] ** 0.5))
    image = table.float().view(g, g, -1).permute(2, 0, 1)[None]
    x = ((w_idx.float() + 0.5) / target_w.float()) * 2 - 1
    y = ((h_idx.float() + 0.5) / target_h.float()) * 2 - 1
    grid = torch.stack([x, y], dim=-1).view(1, -1, 1, 2)
    out = F.grid_sample(image, grid, mode=mode, align_corners=False, padding_mode="border")
    return out[0, :, :, 0].T


def max_diff(table, grids, mode, fn=interpolate_pos_embed):
    args = indices(grids, table.device)
    got = fn(table, *args, mode=mode)
    assert got.shape == (args[0].shape[0], table.shape[1]) and got.dtype == table.dtype
    return (got.float() - oracle(table, *args, mode)).abs().max().item()


# Targets smaller than, equal to and larger than G, extreme aspect ratios, and several items in one call.
CASES = {
    8: [[(4, 6)], [(8, 8)], [(20, 14)], [(2, 200)], [(200, 2)], [(1, 1)], [(2, 2), (8, 8), (30, 4), (6, 50)]],
    5: [[(2, 2)], [(5, 5)], [(3, 17)], [(1, 9), (9, 1), (12, 12)]],
    24: [[(16, 16)], [(24, 24)], [(40, 6)], [(78, 138)], [(4, 214), (16, 16), (32, 32)]],
}
FALLBACK_CASES = [(g, grids) for g, cases in CASES.items() for grids in cases]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("g,grids", FALLBACK_CASES, ids=lambda v: str(v).replace(" ", ""))
def test_fallback_matches_grid_sample(g, grids, mode):
    table = torch.randn(g * g, 16, generator=torch.Generator().manual_seed(g))
    assert max_diff(table, grids, mode, interpolate_pos_embed_torch) <= 1e-5


def test_fallback_full_size_table():
    """The real 576 × 1536 shape: many samples on a steep random table expose coordinate rounding."""
    table = torch.randn(576, 1536, generator=torch.Generator().manual_seed(0))
    assert max_diff(table, [(16, 16), (4, 214)], "bicubic", interpolate_pos_embed_torch) <= 1e-5


def test_fallback_empty_batch():
    args = indices([])
    assert interpolate_pos_embed(torch.randn(64, 8), *args).shape == (0, 8)


# ---------------------------------------------------------------------------------------------- bad inputs

def _bad_inputs():
    table = torch.randn(64, 8)
    h, w, th, tw = indices([(4, 6)])
    yield "same length", (table, h[:-1], w, th, tw)
    yield "square", (torch.randn(63, 8), h, w, th, tw)
    yield "table must be", (torch.randn(64, 8, 1), h, w, th, tw)
    yield "positive", (table, h, w, th * 0, tw)
    yield "positive", (table, h, w, th, tw - 7)
    yield "outside its target", (table, h, w + 1, th, tw)
    yield "outside its target", (table, h - 1, w, th, tw)
    yield "int32", (table, h.long(), w, th, tw)
    yield "floating-point", (table.int(), h, w, th, tw)
    yield "is on meta", (table, h, w, th.to("meta"), tw)


@pytest.mark.parametrize("message,args", list(_bad_inputs()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_inputs_raise(message, args):
    with pytest.raises(ValueError, match=message):
        interpolate_pos_embed(*args)


def test_bad_mode_raises():
    with pytest.raises(ValueError, match="mode"):
        interpolate_pos_embed(torch.randn(64, 8), *indices([(2, 2)]), mode="nearest")


# ------------------------------------------------------------------------------ Triton under the interpreter

# Tiny on purpose: the interpreter runs each program in numpy (≈ 30 ms each); these are ~250 programs in all.
INTERPRETER_CASES = {
    "G8-D32-smaller-equal-larger": (8, 32, [(4, 6), (8, 8), (12, 10)]),
    "G8-D32-extreme-aspect": (8, 32, [(2, 40), (40, 2)]),
    "G5-D8-mixed": (5, 8, [(1, 1), (3, 17), (9, 1)]),
    "G24-D16-mixed": (24, 16, [(10, 12), (2, 30)]),
    "G8-D520-two-channel-blocks": (8, 520, [(2, 3)]),
}


def _interpreter_child() -> None:
    """Runs in a subprocess with TRITON_INTERPRET=1; prints one JSON dict of results."""
    from glmvit import VisionConfig
    from glmvit.kernels import interpreting, uses_triton
    from glmvit.kernels.triton_bicubic import interpolate_pos_embed_triton
    from glmvit.oracle import encoder_like, hf_vision_model
    from glmvit.workloads import random_batch

    torch.set_num_threads(2)
    results = {
        "interpreting": interpreting(),
        "dispatch_fp32": uses_triton(torch.zeros(4, 2)),
        "dispatch_bf16": uses_triton(torch.zeros(4, 2, dtype=torch.bfloat16)),
        "empty_shape": list(interpolate_pos_embed_triton(torch.randn(64, 8), *indices([]), mode="bicubic").shape),
    }
    for name, (g, d, grids) in INTERPRETER_CASES.items():
        table = torch.randn(g * g, d, generator=torch.Generator().manual_seed(g + d))
        for mode in MODES:
            results[f"{name}-{mode}"] = max_diff(table, grids, mode, interpolate_pos_embed_triton)

    config = VisionConfig.tiny()
    hf = hf_vision_model(config, seed=0)
    model = encoder_like(hf, config)
    pixels, grid = random_batch([[1, 4, 6], [1, 8, 4]], config, seed=0)
    with torch.no_grad():
        expected = hf(pixels, grid).pooler_output
        got = model(pixels, grid)
    results["encoder_uses_triton"] = uses_triton(model.embeddings.position_embedding.weight)
    results["encoder"] = (got - expected).abs().max().item()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    """Results of :func:`_interpreter_child` (the interpreter is chosen at import, hence a fresh process)."""
    return run_interpreted("test_kernels")


def test_interpreter_dispatch(interpreted):
    assert interpreted["interpreting"] and interpreted["dispatch_fp32"] and interpreted["encoder_uses_triton"]
    assert not interpreted["dispatch_bf16"]  # the interpreter cannot compute in bf16: the fallback runs
    assert interpreted["empty_shape"] == [0, 8]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", INTERPRETER_CASES)
def test_triton_interpreted_matches_grid_sample(interpreted, case, mode):
    assert interpreted[f"{case}-{mode}"] <= 1e-5


def test_encoder_with_interpreted_triton_matches_transformers(interpreted):
    assert interpreted["encoder"] <= 1e-5


# ---------------------------------------------------------------------------------------------- real GPU

GPU_GRIDS = [(16, 16), (32, 32), (78, 138), (4, 214)]


def _gpu_table(dtype):
    return torch.randn(576, 1536, generator=torch.Generator().manual_seed(0)).to("cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_fp32_matches_grid_sample(mode):
    from glmvit.kernels import uses_triton

    table = _gpu_table(torch.float32)
    assert uses_triton(table)
    assert max_diff(table, GPU_GRIDS, mode) <= 1e-5


@pytest.mark.gpu
def test_gpu_bf16_within_one_rounding():
    """bf16 output within one bf16 ulp of grid_sample's fp32 result (one rounding, fp32 accumulation order aside).

    The ulp is that of the reference value, floored at 2^-8 ulps of the table's scale for values near zero."""
    table = _gpu_table(torch.bfloat16)
    args = indices(GPU_GRIDS, "cuda")
    got = interpolate_pos_embed(table, *args).float()
    exact = oracle(table, *args, "bicubic")
    def ulp(x):
        return torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    tol = torch.maximum(ulp(exact), ulp(exact.abs().max()) * 2.0**-8)
    assert ((got - exact).abs() <= tol).all(), ((got - exact).abs() / tol).max()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_graph_replays_new_indices(dtype):
    """Capture one call, overwrite the index tensors in place, replay: the output follows the new indices."""
    table = _gpu_table(dtype)
    first = indices([(16, 16), (32, 32)], "cuda")
    second = indices([(40, 32)], "cuda")  # same token count (1280), different grid
    static = [t.clone() for t in first]
    before = interpolate_pos_embed(table, *static, check_values=False)  # also compiles, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = interpolate_pos_embed(table, *static, check_values=False)
    for dst, src in zip(static, second, strict=False):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    expected = interpolate_pos_embed(table, *second)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    assert not torch.equal(out, before)


# ---------------------------------------------------------------------------------------------- benchmark

def test_bench_paths_compute_the_same():
    """The benchmark's grid_sample baselines and the kernel path give the same result (fp32, fallback on CPU)."""
    from glmvit.cli import bench_interp as kernel_bench

    table = torch.randn(576, 16, generator=torch.Generator().manual_seed(1))
    inputs = kernel_bench.make_inputs([[1, 16, 16], [1, 6, 10], [1, 74, 74]], "cpu")
    kernel, *baselines = (kernel_bench.run_path(path, table, inputs[path]) for path in kernel_bench.PATHS)
    for out in baselines:
        torch.testing.assert_close(out, kernel, atol=1e-5, rtol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_exits_without_cuda():
    from glmvit.cli import bench_interp as kernel_bench

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        kernel_bench.main([])


@pytest.mark.gpu
def test_bench_writes_json(tmp_path):
    from glmvit.cli import bench_interp as kernel_bench

    path = tmp_path / "bench.json"
    assert kernel_bench.main(["--runs", "100", "--warmup", "5", "--json", str(path)]) == 0
    record = json.loads(path.read_text())
    assert [r["case"] for r in record["results"]] == list(kernel_bench.CASES)
    assert all(r["median_us"]["triton"] > 0 for r in record["results"]) and record["provenance"]["gpu"]


@pytest.mark.gpu
def test_kernels_profile_splits_a_replay_into_busy_time_gaps_and_host(tmp_path):
    """`glmvit kernels --parts profile`: a replay's time on the device is split into its kernels' busy time plus the
    gaps between them (one stream: kernels cannot overlap). Busy time, device time and wall time come from separate
    passes (a profiler, CUDA events, the host's clock), so on a GPU that other processes share (this suite runs in
    parallel) their order is a measurement, not a contract: the split is checked, and each is a positive time."""
    from glmvit.cli import kernels as kernels_cli

    path = tmp_path / "kernels.json"
    assert kernels_cli.main(["--layouts", "1x224", "--parts", "profile", "--backends", "triton", "--quiet",
                             "--json", str(path)]) == 0
    profile = json.loads(path.read_text())["profile"]
    assert set(profile) == {"triton", "triton-compiled", "triton-compiled-model"}
    for variant in profile.values():
        p = variant["1x224"]
        device_us, wall_us = p["replay_device"]["median_ms"] * 1e3, p["replay_wall"]["median_ms"] * 1e3
        assert p["gaps_us_per_call"] == pytest.approx(device_us - p["graph_gpu_us_per_call"])
        assert min(p["graph_gpu_us_per_call"], device_us, wall_us) > 0, p
        assert 0 <= p["graph_idle_us_per_call"] < device_us, p  # the graph's idle boundaries, at the profiled clock


@pytest.mark.gpu
def test_kernels_profiles_the_uniform_graph_a_runner_replays_on_a_one_length_layout(tmp_path):
    """The 8-frame clip (four 256-row frames, 1024 rows: DENSE_MIN_ROWS) replays in a uniform graph: its profile has
    the dense attention's cuDNN kernel where the ragged variants have glmvit's Triton kernel; one 224² image (256
    rows) replays in none, so it has no uniform entry."""
    from glmvit.cli import kernels as kernels_cli

    path = tmp_path / "kernels.json"
    assert kernels_cli.main(["--layouts", "1x224,clip8x224", "--parts", "profile", "--backends", "triton",
                             "--quiet", "--json", str(path)]) == 0
    profile = json.loads(path.read_text())["profile"]
    assert set(profile["uniform-compiled"]) == {"capture", "clip8x224"}
    def kernels(variant: str) -> set[str]:
        return {k["name"] for k in profile[variant]["clip8x224"]["top"] if k["category"] == "attention"}

    assert "_rope_varlen_attention_kernel" in kernels("triton-compiled")
    assert "_rope_varlen_attention_kernel" not in kernels("uniform-compiled")
    assert "_rope_rotate_qk_kernel" in kernels("uniform-compiled")  # the dense path's rotation launch
