"""glmvit's SwiGLU GEMM (``silu(x·Wgᵀ) · (x·Wuᵀ)`` in one kernel) against the unfused reference: one matmul by the
fused [Wg; Wu] weight, split into gate and up, then ``F.silu(gate) * up``. On the CPU through the Triton
interpreter (fp32, tiny sizes, a fresh process), compiled for sm_90 without a GPU, and on the GPU in bf16.

Tolerances. fp32 (interpreter): the kernel and the reference compute each dot product of K terms in float32 in
different orders (K-blocked tiles against torch's matmul). Any order is within γ_K·Σₖ|x_k w_k| of the exact sum
(γ_K = K·u/(1 − K·u), u = 2⁻²⁴), so the two gates differ by at most 2γ_K·(|x|·|Wg|ᵀ), the ups by 2γ_K·(|x|·|Wu|ᵀ).
silu(g)·u moves by at most |silu'|·|u|·Δg + |silu(g)|·Δu (|silu'| ≤ 1.1), and the float32 exp, divide and multiply
add a few roundings of the output (we allow 8u·|out|). That bound is checked element by element (the largest ratio
error / bound must be ≤ 1); it is ~10⁻⁵ relative at these sizes, while a wrong layout (gate and up swapped), a
dropped K tail or a wrong row is off by O(|out|): the child checks that the swapped reference breaks the bound.
bf16 (GPU): against the float32 SwiGLU of the same bf16 inputs, the kernel rounds once, at the end (≤ 2⁻⁹·|ref|),
on top of float32 accumulation differences far below 2⁻¹²·max|ref|: every element within 2⁻⁸·|ref| + 2⁻¹²·max|ref|.
The unfused path rounds gate and up to bf16 before silu, which is not bounded relative to each element (silu's
relative sensitivity grows like |g| for negative g), so it gets only the max band 2⁻⁶·max|ref| that both meet.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import H200_SHARED_PER_BLOCK, run_interpreted, skip_unless_sm90_compiler, sweep_configs

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (M, K, H): none a multiple of the 16-wide tiles, M = 1, M below a tile, K over several tiles with a tail.
POINTER_SHAPES = [(37, 29, 23), (1, 29, 23), (5, 50, 40), (16, 16, 16)]
# The same kinds for the descriptor path, whose rows must be multiples of 16 bytes (K and H multiples of 4 in fp32);
# the pointer path runs these too.
TMA_SHAPES = [(37, 44, 20), (1, 44, 20), (7, 36, 52), (16, 16, 16)]
# The packed weight holds whole tiles of 16 rows (H a multiple of the tiny configs' block_n); the same kinds again.
PACKED_SHAPES = [(37, 44, 32), (1, 44, 16), (7, 36, 48), (16, 16, 16)]


def configs():
    """Tiny tiles: many tiles, partial groups (3 row tiles of 37 rows in groups of 2), tails in every direction."""
    from glmvit.kernels.triton_swiglu_gemm import SwigluConfig

    return {"pointer": SwigluConfig(16, 16, 16, 4, 1, group_m=2, tma=False),
            "pointer-wide": SwigluConfig(16, 32, 16, 4, 2, group_m=3, tma=False),
            "tma": SwigluConfig(16, 16, 16, 4, 1, group_m=2),
            "tma-wide": SwigluConfig(16, 32, 16, 4, 2, group_m=3),
            # 3 programs on the CPU, each walking several tiles (an uneven share where the tiles are not 3k)
            "pointer-persistent": SwigluConfig(16, 16, 16, 4, 1, group_m=2, tma=False, persistent=True),
            "tma-persistent": SwigluConfig(16, 16, 16, 4, 1, group_m=2, persistent=True),
            "tma-persistent-flat": SwigluConfig(16, 16, 16, 4, 2, group_m=2, persistent=True, flatten=True),
            "tma-packed": SwigluConfig(16, 16, 16, 4, 1, group_m=2, packed=True),
            "tma-persistent-packed": SwigluConfig(16, 16, 16, 4, 2, group_m=2, persistent=True, packed=True)}


# Configurations that compute the same tiles (another load path or grid) and the one they must match bit for bit.
TWINS = {"tma": "pointer", "tma-wide": "pointer-wide", "tma-persistent": "pointer", "pointer-persistent": "pointer",
         "tma-persistent-flat": "pointer"}


def case(m, k, h, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen), torch.randn(2 * h, k, generator=gen)


def reference(x, weight):
    """The model's unfused path in float32: one matmul, split (gate rows first), then silu(gate)·up."""
    gate, up = (x @ weight.T).chunk(2, dim=-1)
    return F.silu(gate) * up


