"""Loading checkpoints: from_pretrained against transformers' own save_pretrained/from_pretrained, and every refusal.

The oracle is transformers: checkpoints are written by ``Glm4vForConditionalGeneration.save_pretrained`` and the
loaded tensors are compared bitwise with the ones transformers holds. Refusals must leave the model untouched.
"""
import copy
import dataclasses
import json
import os
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmvit import GlmVisionEncoder, VisionConfig, load_vision_weights
from glmvit.random_weights import randomize_
from glmvit.workloads import random_batch

TEXT = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=128)


def hf_full_model(config: VisionConfig, seed: int):
    """transformers' whole GLM-4V model (tiny text part) with random vision weights."""
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration

    model = Glm4vForConditionalGeneration(Glm4vConfig(vision_config=config.to_hf_dict(), text_config=TEXT)).eval()
    randomize_(model.model.visual, seed=seed)
    return model


@pytest.fixture(scope="module")
def hf_full(tiny_config):
    return hf_full_model(tiny_config, seed=3)


@pytest.fixture(scope="module")
def sharded(hf_full, tmp_path_factory):
    """save_pretrained in several shards with an index (float32)."""
    path = tmp_path_factory.mktemp("sharded")
    hf_full.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module")
def single(hf_full, tmp_path_factory):
    """save_pretrained as one model.safetensors beside config.json (float32)."""
    path = tmp_path_factory.mktemp("single")
    hf_full.save_pretrained(path)
    return path


@pytest.fixture
def ckpt(sharded, tmp_path):
    """A private copy of the sharded checkpoint that a test may damage."""
    return shutil.copytree(sharded, tmp_path / "ckpt")


def index_of(path):
    return json.loads((path / "model.safetensors.index.json").read_text())


def write_index(path, weight_map):
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before):
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused checkpoint changed the model"


def assert_equal_state(ours, theirs):
    ours, theirs = ours.state_dict(), theirs.state_dict()
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]), k


def fresh(config, seed=9):
    return randomize_(GlmVisionEncoder(config), seed=seed)


# ---------------------------------------------------------------------------------------------------------------
# from_pretrained against transformers
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["sharded", "single", "single_file"])
def test_from_pretrained_holds_transformers_weights(layout, sharded, single, hf_full, tiny_config):
    path = {"sharded": sharded, "single": single, "single_file": single / "model.safetensors"}[layout]
    assert len(list(sharded.glob("*.safetensors"))) > 1
    model = GlmVisionEncoder.from_pretrained(path)
    visual = hf_full.model.visual
    assert model.config == tiny_config and not model.training and model.dtype == torch.float32
    assert_equal_state(model, visual)
    assert torch.equal(model.rotary_pos_emb.inv_freq, GlmVisionEncoder(tiny_config).rotary_pos_emb.inv_freq)
    pixels, grid = random_batch([[1, 4, 6], [2, 8, 4]], tiny_config, seed=2)
    with torch.no_grad():  # same weights, same float32 ops as test_model.py: the same tolerance
        expected = visual(pixels, torch.tensor([[1, 4, 6], [1, 8, 4], [1, 8, 4]])).pooler_output
        torch.testing.assert_close(model(pixels, grid), expected, atol=1e-5, rtol=0)


def test_buffers_equal_a_normally_built_model(single, tiny_config):
    """to_empty leaves non-persistent buffers as junk: every buffer must be rebuilt (inv_freq today)."""
    loaded, built = GlmVisionEncoder.from_pretrained(single), GlmVisionEncoder(tiny_config)
    assert sorted(n for n, _ in loaded.named_buffers()) == sorted(n for n, _ in built.named_buffers())
    built_buffers = dict(built.named_buffers())
    for name, value in loaded.named_buffers():
        assert value.dtype == built_buffers[name].dtype and torch.equal(value, built_buffers[name]), name


