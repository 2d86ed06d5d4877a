"""glmvit.profiling: kernel categories, the matmul list of a forward against the analytic FLOPs, the roofline."""
from __future__ import annotations

import pytest

from glmvit import VisionConfig
from glmvit.floor import flops_breakdown
from glmvit.profiling import OTHER, categorise, encoder_gemms, roofline_us


@pytest.mark.parametrize("name, category", [
    ("nvjet_sm90_tst_64x64_64x13_4x2_h_bz_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("_rope_varlen_attention_kernel", "attention"),
    ("_rope_rotate_qk_kernel", "attention"),  # the prerotated path's first launch
    ("_combine_splits_kernel", "attention"),  # the split-key path's second
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false>>", "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_7", "fused elementwise"),
    ("triton_poi_fused_mul_silu_split_4", "fused elementwise"),
    ("_interp_kernel", "interpolation"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "fill"),
    ("Memcpy HtoD (Pageable -> Device)", "copy"),
    ("void at::native::elementwise_kernel<128, 2, mul>", OTHER),
])
def test_kernel_categories(name, category):
    assert categorise(name) == category


@pytest.mark.parametrize("config", [VisionConfig.glm41v(), VisionConfig.tiny()])
@pytest.mark.parametrize("grid", [[1, 16, 16], [1, 32, 32], [4, 16, 16]])
def test_the_matmul_list_is_the_analytic_matmul_count(config, grid):
    """Every matmul of the forward, as the profiler and the roofline see them, adds up to flops_breakdown's."""
    rows = grid[0] * grid[1] * grid[2]
    listed = sum(2 * m * k * n * count for _, m, k, n, count in encoder_gemms(config, rows))
    assert listed == flops_breakdown(config, [grid])["matmul"]


def test_roofline_is_the_larger_of_compute_and_bandwidth():
    assert roofline_us(1e12, 1, 1000, 1000) == pytest.approx(1000.0)  # 1 TFLOP at 1 PFLOP/s: 1 ms
    assert roofline_us(1, 4e9, 1000, 4000) == pytest.approx(1000.0)  # 4 GB at 4 TB/s: 1 ms


def test_idle_time_is_the_span_that_no_kernel_covers():
    """Overlapping, nested and back-to-back intervals leave no idle time between them; order does not matter."""
    from glmvit.profiling import idle_us

    assert idle_us([]) == 0.0
    assert idle_us([(12.0, 20.0), (0.0, 10.0), (25.0, 30.0)]) == 7.0  # 10→12 and 20→25
    assert idle_us([(0.0, 10.0), (2.0, 4.0), (9.0, 15.0), (15.0, 16.0), (18.0, 19.0)]) == 2.0  # only 16→18
