"""glmvit's Triton varlen attention (rotary inside) against the unfused reference: split q, k, v, ``apply_rotary``,
one SDPA call per segment. On the CPU through the Triton interpreter (fp32, tiny sizes, a fresh process: the
interpreter is chosen at import), on the GPU in bf16.

Tolerances. fp32: the kernel and the reference do the same float32 arithmetic in another order (blocked dot
products, the online softmax's rescaling), so they differ by a few float32 roundings of O(1) values: 1e-5 absolute
is ~100 ulps. bf16 (GPU): both round the rotated q, k and the softmax weights P to bf16 before their matmuls, and
the output to bf16 at the end: each rounding is ≤ 2⁻⁹ relative, so against a float32 reference on the same rotated
inputs the output of either kernel is off by about 2⁻⁸·max|v|; we allow 2⁻⁶·max|v| and check the library's varlen
kernel lands in the same band.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from conftest import run_interpreted
from glmvit.attention import attend
from glmvit.metadata import BatchShape, build_metadata
from glmvit.rotary import apply_rotary, inv_freq, rotary_cos_sin

HAS_TRITON = importlib.util.find_spec("triton") is not None

# (grids, padded shape or None): one segment over several 64-row blocks, blocks straddling segments, many segments
# in one block, video segments, padded rows and unused segment slots.
LAYOUTS = {
    "one-segment-three-blocks": ([(1, 10, 16)], None),
    "straddling": ([(1, 4, 6), (2, 2, 4), (1, 10, 8), (1, 2, 2)], BatchShape(140, 8, 140)),
    "many-small-in-one-block": ([(1, 2, 2)] * 5 + [(3, 2, 4)], BatchShape(96, 12, 96)),
    "block-aligned": ([(1, 8, 8), (1, 8, 8)], BatchShape(192, 4, 192)),
}


# Keys split over 2 or 3 programs, 16 keys a block: every layout has segments with fewer key blocks than splits
# (a split with nothing to do) and segments whose blocks do not divide evenly among the splits.
SPLITS = (2, 3)


def split_config(split):
    from glmvit.kernels.triton_attention import AttnConfig

    return AttnConfig(32, 16, 4, 1, split_k=split)


def prerotated_config():
    """q and k rotated once in their own launch (the long-segment path), 16 keys a block as above."""
    from glmvit.kernels.triton_attention import AttnConfig

    return AttnConfig(32, 16, 4, 1, prerotate=True)


def reference(qkv, cos, sin, meta, heads):
    rows = qkv.shape[0]
    q, k, v = qkv.view(rows, 3, heads, -1).unbind(1)
    return attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, meta, "segments").reshape(rows, -1)


def case(grids, shape, heads, head_dim, dtype=torch.float32, device="cpu", seed=0):
    meta = build_metadata(grids, 2, shape).to(device)
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(meta.shape.rows, 3 * heads * head_dim, generator=gen).to(device, dtype)
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(head_dim).to(device))
    return qkv, cos, sin, meta


def _interpreter_child() -> None:
    """Runs with TRITON_INTERPRET=1; prints one JSON dict of results."""
    from glmvit import VisionConfig
    from glmvit.attention import available_backends
    from glmvit.kernels.triton_attention import rope_varlen_attention_triton, rotate_qk_triton
    from glmvit.oracle import encoder_like, flatten_video_grids, hf_vision_model
    from glmvit.workloads import random_batch

    torch.set_num_threads(2)
    heads, head_dim = 2, 32
    results: dict = {"cpu_fp32_backends": available_backends("cpu", torch.float32),
                     "cpu_bf16_backends": available_backends("cpu", torch.bfloat16)}
    for name, (grids, shape) in LAYOUTS.items():
        qkv, cos, sin, meta = case(grids, shape, heads, head_dim)
        n = meta.host.num_rows
        expected = reference(qkv, cos, sin, meta, heads)[:n]
        got = rope_varlen_attention_triton(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads)
        results[name] = (got[:n] - expected).abs().max().item()
        for split in SPLITS:
            split_out = rope_varlen_attention_triton(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads,
                                                     split_config(split))
            results[f"{name}-split{split}"] = (split_out[:n] - expected).abs().max().item()
        pre = rope_varlen_attention_triton(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads,
                                           prerotated_config())
        results[f"{name}-prerotated"] = (pre[:n] - expected).abs().max().item()
        # q and k rotated before the call (as the fused rotary qkv GEMM leaves them), rotated=True: no config rotates
        rotated = qkv.clone()
        rotated[:, :2 * heads * head_dim] = rotate_qk_triton(qkv, cos, sin, meta.cu_seqlens, heads)
        for label, config in (("inloop", None), ("prerotated", prerotated_config())):
            given = rope_varlen_attention_triton(rotated, cos, sin, meta.segment_ids, meta.cu_seqlens, heads, config,
                                                 rotated=True)
            results[f"{name}-given-rotated-{label}"] = (given[:n] - expected).abs().max().item()
        results[f"{name}-given-rotated-bitwise"] = bool(torch.equal(given[:n], pre[:n]))
        if shape is not None:  # the same batch unpadded: every real row bitwise the same
            exact = case(grids, None, heads, head_dim)
            alone = rope_varlen_attention_triton(*exact[:3], exact[3].segment_ids, exact[3].cu_seqlens, heads)
            results[name + "-padding-invariant"] = bool(torch.equal(alone, got[:n]))

    # A NaN or Inf in one item's q, k or v: every row of every other item bitwise unchanged, that item's rows NaN.
    grids, shape = LAYOUTS["straddling"]
    qkv, cos, sin, meta = case(grids, shape, heads, head_dim)
    cu = meta.cu_seqlens.tolist()
    for label, config in (("isolated", None), ("isolated-split", split_config(SPLITS[-1])),
                          ("isolated-prerotated", prerotated_config())):
        clean = rope_varlen_attention_triton(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads, config)
        isolated = True
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            if b <= a:
                continue
            for value in (float("nan"), float("inf")):
                for part in range(3):  # q, k, v of head 0
                    bad = qkv.clone()
                    bad[a, part * heads * head_dim] = value
                    out = rope_varlen_attention_triton(bad, cos, sin, meta.segment_ids, meta.cu_seqlens, heads, config)
                    others = torch.ones(out.shape[0], dtype=torch.bool)
                    others[a:b] = False
                    others[cu[-1]:] = False
                    isolated &= bool(torch.equal(out[others], clean[others]))
        results[label] = isolated

    config = VisionConfig.tiny()
    hf = hf_vision_model(config, seed=0)
    model = encoder_like(hf, config, attn_backend="triton")
    pixels, grid = random_batch([[1, 4, 6], [2, 8, 4], [1, 2, 2]], config, seed=0)
    with torch.no_grad():
        expected = hf(pixels, flatten_video_grids(grid)).pooler_output  # transformers: one row per frame
        got = model(pixels, grid)
    results["encoder_rel"] = ((got - expected).abs().max() / expected.abs().max()).item()
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("test_triton_attention")


def test_backend_offered_on_cpu_only_in_fp32_under_the_interpreter(interpreted):
    assert "triton" in interpreted["cpu_fp32_backends"] and interpreted["cpu_fp32_backends"][0] == "segments"
    assert "triton" not in interpreted["cpu_bf16_backends"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_interpreted_kernel_matches_reference(interpreted, layout):
    assert interpreted[layout] <= 1e-5
    if LAYOUTS[layout][1] is not None:
        assert interpreted[layout + "-padding-invariant"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split", SPLITS)
def test_interpreted_split_keys_match_reference(interpreted, layout, split):
    """The split-key path (partials, then the combine launch) is the same attention to float32 rounding."""
    assert interpreted[f"{layout}-split{split}"] <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_interpreted_prerotated_path_matches_reference(interpreted, layout):
    """Rotating q and k once in a first launch and attending on the rotated copy: the same attention."""
    assert interpreted[f"{layout}-prerotated"] <= 1e-5


@pytest.mark.parametrize("layout", LAYOUTS)
def test_interpreted_kernel_takes_q_and_k_rotated_already(interpreted, layout):
    """``rotated=True`` (q and k rotated before the call, as the fused rotary qkv GEMM leaves them): the in-loop and
    the prerotated configuration both attend without rotating again, the same attention to float32 rounding, and
    the prerotated one bitwise the call that rotated in its own launch (the same q̃, k̃ read at another stride)."""
    assert interpreted[f"{layout}-given-rotated-inloop"] <= 1e-5
    assert interpreted[f"{layout}-given-rotated-prerotated"] <= 1e-5
    assert interpreted[f"{layout}-given-rotated-bitwise"]


@pytest.mark.parametrize("path", ["isolated", "isolated-split", "isolated-prerotated"])
def test_nonfinite_input_stays_in_its_segment(interpreted, path):
    assert interpreted[path]


def test_encoder_with_triton_attention_matches_transformers(interpreted):
    assert interpreted["encoder_rel"] <= 1e-5


def test_backend_not_offered_without_interpreter_on_cpu():
    from glmvit.attention import available_backends
    from glmvit.kernels import interpreting

    if HAS_TRITON and interpreting():
        pytest.skip("this process runs the interpreter")
    assert "triton" not in available_backends("cpu", torch.float32)


# ---------------------------------------------------------------------------------------------- real GPU

GPU_LAYOUTS = {
    "1x224": [(1, 16, 16)],
    "4x224+video": [(1, 16, 16)] * 4 + [(8, 16, 16)],
    "mixed": [(1, 32, 32), (1, 4, 214), (1, 2, 2), (1, 78, 138), (3, 10, 12)],
}


GPU_CONFIGS = {"one-pass": {}, "split4": {"split_k": 4}, "prerotated": {"prerotate": True},
               "prerotated-128x64w8s3": {"prerotate": True, "block_m": 128, "num_warps": 8, "num_stages": 3},
               "table": None}  # the launch table's choice for the row count (the mixed layout: prerotated)


@pytest.mark.gpu
@pytest.mark.parametrize("path", GPU_CONFIGS)
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_bf16_within_rounding_of_float32_reference(layout, path):
    """Split keys add float32 partials and one bf16 rounding at the end, and the prerotated path rounds q̃, k̃ as
    the fused one does: the same band as one pass."""
    from glmvit.kernels.triton_attention import AttnConfig, rope_varlen_attention_triton

    heads, head_dim = 12, 128
    grids = GPU_LAYOUTS[layout]
    rows = sum(t * h * w for t, h, w in grids)
    qkv, cos, sin, meta = case(grids, BatchShape(rows + 512, len(grids) * 8 + 4, rows + 512), heads, head_dim,
                               torch.bfloat16, "cuda")
    n = meta.host.num_rows
    q, k, v = qkv.view(-1, 3, heads, head_dim).unbind(1)
    ref = attend(apply_rotary(q, cos, sin).float(), apply_rotary(k, cos, sin).float(), v.float(), meta, "segments")
    band = 2**-6 * v[:n].float().abs().max().item()
    chosen = GPU_CONFIGS[path]
    config = None if chosen is None else AttnConfig(**{"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 1,
                                                       **chosen})
    got = rope_varlen_attention_triton(qkv, cos, sin, meta.segment_ids, meta.cu_seqlens, heads, config)
    assert (got[:n].float() - ref.reshape(-1, heads * head_dim)[:n]).abs().max().item() <= band
    library = attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, meta, "varlen")
    assert (library[:n].float() - ref[:n]).abs().max().item() <= band


def test_gpu_backend_needs_a_head_dim_the_kernel_can_split():
    """On a GPU half a head is one tl.dot operand: the tiny config's head_dim 16 falls back to the library kernels."""
    from glmvit.attention import triton_attention_runs
    from glmvit.kernels import interpreting, triton_available

    if not triton_available() or interpreting():
        pytest.skip("needs triton, and this process must not run the interpreter")
    assert triton_attention_runs("cuda", torch.bfloat16, 128) and triton_attention_runs("cuda", torch.bfloat16, None)
    assert not triton_attention_runs("cuda", torch.bfloat16, 16)
    assert not triton_attention_runs("cuda", torch.float32, 128)