def fp32_bound(x, weight, spread=2):
    """The elementwise float32 bound of the module docstring: gate and up apart by ``spread``·γ_K·(|x|·|W|ᵀ)."""
    u = 2.0**-24
    gamma = x.shape[1] * u / (1 - x.shape[1] * u)
    gate, up = (x @ weight.T).chunk(2, dim=-1)
    mag_gate, mag_up = (x.abs() @ weight.abs().T).chunk(2, dim=-1)
    out = F.silu(gate) * up
    return spread * gamma * (1.1 * up.abs() * mag_gate + F.silu(gate).abs() * mag_up) + 8 * u * out.abs() + 1e-30


EPS = 1e-5


def rms_normed(x, norm_weight, eps=EPS):
    """glmvit.model.RMSNorm in float32: x·rsqrt(mean(x²) + eps)·g."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight


# The norm inside the GEMM (float32): each gate and up term is x_k·g_k (one rounding) where the reference forms
# x_k·r·g_k (two), the row's r = 1/rms comes from a sum of squares in another order (within γ_K relative) and a
# divide, an add and a rsqrt on each side (about 3u each), and r scales the accumulator once more: at most
# γ_K + 10u ≤ 2γ_K (K ≥ 10; every K here is 16 or more) beyond the two orders' 2γ_K, so the bound of fp32_bound with
# spread 4, on the normed input.
NORM_SPREAD = 4


def _interpreter_child() -> None:
    """Runs with TRITON_INTERPRET=1; prints one JSON dict of results."""
    from glmvit.kernels.triton_swiglu_gemm import pack_gate_up, swiglu_linear_triton

    torch.set_num_threads(2)
    results: dict = {}
    outputs: dict = {}
    for name, config in configs().items():
        shapes = PACKED_SHAPES if config.packed else TMA_SHAPES if config.tma else POINTER_SHAPES + TMA_SHAPES
        for m, k, h in dict.fromkeys(shapes):
            x, weight = case(m, k, h)
            got = swiglu_linear_triton(x, pack_gate_up(weight, config.block_n) if config.packed else weight, config)
            key = f"{name}/{m}x{k}x{h}"
            outputs[key] = got
            results[key] = {"shape": list(got.shape),
                            "ratio": ((got - reference(x, weight)).abs() / fp32_bound(x, weight)).max().item()}
    for m, k, h in TMA_SHAPES:  # the same zero-padded tiles through either load path or grid: the same bits
        for name, twin in TWINS.items():
            results[f"same-bits/{name}/{m}x{k}x{h}"] = bool(torch.equal(outputs[f"{name}/{m}x{k}x{h}"],
                                                                        outputs[f"{twin}/{m}x{k}x{h}"]))
    x, weight = case(*TMA_SHAPES[0])
    gate, up = (x @ weight.T).chunk(2, dim=-1)
    results["swapped-ratio"] = ((F.silu(up) * gate - reference(x, weight)).abs() / fp32_bound(x, weight)).max().item()

    # NaN in one row of x: only that output row is NaN; in one gate or up row of W: only that output column.
    for name in ("pointer", "tma"):
        config = configs()[name]
        m, k, h = TMA_SHAPES[0]
        clean = swiglu_linear_triton(x, weight, config)
        bad_x = x.clone()
        bad_x[20, 3] = float("nan")
        out = swiglu_linear_triton(bad_x, weight, config)
        others = torch.arange(m) != 20
        row_ok = bool(out[20].isnan().all()) and bool(torch.equal(out[others], clean[others]))
        col_ok = True
        for w_row, col in ((5, 5), (h + 17, 17)):  # a gate row, an up row
            bad_w = weight.clone()
            bad_w[w_row, 0] = float("nan")
            out = swiglu_linear_triton(x, bad_w, config)
            keep = torch.arange(h) != col
            col_ok &= bool(out[:, col].isnan().all()) and bool(torch.equal(out[:, keep], clean[:, keep]))
        results[f"isolated/{name}"] = row_ok and col_ok
    # the same through the packed weight: a NaN in a gate or an up row of W reaches only its own output column
    config = configs()["tma-packed"]
    x, weight = case(*PACKED_SHAPES[0])
    h = PACKED_SHAPES[0][2]
    clean = swiglu_linear_triton(x, pack_gate_up(weight, config.block_n), config)
    col_ok = True
    for w_row, col in ((5, 5), (h + 17, 17)):
        bad_w = weight.clone()
        bad_w[w_row, 0] = float("nan")
        out = swiglu_linear_triton(x, pack_gate_up(bad_w, config.block_n), config)
        keep = torch.arange(h) != col
        col_ok &= bool(out[:, col].isnan().all()) and bool(torch.equal(out[:, keep], clean[:, keep]))
    results["isolated/tma-packed"] = col_ok
    results.update(_model_packed_results())
    results.update(_norm_results())
    print(json.dumps(results))


def _norm_results() -> dict:
    """The packed configurations with the RMSNorm inside (both ways of summing the squares) against the float32
    norm then SwiGLU; a NaN in one row of x stays in that row; a bound that drops the norm's weight breaks."""
    from glmvit.kernels.triton_swiglu_gemm import pack_gate_up, swiglu_linear_triton

    results: dict = {}
    gen = torch.Generator().manual_seed(5)
    for name in ("tma-packed", "tma-persistent-packed"):
        config = configs()[name]
        for m, k, h in PACKED_SHAPES:
            x, weight = case(m, k, h)
            x = 3 * x
            x[0] = 0.0  # a zero row (a padded one): 1/rms = rsqrt(eps), its outputs zero, never NaN
            x[-1] = 1e-4 * x[-1]  # a row whose mean square is below eps: eps decides its scale
            g = 0.5 + torch.rand(k, generator=gen)
            n = rms_normed(x, g)
            for mode in (1, 2):
                got = swiglu_linear_triton(x, pack_gate_up(weight, config.block_n), config, g, EPS, mode)
                results[f"norm/{name}#{mode}/{m}x{k}x{h}"] = (
                    (got - reference(n, weight)).abs() / fp32_bound(n, weight, NORM_SPREAD)).max().item()
            if (m, k, h) == PACKED_SHAPES[0]:
                results[f"norm/{name}/unweighted-ratio"] = ((got - reference(rms_normed(x, 1.0), weight)).abs()
                                                            / fp32_bound(n, weight, NORM_SPREAD)).max().item()
                no_eps = swiglu_linear_triton(x, pack_gate_up(weight, config.block_n), config, g, 0.0)
                results[f"norm/{name}/eps-ignored-ratio"] = ((no_eps - reference(n, weight)).abs()
                                                             / fp32_bound(n, weight, NORM_SPREAD)
                                                             ).nan_to_num(float("inf")).max().item()
                bad = x.clone()
                bad[20, 3] = float("nan")
                packed = pack_gate_up(weight, config.block_n)
                out = swiglu_linear_triton(bad, packed, config, g, EPS)
                others = torch.arange(m) != 20
                results[f"norm/{name}/isolated"] = bool(out[20].isnan().all()) and bool(
                    torch.equal(out[others], swiglu_linear_triton(x, packed, config, g, EPS)[others]))
    return results