def test_bf16_checkpoint_gives_transformers_bf16_model(hf_full, tmp_path):
    from transformers import Glm4vForConditionalGeneration

    copy.deepcopy(hf_full).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="100KB")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    theirs = Glm4vForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16).model.visual
    ours = GlmVisionEncoder.from_pretrained(tmp_path)
    assert ours.dtype == torch.bfloat16
    assert GlmVisionEncoder.from_pretrained(tmp_path, dtype="auto").dtype == torch.bfloat16  # as transformers' "auto"
    assert_equal_state(ours, theirs)
    assert ours.rotary_pos_emb.inv_freq.dtype == theirs.rotary_pos_emb.inv_freq.dtype == torch.float32
    assert torch.equal(ours.rotary_pos_emb.inv_freq, theirs.rotary_pos_emb.inv_freq)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]  # no dtype in config.json: the tensors' dtype
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert GlmVisionEncoder.from_pretrained(tmp_path).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                             ("bfloat16", torch.bfloat16), ("torch.float64", torch.float64)])
def test_dtype_argument_converts_each_tensor(single, dtype, expected):
    model = GlmVisionEncoder.from_pretrained(single, dtype=dtype)
    stored = {k.removeprefix("model.visual."): v for k, v in load_file(single / "model.safetensors").items()}
    for name, value in model.state_dict().items():
        assert value.dtype == expected and torch.equal(value, stored[name].to(expected)), name


