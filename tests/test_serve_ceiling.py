"""tools/serve_ceiling.py: the stand-in costs what it is told and answers the true shapes; a short load through the
real server counts every role's CPU and every request's answer."""
import json
import time
import types

import pytest
import torch

from glmvit.request import EncoderRequest
from tools.serve_ceiling import StandInEncoder, main


def test_the_stand_in_sleeps_its_time_and_answers_each_items_shape():
    model = types.SimpleNamespace(config=types.SimpleNamespace(out_hidden_size=24), dtype=torch.bfloat16,
                                  device=torch.device("cpu"))
    encoder = StandInEncoder(model, None, ms_per_item=15.0, ms_per_batch=10.0, host_ops=50)
    request = EncoderRequest.of(torch.tensor([[1, 4, 4], [2, 8, 4]]))
    start = time.perf_counter()
    outputs = encoder.encode(torch.zeros(0), request, sync=False)
    assert time.perf_counter() - start >= 0.040  # 10 + 2 × 15 ms, a sleep never shorter than asked
    assert [tuple(o.shape) for o in outputs] == [(4, 24), (16, 24)]  # tokens: t·h·w / 2²
    assert all(o.dtype == torch.bfloat16 and not o.any() for o in outputs) and encoder.batches == 1
    assert 0 < encoder.host_s < time.perf_counter() - start - 0.040  # its 50 torch calls, timed apart


@pytest.mark.skipif(not __import__("pathlib").Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_short_load_is_answered_and_every_role_is_counted(tmp_path, capsys):
    out = tmp_path / "ceiling.json"
    assert main(["--config", "tiny", "--engine-ms-per-item", "20", "--engine-host-ops", "10", "--json", str(out), "--",
                 "--num-prompts", "6", "--warmup-requests", "1"]) == 0
    result = json.loads(out.read_text())
    assert result["items"] == result["successful"] == 6 and result["failed"] == result["refused"] == 0
    assert result["items_counted_for_cpu"] == 7  # the warm-up request's item too
    assert result["busy_s"] >= 6 * 0.020  # the stand-in's sleeps are the engine's busy time
    assert {"engine", "decode", "client"} <= set(result["cpu_s"])
    assert all(v >= 0 for v in result["cpu_ms_per_item"].values()) and result["cpu_s"]["decode"] > 0
    # the server's last line: every batch's host work (warm-up included), timed apart from its sleep (20 ms an item)
    assert 1 <= result["stand_in"]["batches"] <= 7 and 0 < result["stand_in"]["host_ms_per_batch"] < 20
    printed = capsys.readouterr().out
    assert "items/s" in printed and "\nall " in printed and "stand-in host work" in printed