def _model_packed_results() -> dict:
    """The model's own MLP module, 256 wide (two tiles of PACK_TILE = 128), its weight packed by its load hook as the
    model stores it, through the model's op: the configuration the table picks for a packed weight, below and from
    SWIGLU_PERSISTENT_MIN_ROWS rows, against the float32 bound; the CPU's unfused path (swiglu on the packed
    projection) too; and the same weight read by a plain configuration, which pairs the wrong rows."""
    from glmvit.gate_up import unpack_gate_up
    from glmvit.kernels.fused_gemm_table import SWIGLU_PERSISTENT_MIN_ROWS, swiglu_config
    from glmvit.kernels.triton_swiglu_gemm import swiglu_linear_triton
    from glmvit.model import SwiGLU, swiglu_linear

    gen = torch.Generator().manual_seed(3)
    mlp = SwiGLU(64, 256)
    mlp.load_state_dict({k: torch.randn(v.shape, generator=gen) for k, v in mlp.state_dict().items()}, strict=True)
    packed = mlp.gate_up_proj.weight.detach()
    plain = unpack_gate_up(packed, mlp.gate_up_tile)
    results: dict = {}
    with torch.no_grad():
        for m in (37, SWIGLU_PERSISTENT_MIN_ROWS + 5):
            x = torch.randn(m, 64, generator=gen)
            ref, bound = reference(x, plain), fp32_bound(x, plain)
            got = swiglu_linear(x, packed, mlp.gate_up_tile)
            results[f"model-packed/{m}"] = {"config": swiglu_config(m, True).name,
                                            "ratio": ((got - ref).abs() / bound).max().item(),
                                            "unfused_ratio": ((mlp.gated(x) - ref).abs() / bound).max().item()}
        x = torch.randn(37, 64, generator=gen)
        misread = swiglu_linear_triton(x, packed, swiglu_config(37, False))
        results["model-packed/misread-ratio"] = ((misread - reference(x, plain)).abs()
                                                 / fp32_bound(x, plain)).max().item()
    return results


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_triton_swiglu_gemm")


