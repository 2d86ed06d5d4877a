"""Bad and odd inputs to processing, generated (hypothesis): sizes, modes, frame counts, frame rates, durations,
broken files.

Every property has the same shape: a valid result whose geometry follows the resize rule, or one ValueError (or
FileNotFoundError) naming the input, on one line: never another exception, never a hang. Frame sampling is
checked against transformers' own samplers, the oracle.
"""
import math
import os
import stat
import tempfile
import threading
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
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


# --- sizes from outside: grids, picture sizes, budgets, bucket configs, traces (issue 29) -----------------------------
# Each size is checked exactly before it is used: never an int64 wrap, an OverflowError, a RecursionError, a
# StopIteration or an allocation sized by a hostile number; either a valid result or one ValueError on one line.

HOSTILE_INTS = st.sampled_from([0, -1, 1, 2, 3, 2**15, 2**30, 2**30 + 1, 2**31, 2**32, 2**62, 2**63 - 1, 2**64 - 1,
                                2**70, 10**400, -(2**63)])
grid_entries = HOSTILE_INTS | st.integers(-(2**70), 2**70) | st.integers(1, 40) | st.floats(allow_nan=True) \
    | st.sampled_from([2.0, 4.0, 1.5, math.inf])


def exact_rows(grid) -> int | None:
    """Σ t·h·w in Python ints if every entry is a positive integral number within MAX_ROWS, else None."""
    from glmvit.metadata import MAX_ROWS

    rows = 0
    for row in grid:
        if not all(isinstance(v, (int, float)) and 1 <= v <= MAX_ROWS and float(v).is_integer() for v in row):
            return None
        t, h, w = (int(v) for v in row)
        rows += t * h * w
    return rows


@settings(max_examples=300, deadline=None)
@given(grid=st.lists(st.lists(grid_entries, min_size=3, max_size=3), min_size=1, max_size=4),
       form=st.sampled_from(["list", "numpy", "torch"]))
@example(grid=[[1, 1, 8388608.5]], form="torch")  # float32 holds 8388608.0: an integer grid, though the list was not
def test_any_grid_is_a_valid_array_or_one_line_error(grid, form):
    from glmvit.metadata import MAX_ROWS, as_grid_array, rows_of

    value = grid
    if form != "list":
        try:
            value = np.array(grid) if form == "numpy" else torch.tensor(grid)
        except (OverflowError, RuntimeError, TypeError, ValueError):
            value = grid  # too large for a fixed-width dtype: the caller can only pass it as a list
    # what the array holds: torch.tensor stores a list of floats in float32, which rounds 8388608.5 to 8388608.0
    expected = exact_rows(grid if isinstance(value, list) else value.tolist())
    try:
        grids = as_grid_array(value)
    except ValueError as err:
        one_line_error(err)
        assert expected is None or expected > MAX_ROWS or "item" not in str(err), (grid, err)
        return
    assert expected is not None and expected <= MAX_ROWS and rows_of(grids) == expected, grid


@settings(max_examples=120, deadline=None)
@given(grid=st.lists(st.lists(grid_entries, min_size=3, max_size=3), min_size=1, max_size=3),
       rows=st.integers(0, 8))
@pytest.mark.timeout(120)
def test_the_encoder_never_crashes_or_allocates_for_a_hostile_grid(tiny_model, grid, rows):
    """`m(zeros(4, 1176), [[2**62, 2, 2]] * 4 + [[1, 2, 2]])` segfaulted (t·h·w wrapped in int64) and
    `[[1, 2**32, 2**32]]` with no rows allocated 16 GB: now every grid is checked before build_metadata."""
    try:
        out = tiny_model(torch.zeros(rows, 1176), grid)
    except ValueError as err:
        one_line_error(err)
        return
    assert out.shape[0] * 4 == rows == exact_rows(grid)


@FUZZ
@given(height=HOSTILE_INTS | st.integers(1, 10**6), width=HOSTILE_INTS | st.integers(1, 10**6),
       frames=HOSTILE_INTS | st.integers(1, 700))
def test_picture_sizes_of_any_magnitude_follow_the_rule_or_fail_in_one_line(height, width, frames):
    from glmvit.geometry import grid_for

    try:
        t, h, w = grid_for(height, width, frames)
    except ValueError as err:
        one_line_error(err)
        assert len(str(err)) < 300
        return
    assert t == math.ceil(frames / 2) and h % 2 == 0 and w % 2 == 0 and h * w * 196 <= 28 * 28 * 2 * 30000


