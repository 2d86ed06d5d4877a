"""load_vision_weights: sharded Hugging Face checkpoints and single files, safetensors only, clear errors."""
import pytest
import torch
from safetensors.torch import save_file

from glmvit import GlmVisionEncoder, VisionConfig, load_vision_weights
from glmvit.testing import random_batch, randomize_


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A tiny Glm4vForConditionalGeneration saved with save_pretrained in several safetensors shards."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    vision = VisionConfig.tiny()
    text = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=128)
    model = Glm4vForConditionalGeneration(Glm4vConfig(vision_config=vision.to_hf_dict(), text_config=text)).eval()
    randomize_(model.model.visual, seed=3)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path, max_shard_size="100KB")
    return path, model.model.visual, vision


def test_sharded_checkpoint_gives_the_towers_output(tiny_checkpoint):
    path, visual, config = tiny_checkpoint
    assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) > 1
    model = GlmVisionEncoder(config).eval()
    report = load_vision_weights(model, path)
    assert report["missing"] == []
    pixels, grid = random_batch([[1, 4, 6], [1, 8, 4]], config, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(model(pixels, grid), visual(pixels, grid).pooler_output, atol=1e-5, rtol=0)


def test_single_file_without_prefix(tmp_path, tiny_model, tiny_config):
    file = tmp_path / "vision.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_model.state_dict().items()}, str(file))
    model = load_vision_weights_into_new(tiny_config, file)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), tiny_model.state_dict().values()))


def load_vision_weights_into_new(config, path):
    model = GlmVisionEncoder(config)
    load_vision_weights(model, path)
    return model


def test_missing_and_misshapen_weights_are_named(tmp_path, tiny_model, tiny_config):
    state = {f"model.visual.{k}": v.contiguous() for k, v in tiny_model.state_dict().items()}
    del state["model.visual.merger.proj.weight"]
    save_file(state, str(tmp_path / "missing.safetensors"))
    with pytest.raises(KeyError, match="merger.proj.weight"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path / "missing.safetensors")
    state = {f"visual.{k}": v.contiguous() for k, v in tiny_model.state_dict().items()}
    state["visual.post_layernorm.weight"] = torch.ones(7)
    save_file(state, str(tmp_path / "shape.safetensors"))
    with pytest.raises(ValueError, match=r"post_layernorm.weight: checkpoint \(7,\)"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path / "shape.safetensors")
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "text.safetensors"))
    with pytest.raises(ValueError, match="no GLM-4V vision weights"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path / "text.safetensors")


def test_pickle_checkpoints_are_refused(tmp_path, tiny_config):
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only .safetensors"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path)


@pytest.mark.parametrize("name", ["Glm4vConfig", "Glm46VConfig", "Glm4vMoeConfig"])
def test_transformers_glm4v_configs_give_the_glm41v_tower(name):
    import transformers

    config = getattr(transformers, name)()
    for form in (config, config.to_dict(), config.vision_config, config.vision_config.to_dict()):
        assert VisionConfig.from_hf(form) == VisionConfig.glm41v()


LLAMA = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32}
VISION = {"model_type": "glm4v_vision", "depth": 2, "hidden_size": 64, "num_heads": 4}


@pytest.mark.parametrize("config, message", [
    (LLAMA, r"model_type 'llama' is not a GLM-4V model"),
    ({k: v for k, v in VISION.items() if k != "model_type"}, r"model_type None is not a GLM-4V model"),
    ({"model_type": "glm_ocr", "vision_config": VISION}, r"model_type 'glm_ocr' is not a GLM-4V model"),
    (LLAMA | {"model_type": "glm4v"}, r"'glm4v' config without a vision_config"),
    ({"model_type": "glm4v", "vision_config": VISION | {"model_type": "siglip_vision_model"}},
     r"vision_config has model_type 'siglip_vision_model'"),
    ({"model_type": "glm4v", "vision_config": [1, 2]}, r"vision_config must be a JSON object"),
    ([1, 2], r"config must be a JSON object"),
    ({"model_type": "glm4v_vision", "hidden_size": 64}, r"vision_config lacks depth, num_heads"),
    (VISION | {"depth": "2"}, r"vision_config.depth must be an integer, got '2'"),
    (VISION | {"depth": True}, r"vision_config.depth must be an integer"),
    (VISION | {"num_heads": 4.0}, r"vision_config.num_heads must be an integer"),
    (VISION | {"rms_norm_eps": "small"}, r"vision_config.rms_norm_eps must be a number"),
    (VISION | {"depth": 10**9}, r"depth 1000000000 is implausible"),
    (VISION | {"depth": -1}, r"depth must be positive"),
    (VISION | {"hidden_act": "gelu"}, r"hidden_act='silu'"),
])
def test_non_glm4v_config_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf(config)


def test_aliases_defer_to_the_canonical_name():
    assert VisionConfig.from_hf(VISION | {"num_hidden_layers": 5}).depth == 2
    assert VisionConfig.from_hf({"model_type": "glm4v_vision", "num_hidden_layers": 3, "hidden_size": 64,
                                 "num_attention_heads": 4}).depth == 3