@pytest.mark.parametrize("name", ["pointer", "pointer-wide", "pointer-persistent"])
@pytest.mark.parametrize("shape", list(dict.fromkeys(POINTER_SHAPES + TMA_SHAPES)), ids=lambda s: "x".join(map(str, s)))
def test_interpreted_pointer_path_matches_reference(interpreted, name, shape):
    row = interpreted[f"{name}/{'x'.join(map(str, shape))}"]
    assert row["shape"] == [shape[0], shape[2]]
    assert row["ratio"] <= 1.0


@pytest.mark.parametrize("name", ["tma", "tma-wide", "tma-persistent", "tma-persistent-flat"])
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_descriptor_path_matches_reference(interpreted, name, shape):
    row = interpreted[f"{name}/{'x'.join(map(str, shape))}"]
    assert row["shape"] == [shape[0], shape[2]]
    assert row["ratio"] <= 1.0


@pytest.mark.parametrize("name", TWINS)
@pytest.mark.parametrize("shape", TMA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_load_paths_and_grids_compute_the_same_bits(interpreted, name, shape):
    """Descriptor or pointer loads, one program per tile or a persistent grid: the same tiles, the same bits."""
    assert interpreted[f"same-bits/{name}/{'x'.join(map(str, shape))}"]


def test_the_bound_catches_gate_and_up_swapped(interpreted):
    """The tolerance is tight enough to matter: reading the halves the wrong way round breaks it many times over."""
    assert interpreted["swapped-ratio"] > 100


@pytest.mark.parametrize("name", ["tma-packed", "tma-persistent-packed"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_packed_weight_matches_reference(interpreted, name, shape):
    """One dot over a (2·BLOCK_N)-row tile of the packed weight, split into gate and up in the epilogue."""
    row = interpreted[f"{name}/{'x'.join(map(str, shape))}"]
    assert row["shape"] == [shape[0], shape[2]]
    assert row["ratio"] <= 1.0


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("name", ["tma-packed", "tma-persistent-packed"])
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_norm_inside_matches_norm_then_swiglu(interpreted, name, shape, mode):
    """The block's RMSNorm inside the packed GEMM (its weight on x's columns, 1/rms on the accumulator's rows): within
    the float32 bound of the norm then the SwiGLU (NORM_SPREAD says why), summing the squares either way."""
    assert interpreted[f"norm/{name}#{mode}/{'x'.join(map(str, shape))}"] <= 1.0


@pytest.mark.parametrize("name", ["tma-packed", "tma-persistent-packed"])
def test_norm_inside_keeps_rows_apart_and_its_bound_sees_the_weight_and_eps(interpreted, name):
    """A NaN stays in its row; the bound breaks without the norm's weight, and without eps (the zero row turns NaN,
    the tiny row is scaled as if its mean square were all)."""
    assert interpreted[f"norm/{name}/isolated"]
    assert interpreted[f"norm/{name}/unweighted-ratio"] > 100
    assert interpreted[f"norm/{name}/eps-ignored-ratio"] > 100


def test_pack_gate_up_lays_each_tiles_gate_rows_before_its_up_rows():
    from glmvit.kernels.triton_swiglu_gemm import pack_gate_up

    weight = torch.arange(8.0)[:, None].expand(8, 3).contiguous()  # rows 0-3 gate, 4-7 up; each row its index
    assert pack_gate_up(weight, 2)[:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    with pytest.raises(ValueError, match=r"weight \(6, 3\) does not stack gate and up halves of a multiple of "
                                         r"tile=2"):
        pack_gate_up(weight[:6], 2)


@pytest.mark.parametrize("rows", [37, 1029])
def test_the_models_packed_weight_runs_the_packed_configurations(interpreted, rows):
    """The blocks' MLP stores its weight packed (glmvit.gate_up), so the model's op runs the packed configurations
    on it as stored, within the float32 bound, as the unfused path does; a plain configuration misreads it."""
    from glmvit.kernels.fused_gemm_table import SWIGLU_PERSISTENT_MIN_ROWS

    row = interpreted[f"model-packed/{rows}"]
    assert row["config"].endswith("-packed")
    assert ("-persistent" in row["config"]) == (rows >= SWIGLU_PERSISTENT_MIN_ROWS)
    assert row["ratio"] <= 1.0 and row["unfused_ratio"] <= 1.0
    assert interpreted["model-packed/misread-ratio"] > 100


@pytest.mark.parametrize("name", ["pointer", "tma", "tma-packed"])
def test_nonfinite_input_stays_in_its_row_and_column(interpreted, name):
    assert interpreted[f"isolated/{name}"]


def _module():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from glmvit.kernels import triton_swiglu_gemm

    return triton_swiglu_gemm


def test_config_names_and_refusals():
    module = _module()
    assert module.SwigluConfig().name == "128x128x64w8s3t"
    assert module.SwigluConfig(64, 128, 64, 4, 4, tma=False).name == "64x128x64w4s4p"
    assert module.SwigluConfig(persistent=True).name == "128x128x64w8s3t-persistent"
    assert module.SwigluConfig(persistent=True, flatten=True).name == "128x128x64w8s3t-persistent-flat"
    with pytest.raises(ValueError, match="set persistent=True"):
        module.SwigluConfig(flatten=True)
    assert module.SwigluConfig(persistent=True, packed=True).name == "128x128x64w8s3t-persistent-packed"
    with pytest.raises(ValueError, match="set tma=True"):
        module.SwigluConfig(packed=True, tma=False)
    with pytest.raises(ValueError, match="whole tiles of 16 rows; H = 12"):
        module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(24, 8), module.SwigluConfig(16, 16, 16, packed=True))
    assert len({c.name for c in module.SWEEP_CONFIGS}) == len(module.SWEEP_CONFIGS)
    assert module.SwigluConfig().shared_bytes() == 3 * 48 * 1024
    with pytest.raises(ValueError, match="block_n=48"):
        module.SwigluConfig(block_n=48)
    with pytest.raises(ValueError, match="num_stages=0"):
        module.SwigluConfig(num_stages=0)


def test_refusals_before_any_launch():
    """Bad shapes and rows TMA cannot take fail with one line naming them, before anything is compiled."""
    module = _module()
    config = module.SwigluConfig(16, 16, 16, 4, 1)
    with pytest.raises(ValueError, match=r"weight \(7, 8\)"):
        module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(7, 8), config)
    with pytest.raises(ValueError, match=r"x \(3, 8\), weight \(8, 4\)"):
        module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(8, 4), config)
    with pytest.raises(ValueError, match="x torch.float32"):
        module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(8, 8, dtype=torch.float64), config)
    with pytest.raises(ValueError, match="x rows of 5 torch.float32 are 20 bytes"):
        module.swiglu_linear_triton(torch.zeros(3, 5), torch.zeros(8, 5), config)
    with pytest.raises(ValueError, match="out rows of 6 torch.float32 are 24 bytes"):
        module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(12, 8), config)
    assert module.swiglu_linear_triton(torch.zeros(0, 8), torch.zeros(12, 8), config).shape == (0, 6)
    packed, g = module.SwigluConfig(16, 16, 16, packed=True), torch.ones(8)
    with pytest.raises(ValueError, match="eps given and norm_mode 1 or 2: got eps=None, norm_mode=1"):
        module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(32, 8), packed, g)  # eps forgotten: NaN on 0 rows
    for mode in (0, 3):  # 0 would skip the norm it was given
        with pytest.raises(ValueError, match=f"norm_mode={mode}"):
            module.swiglu_linear_triton(torch.zeros(3, 8), torch.zeros(32, 8), packed, g, 1e-6, mode)


