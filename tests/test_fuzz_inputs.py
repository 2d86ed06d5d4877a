"""Bad and odd inputs to processing, generated (hypothesis): sizes, modes, frame counts, frame rates, durations,
broken files.

Every property has the same shape: a valid result whose geometry follows the resize rule, or one ValueError (or
FileNotFoundError) naming the input, on one line: never another exception, never a hang. Frame sampling is
checked against transformers' own samplers, the oracle.
"""
import math
import tempfile
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from glmvit.geometry import smart_resize
from glmvit.oracle import transformers_glm46v_sampler
from glmvit.processing import (
    VisionInputs,
    process_images,
    process_video,
    sample_frame_indices_glm41v,
    sample_frame_indices_glm46v,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:PIL.TiffImagePlugin")  # broken TIFFs say so, then fail
ROOT = Path(__file__).resolve().parents[1]
MODES = ["1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV",
         "I;16", "I;16B", "I", "F"]
PNG_MODES = {"1", "L", "LA", "P", "RGB", "RGBA", "I;16"}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# normalised pixels of uint8 input lie between these (rescale, then (x − mean) / std, in float32)
_LOW = float(((np.float32(0) - np.float32(OPENAI_CLIP_MEAN)) / np.float32(OPENAI_CLIP_STD)).min())
_HIGH = float(((np.float32(1) - np.float32(OPENAI_CLIP_MEAN)) / np.float32(OPENAI_CLIP_STD)).max())


@pytest.fixture(scope="module", autouse=True)
def small_bomb_limit():
    """Broken files can state huge frames: PIL's own bomb check then refuses above 2 × 4 M pixels, not 179 M."""
    limit = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 4_000_000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield
    Image.MAX_IMAGE_PIXELS = limit


def one_line_error(err: BaseException, *names: str) -> None:
    message = str(err)
    assert "\n" not in message and all(name in message for name in names), message


def check_item(out: VisionInputs, height: int, width: int, frames: int = 2, **resize) -> None:
    """One item with the grid the resize rule gives and normalised uint8 pixels."""
    h, w = smart_resize(height, width, frames, **resize)
    assert out.grid_thw.tolist() == [[max(frames // 2, 1), h // 14, w // 14]]
    assert out.pixel_values.shape == (out.grid_thw.prod().item(), 1176)
    assert _LOW <= out.pixel_values.min().item() and out.pixel_values.max().item() <= _HIGH


# --- images --------------------------------------------------------------------------------------------------------


@st.composite
def pil_images(draw):
    mode = draw(st.sampled_from(MODES))
    width, height = draw(st.integers(1, 400)), draw(st.integers(1, 60))
    if draw(st.booleans()):
        width, height = height, width
    bands = Image.getmodebands(mode)
    bytes_per_band = {"I;16": 2, "I;16B": 2, "I": 4, "F": 4}.get(mode, 1)
    size = (width * height * bands * bytes_per_band) if mode != "1" else math.ceil(width / 8) * height
    raw = draw(st.binary(min_size=size, max_size=size)) if size <= 64 else np.random.default_rng(
        draw(st.integers(0, 2**32 - 1))).integers(0, 256, size, dtype=np.uint8).tobytes()
    return Image.frombytes(mode, (width, height), raw)


@FUZZ
@given(image=pil_images())
def test_images_of_any_size_and_mode(image):
    try:
        out = process_images([image])
    except ValueError as err:
        one_line_error(err, "image 0")
        return
    check_item(out, image.height, image.width)


@FUZZ
@given(image=pil_images().filter(lambda im: im.mode in PNG_MODES))
def test_a_file_and_its_pil_image_give_the_same_pixels(image):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "image.png"
        image.save(path)
        with Image.open(path) as im:
            reopened = im.copy()
        try:
            by_path = process_images(path)
        except ValueError as err:
            one_line_error(err, "image 0", str(path))
            with pytest.raises(ValueError):
                process_images(reopened)
            return
    assert torch.equal(by_path.pixel_values, process_images(reopened).pixel_values)


@FUZZ
@given(values=st.lists(st.integers(0, 65535), min_size=28 * 28, max_size=28 * 28))
def test_16_bit_images_equal_their_8_bit_rounding(values):
    wide = np.array(values, dtype=np.uint16).reshape(28, 28)
    narrow = np.repeat(np.rint(wide / 257).astype(np.uint8)[..., None], 3, axis=2)
    assert torch.equal(process_images(Image.fromarray(wide)).pixel_values, process_images(narrow).pixel_values)


@FUZZ
@given(min_pixels=st.integers(-5, 2 * 10**6), max_pixels=st.integers(-5, 2 * 10**6))
def test_pixel_bounds(min_pixels, max_pixels):
    image = np.full((90, 130, 3), 128, np.uint8)
    if not 1 <= min_pixels <= max_pixels:
        with pytest.raises(ValueError) as err:
            process_images(image, min_pixels=min_pixels, max_pixels=max_pixels)
        one_line_error(err.value, f"min_pixels={min_pixels}", f"max_pixels={max_pixels}")
        return
    # the rule itself can end above max_pixels (its min_pixels branch rounds up): only "follows the rule" holds
    check_item(process_images(image, min_pixels=min_pixels, max_pixels=max_pixels), 90, 130,
               min_pixels=min_pixels, max_pixels=max_pixels)


# --- frame sampling against transformers -----------------------------------------------------------------------------





GLM46V = transformers_glm46v_sampler()
rates = st.floats(0.05, 240, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(total=st.integers(1, 3000), video_fps=rates, fps=st.floats(0.05, 60), duration=st.none() | st.floats(0.01, 3000))
def test_sampling_equals_transformers(total, video_fps, fps, duration):
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps,
                             duration=total / video_fps if duration is None else duration)
    expected = Glm4vVideoProcessor().sample_frames(metadata, fps=fps).tolist() or [0, 0]  # 5.4 samples none
    assert sample_frame_indices_glm41v(total, video_fps, fps, duration) == expected
    assert sample_frame_indices_glm46v(total, video_fps, duration) == GLM46V(metadata).tolist()


bad_numbers = st.sampled_from([0.0, -0.0, -1.0, -1e-300, math.nan, math.inf, -math.inf])


def _positive(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value > 0)


@FUZZ
@given(total=st.integers(-3, 5), video_fps=bad_numbers | rates, fps=bad_numbers | rates,
       duration=st.none() | bad_numbers | rates)
def test_bad_sampling_values_are_refused(total, video_fps, fps, duration):
    metadata_ok = total >= 1 and _positive(video_fps) and _positive(duration)
    calls = {"glm41v": (lambda: sample_frame_indices_glm41v(total, video_fps, fps, duration), _positive(fps)),
             "glm46v": (lambda: sample_frame_indices_glm46v(total, video_fps, duration), True)}
    for call, fps_ok in calls.values():
        if metadata_ok and fps_ok:
            assert len(call()) % 2 == 0
        else:
            with pytest.raises(ValueError, match="must be positive and finite|at least one frame"):
                call()


@settings(max_examples=100, deadline=None)
@given(total=st.integers(1, 2**20), video_fps=st.floats(1e-6, 1e9), fps=st.floats(1e-6, 1e9),
       duration=st.none() | st.floats(1e-6, 1e9))
@pytest.mark.timeout(120)
def test_sampling_work_is_bounded_for_any_rate(total, video_fps, fps, duration):
    for indices in (sample_frame_indices_glm41v(total, video_fps, fps, duration),
                    sample_frame_indices_glm46v(total, video_fps, duration)):
        assert len(indices) % 2 == 0 and all(0 <= i < total for i in indices)
        assert indices[:-1] == sorted(set(indices[:-1]))


# --- videos ---------------------------------------------------------------------------------------------------------


@FUZZ
@given(frames=st.integers(1, 9), height=st.integers(1, 60), width=st.integers(1, 60), video_fps=st.floats(0.1, 100),
       rule=st.sampled_from(["glm41v", "glm46v"]), seed=st.integers(0, 2**32 - 1))
def test_video_arrays_of_odd_shapes_and_rates(frames, height, width, video_fps, rule, seed):
    clip = np.random.default_rng(seed).integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    try:
        out = process_video(clip, rule=rule, video_fps=video_fps)
    except ValueError as err:
        one_line_error(err, "video (array)")
        return
    indices = out.frame_indices[0]
    check_item(out, height, width, len(indices), max_pixels=28 * 28 * 2 * 30000)
    assert all(0 <= i < frames for i in indices)
    stamps = out.timestamps[0]
    assert stamps == [i / video_fps for i in indices[::2]] and stamps == sorted(set(stamps))


@FUZZ
@given(delays=st.lists(st.integers(0, 60), min_size=1, max_size=24), side=st.integers(1, 40),
       seed=st.integers(0, 2**32 - 1))
def test_animations_of_any_frame_count_and_delays(delays, side, seed):
    rng = np.random.default_rng(seed)
    frames = [Image.fromarray(rng.integers(0, 256, size=(side, side + 3, 3), dtype=np.uint8)) for _ in delays]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "anim.gif"
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=[10 * d for d in delays], loop=0)
        if sum(delays) == 0:
            with pytest.raises(ValueError, match="states no frame rate"):
                process_video(path)
            return
        out = process_video(path)
    seconds = sum(delays) / 100
    metadata = VideoMetadata(total_num_frames=len(delays), fps=len(delays) / seconds, duration=seconds)
    assert out.frame_indices == [Glm4vVideoProcessor().sample_frames(metadata).tolist() or [0, 0]]


# --- broken files ---------------------------------------------------------------------------------------------------


def _samples() -> dict[str, bytes]:
    images = sorted((ROOT / "data" / "images").glob("*.jpg"))
    out = {"jpg": images[0].read_bytes(), "gif": (ROOT / "data" / "clip.gif").read_bytes()}
    with Image.open(images[1]) as im:
        small = im.convert("RGBA").resize((64, 48))
    for fmt in ("png", "webp", "tiff", "bmp"):
        with tempfile.TemporaryFile() as fp:
            small.save(fp, fmt)
            fp.seek(0)
            out[fmt] = fp.read()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "anim.webp"
        small.save(path, save_all=True, append_images=[small.rotate(90), small.rotate(180)], duration=200)
        out["anim.webp"] = path.read_bytes()
    return out


SAMPLES = _samples()


@st.composite
def broken(draw):
    """A sample file cut short, or with a stretch of bytes overwritten."""
    kind = draw(st.sampled_from(sorted(SAMPLES)))
    data = bytearray(SAMPLES[kind])
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data) - 1))]
    else:
        start = draw(st.integers(0, len(data) - 1))
        patch = draw(st.binary(min_size=1, max_size=16))
        data[start : start + len(patch)] = patch
    return kind, bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=broken())
def test_broken_files_are_one_line_errors_naming_the_file(case):
    kind, data = case
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"broken.{kind}"
        path.write_bytes(data)
        calls = [(process_images, ["image 0", str(path)])]
        if kind in ("gif", "anim.webp"):
            calls.append((partial(process_video, max_pixels=28 * 28 * 2 * 64, video_fps=10), [f"video {path}"]))
        for call, names in calls:
            try:
                call(path)
            except ValueError as err:
                one_line_error(err, *names)
