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


def test_a_tma_operand_is_refused_in_one_line_naming_it():
    """Rows of a multiple of 16 bytes and a 16-byte aligned start: what a tensor descriptor takes."""
    import torch

    from glmvit.kernels.launch_checks import check_tma_operands

    good = torch.zeros(4, 8, dtype=torch.bfloat16)  # 16-byte rows
    check_tma_operands("cfg", (("x", good), ("out", good)))
    with pytest.raises(ValueError, match=r"^cfg: TMA needs rows of a multiple of 16 bytes: out rows of 6 "
                                         r"torch.bfloat16 are 12 bytes$"):
        check_tma_operands("cfg", (("x", good), ("out", torch.zeros(4, 6, dtype=torch.bfloat16))))
    shifted = torch.zeros(4 * 8 + 1, dtype=torch.bfloat16)[1:].view(4, 8)  # starts 2 bytes past an aligned one
    with pytest.raises(ValueError, match="^cfg: TMA needs 16-byte aligned tensors: weight is not$"):
        check_tma_operands("cfg", (("weight", shifted),))
