"""Images and videos → pixel rows, against transformers' processors and frame samplers (the oracle)."""
import ast
import math
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageSequence
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from glmvit.oracle import flatten_video_grids
from glmvit.processing import (
    VisionInputs,
    patchify_image,
    patchify_video,
    process_images,
    process_video,
    sample_frame_indices_glm41v,
    sample_frame_indices_glm46v,
)

DATA = Path(__file__).resolve().parents[1] / "data"
IMAGES = sorted((DATA / "images").glob("*.jpg"))
CLIP = DATA / "clip.gif"

# (total_frames, video_fps): short, odd counts, fewer frames than wanted, 30 s / 300 s edges, > 300 s, > 2400 s
SAMPLING_CASES = [
    (1, 30), (3, 30), (5, 0.5), (7, 2), (10, 1), (20, 10), (24, 10), (75, 29.97), (100, 24), (900, 30), (901, 30),
    (9000, 30), (9030, 30), (600, 1), (700, 2), (36000, 30), (80000, 25),
]


def test_sample_data_is_present_and_small():
    assert len(IMAGES) >= 3 and CLIP.is_file()
    assert all(p.stat().st_size <= 100_000 for p in IMAGES)
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 2_000_000


# --- images --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_pixels", [9_633_792, 28 * 28 * 2 * 64], ids=["default", "small"])
def test_images_equal_the_transformers_processor(max_pixels):
    ours = process_images(IMAGES, max_pixels=max_pixels)
    processor = Glm4vImageProcessorPil(size={"shortest_edge": 12544, "longest_edge": max_pixels})
    expected = processor([str(p) for p in IMAGES], return_tensors="pt")
    assert ours.pixel_values.dtype == torch.float32 and ours.grid_thw.dtype == torch.long
    assert torch.equal(ours.pixel_values, expected["pixel_values"])
    assert torch.equal(ours.grid_thw, expected["image_grid_thw"].long())
    assert ours.kinds == ["image"] * len(IMAGES) and ours.timestamps == [None] * len(IMAGES)
    assert ours.sources == [str(p) for p in IMAGES]


def test_image_inputs_as_path_pil_or_array_agree():
    path = IMAGES[0]
    with Image.open(path) as im:
        pil = im.convert("RGB")
    batch = process_images([path, pil, np.asarray(pil)])
    first, second, third = batch.split()
    assert torch.equal(first, second) and torch.equal(first, third)
    assert torch.equal(process_images(str(path)).pixel_values, first)


# --- patchify ------------------------------------------------------------------------------------------------------


