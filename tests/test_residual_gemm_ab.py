"""tools/residual_gemm_ab.py off CUDA: its arguments and its per-call turn; the timing itself needs a CUDA GPU."""
import json
from pathlib import Path

import pytest

from tools.residual_gemm_ab import SHAPES, in_turn, main

RECORD = Path(__file__).resolve().parents[1] / "data" / "sweeps" / "residual_gemm_ab_h100.json"


def test_each_call_takes_the_next_operand_in_turn():
    turn = in_turn(["w0", "w1", "w2"])
    assert [turn() for _ in range(7)] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


@pytest.mark.parametrize("argv, message", [(["--rows", "256,a"], "a comma list of integers"),
                                           (["--rows", "250"], "multiple of 4"),
                                           (["--lt-algos", "0"], "--lt-algos must be at least 1")])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_without_cuda_it_says_so_and_exits_2(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main([]) == 2 and "no CUDA device" in capsys.readouterr().err


def test_the_recorded_ab_checked_every_path_and_the_epilogue_beats_the_separate_add():
    """The H100 record: every path of both matmuls at each row count ran and was checked; the best cuBLASLt
    algorithm with the residual as C is faster than the matmul and then the add, at every row count."""
    record = json.loads(RECORD.read_text())
    assert {(r["matmul"], r["rows"]) for r in record["results"]} == {(m, n) for m in SHAPES for n in (256, 1024, 8192)}
    for result in record["results"]:
        paths = result["paths"]
        assert all("us" in row and row["max_abs_err"] >= 0 for row in paths.values()), result["matmul"]
        best_c = min(row["us"] for path, row in paths.items() if path.endswith("+c"))
        assert best_c < paths["linear+add"]["us"], (result["matmul"], result["rows"])