def test_ab_check_tells_one_rounding_from_more():
    """tools/swiglu_ab.py's check: one bf16 rounding of the float32 result passes both marks; a 2⁻⁷ relative error
    is inside the max band but not one rounding; an offset of 2⁻⁵·max|ref| fails the band."""
    from tools.swiglu_ab import check

    ref = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    assert check(ref.bfloat16(), ref)["ok"] and check(ref.bfloat16(), ref)["one_rounding"]
    loose = check(ref * (1 + 2**-7), ref)
    assert loose["ok"] and not loose["one_rounding"]
    assert not check(ref + 2**-5 * ref.abs().max(), ref)["ok"]


# ---------------------------------------------------------------------------------------------- real GPU

GPU_CONFIGS = sweep_configs("glmvit.kernels.triton_swiglu_gemm")


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_each_configuration_compiles_for_hopper_as_intended(name):
    """No GPU needed: compiled for sm_90 by the installed Triton (``tools/swiglu_ab.py --compile-only``) at the
    model's shapes, every configuration uses warp-group MMAs, loads through TMA (descriptor configs) or pipelined
    asynchronous copies (pointer configs), holds ``num_stages`` buffers of x, gate and up tiles, and fits a block."""
    skip_unless_sm90_compiler()
    from tools.swiglu_ab import compile_report

    config = GPU_CONFIGS[name]
    report = compile_report(config)
    assert "unavailable" not in report, report
    assert report["wgmma"] > 0
    assert (report["tma_copies"] > 0) == config.tma
    assert (report["async_copies"] > 0) == (not config.tma)
    assert config.shared_bytes() <= report["shared_bytes"] <= H200_SHARED_PER_BLOCK


