"""Video clips end to end on CPU: frames → temporal patches → encoder, against transformers' full
``Glm4vModel.get_video_features`` (the oracle), and video through the graph runner (emulate backend)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from glmvit import VisionConfig
from glmvit.graphs import EncoderGraphRunner
from glmvit.metadata import BatchShape
from glmvit.oracle import encoder_like
from glmvit.packing import BudgetConfig
from glmvit.processing import VisionInputs, patchify_video, process_images, process_video
from glmvit.random_weights import randomize_

CLIP = Path(__file__).resolve().parent.parent / "data" / "clip.gif"

HEIGHT, WIDTH = 56, 84  # → a 4 × 6 patch grid: 6 output tokens per temporal patch
VIDEO_FPS = 2.0  # with the GLM-4.1V rule at fps = 2, every frame is sampled: the frame count is ours to choose
SMALL = dict(min_pixels=28 * 28, max_pixels=28 * 28 * 2 * 1000)  # keep 56 × 84 as it is


def frames(count, seed=0):
    """(count, 56, 84, 3) uint8 random frames."""
    return np.random.default_rng(seed).integers(0, 256, size=(count, HEIGHT, WIDTH, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def glm4v():
    """A tiny random ``Glm4vModel`` (vision tower = VisionConfig.tiny(), a 1-layer text model), fp32, eval."""
    from transformers import Glm4vConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vModel

    text = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=100, max_position_embeddings=512)
    config = Glm4vConfig(vision_config=VisionConfig.tiny().to_hf_dict(), text_config=text)
    config.vision_config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Glm4vModel(config).eval()
    randomize_(model.visual, seed=3)
    return model


@pytest.fixture(scope="module")
def encoder(glm4v):
    return encoder_like(glm4v.visual, VisionConfig.tiny())


def video_features(glm4v, pixel_values, grid_thw) -> torch.Tensor:
    """transformers' per-video features, concatenated (5.x returns an output whose pooler_output is a tuple)."""
    with torch.no_grad():
        out = glm4v.get_video_features(pixel_values_videos=pixel_values, video_grid_thw=grid_thw)
    feats = getattr(out, "pooler_output", out)
    if isinstance(feats, (tuple, list)):
        feats = torch.cat(list(feats))
    return feats


