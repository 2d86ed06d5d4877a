"""glmvit.kernels.launch_checks: every Triton launch configuration refuses, in one line naming the field, a tile
side a tl.dot cannot take and a count below 1."""
import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("module, cls, tile", [("triton_swiglu_gemm", "SwigluConfig", "block_n"),
                                               ("triton_qkv_rope_gemm", "QkvRopeConfig", "block_k"),
                                               ("triton_attention_tma", "TmaConfig", "block_n")])
def test_configurations_refuse_bad_tiles_and_counts(module, cls, tile):
    import importlib

    config = getattr(importlib.import_module(f"glmvit.kernels.{module}"), cls)
    config()  # the defaults are valid
    for value in (48, 8):
        with pytest.raises(ValueError, match=f"^{tile}={value}: a tile side must be a power of two, at least 16"):
            config(**{tile: value})
    with pytest.raises(ValueError, match="^num_warps=0: must be at least 1$"):
        config(num_warps=0)
