"""The packed attention inputs and checks the library backends' GPU tests share (tests/test_cudnn_attention.py,
tests/test_fa4_attention.py): layouts with padding rows, unused segment slots and a video item, one layer's bf16 qkv
projection on CUDA, a float32 per-segment reference on the same rotated inputs, the bf16 band around it, and a graph
captured on one batch replayed on another."""
from typing import Callable

import torch

from glmvit.attention import attend
from glmvit.metadata import BatchShape, build_metadata
from glmvit.rotary import apply_rotary, inv_freq, rotary_cos_sin

GPU_LAYOUTS = {
    "1x224": [(1, 16, 16)],
    "4x224+video": [(1, 16, 16)] * 4 + [(8, 16, 16)],
    "mixed": [(1, 32, 32), (1, 4, 214), (1, 2, 2), (1, 78, 138), (3, 10, 12)],
}


def case(grids, seed=0, heads=12, head_dim=128):
    """(qkv, cos, sin, meta, real rows) on CUDA for ``grids``, 512 padding rows and unused slots after them."""
    rows = sum(t * h * w for t, h, w in grids)
    shape = BatchShape(rows + 512, len(grids) * 8 + 4, rows + 512)  # padding rows and unused slots
    meta = build_metadata(grids, 2, shape).to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(shape.rows, 3 * heads * head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    cos, sin = rotary_cos_sin(meta.h_idx, meta.w_idx, inv_freq(head_dim).to("cuda"))
    return qkv, cos, sin, meta, rows


def reference(qkv, cos, sin, meta, heads=12):
    """The float32 per-segment attention (rows, heads·d) of ``qkv``'s rotated q, k and its v, and that v."""
    q, k, v = qkv.view(qkv.shape[0], 3, heads, -1).unbind(1)
    ref = attend(apply_rotary(q, cos, sin).float(), apply_rotary(k, cos, sin).float(), v.float(), meta, "segments")
    return ref.reshape(qkv.shape[0], -1), v


def assert_within_bf16_band(out, qkv, cos, sin, meta, rows):
    """``out``'s ``rows`` real rows within 2⁻⁶·max|v| of the float32 reference: q̃, k̃, the softmax weights and the
    output each rounded to bf16 (≤ 2⁻⁹ relative) with float32 sums put the output within about 2⁻⁸·max|v|; 2⁻⁶ leaves
    room for the sums, and a kernel that mixed segments or skipped the rotation misses by the output's own scale."""
    ref, v = reference(qkv, cos, sin, meta)
    assert (out[:rows].float() - ref[:rows]).abs().max().item() <= 2**-6 * v[:rows].float().abs().max().item()


def assert_capture_on_one_batch_replays_another(attend: Callable[..., torch.Tensor]):
    """``attend(qkv, cos, sin, meta)`` (a backend's whole per-forward work) captured in a CUDA graph on one batch
    gives, replayed after another batch of the same shape was copied into the metadata and rotary tables, that
    batch's eager answer bitwise, within the bf16 band of its reference. The first eager call is the warm-up that
    builds plans or compiles kernels before the capture."""
    qkv, cos, sin, meta, _ = case(GPU_LAYOUTS["mixed"], seed=1)
    second_meta = build_metadata([(1, 16, 16)] * 3 + [(2, 8, 12)], 2, meta.shape).to("cuda")
    eager_first = attend(qkv, cos, sin, meta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(qkv, cos, sin, meta)
    graph.replay()
    rows_first = meta.host.num_rows
    assert torch.equal(out[:rows_first], eager_first[:rows_first])
    meta.packed.copy_(second_meta.packed)  # the next batch: same shape, other segments
    for buf, table in zip((cos, sin), rotary_cos_sin(second_meta.h_idx, second_meta.w_idx, inv_freq(128).to("cuda")),
                          strict=True):
        buf.copy_(table)
    graph.replay()
    rows = second_meta.host.num_rows
    assert torch.equal(out[:rows], attend(qkv, cos, sin, second_meta)[:rows])
    assert_within_bf16_band(out, qkv, cos, sin, second_meta, rows)