def test_bf16_load_allocates_no_float32_copy(hf_full, tmp_path, tiny_config):
    """Every float32 tensor an op creates off the meta device is counted: a model built in float32 and cast, or
    materialised before the cast, creates ≥ one float32 element per parameter; from_pretrained only inv_freq's."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Float32Allocations(TorchDispatchMode):
        elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type != "meta":
                    self.elements += t.numel()
            return out

    copy.deepcopy(hf_full).to(torch.bfloat16).save_pretrained(tmp_path)
    parameters = sum(p.numel() for p in GlmVisionEncoder(tiny_config).parameters())
    with Float32Allocations() as naive:
        GlmVisionEncoder(tiny_config).to(torch.bfloat16)
    assert naive.elements >= parameters  # the detector sees a float32 build
    with Float32Allocations() as ours:
        model = GlmVisionEncoder.from_pretrained(tmp_path)
    assert model.dtype == torch.bfloat16
    assert ours.elements < parameters / 100, f"{ours.elements} float32 elements allocated"


def test_load_vision_weights_reports_what_it_read(sharded, tiny_config):
    report = load_vision_weights(fresh(tiny_config), sharded)
    assert report.prefix == "model.visual." and report.dtype == torch.float32
    assert report.files and all(f.parent == sharded and f.suffix == ".safetensors" for f in report.files)


def test_single_file_without_prefix(tmp_path, tiny_model, tiny_config):
    file = tmp_path / "vision.safetensors"
    save_file({k: v.contiguous() for k, v in tiny_model.state_dict().items()}, str(file))
    model = fresh(tiny_config)
    assert load_vision_weights(model, file).prefix == ""
    assert_equal_state(model, tiny_model)


def test_hugging_face_cache_snapshot_links_into_blobs(single, tmp_path, hf_full):
    """models--org--name/snapshots/REV/* are links to ../../blobs/*: inside the repository, so accepted."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for name, blob in [("model.safetensors", "aa11"), ("config.json", "bb22")]:
        shutil.copy(single / name, repo / "blobs" / blob)
        (snap / name).symlink_to(f"../../blobs/{blob}")
    assert_equal_state(GlmVisionEncoder.from_pretrained(snap), hf_full.model.visual)
    (snap / "model.safetensors").unlink()
    shutil.copy(single / "model.safetensors", tmp_path / "elsewhere.safetensors")
    (snap / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ValueError, match="outside"):
        GlmVisionEncoder.from_pretrained(snap)


# ---------------------------------------------------------------------------------------------------------------
# Atomic: nothing is written unless everything checks out
# ---------------------------------------------------------------------------------------------------------------
def last_shard_with_vision(path):
    weight_map = index_of(path)["weight_map"]
    return max(f for k, f in weight_map.items() if k.startswith("model.visual."))


def rewrite_shard(file, change):
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (lambda t, k: t.__setitem__(k, torch.zeros(7)), r"checkpoint \(7,\) vs model"),
    (lambda t, k: t.__setitem__(k, torch.zeros(t[k].shape, dtype=torch.int32)), r"is I32, not floating point"),
])
def test_bad_tensor_in_last_shard_leaves_model_untouched(ckpt, tiny_config, damage, message):
    shard = last_shard_with_vision(ckpt)
    key = max(k for k, f in index_of(ckpt)["weight_map"].items() if f == shard and k.startswith("model.visual."))
    rewrite_shard(ckpt / shard, lambda tensors: damage(tensors, key))
    model = fresh(tiny_config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=f"{shard}: {key.removeprefix('model.visual.')}.*{message}"):
        load_vision_weights(model, ckpt)
    assert_unchanged(model, before)


def test_missing_weight_is_named_and_nothing_written(tmp_path, tiny_model, tiny_config):
    state = {f"model.visual.{k}": v.contiguous() for k, v in tiny_model.state_dict().items()}
    del state["model.visual.merger.proj.weight"]
    save_file(state, str(tmp_path / "missing.safetensors"))
    model = fresh(tiny_config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"missing\.safetensors.*missing vision weights \['merger.proj.weight'\]"):
        load_vision_weights(model, tmp_path / "missing.safetensors")
    assert_unchanged(model, before)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "text.safetensors"))
    with pytest.raises(ValueError, match=r"text\.safetensors: .*no GLM-4V vision weights"):
        load_vision_weights(model, tmp_path / "text.safetensors")


def test_weights_of_another_tower_are_refused(single, tmp_path, tiny_config):
    """A config saying depth 1 for a 2-block checkpoint would silently drop a block."""
    shutil.copy(single / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((single / "config.json").read_text())
    config["vision_config"]["depth"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vision weights the model does not have \['blocks\.1\."):
        GlmVisionEncoder.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"does not have"):
        load_vision_weights(GlmVisionEncoder(dataclasses.replace(tiny_config, depth=1)), single)


def test_handles_are_closed_when_loading_fails(ckpt, tiny_config):
    """The traceback keeps the loader's frames alive: open safe_open handles would keep the shards mapped."""
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs /proc/self/maps")
    shard = last_shard_with_vision(ckpt)
    key = next(k for k, f in index_of(ckpt)["weight_map"].items() if f == shard and k.startswith("model.visual."))
    rewrite_shard(ckpt / shard, lambda tensors: tensors.__setitem__(key, torch.zeros(7)))
    with pytest.raises(ValueError) as info:
        load_vision_weights(GlmVisionEncoder(tiny_config), ckpt)
    with open("/proc/self/maps") as maps:
        mapped = [line for line in maps if str(ckpt) in line]
    assert mapped == [], f"{info.value} left the shards mapped"


# ---------------------------------------------------------------------------------------------------------------
# Confined: every file is a regular file inside the checkpoint
# ---------------------------------------------------------------------------------------------------------------
def escape(ckpt, tmp_path, how):
    """Move one shard out of the checkpoint and point at it by ``how``."""
    shard = last_shard_with_vision(ckpt)
    outside = tmp_path / "outside.safetensors"
    shutil.move(ckpt / shard, outside)
    if how == "symlink":
        (ckpt / shard).symlink_to(outside)
        return
    target = "../outside.safetensors" if how == "dotdot" else str(outside)
    write_index(ckpt, {k: target if f == shard else f for k, f in index_of(ckpt)["weight_map"].items()})


@pytest.mark.parametrize("how, message", [
    ("dotdot", r"'\.\./outside\.safetensors' is not a file name inside"),
    ("absolute", r"outside\.safetensors' is not a file name inside"),
    ("symlink", r"resolves to .*outside\.safetensors, outside"),
])
def test_files_outside_the_checkpoint_are_refused(ckpt, tmp_path, tiny_config, how, message):
    escape(ckpt, tmp_path, how)
    model = fresh(tiny_config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=message):
        load_vision_weights(model, ckpt)
    assert_unchanged(model, before)


def test_symlink_out_of_an_unindexed_directory_is_refused(single, tmp_path, tiny_config):
    shutil.copy(single / "model.safetensors", tmp_path / "outside.safetensors")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").symlink_to(tmp_path / "outside.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors' resolves to .*outside"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path / "ckpt")


def load_without_hanging(load, fifo):
    """Run ``load``; if it blocks opening ``fifo``, open the FIFO's other end to free it and fail the test."""
    caught: list[BaseException] = []

    def run():
        try:
            load()
        except Exception as err:  # handed to the test's thread
            caught.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        pytest.fail(f"loading blocked opening the FIFO {fifo}")
    return caught[0] if caught else None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["only_file", "given_path", "shard", "config"])
def test_fifo_is_refused_without_opening_it(single, ckpt, tmp_path, tiny_config, where):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    directory = ckpt if where == "shard" else tmp_path / "fifo"
    if where != "shard":
        directory.mkdir()
        shutil.copy(single / "config.json", directory / "config.json")
    name = {"shard": last_shard_with_vision(ckpt), "config": "config.json"}.get(where, "model.safetensors")
    if where == "config":
        shutil.copy(single / "model.safetensors", directory / "model.safetensors")
    (directory / name).unlink(missing_ok=True)
    os.mkfifo(directory / name)
    path = directory / name if where == "given_path" else directory
    err = load_without_hanging(lambda: GlmVisionEncoder.from_pretrained(path), directory / name)
    assert isinstance(err, ValueError) and f"{directory / name}: not a regular file" in str(err), repr(err)


# ---------------------------------------------------------------------------------------------------------------
# Duplicates, bad indexes, bad files
# ---------------------------------------------------------------------------------------------------------------
def test_duplicate_key_in_unindexed_directory_is_refused(single, tmp_path, tiny_config):
    """A stale extra file with an older copy of one weight must not silently win."""
    shutil.copy(single / "model.safetensors", tmp_path / "model.safetensors")
    save_file({"model.visual.merger.proj.weight": torch.zeros(64, 64)}, str(tmp_path / "stale.safetensors"))
    model = fresh(tiny_config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"stale\.safetensors: tensor 'model.visual.merger.proj.weight' is also in "
                                         r".*model\.safetensors"):
        load_vision_weights(model, tmp_path)
    assert_unchanged(model, before)


def test_duplicate_key_across_indexed_shards_is_refused(ckpt, tiny_config):
    weight_map = index_of(ckpt)["weight_map"]
    key = next(k for k in weight_map if k.startswith("model.visual."))
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[key])
    value = load_file(ckpt / weight_map[key])[key]
    rewrite_shard(ckpt / other, lambda tensors: tensors.__setitem__(key, torch.zeros_like(value)))
    with pytest.raises(ValueError, match=f"tensor '{key}' is also in"):
        load_vision_weights(fresh(tiny_config), ckpt)


def test_index_naming_a_shard_without_the_key_is_refused(ckpt, tiny_config):
    """The key moved to another listed shard: the index is stale, whichever copy is right."""
    weight_map = index_of(ckpt)["weight_map"]
    key = next(k for k in weight_map if k.startswith("model.visual."))
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[key])
    value = load_file(ckpt / weight_map[key])[key]
    rewrite_shard(ckpt / weight_map[key], lambda tensors: tensors.pop(key))
    rewrite_shard(ckpt / other, lambda tensors: tensors.__setitem__(key, value))
    model = fresh(tiny_config)
    before = snapshot(model)
    with pytest.raises(ValueError, match=f"weight_map puts '{key}' in {weight_map[key]}, which does not hold it"):
        load_vision_weights(model, ckpt)
    assert_unchanged(model, before)


@pytest.mark.parametrize("text, message", [
    ("{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"metadata": {}}', 'no "weight_map" object'),
    ('{"weight_map": []}', 'no "weight_map" object'),
    ('{"weight_map": {}}', 'no "weight_map" object'),
    ('{"weight_map": {"model.visual.x": 3}}', r"weight_map\['model.visual.x'\] is 3, not a .safetensors file name"),
    ('{"weight_map": {"a": "pytorch_model.bin"}}', r"is 'pytorch_model.bin', not a .safetensors file name"),
    ('{"weight_map": {"a": "gone.safetensors"}}', r"gone\.safetensors: no such file \(named by .*index\.json\)"),
])
def test_bad_index_is_one_line_naming_the_file(ckpt, tiny_config, text, message):
    index = ckpt / "model.safetensors.index.json"
    index.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises((ValueError, FileNotFoundError), match=message) as info:
        load_vision_weights(fresh(tiny_config), ckpt)
    assert str(index) in str(info.value) and "\n" not in str(info.value)


def test_unreadable_safetensors_is_named(tmp_path, tiny_config):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path)


def test_pickle_checkpoints_are_refused(tmp_path, tiny_config):
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only .safetensors"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        load_vision_weights(GlmVisionEncoder(tiny_config), tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere: no such checkpoint"):
        GlmVisionEncoder.from_pretrained(tmp_path / "nowhere")


def test_a_hub_model_id_says_only_local_checkpoints_are_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        GlmVisionEncoder.from_pretrained("zai-org/GLM-4.1V-9B-Thinking")
    assert str(err.value) == (
        "zai-org/GLM-4.1V-9B-Thinking: no such checkpoint file or directory (only local checkpoints are read, nothing "
        "is downloaded; fetch it with: huggingface-cli download zai-org/GLM-4.1V-9B-Thinking --local-dir DIR, then "
        "pass DIR)")
    with pytest.raises(FileNotFoundError, match=r"fetch one with: huggingface-cli download zai-org/GLM-4.1V"):
        GlmVisionEncoder.from_pretrained(tmp_path / "nowhere")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_a_config_json_that_is_no_regular_small_file_is_refused_without_reading_it(single, tmp_path, kind):
    """A FIFO would block the read, /dev/zero never ends (a link to it resolves outside the checkpoint, and is
    refused for that first), a sparse 65 MiB file is past the limit: each a one-line error, quickly."""
    shutil.copy(single / "model.safetensors", tmp_path / "model.safetensors")
    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "dev-zero":
        config.symlink_to("/dev/zero")
    else:
        with open(config, "wb") as f:
            f.truncate(65 << 20)
    message = {"fifo": "not a regular file", "dev-zero": "outside", "huge": "larger than any checkpoint JSON"}[kind]
    with pytest.raises(ValueError, match=message) as err:
        GlmVisionEncoder.from_pretrained(tmp_path)
    assert "config.json" in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------------------------------
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
    (VISION | {"hidden_size": 2**40, "num_heads": 16}, r"hidden_size 1099511627776 is implausible: at most 131,072"),
    (VISION | {"out_hidden_size": 10**400}, r"out_hidden_size \(an int of about 400 digits\) is implausible"),
    (VISION | {"intermediate_size": 2**20}, r"intermediate_size 1048576 is implausible"),
    (VISION | {"patch_size": 2**12}, r"patch_dim .* is implausible"),
    (VISION | {"image_size": 14 * 2000, "patch_size": 14}, r"pos_grid .* 2000 is implausible"),
    (VISION | {"rope_theta": float("inf")}, r"rope_theta must be positive and finite, got inf"),
    (VISION | {"hidden_act": "gelu"}, r"hidden_act='silu'"),
])
def test_non_glm4v_config_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        VisionConfig.from_hf(config)


def test_aliases_defer_to_the_canonical_name():
    assert VisionConfig.from_hf(VISION | {"num_hidden_layers": 5}).depth == 2
    assert VisionConfig.from_hf({"model_type": "glm4v_vision", "num_hidden_layers": 3, "hidden_size": 64,
                                 "num_attention_heads": 4}).depth == 3


@pytest.mark.parametrize("text, message", [
    ("{oops", r"config\.json: not valid JSON"),
    (json.dumps(LLAMA), r"config\.json: model_type 'llama' is not a GLM-4V model"),
    (json.dumps({"model_type": "glm4v", "dtype": "int8", "vision_config": VISION}),
     r"config\.json: dtype 'int8' is not a floating-point torch dtype"),
])
def test_bad_config_json_names_the_file(single, tmp_path, text, message):
    shutil.copy(single / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        GlmVisionEncoder.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and "\n" not in str(info.value)


def test_missing_config_json_is_named(single, tmp_path):
    shutil.copy(single / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"config\.json: no such file"):
        GlmVisionEncoder.from_pretrained(tmp_path / "model.safetensors")


def test_bad_dtype_argument(single):
    with pytest.raises(ValueError, match=r"dtype torch\.int64 is not a floating-point"):
        GlmVisionEncoder.from_pretrained(single, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------------
# On the GPU (run on the H200)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_from_pretrained_on_cuda_holds_the_same_tensors(sharded):
    on_cpu = GlmVisionEncoder.from_pretrained(sharded)
    on_gpu = GlmVisionEncoder.from_pretrained(sharded, device="cuda")
    assert all(t.is_cuda for t in on_gpu.state_dict().values()) and on_gpu.rotary_pos_emb.inv_freq.is_cuda
    for name, value in on_cpu.state_dict().items():
        assert torch.equal(on_gpu.state_dict()[name].cpu(), value), name
    assert torch.equal(on_gpu.rotary_pos_emb.inv_freq.cpu(), on_cpu.rotary_pos_emb.inv_freq)


@pytest.mark.gpu
def test_float32_checkpoint_to_bf16_on_cuda_never_holds_a_float32_copy(tmp_path):
    """Full-width tower (4 blocks): peak GPU memory stays below the bf16 weights plus two float32 copies of the
    largest tensor (a conversion buffer), well under the 1.30 GB a float32 copy of the weights would need."""
    config = VisionConfig(depth=4)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GlmVisionEncoder(config).state_dict().items()}
    tensors = {k: torch.zeros(s) for k, s in shapes.items()}  # values do not matter here, one checks the copy
    probe = torch.randn(shapes["merger.proj.weight"], generator=torch.Generator().manual_seed(1))
    tensors["merger.proj.weight"] = probe
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm4v_vision", "dtype": "float32",
                                                      **config.to_hf_dict()}))
    numels = [t.numel() for t in tensors.values()]
    bf16_bytes, fp32_bytes, largest_fp32 = 2 * sum(numels), 4 * sum(numels), 4 * max(numels)
    bound = bf16_bytes + 2 * largest_fp32
    assert bound < fp32_bytes
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = GlmVisionEncoder.from_pretrained(tmp_path, dtype=torch.bfloat16, device="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert model.dtype == torch.bfloat16 and model.device.type == "cuda"
    assert torch.equal(model.merger.proj.weight.cpu(), probe.to(torch.bfloat16))
    del model
    torch.cuda.empty_cache()
    assert peak <= bound, f"peak {peak / 1e9:.3f} GB > bound {bound / 1e9:.3f} GB (bf16 weights {bf16_bytes / 1e9:.3f})"
