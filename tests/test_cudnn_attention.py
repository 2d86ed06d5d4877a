"""The ``cudnn`` attention backend (cuDNN's ragged SDPA through the cuDNN frontend): its offsets and its refusals on
any machine; on a Hopper GPU with the frontend installed, its output against a float32 reference and under a CUDA
graph replayed on another batch. (The encoder-level GPU tests in ``test_gpu.py`` run it too: every backend
``available_backends`` offers.)

Tolerance (GPU): as ``test_triton_attention``'s bf16 band. Both paths round q̃, k̃, the softmax weights and the
output to bf16 (each ≤ 2⁻⁹ relative) and accumulate in float32, so the output is within about 2⁻⁸·max|v| of a float32
reference on the same rotated inputs; 2⁻⁶·max|v| leaves room for the sums, and a kernel that mixed segments or
skipped the rotation misses by the output's own scale.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from glmvit.attention import available_backends, check_backend, prepare_attention
from glmvit.kernels.cudnn_attention import check_rows, ragged_offsets, unavailable_reason
from glmvit.metadata import BatchShape, build_metadata
from glmvit.rotary import inv_freq, rotary_cos_sin
from tests.packed_attention_cases import (
    GPU_LAYOUTS,
    assert_capture_on_one_batch_replays_another,
    assert_within_bf16_band,
    case,
)

GRIDS = [(1, 4, 6), (2, 2, 4), (1, 10, 8), (1, 2, 2)]  # a video item: two segments of 8 rows


def test_ragged_offsets_count_each_segment_from_its_first_row():
    meta = build_metadata(GRIDS, 2, BatchShape(160, 9, 160))
    heads, head_dim = 3, 8
    got = ragged_offsets(torch.from_numpy(meta.cu_seqlens.copy()), heads, head_dim).numpy()
    lengths = [24, 8, 8, 80, 4]  # t·h·w per segment: a video item has one segment per temporal patch
    starts = np.concatenate([[0], np.cumsum(lengths)])
    slots = meta.cu_seqlens.shape[0] - 1
    assert got.shape == (4, slots + 1) and got.dtype == np.int32
    np.testing.assert_array_equal(got[0, : len(lengths)], lengths)
    assert not got[0, len(lengths):].any()  # unused slots and the trailing entry: empty segments
    for row, width in ((1, 2 * heads * head_dim), (2, 3 * heads * head_dim), (3, heads * head_dim)):
        np.testing.assert_array_equal(got[row, : len(starts)], starts * width)
        np.testing.assert_array_equal(got[row, len(starts):], starts[-1] * width)  # empty slots start at the end


def test_offsets_that_would_overflow_int32_are_refused_in_one_line():
    heads, head_dim = 12, 128
    limit = 2**31 // (3 * heads * head_dim)  # rows · 3·heads·d must stay below 2³¹
    check_rows(limit, heads, head_dim)
    with pytest.raises(ValueError, match=f"{limit + 1:,} rows") as err:
        check_rows(limit + 1, heads, head_dim)
    assert "\n" not in str(err.value)


def test_the_offsets_are_computed_once_per_forward_and_only_for_cudnn():
    meta = build_metadata(GRIDS, 2).to("cpu")
    assert prepare_attention(meta, "segments", 3, 8) is meta and meta.ragged is None
    ready = prepare_attention(meta, "cudnn", 3, 8)
    assert ready is not meta and meta.ragged is None  # the runner's own buffers are never changed
    assert torch.equal(ready.ragged, ragged_offsets(meta.cu_seqlens, 3, 8))
    assert ready.packed is meta.packed  # every other view shared


@pytest.mark.parametrize("dtype, head_dim, reason", [(torch.float32, 128, "fp16/bf16"),
                                                      (torch.bfloat16, 16, "head_dim")])
def test_unsupported_dtypes_and_head_dims_are_named(dtype, head_dim, reason):
    assert reason in unavailable_reason(0, dtype, head_dim)


def test_not_offered_off_cuda_and_refused_in_one_line():
    for dtype in (torch.float32, torch.bfloat16):
        assert "cudnn" not in available_backends("cpu", dtype)
    with pytest.raises(ValueError, match="'cudnn' is not available on cpu") as err:
        check_backend("cudnn", "cpu", torch.float32)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- real GPU

def _cudnn_here() -> bool:
    return torch.cuda.is_available() and unavailable_reason(torch.cuda.current_device(), torch.bfloat16, 128) is None


needs_cudnn = pytest.mark.skipif(not _cudnn_here(), reason="needs a Hopper GPU and the cuDNN frontend ('cuda' extra)")

@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_bf16_within_rounding_of_float32_reference(layout):
    from glmvit.attention import attend_qkv

    qkv, cos, sin, meta, rows = case(GPU_LAYOUTS[layout])
    got = attend_qkv(qkv, cos, sin, prepare_attention(meta, "cudnn", 12, 128), "cudnn", 12)
    assert_within_bf16_band(got, qkv, cos, sin, meta, rows)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("layout", GPU_LAYOUTS)
def test_gpu_q_and_k_rotated_in_qkv_itself_give_the_scratch_s_bits(layout):
    """``rotated=True`` (q̃, k̃ in qkv's own columns, as the fused rotary qkv GEMM leaves them): a plan of row stride
    3·heads·d and the qkv offsets, bitwise the result of the same q̃, k̃ from the rotation's scratch."""
    from glmvit.attention import attend_qkv
    from glmvit.kernels.triton_attention import rotate_qk_triton

    qkv, cos, sin, meta, rows = case(GPU_LAYOUTS[layout])
    ready = prepare_attention(meta, "cudnn", 12, 128)
    rotated = qkv.clone()
    rotated[:, :2 * 12 * 128] = rotate_qk_triton(qkv, cos, sin, meta.cu_seqlens, 12)
    expected = attend_qkv(qkv, cos, sin, ready, "cudnn", 12)
    got = attend_qkv(rotated, cos, sin, ready, "cudnn", 12, rotated=True)
    assert torch.equal(got[:rows], expected[:rows])


@pytest.mark.gpu
@needs_cudnn
def test_gpu_a_graph_captured_on_one_batch_replays_another():
    """The plan's dims are the shape's (slots, max_seqlen); lengths and offsets are read from the device at replay:
    a graph captured on one batch gives, replayed on another of the same shape, that batch's eager answer."""
    from glmvit.attention import attend_qkv

    def attend(qkv, cos, sin, meta):  # the offsets computed inside the graph, as a forward does
        return attend_qkv(qkv, cos, sin, prepare_attention(meta, "cudnn", 12, 128), "cudnn", 12)

    assert_capture_on_one_batch_replays_another(attend)


def test_auto_runs_cudnn_from_the_tables_row_count_and_triton_below():
    from glmvit.attention import resolve
    from glmvit.kernels.attention_table import CUDNN_MIN_ROWS

    assert resolve("auto", CUDNN_MIN_ROWS) == "cudnn" and resolve("auto", CUDNN_MIN_ROWS - 4) == "triton"
    assert all(resolve(name, CUDNN_MIN_ROWS) == name for name in ("triton", "cudnn", "varlen", "segments"))
    meta = build_metadata(GRIDS, 2, BatchShape(CUDNN_MIN_ROWS, 9, CUDNN_MIN_ROWS)).to("cpu")
    assert prepare_attention(meta, "auto", 3, 8).ragged is not None  # a cudnn-sized shape gets its offsets
    small = build_metadata(GRIDS, 2).to("cpu")
    assert prepare_attention(small, "auto", 3, 8) is small


def test_plans_are_shared_by_segment_bounds_rounded_up_to_a_power_of_two():
    from glmvit.kernels.cudnn_attention import plan_bound

    assert [plan_bound(n) for n in (1, 256, 257, 1024, 5329, 8192)] == [256, 256, 512, 1024, 8192, 8192]
    assert all(plan_bound(n) >= n for n in range(1, 20000, 37))  # a bound, never below the shape's


def test_auto_falls_back_to_triton_where_cudnn_offsets_would_overflow():
    from glmvit.attention import resolve

    width = 3 * 12 * 128
    rows = 2**31 // width + 4
    assert resolve("auto", rows, width) == "triton" and resolve("auto", rows) == "cudnn"
    assert resolve("auto", rows - 8, width) == "cudnn"


def test_strided_inputs_are_refused_in_one_line():
    from glmvit.kernels.cudnn_attention import cudnn_varlen_attention

    qkv = torch.zeros(8, 2 * 3 * 2 * 16)[:, ::2]  # a column slice: rows are not dense
    cos = sin = torch.zeros(8, 16)
    cu = torch.tensor([0, 8, 8, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous") as err:
        cudnn_varlen_attention(qkv, cos, sin, cu, ragged_offsets(cu, 2, 16), 2, 8)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@needs_cudnn
def test_gpu_a_batch_of_no_items_runs_as_the_runner_warms_up_and_captures():
    """The runner allocates its buffers from empty grids (every slot an empty segment) and warms up on them."""
    from glmvit.attention import attend_qkv

    meta = build_metadata(np.zeros((0, 3), dtype=np.int64), 2, BatchShape(6144, 64, 6144)).to("cuda")
    qkv = torch.randn(6144, 3 * 12 * 128, device="cuda").to(torch.bfloat16)
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(128).to("cuda"))
    out = attend_qkv(qkv, cos, sin, prepare_attention(meta, "auto", 12, 128), "auto", 12)
    torch.cuda.synchronize()
    assert out.shape == (6144, 12 * 128)
