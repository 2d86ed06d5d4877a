"""tools/pdl_ab.py's sizing and refusals; the A/B itself needs a CUDA GPU (it runs in the H200 calls)."""
import pytest
import torch

from tools.pdl_ab import PATHS, forwards_per_graph, main


def test_a_timed_graph_holds_about_the_same_gpu_work_at_every_row_count():
    assert forwards_per_graph(256) == 20 and forwards_per_graph(1024) == 5 and forwards_per_graph(8192) == 1
    assert all(forwards_per_graph(rows) >= 1 for rows in (256, 512, 4096, 65536))


def test_the_two_paths_differ_only_in_the_pdl_option():
    assert PATHS["compiled"] == {} and PATHS["compiled+pdl"] == {"triton.enable_pdl": True}


@pytest.mark.parametrize("rows, message", [("256,x", "a comma list of integers"), ("300", "multiple of 256")])
def test_bad_rows_are_refused_in_one_line(capsys, rows, message):
    with pytest.raises(SystemExit) as exit_:
        main(["--rows", rows])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert main(["--rows", "256"]) == 2
    assert capsys.readouterr().err.strip() == "pdl_ab times CUDA graphs: this machine has no CUDA device"