def test_patchify_image_equals_the_processor():
    image = torch.randn(3, 56, 84, generator=torch.Generator().manual_seed(0))
    expected = Glm4vImageProcessorPil()(
        image.numpy(), do_resize=False, do_rescale=False, do_normalize=False,
        input_data_format="channels_first", return_tensors="pt",
    )
    assert expected["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.equal(patchify_image(image), expected["pixel_values"])


def test_patchify_video_follows_the_index_formula():
    """Row ti·gh·gw + ((bh·gw/2 + bw)·2 + mh)·2 + mw, column ((c·2 + t)·14 + py)·14 + px (§11)."""
    video = torch.randn(4, 3, 56, 28, generator=torch.Generator().manual_seed(1))
    rows = patchify_video(video)
    gh, gw = 4, 2
    assert rows.shape == (2 * gh * gw, 1176)
    for ti in range(2):
        for bh in range(gh // 2):
            for bw in range(gw // 2):
                for mh in range(2):
                    for mw in range(2):
                        row = ti * gh * gw + ((bh * (gw // 2) + bw) * 2 + mh) * 2 + mw
                        y, x = (2 * bh + mh) * 14, (2 * bw + mw) * 14
                        patch = video[2 * ti : 2 * ti + 2, :, y : y + 14, x : x + 14]  # (T, C, 14, 14)
                        assert torch.equal(rows[row], patch.transpose(0, 1).reshape(-1))


def test_two_equal_frames_patchify_like_the_image():
    image = torch.randn(3, 28, 84, generator=torch.Generator().manual_seed(2))
    assert torch.equal(patchify_video(torch.stack([image, image])), patchify_image(image))


def test_patchify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="even number of frames"):
        patchify_video(torch.zeros(3, 3, 28, 28))
    with pytest.raises(ValueError, match="multiples of 28"):
        patchify_image(torch.zeros(3, 28, 42))


# --- frame sampling ------------------------------------------------------------------------------------------------


def _metadata(total_frames, video_fps):
    """What transformers' decoders report: duration = frames / fps."""
    return VideoMetadata(total_num_frames=total_frames, fps=video_fps, duration=total_frames / video_fps)


def _transformers_glm46v_sampler():
    """``Glm46VVideoProcessor.sample_frames`` compiled from the installed source: its module needs torchvision."""
    path = Path(transformers.__file__).parent / "models" / "glm46v" / "video_processing_glm46v.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Glm46VVideoProcessor")
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames")
    namespace = {"math": math, "np": np, "VideoMetadata": VideoMetadata}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), namespace)
    return partial(namespace["sample_frames"], SimpleNamespace(temporal_patch_size=2))


@pytest.mark.parametrize("total_frames,video_fps", SAMPLING_CASES)
@pytest.mark.parametrize("fps", [2, 1, 0.5])
def test_glm41v_sampling_equals_transformers(total_frames, video_fps, fps):
    expected = Glm4vVideoProcessor().sample_frames(_metadata(total_frames, video_fps), fps=fps).tolist()
    assert sample_frame_indices_glm41v(total_frames, video_fps, fps) == expected


@pytest.mark.parametrize("total_frames,video_fps", SAMPLING_CASES)
def test_glm46v_sampling_equals_transformers(total_frames, video_fps):
    expected = _transformers_glm46v_sampler()(_metadata(total_frames, video_fps)).tolist()
    assert sample_frame_indices_glm46v(total_frames, video_fps) == expected


def test_sampling_hand_worked_cases():
    assert sample_frame_indices_glm41v(20, 10) == [0, 5, 10, 15]  # 2 s at 2 fps
    assert sample_frame_indices_glm41v(7, 2) == [0, 1, 2, 3, 4, 5, 6, 6]  # odd count: last repeated
    assert sample_frame_indices_glm41v(3, 30) == [0, 0]  # 0.1 s: at least one frame, made even
    assert sample_frame_indices_glm41v(10, 1) == list(range(10))  # ceil(i/2) de-duplicated
    assert sample_frame_indices_glm41v(600, 1) == list(range(600))  # 600 s > 300 s but 600 samples cover all
    long = sample_frame_indices_glm41v(9030, 30)  # 301 s: linspace over 600 samples
    assert (len(long), long[:2], long[-1]) == (600, [0, 16], 9029)
    # 2 s at 3 fps: steps of 1/6 s pick 12 frames = extract_t
    assert sample_frame_indices_glm46v(20, 10) == [0, 2, 4, 5, 7, 9, 10, 12, 14, 15, 17, 19]
    # 2.4 s: the walk stops at int(2.4) = 2 s with 12 < 14 frames, so linspace(0, 19, 14) instead
    assert sample_frame_indices_glm46v(24, 10) == [0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 16, 17, 19]
    assert sample_frame_indices_glm46v(5, 0.5) == [0, 1, 2, 3, 4, 4]  # fewer frames than extract_t = 60
    assert sample_frame_indices_glm46v(80000, 25) == np.linspace(0, 79999, 640, dtype=int).tolist()  # capped
    assert sample_frame_indices_glm46v(1, 30) == []  # extract_t = int(1/30 · 6) = 0


@pytest.mark.parametrize("sampler", [sample_frame_indices_glm41v, sample_frame_indices_glm46v])
def test_sampling_rejects_bad_metadata(sampler):
    with pytest.raises(ValueError, match="at least one frame"):
        sampler(0, 30)
    with pytest.raises(ValueError, match="video_fps must be positive"):
        sampler(10, 0)


# --- videos --------------------------------------------------------------------------------------------------------


def _clip_frames() -> np.ndarray:
    with Image.open(CLIP) as im:
        return np.stack([np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(im)])


@pytest.mark.parametrize("rule", ["glm41v", "glm46v"])
def test_process_video_on_the_clip(rule):
    frames = _clip_frames()
    assert frames.shape == (20, 160, 240, 3)
    video = process_video(CLIP, rule=rule)
    sampler = sample_frame_indices_glm41v if rule == "glm41v" else sample_frame_indices_glm46v
    indices = sampler(20, 10.0)
    assert len(indices) % 2 == 0
    t, gh, gw = video.grid_thw.tolist()[0]
    assert (t, gh, gw) == (len(indices) // 2, 12, 18)  # smart_resize(F, 160, 240) = 168 × 252
    assert video.pixel_values.shape == (t * gh * gw, 1176)
    assert video.kinds == ["video"] and video.sources == [str(CLIP)]
    stamps = video.timestamps[0]
    assert stamps == [i / 10.0 for i in indices[::2]]
    assert all(a < b for a, b in zip(stamps, stamps[1:], strict=False))


@pytest.mark.parametrize("rule", ["glm41v", "glm46v"])
def test_array_input_equals_file_input(rule):
    from_file = process_video(CLIP, rule=rule)
    from_array = process_video(_clip_frames(), rule=rule, video_fps=10)
    assert torch.equal(from_file.pixel_values, from_array.pixel_values)
    assert torch.equal(from_file.grid_thw, from_array.grid_thw)
    assert from_file.timestamps == from_array.timestamps


@pytest.mark.parametrize("copies", [2, 3])
def test_still_video_equals_the_image_processor(copies):
    """Frames of one photo (video_fps 1: 2 or 3 frames sampled, made even) give the image's rows per patch."""
    with Image.open(IMAGES[-1]) as im:
        frame = np.asarray(im.convert("RGB"))
    video = process_video(np.stack([frame] * copies), video_fps=1, max_pixels=9_633_792)
    image = process_images(IMAGES[-1])
    t = (copies + 1) // 2
    assert video.grid_thw.tolist() == [[t, *image.grid_thw[0, 1:].tolist()]]
    assert torch.equal(video.pixel_values, image.pixel_values.repeat(t, 1))
    assert video.timestamps == [[float(2 * k) for k in range(t)]]


def test_concat_and_split():
    images = process_images(IMAGES[:2], max_pixels=28 * 28 * 2 * 16)
    video = process_video(CLIP, max_pixels=28 * 28 * 4 * 16)
    batch = VisionInputs.concat([images, video])
    assert len(batch) == 3 and batch.kinds == ["image", "image", "video"]
    assert batch.item_rows() == images.item_rows() + video.item_rows()
    parts = batch.split()
    assert all(torch.equal(a, b) for a, b in zip(parts, images.split() + video.split(), strict=False))
    assert batch.timestamps == [None, None, video.timestamps[0]]
    with pytest.raises(ValueError, match="rows"):
        VisionInputs(images.pixel_values[:-1], images.grid_thw, images.kinds, images.timestamps)
    with pytest.raises(ValueError, match="timestamp"):
        VisionInputs(video.pixel_values, video.grid_thw, ["video"], [[0.0]])


def test_video_rows_through_the_encoder_equal_transformers(tiny_hf, tiny_model):
    """Our encoder takes the [t, h, w] grid; transformers' tower needs it flattened to t × [1, h, w]."""
    video = process_video(CLIP, max_pixels=80_000)
    assert video.grid_thw.tolist() == [[2, 8, 12]]
    batch = VisionInputs.concat([process_images(IMAGES[0], max_pixels=28 * 28 * 2 * 16), video])
    with torch.no_grad():
        expected = tiny_hf(batch.pixel_values, flatten_video_grids(batch.grid_thw)).pooler_output
        got = tiny_model(batch.pixel_values, batch.grid_thw)
    assert got.shape == expected.shape == (sum(batch.item_rows()) // 4, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# --- bad inputs ----------------------------------------------------------------------------------------------------


def test_bad_image_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="image 0: no such file"):
        process_images(tmp_path / "missing.jpg")
    with pytest.raises(ValueError, match="image 1: arrays must be HWC uint8"):
        process_images([IMAGES[0], np.zeros((28, 28), np.uint8)])
    with pytest.raises(ValueError, match="image 0: arrays must be HWC uint8"):
        process_images([np.zeros((28, 28, 3), np.float32)])
    with pytest.raises(TypeError, match="image 0: expected a path"):
        process_images([42])
    text = tmp_path / "notes.txt"
    text.write_text("not an image")
    with pytest.raises(ValueError, match="image 0: cannot decode"):
        process_images(text)


def test_bad_video_inputs(tmp_path):
    frames = np.zeros((4, 28, 28, 3), np.uint8)
    with pytest.raises(FileNotFoundError, match="no such file"):
        process_video(tmp_path / "missing.gif")
    with pytest.raises(ValueError, match=r"\(F, H, W, 3\) uint8"):
        process_video(np.zeros((4, 28, 28), np.uint8), video_fps=2)
    with pytest.raises(ValueError, match=r"\(F, H, W, 3\) uint8"):
        process_video(frames.astype(np.float32), video_fps=2)
    with pytest.raises(ValueError, match="needs video_fps"):
        process_video(frames)
    with pytest.raises(TypeError, match="expected a path"):
        process_video([frames])
    with pytest.raises(ValueError, match="rule must be one of"):
        process_video(frames, video_fps=2, rule="glm5")
    with pytest.raises(ValueError, match="leave fps as None"):
        process_video(frames, video_fps=2, rule="glm46v", fps=2)
    with pytest.raises(ValueError, match="too short"):
        process_video(frames[:1], video_fps=30, rule="glm46v")
    text = tmp_path / "clip.txt"
    text.write_text("not a video")
    with pytest.raises(ValueError, match="cannot decode"):
        process_video(text)
