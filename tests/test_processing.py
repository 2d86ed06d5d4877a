"""Images and videos → pixel rows, against transformers' processors and frame samplers (the oracle)."""
import importlib.util
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence
from transformers.image_transforms import convert_to_rgb
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from glmvit.oracle import flatten_video_grids, transformers_glm46v_sampler
from glmvit.processing import (
    MAX_FRAMES,
    VisionInputs,
    patchify_image,
    patchify_video,
    process_images,
    process_video,
    rows_from_frames,
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
    """The sample inputs stay under 1 MB; every file of recorded results (bench/, notebooks/) under 1 MB, data/ under
    8 MB. A serve record keeps each of its 1000 requests' times per mode (P99 and the time split are read from them):
    about 0.7 MB for two modes."""
    assert len(IMAGES) >= 3 and CLIP.is_file()
    assert all(p.stat().st_size <= 100_000 for p in IMAGES)
    assert sum(p.stat().st_size for p in [*IMAGES, CLIP]) < 1_000_000
    recorded = [p for folder in ("bench", "notebooks") for p in (DATA / folder).glob("*.json")]
    assert all(p.stat().st_size < 1_000_000 for p in recorded)
    assert sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file()) < 8_000_000


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


def _white_composite(image: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb for a PIL image with transparency (5.24): alpha-composite on white."""
    rgba = image.convert("RGBA")
    return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB"))


def _composites_on_white() -> bool:
    """Whether the installed transformers' convert_to_rgb composites transparency (5.24 does; 5.4 and 5.17 drop it)."""
    clear = Image.new("RGBA", (1, 1), (0, 0, 0, 0))
    return np.asarray(convert_to_rgb(clear)).tolist() == [[[255, 255, 255]]]


def _transparent_images() -> dict[str, Image.Image]:
    """RGBA with every alpha level, LA, and a palette image with a transparent index."""
    rng = np.random.default_rng(7)
    rgba = rng.integers(0, 256, size=(60, 90, 4), dtype=np.uint8)
    rgba[..., 3] = np.arange(90, dtype=np.uint8)[None, :] * 2
    palette = Image.fromarray(rgba[..., :3]).quantize(colors=16)
    palette.info["transparency"] = 3
    return {"RGBA": Image.fromarray(rgba), "LA": Image.fromarray(rgba[..., [0, 3]], mode="LA"), "P": palette}


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_on_white_by_path_and_as_pil(tmp_path, mode):
    """By path, transparency used to be dropped (load_image's convert("RGB")); as a PIL image, composited."""
    image = _transparent_images()[mode]
    path = tmp_path / f"{mode}.png"
    image.save(path)
    with Image.open(path) as im:
        from_file = im.copy()
    expected = process_images(_white_composite(from_file))
    by_path, as_pil = process_images(path), process_images(from_file)
    assert torch.equal(by_path.pixel_values, expected.pixel_values)
    assert torch.equal(as_pil.pixel_values, expected.pixel_values)
    if _composites_on_white():  # the oracle itself, where it composites
        oracle = Glm4vImageProcessorPil()(from_file, return_tensors="pt")["pixel_values"]
        assert torch.equal(by_path.pixel_values, oracle)


def _high_bit_images() -> dict[str, tuple[Image.Image, np.ndarray]]:
    """A 64 × 96 ramp over the whole range in each high-bit-depth mode, and its 8-bit value (rounded, not clipped)."""
    ramp = np.linspace(0, 65535, 64 * 96).round().reshape(64, 96)
    expected = np.rint(ramp / 257).astype(np.uint8)
    return {
        "I;16": (Image.fromarray(ramp.astype(np.uint16)), expected),
        "I;16B": (Image.frombytes("I;16B", (96, 64), ramp.astype(">u2").tobytes()), expected),
        "I": (Image.fromarray(ramp.astype(np.int32)), expected),
        "F": (Image.fromarray((ramp / 65535).astype(np.float32)), np.rint(ramp / 65535 * 255).astype(np.uint8)),
    }


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I", "F"])
def test_high_bit_depth_images_are_scaled_not_clipped(tmp_path, mode):
    """PIL's convert("RGB") clips I;16 and I at 255 (99.6 % white here) and F at 0..1 to black."""
    image, expected = _high_bit_images()[mode]
    rgb = np.repeat(expected[..., None], 3, axis=2)
    reference = process_images(rgb).pixel_values
    assert torch.equal(process_images(image).pixel_values, reference)
    path = tmp_path / ("ramp.png" if mode == "I;16" else "ramp.tiff")
    image.save(path)
    with Image.open(path) as im:
        assert im.mode == mode
    assert torch.equal(process_images(path).pixel_values, reference)


def test_a_16_bit_transparency_key_becomes_white(tmp_path):
    image, expected = _high_bit_images()["I;16"]
    key = int(np.asarray(image)[10, 10])
    path = tmp_path / "keyed.png"
    image.save(path, transparency=key)
    rgb = np.repeat(expected[..., None], 3, axis=2)
    rgb[np.asarray(image) == key] = 255
    assert torch.equal(process_images(path).pixel_values, process_images(rgb).pixel_values)


@pytest.mark.parametrize("values", [[-1, 5], [0, 70000]], ids=["negative", "over-16-bit"])
def test_high_bit_values_outside_their_range_are_an_error(values):
    image = Image.fromarray(np.array([values] * 28, dtype=np.int32))
    with pytest.raises(ValueError, match=r"image 0: mode I values span .* outside 0\.\.65535"):
        process_images(image)
    floats = Image.fromarray(np.array([[0.5, 1.5]] * 28, dtype=np.float32))
    with pytest.raises(ValueError, match=r"image 1: mode F values span .* outside 0\.\.1"):
        process_images([IMAGES[0], floats])


def test_min_pixels_above_max_pixels_is_an_error():
    """It used to be accepted, producing an image above max_pixels (here 280 × 392 for max_pixels 40,000)."""
    for call in (lambda: process_images(IMAGES[0], min_pixels=50_000, max_pixels=40_000),
                 lambda: process_video(np.zeros((2, 56, 56, 3), np.uint8), video_fps=2, min_pixels=50_000,
                                       max_pixels=40_000)):
        with pytest.raises(ValueError, match="min_pixels=50000, max_pixels=40000"):
            call()


def test_more_sampled_frames_than_max_pixels_can_hold_is_an_error():
    """Each frame keeps one 28 × 28 token at least: 200 frames need 156,800 pixels; the output used to exceed
    max_pixels (78,400) by that much, and with a requested fps far above 2 it grows without bound."""
    frames = np.zeros((200, 28, 28, 3), np.uint8)
    with pytest.raises(ValueError, match="200 sampled frames need at least 200·28·28 = 156,800 pixels"):
        process_video(frames, fps=30, video_fps=30, max_pixels=28 * 28 * 100)
    assert process_video(frames, fps=30, video_fps=30, max_pixels=28 * 28 * 200).grid_thw.tolist() == [[100, 2, 2]]


# --- patchify ------------------------------------------------------------------------------------------------------


def test_patchify_image_equals_the_processor():
    image = torch.randn(3, 56, 84, generator=torch.Generator().manual_seed(0))
    expected = Glm4vImageProcessorPil()(
        image.numpy(), do_resize=False, do_rescale=False, do_normalize=False,
        input_data_format="channels_first", return_tensors="pt",
    )
    assert expected["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert torch.equal(patchify_image(image), expected["pixel_values"])


def _normalised(frames):
    """The processor's float arithmetic on (F, H, W, 3) uint8: × 1/255 in float64 → float32, then (x − mean) / std
    in float32; (F, 3, H, W)."""
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    scaled = (frames.astype(np.float64) * (1 / 255)).astype(np.float32)
    normed = (scaled - np.array(OPENAI_CLIP_MEAN, np.float32)) / np.array(OPENAI_CLIP_STD, np.float32)
    return torch.from_numpy(np.ascontiguousarray(normed.transpose(0, 3, 1, 2)))


# (frames, height, width): grids with odd merged sides (3 × 5, 5 × 1, 1 × 1), a single pair, longer clips
@pytest.mark.parametrize("shape", [(1, 84, 140), (1, 140, 28), (1, 28, 28), (2, 28, 28), (4, 56, 84), (6, 140, 28)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_from_frames_equal_the_float_path(shape, dtype):
    """The uint8 frames' rows (a lookup, then patchify) are bitwise the processor's float arithmetic patchified,
    cast to dtype after: for a video, and for each frame as an image (oracle for images: the processor itself)."""
    f, h, w = shape
    frames = np.random.default_rng(list(shape)).integers(0, 256, (f, h, w, 3), dtype=np.uint8)
    floats = _normalised(frames)
    for k in range(f):
        got = rows_from_frames(torch.from_numpy(frames[k : k + 1]), "image", dtype)
        assert got.dtype == dtype and torch.equal(got, patchify_image(floats[k]).to(dtype))
    if f == 1:
        oracle = Glm4vImageProcessorPil()(frames[0], do_resize=False, return_tensors="pt")["pixel_values"]
        assert torch.equal(rows_from_frames(torch.from_numpy(frames), "image"), oracle)
    else:
        got = rows_from_frames(torch.from_numpy(frames), "video", dtype)
        assert got.dtype == dtype and torch.equal(got, patchify_video(floats).to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_from_frames_on_cuda_equal_the_float_path(dtype):
    """The server makes rows on the model's device: there too each value is only moved and looked up, so the rows
    are bitwise the CPU float arithmetic's, cast after (no rounding happens on the device)."""
    frames = np.random.default_rng(7).integers(0, 256, (4, 56, 84, 3), dtype=np.uint8)
    floats = _normalised(frames)
    got = rows_from_frames(torch.from_numpy(frames).cuda(), "video", dtype)
    assert got.device.type == "cuda" and torch.equal(got.cpu(), patchify_video(floats).to(dtype))
    image = rows_from_frames(torch.from_numpy(frames[:1]).cuda(), "image", dtype)
    assert torch.equal(image.cpu(), patchify_image(floats[0]).to(dtype))


def test_rows_from_frames_rejects_what_is_not_uint8_frames():
    with pytest.raises(ValueError, match=r"frames must be \(F, H, W, 3\) uint8, got float32"):
        rows_from_frames(torch.zeros(1, 28, 28, 3), "image")
    with pytest.raises(ValueError, match="an image is one frame, got 2"):
        rows_from_frames(torch.zeros(2, 28, 28, 3, dtype=torch.uint8), "image")
    with pytest.raises(ValueError, match="kind must be one of"):
        rows_from_frames(torch.zeros(2, 28, 28, 3, dtype=torch.uint8), "clip")


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





def _glm41v_expected(metadata, fps):
    """transformers' GLM-4.1V indices. 5.4 samples no frame when duration · fps < 1 (and then fails downstream);
    later versions sample frame 0, as glmvit does: that case is checked as [0, 0]."""
    expected = Glm4vVideoProcessor().sample_frames(metadata, fps=fps).tolist()
    return expected or [0, 0]


@pytest.mark.parametrize("total_frames,video_fps", SAMPLING_CASES)
@pytest.mark.parametrize("fps", [2, 1, 0.5])
def test_glm41v_sampling_equals_transformers(total_frames, video_fps, fps):
    expected = _glm41v_expected(_metadata(total_frames, video_fps), fps)
    assert sample_frame_indices_glm41v(total_frames, video_fps, fps) == expected


@pytest.mark.parametrize("total_frames,video_fps", SAMPLING_CASES)
def test_glm46v_sampling_equals_transformers(total_frames, video_fps):
    expected = transformers_glm46v_sampler()(_metadata(total_frames, video_fps)).tolist()
    assert sample_frame_indices_glm46v(total_frames, video_fps) == expected


# durations that are not frames / fps: a container's own, or the caller's (< and > 30 s, 300 s and 2400 s edges)
DURATION_CASES = [(20, 10, 2.5), (20, 10, 1.0), (75, 29.97, 2.5025), (900, 30, 31.0), (901, 30, 29.0),
                  (9000, 30, 301.0), (9030, 30, 299.5), (700, 2, 2401.0), (36000, 30, 1199.0)]


@pytest.mark.parametrize("total_frames,video_fps,duration", DURATION_CASES)
def test_sampling_with_a_given_duration_equals_transformers(total_frames, video_fps, duration):
    metadata = VideoMetadata(total_num_frames=total_frames, fps=video_fps, duration=duration)
    for fps in (2, 1, 0.5):
        expected = _glm41v_expected(metadata, fps)
        assert sample_frame_indices_glm41v(total_frames, video_fps, fps, duration=duration) == expected
    expected = transformers_glm46v_sampler()(metadata).tolist()
    assert sample_frame_indices_glm46v(total_frames, video_fps, duration=duration) == expected


@pytest.mark.timeout(20)
def test_sampling_work_stays_within_the_frame_count():
    """fps far above video_fps used to walk floor(duration · fps) samples (here 10^16) before de-duplicating."""
    assert sample_frame_indices_glm41v(10, 1.0, fps=1e15) == list(range(10))
    assert sample_frame_indices_glm41v(10, 1e12, fps=1e12, duration=300) == list(range(10))
    assert sample_frame_indices_glm41v(7, 2.0, fps=3.0) == Glm4vVideoProcessor().sample_frames(
        _metadata(7, 2.0), fps=3.0).tolist()  # the step-by-step branch: 2/3 of a frame per sample
    assert len(sample_frame_indices_glm46v(MAX_FRAMES, 1e-3)) == 640  # 2**24 frames: a linspace, quickly
    with pytest.raises(ValueError, match="at most"):
        sample_frame_indices_glm46v(MAX_FRAMES + 1, 30)


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
    for bad in (0, -1, math.nan, math.inf):
        with pytest.raises(ValueError, match="video_fps must be positive and finite"):
            sampler(10, bad)
        with pytest.raises(ValueError, match="duration must be positive and finite"):
            sampler(10, 30, duration=bad)
    with pytest.raises(TypeError):
        sampler(10.5, 30)


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
    with pytest.raises(ValueError, match="image 0: aspect ratio"):
        process_images(np.zeros((28, 6000, 3), np.uint8))


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".gif", ".webp"])
def test_empty_and_truncated_image_files_name_the_file(tmp_path, suffix):
    """Truncated files used to raise PIL's own OSError ("image file is truncated") without saying which."""
    with Image.open(IMAGES[0]) as im:
        im.save(tmp_path / f"whole{suffix}")
    data = (tmp_path / f"whole{suffix}").read_bytes()
    for name, content in (("empty", b""), ("truncated", data[: len(data) // 2])):
        path = tmp_path / f"{name}{suffix}"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"image 1: cannot decode .*{name}{suffix}") as err:
            process_images([IMAGES[1], path])
        assert "\n" not in str(err.value)


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
    with pytest.raises(ValueError, match="cannot decode" if importlib.util.find_spec("av") else "pip install av"):
        process_video(text)


# --- bounded memory ------------------------------------------------------------------------------------------------


def png_claiming(width: int, height: int) -> bytes:
    """A 60-byte PNG whose header states width × height RGB pixels (and whose image data is empty): what a reader
    must refuse from the header, as a real 140 KB PNG of 12000² pixels would cost 2.7 GB to decode."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.timeout(30)
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_picture_above_max_frame_pixels_is_refused_before_decoding(tmp_path):
    path = tmp_path / "huge.png"
    path.write_bytes(png_claiming(12000, 12000))
    with Image.open(path) as im:
        assert im.size == (12000, 12000)  # PIL reads the header (its own bomb limit warns only, at 144 M pixels)
    with pytest.raises(ValueError, match=rf"image 1 \({path}\): 12000×12000 is 144,000,000 pixels, more than "
                                         r"max_frame_pixels=67,108,864") as err:
        process_images([IMAGES[0], path])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"image 0: 60×40 is 2,400 pixels, more than max_frame_pixels=2,000"):
        process_images(np.zeros((40, 60, 3), np.uint8), max_frame_pixels=2000)
    with pytest.raises(ValueError, match=r"image 0: 60×40 is 2,400 pixels"):
        process_images(Image.new("RGB", (60, 40)), max_frame_pixels=2000)
    with pytest.raises(ValueError, match=r"video \(array\): 60×40 is 2,400 pixels"):
        process_video(np.zeros((2, 40, 60, 3), np.uint8), video_fps=2, max_frame_pixels=2000)
    assert len(process_images(np.zeros((40, 60, 3), np.uint8), max_frame_pixels=2400)) == 1  # the bound is inclusive


MEMORY_SCRIPT = """
import sys
from glmvit.processing import process_images

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

path, count = sys.argv[1], int(sys.argv[2])
process_images([path], max_pixels=28 * 28 * 2 * 64)  # warm up: imports, allocator pools, one picture's peak
one = peak_kib()
out = process_images([path] * count, max_pixels=28 * 28 * 2 * 64)
print(one, peak_kib(), out.grid_thw.shape[0])
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_many_images_are_decoded_one_at_a_time(tmp_path):
    """Eight 3000 × 3000 PNGs of 30 KB each: decoded all at once they held 8 × 63 MB (RGB array and PIL copy).
    One at a time, the peak after the first can exceed the warm-up's by at most one picture's working set (its RGB
    array and its PIL copy, released in an order the allocator decides) plus the outputs (64 tokens an image: 1.2 MB
    of pixel rows each); decoding all eight together would add at least seven pictures (7 × 27 MB), three times
    that bound."""
    path = tmp_path / "flat.png"
    Image.new("RGB", (3000, 3000), (30, 140, 200)).save(path)
    assert path.stat().st_size < 100_000
    run = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path), "8"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert run.returncode == 0, run.stderr
    one, eight, items = (int(v) for v in run.stdout.split())
    picture_kib, output_kib = 3000 * 3000 * 3 // 1024, 256 * 1176 * 4 // 1024
    assert items == 8 and eight - one < 2 * picture_kib + 8 * output_kib < 7 * picture_kib, run.stdout
