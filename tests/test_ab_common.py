"""tools/ab_common.py: what the A/B tools share, on the CPU (the A/Bs themselves need a CUDA GPU)."""
import argparse

import pytest
import torch

from tools import autotune_ab, blas_ab, pdl_ab, qkv_rope_ab, swiglu_ab
from tools.ab_common import aligned_attrs, parse_rows


def _parser():
    return argparse.ArgumentParser(prog="ab")


def test_rows_are_a_comma_list_of_positive_multiples(capsys):
    assert parse_rows(_parser(), "256,1024") == [256, 1024]
    assert parse_rows(_parser(), "7", 1) == [7]
    for text, message in (("256,x", "a comma list of integers"), ("0", "at least 1"),
                          ("300", "a positive multiple of 256 (whole images)")):
        with pytest.raises(SystemExit):
            parse_rows(_parser(), text, 256 if text == "300" else 1, " (whole images)")
        assert f"--rows {text!r}: " in (err := capsys.readouterr().err) and message in err


def test_only_tensors_and_sizes_divisible_by_16_are_marked_aligned():
    args = {"x": torch.empty(2), "m": 32, "k": 24, "flag": True}
    assert aligned_attrs(args) == {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}


@pytest.mark.parametrize("tool", [swiglu_ab, qkv_rope_ab], ids=["swiglu_ab", "qkv_rope_ab"])
def test_each_gemm_ab_refuses_bad_rows_and_a_machine_without_cuda(tool, capsys):
    with pytest.raises(SystemExit):
        tool.main(["--rows", "256,x"])
    assert "--rows '256,x'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert tool.main([]) == 2
        assert capsys.readouterr().err.strip() == (
            f"{tool.__name__.rsplit('.', 1)[1]} times CUDA kernels: this machine has no CUDA device")


@pytest.mark.parametrize("tool, what", [(blas_ab, "CUDA matmuls"), (pdl_ab, "CUDA graphs"),
                                        (autotune_ab, "CUDA graphs")], ids=["blas_ab", "pdl_ab", "autotune_ab"])
def test_each_whole_image_ab_refuses_bad_rows_and_a_machine_without_cuda(tool, what, capsys):
    """Their shared command line (ab_common.whole_image_rows, cuda_here): one line for bad rows, one without CUDA."""
    for rows, message in (("256,x", "a comma list of integers"), ("300", "multiple of 256")):
        with pytest.raises(SystemExit) as exit_:
            tool.main(["--rows", rows])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    if not torch.cuda.is_available():
        name = tool.__name__.rsplit(".", 1)[-1]
        assert tool.main(["--rows", "256"]) == 2
        assert capsys.readouterr().err.strip() == f"{name} times {what}: this machine has no CUDA device"
