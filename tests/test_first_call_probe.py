"""tools/first_call_probe.py's grid parsing and a CPU dry run; the first-call cost itself needs a CUDA GPU."""
import pytest

from tools.first_call_probe import main, parse_grids


def test_grids_parse_into_batches_of_items():
    assert parse_grids("8x32x32+1x16x16;4x16x16") == [[[8, 32, 32], [1, 16, 16]], [[4, 16, 16]]]


@pytest.mark.parametrize("text, bad", [("4x16", "4x16"), ("1x0x4", "1x0x4"), ("1x4x4+ax4x4", "ax4x4")])
def test_a_bad_grid_item_is_refused_in_one_line_naming_it(text, bad):
    with pytest.raises(ValueError, match=f"grid item '{bad}' is not TxHxW"):
        parse_grids(text)


def test_a_cpu_dry_run_times_each_batch_twice(capsys, tmp_path):
    out = tmp_path / "first.json"
    assert main(["--device", "cpu", "--config", "tiny", "--grids", "1x4x4;2x4x6", "--json", str(out)]) == 0
    import json

    batches = json.loads(out.read_text())["batches"]
    assert [b["grids"] for b in batches] == [[[1, 4, 4]], [[2, 4, 6]]]
    assert all(b["first_ms"] > 0 and b["second_ms"] > 0 for b in batches)
    assert all(b["first_cudnn_plans"] == b["second_cudnn_plans"] == 0 for b in batches)  # no cuDNN on the CPU
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_triton_misses_are_caught_while_entered_and_the_hook_restored():
    pytest.importorskip("triton")
    from triton import knobs

    from tools.first_call_probe import TritonMisses

    before = knobs.runtime.jit_cache_hook
    with TritonMisses() as misses:
        assert knobs.runtime.jit_cache_hook == misses._hook
        assert misses._hook(repr="kernel[num_warps=4](x: *fp32)") is False  # the launch compiles as usual
    assert misses.kernels == ["kernel[num_warps=4](x: *fp32)"] and knobs.runtime.jit_cache_hook is before


def test_the_warmup_is_one_batch(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cpu", "--config", "tiny", "--warmup", "1x4x4;1x4x4"])
    assert exit_.value.code == 2 and "--warmup is one batch, not 2" in capsys.readouterr().err
