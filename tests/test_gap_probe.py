"""tools/gap_probe.py's reading of profiled replays: idle time between consecutive kernels (none where they
overlap), each replay's span and busy time. Synthetic kernel events, so it runs anywhere; the
probe itself needs a CUDA GPU and says so in one line elsewhere."""
import pytest
import torch

from tools.gap_probe import idle_intervals, main, summarise_replays

# two replays of three kernels (start µs, end µs, name), each sorted by start; in the second, b overlaps a by 1 µs
REPLAYS = [[(0.0, 10.0, "a"), (12.0, 20.0, "b"), (25.0, 30.0, "c")],
           [(100.0, 110.0, "a"), (109.0, 120.0, "b"), (120.0, 121.0, "c")]]


def test_idle_time_is_between_kernels_and_never_negative():
    first, second = REPLAYS
    assert [(i["us"], i["before"], i["after"]) for i in idle_intervals(first)] == [(2.0, "a", "b"), (5.0, "b", "c")]
    assert idle_intervals(second) == []  # overlap and back-to-back: no idle time


def test_span_is_busy_plus_idle_when_kernels_do_not_overlap():
    summary = summarise_replays(REPLAYS)
    assert summary["span_us"] == [30.0, 21.0]
    assert summary["busy_us"] == [23.0, 22.0]  # the second replay's overlap counts twice in busy time
    assert summary["idle_us"] == [7.0, 0.0]
    assert summary["span_us"][0] == summary["busy_us"][0] + summary["idle_us"][0]
    assert [i["us"] for i in summary["largest_idle"]] == [5.0, 2.0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert main(["--layouts", "8x448"]) == 2
    assert capsys.readouterr().err.strip() == "gap_probe: needs a CUDA GPU"
