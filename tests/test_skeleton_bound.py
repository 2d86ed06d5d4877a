"""tools/skeleton_bound.py's op list, arithmetic and refusals; the bound itself needs a CUDA GPU (the H200 calls)."""
import pytest
import torch

from glmvit.config import VisionConfig
from glmvit.floor import flops_breakdown
from tools import skeleton_bound
from tools.skeleton_bound import WORKLOADS, main, segment_lengths, skeleton, steady, summary


@pytest.mark.parametrize("grids", [*WORKLOADS.values(), [[2, 32, 48], [1, 16, 16], [6, 8, 12]]])
def test_the_skeleton_does_the_forward_s_matmul_and_attention_flops(grids):
    """Its FLOPs are the model's useful FLOPs as glmvit.floor counts them (an independent count, by part): the
    skeleton leaves out only what the floor does not count (norms, rotary, softmax, activations, biases)."""
    config = VisionConfig.glm41v()
    ops = skeleton(config, grids)
    expected = flops_breakdown(config, grids)
    assert sum(op.flops(config.hidden_size) for op in ops if op.kind == "matmul") == expected["matmul"]
    assert sum(op.flops(config.hidden_size) for op in ops if op.kind == "attention") == expected["attention"]


def test_the_ops_run_in_the_model_s_order():
    config = VisionConfig.glm41v()
    ops = skeleton(config, WORKLOADS["8x448"])
    assert len(ops) == 1 + 5 * config.depth + 4
    assert [op.name for op in ops[:6]] == ["patch_embed", "block0.qkv", "block0.attention", "block0.proj",
                                           "block0.gate_up", "block0.down"]
    assert [op.gemm for op in ops[-4:]] == ["downsample", "merger.proj", "merger.gate_up", "merger.down"]
    assert ops[1].shape == (8192, 1536, 4608) and ops[-4].shape == (2048, 6144, 4096)


def test_every_temporal_patch_is_its_own_segment():
    assert segment_lengths([[4, 16, 16], [1, 32, 32]]) == (256,) * 4 + (1024,)


def test_a_sustained_run_is_read_on_its_second_half():
    assert steady([9.0, 8.0, 5.0, 6.0, 7.0]) == 6.0  # the clock's ramp (9, 8) left out
    with pytest.raises(ValueError, match="at least 2"):
        steady([1.0])
    run = {"device_ms": [9.0, 8.0, 5.0, 6.0], "sm_mhz": [1980, None, 1500, 1480], "power_w": [None, None, None, None]}
    assert summary(run, sustained=True) == {"ms": 5.5, "sm_mhz": 1490, "power_w": None, "replays": 4}
    assert summary(run, sustained=False)["ms"] == 7.0


def test_an_unknown_workload_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--workloads", "1x224,2x999"])
    assert exit_.value.code == 2 and "unknown workload '2x999'" in capsys.readouterr().err


def test_a_negative_count_of_cublaslt_algorithms_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--workloads", "1x224", "--lt-algos", "-1"])
    assert exit_.value.code == 2 and "--lt-algos not negative" in capsys.readouterr().err


def test_a_cublaslt_algorithm_is_described_by_what_it_reports():
    from tools.skeleton_bound import lt_describe

    class Algorithm:  # reports some fields, refuses one, and gives a tuple where cuBLASLt gives one
        algorithm_id, stages, split_k, reduction_scheme, cta_swizzling = 66, (3,), 4, 1, True
        tile = "TILE_128x64"

        @property
        def cluster_shape(self):
            raise RuntimeError("not reported by this cuBLASLt")

    described = lt_describe(Algorithm())
    assert described["algorithm_id"] == 66 and described["split_k"] == 4 and described["stages"] == "(3,)"
    assert described["cluster_shape"] == "RuntimeError: not reported by this cuBLASLt"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_refuses_in_one_line(capsys):
    assert main(["--workloads", "1x224"]) == 2
    assert capsys.readouterr().err.strip() == "skeleton_bound times CUDA kernels: this machine has no CUDA device"


def test_the_run_regime_replays_as_many_as_the_record_times():
    """The ``run`` regime stands for the record that measures each workload: its benchmark's timed requests and, for
    sixteen clips, the in-process serving run's batches (within 5 %: a count of batches is measured, the first ones
    part-full)."""
    import json
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "data" / "bench"

    def record(name: str) -> dict:
        return json.loads((bench / f"{name}.json").read_text())

    for workload, name in (("1x224", "img1x224"), ("clip8x224", "video8x224"), ("8x448", "img8x448")):
        assert skeleton_bound.RUN_REPLAYS[workload] == record(name)["settings"]["num_requests"], name
    batches = record("serve_video8x224_in_process")["runs"][0]["server"]["batches"]
    assert abs(skeleton_bound.RUN_REPLAYS["16clips"] - batches) <= 0.05 * batches
    assert set(skeleton_bound.RUN_REPLAYS) == set(skeleton_bound.WORKLOADS)
