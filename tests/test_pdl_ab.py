"""tools/pdl_ab.py's sizing (its refusals: tests/test_ab_common.py); the A/B itself runs on a CUDA GPU."""
from tools.pdl_ab import PATHS, forwards_per_graph


def test_a_timed_graph_holds_about_the_same_gpu_work_at_every_row_count():
    assert forwards_per_graph(256) == 20 and forwards_per_graph(1024) == 5 and forwards_per_graph(8192) == 1
    assert all(forwards_per_graph(rows) >= 1 for rows in (256, 512, 4096, 65536))


def test_the_two_paths_differ_only_in_the_pdl_option():
    assert PATHS["compiled"] == {} and PATHS["compiled+pdl"] == {"triton.enable_pdl": True}