numbers_as_text = st.sampled_from(["1" + "0" * 400, "1" + "0" * 5000, "-" * 3000 + "1", "+" * 3000 + "1", "²", "١٢",
                                   "64", "-64", "0", "1e400", "1e308", "nan", "inf", "0x40", "64.0", "  7  "]) \
    | st.integers(-(2**80), 2**80).map(str) | st.text(max_size=12)


@settings(max_examples=300, deadline=None)
@given(words=st.lists(numbers_as_text, min_size=1, max_size=4), sep=st.sampled_from([",", " ", ", "]))
def test_budget_text_parses_or_fails_in_one_line(words, sep):
    from glmvit.packing import parse_budgets

    text = sep.join(words)
    try:
        budgets = parse_budgets(text)
    except ValueError as err:
        one_line_error(err)
        assert len(str(err)) < 200
        return
    assert budgets is None or all(abs(b) < 10**18 for b in budgets)


@settings(max_examples=200, deadline=None)
@given(text=numbers_as_text)
def test_integer_arguments_parse_or_fail_in_one_line(text):
    import argparse

    from glmvit.cli.common import float_in, int_in

    for parse in (int_in(0, 2**32 - 1), float_in(0, 1)):
        try:
            parse(text)
        except argparse.ArgumentTypeError as err:
            one_line_error(err)
            assert len(str(err)) < 200


@settings(max_examples=300, deadline=None)
@given(height=numbers_as_text, width=numbers_as_text, frames=numbers_as_text, prob=numbers_as_text,
       wrap=st.sampled_from(["{{({h}, {w}, {f}): {p}}}", "{{({h}, {w}, {f}): {p}, (224, 224, 1): 1}}", "{h}"]))
def test_bucket_configs_parse_or_fail_in_one_line(height, width, frames, prob, wrap):
    from glmvit.workloads import parse_bucket_config

    try:
        buckets = parse_bucket_config(wrap.format(h=height, w=width, f=frames, p=prob))
    except ValueError as err:
        one_line_error(err)
        assert len(str(err)) < 400
        return
    assert buckets and math.isclose(sum(buckets.values()), 1.0)


trace_values = HOSTILE_INTS | st.integers(1, 5000) | st.sampled_from(["224", "1" + "0" * 400, "-5", "", "x", 1.5, None])


@settings(max_examples=200, deadline=None)
@given(records=st.lists(st.fixed_dictionaries({"height": trace_values, "width": trace_values},
                                              optional={"frames": trace_values}), min_size=1, max_size=3),
       suffix=st.sampled_from([".json", ".jsonl", ".csv"]))
def test_traces_with_any_sizes_parse_or_fail_in_one_line(records, suffix):
    import json

    from glmvit.traces import parse_trace

    if suffix == ".json":
        data = json.dumps(records)
    elif suffix == ".jsonl":
        data = "\n".join(json.dumps(r) for r in records)
    else:
        data = "height,width,frames\n" + "".join(f"{r['height']},{r['width']},{r.get('frames', '')}\n"
                                                 for r in records)
    try:
        requests = parse_trace(data.encode(), f"t{suffix}")
    except ValueError as err:
        one_line_error(err, f"t{suffix}")
        assert len(str(err)) < 400
        return
    assert sum(len(r) for r in requests) == len(records)


# --- files a tool reads: regular files only, bounded (issue 29) -------------------------------------------------------


def hostile_file(kind: str, folder: Path) -> Path:
    """A path of ``kind``: what a read must refuse at once (a FIFO blocks, /dev/zero never ends)."""
    import socket

    path = folder / f"{kind}.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(1 << 40)  # a terabyte, no blocks on disk
    elif kind == "link-to-fifo":
        os.mkfifo(folder / "target")
        path.symlink_to(folder / "target")
    return path  # "missing": nothing there


