"""tools/sustained_floor.py's arithmetic: a window's rate, and the sustained rate as the settled half's median (the
ramp kept apart). The probe itself needs a CUDA GPU and says so in one line elsewhere."""
import pytest
import torch

from tools.sustained_floor import main, sustained, window_tflops


def test_a_window_rate_is_flops_over_time():
    assert window_tflops(2 * 8192**3, 10, 14.0) == pytest.approx(2 * 8192**3 * 10 / 0.014 / 1e12)
    with pytest.raises(ValueError, match="0 calls"):
        window_tflops(1, 0, 1.0)


def test_the_sustained_rate_is_the_second_half_after_the_ramp():
    windows = [{"tflops": 800.0, "sm_mhz": 1980.0, "power_w": 500.0}, {"tflops": 760.0, "sm_mhz": 1800.0},
               {"tflops": 660.0, "sm_mhz": 1500.0, "power_w": 700.0}, {"tflops": 640.0, "sm_mhz": 1450.0,
                                                                        "power_w": 700.0}]
    steady = sustained(windows)
    assert steady["tflops"] == 650.0 and steady["sm_mhz"] == 1475.0 and steady["power_w"] == 700.0
    assert steady["first_window"] == {"tflops": 800.0, "sm_mhz": 1980.0, "power_w": 500.0}
    assert sustained(windows[:2])["power_w"] is None  # no reading in the settled half: none, not a guess
    with pytest.raises(ValueError, match="at least 2 windows"):
        sustained(windows[:1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert main(["--seconds", "1"]) == 2
    assert capsys.readouterr().err.strip() == "sustained_floor: needs a CUDA GPU"
