"""tools/lt_block_ab.py off CUDA: its block is the model's block, bit for bit, where linear_residual is the two ops
(on the CPU); its arguments; its refusal without CUDA. The replays themselves need a CUDA GPU and nvmath-python."""
import pytest
import torch

from glmvit.model import Block
from glmvit.workloads import random_batch
from tools.lt_block_ab import block_forward_lt, main


def test_the_ab_block_is_the_model_block_where_the_residual_add_is_the_two_ops(tiny_model, tiny_config, monkeypatch):
    pixels, grid = random_batch([[1, 4, 6], [2, 4, 4]], tiny_config, seed=3)
    with torch.no_grad():
        expected = tiny_model(pixels, grid)
        monkeypatch.setattr(Block, "forward", block_forward_lt)
        got = tiny_model(pixels, grid)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("argv", [["--burst", "0"], ["--rest-s", "-1"], ["--seconds", "0"]])
def test_bad_arguments_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "--burst must be at least 1" in capsys.readouterr().err


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main([]) == 2 and "no CUDA device" in capsys.readouterr().err
