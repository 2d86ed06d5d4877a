"""Our encoder against transformers' Glm4vVisionModel on the same random weights (fp32, CPU)."""
import pytest
import torch

from glmvit import GlmVisionEncoder, VisionConfig
from glmvit.oracle import flatten_video_grids
from glmvit.workloads import random_batch

GRID_MIXES = [
    [[1, 4, 6]],  # non-square
    [[1, 2, 2]],  # a single merge block
    [[1, 8, 8]],  # the table's own size (G = 8 in the tiny config)
    [[1, 24, 24]],  # larger than the table
    [[1, 40, 6]],  # extreme aspect ratio
    [[1, 4, 6], [1, 8, 4], [1, 6, 4]],  # several images
    [[2, 6, 4]],  # a video, t = 2
    [[1, 4, 6], [3, 4, 4], [1, 2, 10]],  # images around a t = 3 video
    [[2, 2, 2], [1, 12, 2], [2, 10, 6]],  # two videos and an image
]


@pytest.mark.parametrize("grids", GRID_MIXES, ids=lambda g: "+".join("x".join(map(str, r)) for r in g))
@pytest.mark.parametrize("backend", ["sdpa_masked", "segments"])
def test_matches_transformers(tiny_hf, tiny_model, tiny_config, grids, backend):
    pixels, grid = random_batch(grids, tiny_config, seed=len(grids))
    with torch.no_grad():
        expected = tiny_hf(pixels, flatten_video_grids(grid)).pooler_output
        tiny_model.attn_backend = backend
        got = tiny_model(pixels, grid)
    tiny_model.attn_backend = None
    assert got.shape == expected.shape == (int(grid.prod(dim=1).sum()) // 4, tiny_config.out_hidden_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_state_dict_matches_transformers(tiny_hf, tiny_config):
    ours = GlmVisionEncoder(tiny_config).state_dict()
    theirs = tiny_hf.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)


def test_full_size_state_dict_shapes():
    with torch.device("meta"):
        model = GlmVisionEncoder(VisionConfig.glm41v())
    assert sum(p.numel() for p in model.parameters()) == 892_498_432
    sd = model.state_dict()
    assert sd["blocks.0.attn.qkv.weight"].shape == (4608, 1536)
    assert sd["blocks.23.mlp.gate_proj.weight"].shape == (4096, 1536)
    assert sd["merger.gate_proj.weight"].shape == (13696, 4096)
    assert sd["downsample.weight"].shape == (4096, 1536, 2, 2)


def test_video_equals_its_frames_as_images(tiny_model, tiny_config):
    """A t = 3 video is three independent temporal patches with the image's position embedding."""
    pixels, grid = random_batch([[3, 4, 6]], tiny_config, seed=3)
    with torch.no_grad():
        video = tiny_model(pixels, grid)
        frames = tiny_model(pixels, torch.tensor([[1, 4, 6]] * 3))
    torch.testing.assert_close(video, frames, atol=0, rtol=0)


def test_empty_batch(tiny_model, tiny_config):
    out = tiny_model(torch.zeros(0, tiny_config.patch_dim), torch.zeros(0, 3, dtype=torch.long))
    assert out.shape == (0, tiny_config.out_hidden_size)


@pytest.mark.parametrize(
    "rows, grid, message",
    [
        (24, [1, 4, 6], r"shape \[n, 3\]"),
        (24, [[1, 4, 6, 1]], r"shape \[n, 3\]"),
        (0, [[0, 4, 6]], r"item 0: .*non-positive"),
        (24, [[1, 4, 6], [1, -2, 2]], r"item 1: .*non-positive"),
        (15, [[1, 3, 5]], r"item 0: .*not divisible by the spatial merge size"),
        (25, [[1, 4, 6]], r"25 rows .* 24"),
    ],
)
def test_bad_input_is_named(tiny_model, tiny_config, rows, grid, message):
    with pytest.raises(ValueError, match=message):
        tiny_model(torch.zeros(rows, tiny_config.patch_dim), torch.tensor(grid))


def test_bad_row_width(tiny_model):
    with pytest.raises(ValueError, match=r"C·T·P²"):
        tiny_model(torch.zeros(24, 100), torch.tensor([[1, 4, 6]]))


def test_config_from_hf(tiny_hf, tiny_config):
    assert VisionConfig.from_hf(tiny_hf.config) == tiny_config
    assert VisionConfig.from_hf(tiny_hf.config.to_dict()) == tiny_config
    full = {"model_type": "glm4v", "vision_config": {"depth": 24, "hidden_size": 1536, "num_heads": 12}}
    assert VisionConfig.from_hf(full) == VisionConfig.glm41v()
    with pytest.raises(ValueError, match="must be positive"):
        VisionConfig(depth=0)


