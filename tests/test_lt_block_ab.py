"""tools/lt_block_ab.py off CUDA: its arguments and its refusal without CUDA. The replays themselves need a CUDA GPU
and nvmath-python; which path a captured block takes is tested in tests/test_project_residual.py."""
import pytest

from tools.lt_block_ab import main


@pytest.mark.parametrize("argv", [["--burst", "0"], ["--rest-s", "-1"], ["--seconds", "0"]])
def test_bad_arguments_are_one_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "--burst must be at least 1" in capsys.readouterr().err


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main([]) == 2 and "no CUDA device" in capsys.readouterr().err