READ_REFUSALS = {"fifo": "a FIFO (named pipe), not a regular file", "dev-zero": "a character device, not a regular",
                 "directory": "a directory, not a regular file", "socket": "a socket, not a regular file",
                 "sparse": "1,048,576.0 MiB, larger than any", "link-to-fifo": "a FIFO (named pipe)",
                 "missing": "no such"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", sorted(READ_REFUSALS))
def test_every_reader_refuses_what_would_block_or_never_end(kind, tmp_path):
    from glmvit.cli.common import read_latency_table
    from glmvit.files import read_bounded
    from glmvit.traces import load_trace

    path = hostile_file(kind, tmp_path)
    for read in (lambda: read_bounded(path, 1 << 20, "file"), lambda: load_trace(path),
                 lambda: read_latency_table(path)):
        with pytest.raises((ValueError, OSError)) as err:
            read()
        one_line_error(err.value, str(path), READ_REFUSALS[kind])
    if kind in ("sparse", "missing"):
        return  # a regular file the decoders may open (a sparse one is not an image); a missing one: see above
    for decode in (lambda: process_images(path), lambda: process_video(path)):
        with pytest.raises(ValueError) as err:
            decode()
        one_line_error(err.value, str(path), READ_REFUSALS[kind].split(" (")[0].split(",")[0], "not a regular file")


def test_a_file_that_grows_while_it_is_read_is_refused(tmp_path, monkeypatch):
    """The size is checked on the open descriptor, then at most limit + 1 bytes are read: a file that grew in
    between (simulated: fstat reports it empty) is refused, never read whole."""
    from glmvit import files

    path = tmp_path / "t.json"
    path.write_bytes(b"[1, 2, 3]")
    real_fstat = os.fstat

    def stale_fstat(fd):
        fields = list(real_fstat(fd))
        fields[stat.ST_SIZE] = 0
        return os.stat_result(fields)

    monkeypatch.setattr(files.os, "fstat", stale_fstat)
    with pytest.raises(ValueError, match=r"t\.json: the file grew past 4 bytes while it was read"):
        files.read_bounded(path, 4)
    assert files.read_bounded(path, 9) == b"[1, 2, 3]"


# --- outputs: written through, never replacing what is not a regular file (issue 29) -------------------------------


def destination(kind: str, folder: Path) -> Path:
    path = folder / "out.json"
    if kind == "regular":
        path.write_text("old")
    elif kind == "symlink":
        (folder / "real.json").write_text("old")
        path.symlink_to(folder / "real.json")
    elif kind == "dangling-symlink":
        path.symlink_to(folder / "real.json")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "char-device":
        try:
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's device, made here
        except OSError as err:
            pytest.skip(f"cannot make a device node here ({err})")
    elif kind in ("directory", "socket"):
        hostile_file(kind, folder).rename(path)
    return path  # "new": nothing there


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["new", "regular", "symlink", "dangling-symlink", "fifo", "char-device",
                                  "directory", "socket"])
def test_outputs_write_through_or_refuse_never_replace(kind, tmp_path):
    from glmvit.cli.common import check_writable, write_atomic

    path = destination(kind, tmp_path)
    mode = os.lstat(path).st_mode if os.path.lexists(path) else None
    if kind in ("directory", "socket"):
        for call in (lambda: check_writable(path), lambda: write_atomic(path, b"{}")):
            with pytest.raises(OSError) as err:
                call()
            one_line_error(err.value, str(path))
        assert os.lstat(path).st_mode == mode
        return
    received = []
    if kind == "fifo":
        reader = threading.Thread(target=lambda: received.append(path.read_bytes()), daemon=True)
        reader.start()
    check_writable(path)
    write_atomic(path, b'{"new": 1}\n')
    if kind == "fifo":
        reader.join(10)
        assert received == [b'{"new": 1}\n']
    if mode is not None:
        assert stat.S_IFMT(os.lstat(path).st_mode) == stat.S_IFMT(mode), "the output replaced what was there"
    if kind in ("new", "regular", "symlink", "dangling-symlink"):
        assert path.read_bytes() == b'{"new": 1}\n'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


# --- decoders: a picture's stated size is checked before it is decoded (issue 29) ----------------------------------


@FUZZ
@given(width=st.integers(1, 20000), height=st.integers(1, 20000), limit=st.integers(1, 10**6))
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_stated_picture_size_is_checked_before_decoding(width, height, limit):
    """A PNG header stating any size, with no image data: refused for its size when over the limit (from the
    header, at once), otherwise a decoding error; one line naming the file either way."""
    from tests.test_processing import png_claiming

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "claims.png"
        path.write_bytes(png_claiming(width, height))
        with pytest.raises(ValueError) as err:
            process_images(path, max_frame_pixels=limit)
    one_line_error(err.value, "image 0", str(path))
    message = str(err.value)
    refused_for_size = "max_frame_pixels" in message or "decompression bomb" in message  # PIL's: above 8 M here
    assert refused_for_size == (width * height > limit), message