def test_unknown_attention_backend(tiny_model, tiny_config):
    tiny_model.attn_backend = "nope"
    try:
        with pytest.raises(ValueError, match="unknown attention backend"):
            tiny_model(*random_batch([[1, 2, 2]], tiny_config))
        tiny_model.attn_backend = "varlen"
        with pytest.raises(ValueError, match="not available on cpu"):
            tiny_model(*random_batch([[1, 2, 2]], tiny_config))
    finally:
        tiny_model.attn_backend = None


@pytest.mark.slow
def test_full_size_matches_transformers():
    """GLM-4.1V vision tower, one 224² image, fp32 on CPU: relative error ≤ 1e-4."""
    from glmvit.oracle import encoder_like, hf_vision_model

    config = VisionConfig.glm41v()
    hf = hf_vision_model(config, seed=1)
    model = encoder_like(hf, config)
    pixels, grid = random_batch([[1, 16, 16]], config, seed=1)
    with torch.no_grad():
        expected = hf(pixels, grid).pooler_output
        got = model(pixels, grid)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= 1e-4, rel


def test_rotary_frequencies_stay_float32_when_the_model_is_cast(tiny_model):
    """transformers keeps inv_freq in float32 under .to(bf16); a bf16 copy would move every rotary angle."""
    import copy

    cast = copy.deepcopy(tiny_model).to(torch.bfloat16)
    assert cast.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert torch.equal(cast.rotary_pos_emb.inv_freq, tiny_model.rotary_pos_emb.inv_freq)


def test_fused_gate_up_round_trips_transformers_keys(tiny_hf, tiny_config, tmp_path):
    """gate and up are one parameter here, two checkpoint keys there: same key order per module, unpacked and split
    on save, concatenated and packed on load (the tiny MLP, 64 wide, is one tile: plain [gate; up], so its halves are
    views; tests/test_gate_up.py checks a weight really re-laid); a safetensors file of our state dict loads into
    transformers' tower and back."""
    from safetensors.torch import load_file, save_file

    from glmvit.gate_up import pack_gate_up

    ours = GlmVisionEncoder(tiny_config)
    ours.load_state_dict(tiny_hf.state_dict(), strict=True)
    for prefix in ("blocks.0.mlp.", "merger."):
        assert [k for k in ours.state_dict() if k.startswith(prefix)] == \
            [k for k in tiny_hf.state_dict() if k.startswith(prefix)]
    mlp, state = ours.blocks[0].mlp, ours.state_dict()
    fused = mlp.gate_up_proj.weight
    plain = torch.cat([state["blocks.0.mlp.gate_proj.weight"], state["blocks.0.mlp.up_proj.weight"]])
    assert torch.equal(fused, pack_gate_up(plain, mlp.gate_up_tile))
    assert mlp.gate_up_tile == tiny_config.out_hidden_size  # one tile: the halves are views of the parameter
    assert state["blocks.0.mlp.gate_proj.weight"].data_ptr() == fused.data_ptr()
    save_file(ours.state_dict(), str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    tiny_hf.load_state_dict(loaded, strict=True)
    again = GlmVisionEncoder(tiny_config)
    again.load_state_dict(loaded, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_residual_add_is_bitwise_the_eager_add(dtype):
    """Under torch.compile the residual adds in float32 and rounds once (so inductor cannot turn it into an addmm
    that copies its input): eager half-precision adds round the float32 sum once too, so the bits are the same."""
    from glmvit.model import residual_add

    g = torch.Generator().manual_seed(0)
    x, h = (torch.randn(64, 48, generator=g).mul(8).to(dtype) for _ in range(2))
    compiled = torch.compile(residual_add, fullgraph=True, dynamic=False)
    got = compiled(x, h)
    assert got.dtype == dtype and torch.equal(got, x + h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_residual_add_keeps_a_half_precision_residual_out_of_addmm(dtype):
    """Inductor fuses a matmul and the add after it into addmm (whose CUDA kernel copies its input first); the float32
    add of ``residual_add`` does not match the rewrite's pattern, so the compiled code calls mm and adds apart."""
    from torch._inductor.utils import run_and_get_code

    from glmvit.model import residual_add

    g = torch.Generator().manual_seed(1)
    x, a, w = (torch.randn(*shape, generator=g).to(dtype) for shape in ((64, 48), (64, 32), (32, 48)))
    codes = {}
    for name, fn in (("plain", lambda x, a, w: x + a @ w), ("residual_add", lambda x, a, w: residual_add(x, a @ w))):
        torch._dynamo.reset()
        _, code = run_and_get_code(torch.compile(fn, fullgraph=True), x, a, w)
        codes[name] = "\n".join(code)
    assert "addmm" in codes["plain"]  # the rewrite fires on the plain add (so this test can tell)
    assert "addmm" not in codes["residual_add"] and "mm" in codes["residual_add"]
