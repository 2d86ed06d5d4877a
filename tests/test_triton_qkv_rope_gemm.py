"""glmvit's qkv GEMM with a rotary epilogue (x·Wᵀ, q and k of every head rotated, v as is, one kernel) against the
unfused reference: ``F.linear``, then ``glmvit.rotary.apply_rotary`` on the q and k columns. On the CPU through the
Triton interpreter (fp32, tiny sizes, a fresh process), compiled for sm_90 without a GPU, and on the GPU in bf16.

Tolerances. fp32 (interpreter): the kernel and the reference compute each dot product of K terms in float32 in
different orders (K-blocked tiles against torch's matmul). Any order is within γ_K·Σₖ|x_k w_k| of the exact sum
(γ_K = K·u/(1 − K·u), u = 2⁻²⁴), so the two products differ by at most 2γ_K·m per element, m = |x|·|W|ᵀ. The
rotation out₁ = y₁·cos₁ − y₂·sin₁ (out₂ = y₂·cos₂ + y₁·sin₂) carries those differences through |cos| and |sin|:
2γ_K·(m₁·|cos₁| + m₂·|sin₁|) (and the mirror for out₂), and each side's float32 multiplies and add (or a fused
multiply-add) round at most three times, ≤ 3u·(|y₁·cos₁| + |y₂·sin₁|) each: we allow 8u·(|y₁|·|cos₁| + |y₂|·|sin₁|).
v columns: 2γ_K·m alone. That bound is checked element by element (the largest ratio error / bound must be ≤ 1); it
is ~10⁻⁶ relative at these sizes, while rotating the wrong columns (q and k exchanged, k left alone and v rotated),
the halves the wrong way round, cos and sin exchanged, or the first half's tables used for both halves (the
tables of ``rotary_cos_sin`` repeat themselves; these tests' random ones do not) is off by O(|out|): the child
checks that each of those wrong references breaks the bound many times over.
bf16 (GPU): against the float32 rotation of the float32 product of the same bf16 inputs, the kernel rounds once, at
the end (≤ 2⁻⁹·|ref|), on top of float32 accumulation differences far below 2⁻¹²·max|ref|: every element within
2⁻⁸·|ref| + 2⁻¹²·max|ref|. The unfused path rounds y to bf16 before rotating it, an error of up to
2⁻⁹·(|y₁| + |y₂|) in an element that cancellation can make much smaller than |y|, so it gets only the max band
2⁻⁶·max|ref| that both meet (and misses the per-element one: ``test_ab_check_tells_one_rounding_from_two``).
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import H200_SHARED_PER_BLOCK, run_interpreted, skip_unless_sm90_compiler, sweep_configs

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, K, heads, d): M = 1, M below a tile, M over several tiles with a tail, M a multiple of the tile; K with a
# tail of the 16-wide K steps (44) and without; a head wider than a K step. K·4 bytes a multiple of 16 (TMA in fp32).
SHAPES = [(37, 44, 2, 32), (1, 44, 2, 32), (70, 48, 2, 32), (16, 32, 1, 64)]


def configs():
    """Tiny tiles: many tiles, partial groups (3 row tiles of 37 rows in groups of 2), tails in every direction."""
    from glmvit.kernels.triton_qkv_rope_gemm import QkvRopeConfig

    return {"pointer": QkvRopeConfig(16, 16, 4, 1, group_m=2, tma=False),
            "tma": QkvRopeConfig(16, 16, 4, 1, group_m=2),
            "pointer-1dot": QkvRopeConfig(16, 16, 4, 1, group_m=2, tma=False, one_dot=True),
            "tma-1dot-wide": QkvRopeConfig(32, 16, 4, 2, group_m=3, one_dot=True),
            # 3 programs on the CPU, each walking several tiles (an uneven share where the tiles are not 3k)
            "pointer-persistent": QkvRopeConfig(16, 16, 4, 1, group_m=2, tma=False, persistent=True),
            "tma-persistent": QkvRopeConfig(16, 16, 4, 1, group_m=2, persistent=True),
            # two heads a tile: one accumulator of 2·d, each head's halves split out of it
            "tma-1dot-2h": QkvRopeConfig(16, 16, 4, 1, group_m=2, one_dot=True, heads_per_tile=2),
            "pointer-1dot-2h-persistent": QkvRopeConfig(16, 16, 4, 1, group_m=2, tma=False, one_dot=True,
                                                        persistent=True, heads_per_tile=2),
            # the tables' halves equal (rotary_cos_sin's): the first halves are read for both
            "tma-1dot-2h-eq": QkvRopeConfig(16, 16, 4, 1, group_m=2, one_dot=True, heads_per_tile=2,
                                            equal_halves=True),
            "pointer-eq": QkvRopeConfig(16, 16, 4, 1, group_m=2, tma=False, equal_halves=True)}


# Configurations that compute the same tiles (another load path or grid) and the one they must match bit for bit.
TWINS = {"tma": "pointer", "tma-persistent": "pointer", "pointer-persistent": "pointer"}


def case(m, k, heads, d, seed=0, equal_halves=False):
    """x, W and cos/sin tables of random angles, whose two halves differ (unlike ``rotary_cos_sin``'s repeat), or
    with ``equal_halves`` repeat as its do."""
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(m, k, generator=gen), torch.randn(3 * heads * d, k, generator=gen)
    angle = torch.rand(m, d, generator=gen) * 6.3
    if equal_halves:
        angle = torch.cat([angle[:, : d // 2]] * 2, dim=1)
    return x, weight, angle.cos(), angle.sin()


def _heads(t, heads):
    """(M, 3·heads·d) → (M, 3·heads, d): q heads, then k heads, then v heads."""
    return t.reshape(t.shape[0], 3 * heads, -1)


def reference(x, weight, cos, sin, heads, rotated=("q", "k")):
    """The model's unfused path in float32: F.linear, then ``apply_rotary`` on the q and k heads (``rotated``: which
    of q, k, v blocks to rotate, for the wrong references)."""
    from glmvit.rotary import apply_rotary

    y = _heads(F.linear(x, weight), heads)
    blocks = list(y.split(heads, dim=1))
    for i, name in enumerate("qkv"):
        if name in rotated:
            blocks[i] = apply_rotary(blocks[i], cos, sin)
    return torch.cat(blocks, dim=1).reshape(x.shape[0], -1)


def _swap_halves(t):
    return torch.cat(t.chunk(2, dim=-1)[::-1], dim=-1)


def fp32_bound(x, weight, cos, sin, heads):
    """The elementwise float32 bound of the module docstring."""
    u = 2.0**-24
    gamma = x.shape[1] * u / (1 - x.shape[1] * u)
    mag = _heads(x.abs() @ weight.abs().T, heads)
    y = _heads(F.linear(x, weight), heads).abs()
    ac, as_ = cos.abs()[:, None, :], sin.abs()[:, None, :]

    def rot_abs(t):  # |t₁|·|cos₁| + |t₂|·|sin₁| and |t₂|·|cos₂| + |t₁|·|sin₂|
        return t * ac + _swap_halves(t) * as_

    bound = 2 * gamma * mag
    qk = slice(0, 2 * heads)
    bound[:, qk] = 2 * gamma * rot_abs(mag[:, qk]) + 8 * u * rot_abs(y[:, qk])
    return bound.reshape(x.shape[0], -1) + 1e-30


def _ratio(got, ref, bound):
    return ((got - ref).abs() / bound).max().item()


def _interpreter_child() -> None:
    """Runs with TRITON_INTERPRET=1; prints one JSON dict of results."""
    from glmvit.kernels.triton_qkv_rope_gemm import qkv_rope_linear_triton
    from glmvit.rotary import apply_rotary

    torch.set_num_threads(2)
    results: dict = {}
    outputs: dict = {}
    for name, config in configs().items():
        for m, k, heads, d in SHAPES:
            if heads % config.heads_per_tile:
                continue  # refused (test_refusals_before_any_launch)
            x, weight, cos, sin = case(m, k, heads, d, equal_halves=config.equal_halves)
            got = qkv_rope_linear_triton(x, weight, cos, sin, heads, config)
            key = f"{name}/{m}x{k}x{heads}x{d}"
            outputs[key] = got
            results[key] = {"shape": list(got.shape), "dtype": str(got.dtype),
                            "ratio": _ratio(got, reference(x, weight, cos, sin, heads),
                                            fp32_bound(x, weight, cos, sin, heads))}
    for shape in SHAPES:  # the same zero-padded tiles through either load path or grid: the same bits
        tag = "x".join(map(str, shape))
        for name, twin in TWINS.items():
            results[f"same-bits/{name}/{tag}"] = bool(torch.equal(outputs[f"{name}/{tag}"], outputs[f"{twin}/{tag}"]))

    # Wrong references, each a plausible bug: how far the kernel's output is from them, in units of the bound.
    m, k, heads, d = SHAPES[0]
    x, weight, cos, sin = case(m, k, heads, d)
    got = outputs[f"pointer/{m}x{k}x{heads}x{d}"]
    bound = fp32_bound(x, weight, cos, sin, heads)
    right = _heads(reference(x, weight, cos, sin, heads), heads)
    q, k_, v = right.split(heads, dim=1)
    y = _heads(F.linear(x, weight), heads)
    half = d // 2
    first_half_tables = (torch.cat([cos[:, :half]] * 2, dim=1), torch.cat([sin[:, :half]] * 2, dim=1))
    wrong = {
        "q-and-k-exchanged": torch.cat([k_, q, v], dim=1),
        "k-unrotated-v-rotated": _heads(reference(x, weight, cos, sin, heads, rotated=("q", "v")), heads),
        "halves-exchanged": torch.cat([apply_rotary(_swap_halves(y[:, : 2 * heads]), cos, sin), v], dim=1),
        "cos-and-sin-exchanged": _heads(reference(x, weight, sin, cos, heads), heads),
        "first-half-tables": _heads(reference(x, weight, *first_half_tables, heads), heads),
    }
    assert torch.equal(y[:, 2 * heads:], v)  # v is the product itself
    for label, ref in wrong.items():
        results[f"wrong/{label}"] = _ratio(got, ref.reshape(m, -1), bound)
    # equal_halves on tables whose halves differ: the first halves' rotation, as its contract says
    eq = qkv_rope_linear_triton(x, weight, cos, sin, heads, configs()["pointer-eq"])
    results["eq/first-half-tables"] = _ratio(eq, wrong["first-half-tables"].reshape(m, -1), bound)
    results["eq/true-tables"] = _ratio(eq, right.reshape(m, -1), bound)

    # NaN in one row of x: only that output row is NaN. In one weight row: only that column (v) or that column and
    # its partner in the other half of the same head (q, k: the rotation mixes the halves), all else the same bits.
    for name in ("pointer", "tma", "pointer-1dot", "tma-1dot-2h"):
        config = configs()[name]
        clean = qkv_rope_linear_triton(x, weight, cos, sin, heads, config)
        bad_x = x.clone()
        bad_x[20, 3] = float("nan")
        out = qkv_rope_linear_triton(bad_x, weight, cos, sin, heads, config)
        others = torch.arange(m) != 20
        ok = bool(out[20].isnan().all()) and bool(torch.equal(out[others], clean[others]))
        k1 = heads * d + d  # k head 1's first column
        for w_row, cols in ((5, {5, 5 + half}), (k1 + half + 2, {k1 + 2, k1 + half + 2}),
                            (2 * heads * d + 7, {2 * heads * d + 7})):  # q head 0, k head 1 (second half), v
            bad_w = weight.clone()
            bad_w[w_row, 0] = float("nan")
            out = qkv_rope_linear_triton(x, bad_w, cos, sin, heads, config)
            nan_cols = set(torch.nonzero(out.isnan().any(0)).flatten().tolist())
            keep = torch.tensor([c not in cols for c in range(out.shape[1])])
            ok &= nan_cols == cols and bool(out[:, sorted(cols)].isnan().all())
            ok &= bool(torch.equal(out[:, keep], clean[:, keep]))
        results[f"isolated/{name}"] = ok
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_triton_qkv_rope_gemm")


@pytest.mark.parametrize("name", ["pointer", "tma", "pointer-1dot", "tma-1dot-wide", "pointer-persistent",
                                  "tma-persistent", "tma-1dot-2h", "pointer-1dot-2h-persistent", "tma-1dot-2h-eq",
                                  "pointer-eq"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_matches_unfused_reference(interpreted, name, shape):
    m, k, heads, d = shape
    if "2h" in name and heads % 2:
        pytest.skip("one head: no tile of two")
    row = interpreted[f"{name}/{'x'.join(map(str, shape))}"]
    assert row["shape"] == [m, 3 * heads * d] and row["dtype"] == "torch.float32"
    assert row["ratio"] <= 1.0


@pytest.mark.parametrize("name", TWINS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_load_paths_and_grids_compute_the_same_bits(interpreted, name, shape):
    """Descriptor or pointer loads, one program per tile or a persistent grid: the same tiles, the same bits."""
    assert interpreted[f"same-bits/{name}/{'x'.join(map(str, shape))}"]


@pytest.mark.parametrize("label", ["q-and-k-exchanged", "k-unrotated-v-rotated", "halves-exchanged",
                                   "cos-and-sin-exchanged", "first-half-tables"])
def test_the_bound_catches_a_wrong_rotation(interpreted, label):
    """The tolerance is tight enough to matter: each plausible wrong rotation breaks it many times over."""
    assert interpreted[f"wrong/{label}"] > 100


def test_equal_halves_reads_the_first_half_of_each_table(interpreted):
    """``equal_halves`` is a contract on the tables: given unequal halves it rotates by the first ones."""
    assert interpreted["eq/first-half-tables"] <= 1.0 and interpreted["eq/true-tables"] > 100


@pytest.mark.parametrize("name", ["pointer", "tma", "pointer-1dot", "tma-1dot-2h"])
def test_nonfinite_input_stays_in_its_row_and_head_columns(interpreted, name):
    assert interpreted[f"isolated/{name}"]


def _module():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from glmvit.kernels import triton_qkv_rope_gemm

    return triton_qkv_rope_gemm


def test_config_names_and_refusals():
    module = _module()
    assert module.QkvRopeConfig().name == "128xdx64w8s4t"
    assert module.QkvRopeConfig(64, 64, 4, 4, tma=False).name == "64xdx64w4s4p"
    assert module.QkvRopeConfig(one_dot=True, persistent=True).name == "128xdx64w8s4t-1dot-persistent"
    assert len({c.name for c in module.SWEEP_CONFIGS}) == len(module.SWEEP_CONFIGS)
    assert module.QkvRopeConfig().shared_bytes() == 4 * 32 * 1024
    with pytest.raises(ValueError, match="block_k=48"):
        module.QkvRopeConfig(block_k=48)
    with pytest.raises(ValueError, match="num_stages=0"):
        module.QkvRopeConfig(num_stages=0)
    assert module.QkvRopeConfig(one_dot=True, heads_per_tile=2).name == "128xdx64w8s4t-1dot-2h"
    assert module.QkvRopeConfig(equal_halves=True).name == "128xdx64w8s4t-eq"
    assert module.QkvRopeConfig(one_dot=True, heads_per_tile=2).shared_bytes() == 4 * (128 + 256) * 64 * 2
    for bad in (dict(heads_per_tile=2), dict(one_dot=True, heads_per_tile=3)):  # two accumulators; three heads
        with pytest.raises(ValueError, match="heads_per_tile is 1, or 2 with one_dot=True"):
            module.QkvRopeConfig(**bad)


def test_refusals_before_any_launch():
    """Bad shapes, dtypes, tables and rows TMA cannot take fail with one line naming them, before any compile."""
    module = _module()
    config = module.QkvRopeConfig(16, 16, 4, 1)
    x, w = torch.zeros(3, 8), torch.zeros(192, 8)
    cos = sin = torch.zeros(3, 32)

    def call(*args, **kwargs):
        return module.qkv_rope_linear_triton(*args, config=config, **kwargs)

    with pytest.raises(ValueError, match=r"x \(M, K\) and weight \(3·heads·d, K\): got x \(3, 8\), weight \(192, 4\)"):
        call(x, torch.zeros(192, 4), cos, sin, 2)
    with pytest.raises(ValueError, match=r"weight \(190, 8\): rows must be 3·heads·d for num_heads=2"):
        call(x, torch.zeros(190, 8), cos, sin, 2)
    with pytest.raises(ValueError, match="num_heads=0"):
        call(x, w, cos, sin, 0)
    with pytest.raises(ValueError, match="head_dim=16: must be a power of two, at least 32"):
        call(x, torch.zeros(96, 8), torch.zeros(3, 16), torch.zeros(3, 16), 2)
    with pytest.raises(ValueError, match="head_dim=48"):
        call(x, torch.zeros(288, 8), torch.zeros(3, 48), torch.zeros(3, 48), 2)
    with pytest.raises(ValueError, match="x torch.float32"):
        call(x, w.double(), cos, sin, 2)
    with pytest.raises(ValueError, match=r"cos must be \(3, 32\) float32 on cpu: got \(3, 16\)"):
        call(x, w, torch.zeros(3, 16), sin, 2)
    with pytest.raises(ValueError, match=r"sin must be \(3, 32\) float32 on cpu: got \(3, 32\) torch.float64"):
        call(x, w, cos, sin.double(), 2)
    with pytest.raises(ValueError, match="contiguous tensors: cos is not"):
        call(x, w, torch.zeros(32, 3).T, sin, 2)
    with pytest.raises(ValueError, match="contiguous tensors: x is not"):
        call(torch.zeros(8, 3).T, w, cos, sin, 2)
    with pytest.raises(ValueError, match="x rows of 6 torch.float32 are 24 bytes"):
        call(torch.zeros(3, 6), torch.zeros(192, 6), cos, sin, 2)
    with pytest.raises(ValueError, match="3 heads do not fill tiles of 2"):
        module.qkv_rope_linear_triton(x, torch.zeros(288, 8), cos, sin, 3,
                                      config=module.QkvRopeConfig(16, 16, 4, 1, one_dot=True, heads_per_tile=2))
    empty = call(torch.zeros(0, 8), w, torch.zeros(0, 32), torch.zeros(0, 32), 2)
    assert empty.shape == (0, 192)


def test_ab_check_tells_one_rounding_from_two():
    """tools/qkv_rope_ab.py's check, on the CPU in bf16: one rounding of the float32 result passes both marks; the
    unfused path (bf16 product, then rotated and rounded again) passes the max band only; an offset of
    2⁻⁵·max|ref| fails the band. And the unfused pair (qkv, q̃k̃) is read back as one qkv tensor."""
    from glmvit.rotary import apply_rotary
    from tools import qkv_rope_ab

    heads, d = 2, 32
    x, weight, cos, sin = case(512, 256, heads, d)
    x, weight = x.bfloat16(), (weight * 256**-0.5).bfloat16()
    ref = qkv_rope_ab.reference(x, weight, cos, sin, heads)
    assert torch.allclose(ref, reference(x.float(), weight.float(), cos, sin, heads), atol=1e-5)
    check, as_qkv = qkv_rope_ab.check, qkv_rope_ab.as_qkv
    one = check(ref.bfloat16(), ref)
    assert one["ok"] and one["one_rounding"]
    qkv = F.linear(x, weight)
    qk = apply_rotary(_heads(qkv, heads)[:, : 2 * heads], cos, sin).reshape(512, -1)
    unfused = check(as_qkv((qkv, qk)), ref)
    assert unfused["ok"] and not unfused["one_rounding"]
    assert not check(ref + 2**-5 * ref.abs().max(), ref)["ok"]


# ---------------------------------------------------------------------------------------------- real GPU

GPU_CONFIGS = sweep_configs("glmvit.kernels.triton_qkv_rope_gemm")


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_each_configuration_compiles_for_hopper_as_intended(name):
    """No GPU needed: compiled for sm_90 by the installed Triton (``tools/qkv_rope_ab.py --compile-only``) at the
    model's shapes, every configuration uses warp-group MMAs, loads through TMA (descriptor configs) or pipelined
    asynchronous copies (pointer configs), holds ``num_stages`` buffers of x and weight tiles, and fits a block."""
    skip_unless_sm90_compiler()
    from tools.qkv_rope_ab import HEAD_DIM, compile_report

    config = GPU_CONFIGS[name]
    report = compile_report(config)
    assert "unavailable" not in report, report
    assert report["wgmma"] > 0
    assert (report["tma_copies"] > 0) == config.tma
    assert (report["async_copies"] > 0) == (not config.tma)
    assert config.shared_bytes(HEAD_DIM) <= report["shared_bytes"] <= H200_SHARED_PER_BLOCK


# (M, K, heads, d): the model's at 256, 1024 and 8192 rows (1×224², 4×224², 8×448²), and at a row count no tile
# divides.
GPU_SHAPES = [(256, 1536, 12, 128), (1024, 1536, 12, 128), (8192, 1536, 12, 128), (77, 1536, 12, 128)]


def _gpu_case(m, k, heads, d):
    from glmvit.rotary import inv_freq, rotary_cos_sin

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(3 * heads * d, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, m), device="cuda", generator=gen)
    cos, sin = rotary_cos_sin(ids[0], ids[1], inv_freq(d).cuda())
    return x, weight, cos, sin


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CONFIGS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_bf16_one_rounding_of_float32_reference(shape, name):
    from glmvit.kernels.triton_attention import rotate_qk_triton
    from glmvit.kernels.triton_qkv_rope_gemm import qkv_rope_linear_triton
    from tools.qkv_rope_ab import as_qkv

    m, _, heads, d = shape
    x, weight, cos, sin = _gpu_case(*shape)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = reference(x.float(), weight.float(), cos, sin, heads)
    got = qkv_rope_linear_triton(x, weight, cos, sin, heads, GPU_CONFIGS[name])
    assert got.dtype == torch.bfloat16 and got.shape == (m, 3 * heads * d)
    err = (got.float() - ref).abs()
    peak = ref.abs().max().item()
    assert bool((err <= 2**-8 * ref.abs() + 2**-12 * peak).all()), err.max().item()
    qkv = F.linear(x, weight)  # the model's path: the looser band, which both meet
    unfused = as_qkv((qkv, rotate_qk_triton(qkv, cos, sin, torch.tensor([0, m], dtype=torch.int32, device="cuda"),
                                            heads)))
    assert (unfused.float() - ref).abs().max().item() <= 2**-6 * peak
    assert err.max().item() <= 2**-6 * peak


@pytest.mark.gpu
def test_gpu_graph_replay_matches_a_direct_call():
    """Captured in a CUDA graph (the descriptors are baked into the capture), a replay gives the direct call's bits."""
    from glmvit.kernels.triton_qkv_rope_gemm import qkv_rope_linear_triton

    x, weight, cos, sin = _gpu_case(300, 1536, 12, 128)
    config = next(iter(GPU_CONFIGS.values()))
    direct = qkv_rope_linear_triton(x, weight, cos, sin, 12, config)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qkv_rope_linear_triton(x, weight, cos, sin, 12, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = qkv_rope_linear_triton(x, weight, cos, sin, 12, config)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, direct)