@pytest.mark.parametrize("count,pairs", [(2, 1), (3, 2), (8, 4), (17, 9)])
def test_even_frame_rule(count, pairs):
    """An odd frame count repeats the last frame: 3 → 4 and 17 → 18 frames, i.e. ceil(F / 2) temporal patches."""
    clip = frames(count, seed=count)
    video = process_video(clip, video_fps=VIDEO_FPS, **SMALL)
    assert video.grid_thw.tolist() == [[pairs, HEIGHT // 14, WIDTH // 14]]
    # the same rows from the frames themselves, with the last frame repeated when the count is odd
    padded = np.concatenate([clip, clip[-1:]]) if count % 2 else clip
    assert len(padded) == 2 * pairs
    reference = process_video(padded, video_fps=VIDEO_FPS, **SMALL)
    assert torch.equal(video.pixel_values, reference.pixel_values)
    # the last temporal patch of an odd clip holds the same frame twice: its two temporal slots are equal
    if count % 2:
        last = video.pixel_values[-(HEIGHT // 14) * (WIDTH // 14):].view(-1, 3, 2, 14 * 14)
        assert torch.equal(last[:, :, 0], last[:, :, 1])


def test_patchify_video_of_normalised_frames_matches_process_video():
    """process_video = sample → resize (a no-op here) → normalise → patchify_video over frame pairs."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    clip = frames(4, seed=11)
    scaled = (clip.astype(np.float64) * (1 / 255)).astype(np.float32)
    normalised = (scaled - np.array(OPENAI_CLIP_MEAN, np.float32)) / np.array(OPENAI_CLIP_STD, np.float32)
    rows = patchify_video(torch.from_numpy(normalised.transpose(0, 3, 1, 2).copy()))
    assert torch.equal(rows, process_video(clip, video_fps=VIDEO_FPS, **SMALL).pixel_values)


@pytest.mark.parametrize("count", [2, 3, 8, 17])
def test_clip_equals_get_video_features(glm4v, encoder, count):
    video = process_video(frames(count, seed=count), video_fps=VIDEO_FPS, **SMALL)
    expected = video_features(glm4v, video.pixel_values, video.grid_thw)
    with torch.no_grad():
        got = encoder(video.pixel_values, video.grid_thw)
    assert got.shape == expected.shape == (video.grid_thw.prod().item() // 4, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_several_clips_in_one_call_equal_get_video_features(glm4v, encoder):
    clips = [process_video(frames(n, seed=20 + n), video_fps=VIDEO_FPS, **SMALL) for n in (2, 3, 8, 17)]
    batch = VisionInputs.concat(clips)
    expected = video_features(glm4v, batch.pixel_values, batch.grid_thw)
    with torch.no_grad():
        got = encoder(batch.pixel_values, batch.grid_thw)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_sample_clip_equals_get_video_features(glm4v, encoder):
    """data/clip.gif (20 frames at 10 fps → 4 frames at 2 fps → 2 temporal patches), small max_pixels."""
    video = process_video(CLIP, max_pixels=28 * 28 * 2 * 24)
    expected = video_features(glm4v, video.pixel_values, video.grid_thw)
    with torch.no_grad():
        got = encoder(video.pixel_values, video.grid_thw)
    assert video.grid_thw[0, 0].item() >= 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- video through the runner (emulate) ---------------------------------------------------------------------------
CONFIG = BudgetConfig(token_budgets=(8, 32, 64), max_items=4, max_segments=12)


def mixed_batch():
    """Two images and three clips (2, 3 and 8 frames), interleaved."""
    rng = np.random.default_rng(5)
    images = [rng.integers(0, 256, size=(56, 56, 3), dtype=np.uint8),
              rng.integers(0, 256, size=(84, 56, 3), dtype=np.uint8)]
    parts = [process_images([images[0]], min_pixels=28 * 28, max_pixels=56 * 56 * 2),
             process_video(frames(2, seed=31), video_fps=VIDEO_FPS, **SMALL),
             process_images([images[1]], min_pixels=28 * 28, max_pixels=84 * 56 * 2),
             process_video(frames(3, seed=32), video_fps=VIDEO_FPS, **SMALL),
             process_video(frames(8, seed=33), video_fps=VIDEO_FPS, **SMALL)]
    return VisionInputs.concat(parts)


def per_item_eager(encoder, batch):
    with torch.no_grad():
        return [encoder(rows, grid[None]) for rows, grid in zip(batch.split(), batch.grid_thw, strict=False)]


def test_mixed_images_and_videos_through_the_runner(encoder):
    batch = mixed_batch()
    assert batch.kinds == ["image", "video", "image", "video", "video"]
    runner = EncoderGraphRunner(encoder, CONFIG, mode="emulate", check_pointers=True, progress=False).capture()
    outs = runner.run(batch.pixel_values, batch.grid_thw)
    for out, expected in zip(outs, per_item_eager(encoder, batch), strict=True):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert runner.stats.fallback_items == 0 and runner.stats.replays >= 1


def test_clip_over_the_frame_limit_falls_back(encoder):
    """A clip with more temporal patches than max_segments runs eagerly alone; the rest of the batch still replays."""
    config = BudgetConfig(token_budgets=(8, 32, 64), max_items=4, max_segments=6)
    batch = VisionInputs.concat([mixed_batch(), process_video(frames(17, seed=40), video_fps=VIDEO_FPS, **SMALL)])
    assert batch.grid_thw[-1, 0].item() == 9 > config.max_segments  # 9 temporal patches, only 54 tokens
    runner = EncoderGraphRunner(encoder, config, mode="emulate", progress=False).capture()
    outs = runner.run(batch.pixel_values, batch.grid_thw)
    for out, expected in zip(outs, per_item_eager(encoder, batch), strict=True):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert runner.stats.fallback_items == 1 and runner.stats.eager_batches == 1 and runner.stats.replays >= 1


@pytest.mark.parametrize("max_segments", [4, 12, 64])  # 64: the largest budget; smaller ones cap their own slots
def test_frame_capacity_sizing_is_reported_and_bounded(encoder, max_segments):
    """segments = min(max_segments, budget) (a token per segment at least); buffer bytes follow the packed layout."""
    cfg = encoder.config
    config = BudgetConfig(token_budgets=(8, 32, 64), max_items=4, max_segments=max_segments)
    runner = EncoderGraphRunner(encoder, config, mode="emulate", progress=False).capture()
    assert set(runner.captures) == set(config.token_budgets)
    for budget, info in runner.captures.items():
        rows = budget * cfg.merge_area
        segments = min(max_segments, budget)
        assert info.segments == segments and info.rows == rows
        packed = BatchShape(rows, segments, rows).packed_size(cfg.merge_area)
        cu_slots = -(-(segments + 2) // 4) * 4  # segments + 2, rounded up to 16-byte aligned sections
        assert packed == cu_slots + 5 * rows + rows // cfg.merge_area
        expected = (rows * cfg.patch_dim + budget * cfg.out_hidden_size) * 4 + packed * 4  # fp32 + int32
        assert info.buffer_bytes == expected
        static = (rows * cfg.patch_dim + budget * cfg.out_hidden_size) * 4
        assert info.buffer_bytes <= static + (budget + 5 + 6 * rows) * 4
        assert runner.graphs[budget].meta.cu_seqlens.numel() == cu_slots
