"""The packed attention inputs the library backends' GPU tests share (tests/test_cudnn_attention.py,
tests/test_fa4_attention.py): layouts with padding rows, unused segment slots and a video item, one layer's bf16 qkv
projection on CUDA, and a float32 per-segment reference on the same rotated inputs."""
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
