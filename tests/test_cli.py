"""The command line: the demo (main job), encode and plan run on CPU and say what they did."""
import pytest
from safetensors.torch import load_file

from glmvit.__main__ import main


def test_demo_encodes_every_sample_item(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for name in ("astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg", "clip.gif"):
        assert name in out
    assert "emulated (no CUDA graphs on CPU)" in out
    diff = float(out.rsplit("max |runner − eager| = ", 1)[1].split()[0])
    assert diff < 1e-4


def test_encode_saves_embeddings(tmp_path, capsys):
    dest = tmp_path / "emb.safetensors"
    assert main(["encode", "data/images/coffee.jpg", "data/clip.gif", "--out", str(dest)]) == 0
    saved = load_file(str(dest))
    assert set(saved) == {"item_0", "item_1"} and saved["item_0"].shape[1] == 64
    assert "video grid" in capsys.readouterr().out


def test_encode_rejects_unknown_files_in_one_line(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hi")
    assert main(["encode", str(tmp_path / "notes.txt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "notes.txt: unsupported file type '.txt'" in err and "Traceback" not in err
    assert main(["encode", str(tmp_path / "missing.jpg")]) == 1
    assert "missing.jpg: no such file" in capsys.readouterr().err


def test_encode_checks_the_output_before_any_work(tmp_path, capsys):
    out = tmp_path / "is-a-folder.safetensors"
    out.mkdir()
    assert main(["encode", "data/images/coffee.jpg", "--out", str(out)]) == 1
    assert "is a directory" in capsys.readouterr().err


def test_plan_compares_packers(capsys):
    assert main(["plan", "--num-requests", "20", "--items-per-request", "3", "--range-ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "vllm" in out and "ffd" in out


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit):
        main(["fly"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_config):
    """A whole GLM-4V model (tiny) saved by transformers' save_pretrained: what a user points --weights at."""
    from tests.test_weights import hf_full_model

    path = tmp_path_factory.mktemp("ckpt")
    hf_full_model(tiny_config, seed=5).save_pretrained(path, max_shard_size="200KB")
    return path


@pytest.mark.parametrize("command", [["demo"], ["encode", "data/images/coffee.jpg"],
                                     ["bench", "--num-requests", "1", "--warmup", "0", "--modes", "eager", "--quiet"]])
def test_weights_take_the_checkpoints_own_config_on_cpu(command, checkpoint, capsys):
    """--weights on a CPU used to build the tiny config and fail on shapes: the checkpoint's config.json decides."""
    assert main([*command, "--weights", str(checkpoint), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Traceback" not in out and ("checkpoint" in out or "grid" in out or "eager" in out)


def test_config_with_weights_is_refused_in_one_line(checkpoint, capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--weights", str(checkpoint), "--config", "tiny"])
    assert "--config applies to random weights" in capsys.readouterr().err