# (M, K, H): the model's K and H at 1 row and at rows no tile divides; a small odd shape (K, H multiples of 8 for
# TMA in bf16).
GPU_SHAPES = [(1, 1536, 4096), (300, 1536, 4096), (1024, 1536, 4096), (77, 1000, 1000)]


def _gpu_case(m, k, h):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(2 * h, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
    return x, weight


@pytest.mark.gpu
@pytest.mark.parametrize("name", GPU_CONFIGS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gpu_bf16_one_rounding_of_float32_reference(shape, name):
    from glmvit.kernels.triton_swiglu_gemm import pack_gate_up, swiglu_linear_triton
    from glmvit.model import swiglu

    config = GPU_CONFIGS[name]
    if config.packed and shape[2] % config.block_n:
        pytest.skip(f"a packed weight holds whole tiles of {config.block_n} rows, not H = {shape[2]}")
    x, weight = _gpu_case(*shape)
    ref = reference(x.float(), weight.float())
    got = swiglu_linear_triton(x, pack_gate_up(weight, config.block_n) if config.packed else weight, config)
    assert got.dtype == torch.bfloat16 and got.shape == (shape[0], shape[2])
    err = (got.float() - ref).abs()
    peak = ref.abs().max().item()
    assert bool((err <= 2**-8 * ref.abs() + 2**-12 * peak).all()), err.max().item()
    unfused = swiglu(F.linear(x, weight), shape[2])  # the unfused path (plain layout): the looser band, both meet
    assert (unfused.float() - ref).abs().max().item() <= 2**-6 * peak
    assert err.max().item() <= 2**-6 * peak


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("rows", [1, 300, 1024, 1029])
def test_gpu_bf16_norm_inside_within_one_rounding_of_its_inputs(rows, mode):
    """bf16, the launch table's packed configuration for ``rows``, the norm inside: against the float32 norm and
    SwiGLU of the same bf16 inputs. Its roundings: each x_k·g_k to bf16 before the matmul (at most 2⁻⁸ relative a term,
    bf16's unit roundoff, so gate and up within 2⁻⁸·(|n|·|W|ᵀ)), float32 accumulation far below that, and the output's
    one rounding (2⁻⁸·|out|); silu(g)·u then moves by 1.1·|u|·Δg + |silu(g)|·Δu. The norm as its own bf16 kernel
    rounds each term twice (x·r, then ·g): the max band 2⁻⁶·max|ref| holds both."""
    from glmvit.kernels.fused_gemm_table import swiglu_config
    from glmvit.kernels.triton_swiglu_gemm import pack_gate_up, swiglu_linear_triton
    from glmvit.model import RMSNorm, swiglu

    x, weight = _gpu_case(rows, 1536, 4096)
    x = 4 * x
    g = (1 + 0.5 * torch.rand(1536, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
         ).to(torch.bfloat16)
    config = swiglu_config(rows, True)
    got = swiglu_linear_triton(x, pack_gate_up(weight, config.block_n), config, g, EPS, mode)
    n = rms_normed(x.float(), g.float())
    ref = reference(n, weight.float())
    gate, up = (n @ weight.float().T).chunk(2, dim=-1)
    mag_gate, mag_up = (n.abs() @ weight.float().abs().T).chunk(2, dim=-1)
    peak = ref.abs().max().item()
    bound = 2**-8 * (1.1 * up.abs() * mag_gate + F.silu(gate).abs() * mag_up) + 2**-8 * ref.abs() + 2**-12 * peak
    err = (got.float() - ref).abs()
    assert bool((err <= bound).all()), (err / bound).max().item()
    norm = RMSNorm(1536, EPS).to("cuda", torch.bfloat16)
    norm.weight.data.copy_(g)
    unfused = swiglu(F.linear(norm(x), weight), 4096)
    assert (unfused.float() - ref).abs().max().item() <= 2**-6 * peak and err.max().item() <= 2**-6 * peak


@pytest.mark.gpu
def test_gpu_graph_replay_matches_a_direct_call():
    """Captured in a CUDA graph (the descriptors are baked into the capture), a replay gives the direct call's bits."""
    from glmvit.kernels.triton_swiglu_gemm import swiglu_linear_triton

    x, weight = _gpu_case(300, 1536, 4096)
    config = next(iter(GPU_CONFIGS.values()))
    direct = swiglu_linear_triton(x, weight, config)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        swiglu_linear_triton(x, weight, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = swiglu_linear_triton(x, weight, config)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, direct)
