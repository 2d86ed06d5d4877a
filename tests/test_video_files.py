"""Video files: metadata, decoding only the sampled frames in bounded memory, clear errors, and parity with
transformers' PyAV reader and video processors (the oracle; the processors need torchvision).

Test media are written at run time: mp4/mov/webm/mkv with PyAV, GIFs by hand (a few bytes per frame, so a tiny file
can describe huge frames, the way a decompression bomb does).
"""
import contextlib
import io
import logging
import os
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from glmvit import video as video_files
from glmvit.oracle import transformers_glm46v_sampler
from glmvit.processing import process_video
from glmvit.video import MAX_DECODED_PIXELS, DecodeLimitError, probe

ROOT = Path(__file__).resolve().parents[1]
CLIP = ROOT / "data" / "clip.gif"
PHOTO = ROOT / "data" / "images" / "coffee.jpg"
# container → (encoder, frame rate): a non-integer NTSC rate, and formats without a stored frame count
CONTAINERS = {"mp4": ("libx264", Fraction(30000, 1001)), "mov": ("mpeg4", Fraction(15)),
              "webm": ("libvpx-vp9", Fraction(24)), "mkv": ("ffv1", Fraction(25))}
FRAMES, WIDTH, HEIGHT = 45, 96, 64


def moving_frames(count: int = FRAMES) -> np.ndarray:
    """(count, 64, 96, 3) uint8: the coffee photo, shifted 4 px further right each frame (every frame differs)."""
    with Image.open(PHOTO) as im:
        base = np.asarray(im.convert("RGB").resize((WIDTH, HEIGHT), Image.Resampling.BICUBIC))
    return np.stack([np.roll(base, 4 * k, axis=1) for k in range(count)])


def write_video(path: Path, frames: np.ndarray, codec: str, rate: Fraction) -> Path:
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("av")
    folder = tmp_path_factory.mktemp("videos")
    frames = moving_frames()
    return {ext: write_video(folder / f"moving.{ext}", frames, codec, rate)
            for ext, (codec, rate) in CONTAINERS.items()}


def tiny_frames_gif(path: Path, width: int, height: int, frames: int, delay_cs: int = 10,
                    offset=lambda k: (k % 2, 0)) -> Path:
    """A GIF of 1×1 frames on a width × height canvas: 20 bytes a frame, width × height decoded pixels a frame."""
    data = bytearray(b"GIF89a" + struct.pack("<HHBBB", width, height, 0x80, 0, 0) + bytes([0, 0, 0, 255, 255, 255]))
    for k in range(frames):
        x, y = offset(k)
        data += b"!\xf9\x04" + struct.pack("<BHB", 0, delay_cs, 0) + b"\x00"  # graphic control: the delay
        data += b"," + struct.pack("<HHHHB", x, y, 1, 1, 0)  # a 1×1 image at (x, y), no local colour table
        data += b"\x02\x02\x4c\x01\x00"  # LZW, code size 2: clear, colour 1, end
    path.write_bytes(bytes(data + b";"))
    return path




SAMPLERS = {"glm41v": lambda metadata, **_: Glm4vVideoProcessor().sample_frames(metadata),
            "glm46v": lambda metadata, **_: transformers_glm46v_sampler()(metadata)}


def read_all_pyav(path: Path) -> tuple[np.ndarray, VideoMetadata]:
    """Every frame and the metadata, by transformers' own PyAV reader."""
    from transformers.video_utils import read_video_pyav

    return read_video_pyav(str(path), sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))


def decode_all_pyav(path: Path) -> tuple[np.ndarray, VideoMetadata]:
    """Every frame, and transformers' metadata rules with the decoded frame count: its reader cannot open WebM
    (the container stores no frame count, PyAV says 0, and sampling then fails with an IndexError)."""
    import av

    with av.open(str(path)) as container:
        rate = container.streams.video[0].average_rate
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    return frames, VideoMetadata(total_num_frames=len(frames), fps=float(rate), duration=float(len(frames) / rate))


# --- metadata ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ext", ["mp4", "mov"])
def test_probe_follows_transformers_pyav_reader(videos, ext):
    frames, metadata = read_all_pyav(videos[ext])
    info = probe(videos[ext])
    assert (info.frames, info.fps, info.duration) == (metadata.total_num_frames, metadata.fps, metadata.duration)
    assert (info.frames, info.width, info.height) == (FRAMES, WIDTH, HEIGHT) == (len(frames), *frames.shape[2:0:-1])


@pytest.mark.parametrize("ext", ["webm", "mkv"])
def test_containers_without_a_frame_count_count_their_packets(videos, ext):
    """PyAV (so transformers' reader) says 0 frames for WebM/Matroska; the packets are counted instead."""
    import av

    with av.open(str(videos[ext])) as container:
        assert container.streams.video[0].frames == 0
        decoded = sum(1 for _ in container.decode(video=0))
    info = probe(videos[ext])
    assert info.frames == decoded == FRAMES
    assert info.fps == float(CONTAINERS[ext][1]) and info.duration == float(FRAMES / CONTAINERS[ext][1])


def test_animation_metadata_from_frame_durations(tmp_path):
    frames = [Image.fromarray(f) for f in moving_frames(7)]
    durations = [30, 100, 0, 250, 40, 70, 1000]
    for fmt in ("gif", "webp"):
        path = tmp_path / f"varied.{fmt}"
        frames[0].save(path, save_all=True, append_images=frames[1:], duration=durations, loop=0)
        pil_durations = []
        with Image.open(path) as im:
            for k in range(im.n_frames):
                im.seek(k)
                im.load()  # WebP sets the duration on load
                pil_durations.append(im.info.get("duration", 0))
        assert pil_durations == durations
        info = probe(path)
        assert (info.frames, info.duration, info.fps) == (7, 1.49, 7 / 1.49)


# --- frames and indices against transformers' PyAV reader ------------------------------------------------------------


@pytest.mark.parametrize("rule", ["glm41v", "glm46v"])
@pytest.mark.parametrize("ext", ["mp4", "mov", "webm"])
def test_sampled_frames_equal_transformers_pyav_reader(videos, ext, rule):
    """Indices and timestamps as transformers' reader + sampler; pixels as the same frames given as an array."""
    frames, metadata = read_all_pyav(videos[ext]) if ext != "webm" else decode_all_pyav(videos[ext])
    expected = SAMPLERS[rule](metadata).tolist()
    ours = process_video(videos[ext], rule=rule)
    assert ours.frame_indices == [expected]
    assert ours.timestamps == [[i / metadata.fps for i in expected[::2]]]
    reference = process_video(frames, rule=rule, video_fps=metadata.fps, duration=metadata.duration)
    assert reference.frame_indices == ours.frame_indices
    assert torch.equal(ours.pixel_values, reference.pixel_values) and torch.equal(ours.grid_thw, reference.grid_thw)


@pytest.mark.parametrize("ext", ["mp4", "webm"])
def test_pyav_frames_share_one_converter_and_are_pyavs_own_rgb(videos, ext, monkeypatch):
    """A video's frames go through one swscale converter (one made per frame cost more than the decoding) and come
    out as PyAV's own rgb24 conversion of each frame, byte for byte."""
    import av

    made, real = [], av.video.reformatter.VideoReformatter

    def counting():
        made.append(real())
        return made[-1]

    monkeypatch.setattr(av.video.reformatter, "VideoReformatter", counting)
    info = probe(videos[ext])
    frames = np.stack([np.array(f) for _, f in video_files.decode(videos[ext], info, list(range(info.frames)))])
    assert len(made) == 1
    assert np.array_equal(frames, decode_all_pyav(videos[ext])[0])


def test_caller_metadata_overrides_the_file():
    frames = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(CLIP))])
    slow = process_video(CLIP, video_fps=5)  # 20 frames at 5 fps: 4 s, 8 frames at 2 fps
    assert slow.frame_indices == [[0, 3, 5, 8, 10, 13, 15, 18]] and slow.timestamps == [[0.0, 1.0, 2.0, 3.0]]
    metadata = VideoMetadata(total_num_frames=20, fps=10.0, duration=3.0)  # a duration that is not frames / fps
    stretched = process_video(CLIP, duration=3.0)
    assert stretched.frame_indices == [SAMPLERS["glm41v"](metadata).tolist()]
    assert torch.equal(stretched.pixel_values, process_video(frames, video_fps=10, duration=3.0).pixel_values)


# --- pixels against transformers' video processors (they need torchvision) --------------------------------------------


def _processor(rule):
    pytest.importorskip("torchvision")
    if rule == "glm41v":
        return Glm4vVideoProcessor()
    from transformers.models.glm46v.video_processing_glm46v import Glm46VVideoProcessor

    return Glm46VVideoProcessor()


def _source(name: str, request) -> tuple[object, np.ndarray, VideoMetadata]:
    """What process_video gets, and the full frames + metadata the processor gets for the same video."""
    if name == "gif":
        gif = np.stack([np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(Image.open(CLIP))])
        return CLIP, gif, VideoMetadata(total_num_frames=20, fps=10.0, duration=2.0)
    if name == "mp4":
        path = request.getfixturevalue("videos")["mp4"]
        return (path, *read_all_pyav(path))
    noise = np.random.default_rng(3).integers(0, 256, size=(31, 50, 70, 3), dtype=np.uint8)
    return noise, noise, VideoMetadata(total_num_frames=31, fps=12.0, duration=3.3)


@pytest.mark.parametrize("rule", ["glm41v", "glm46v"])
@pytest.mark.parametrize("source", ["gif", "mp4", "array"])
def test_torchvision_resize_equals_the_video_processors(request, rule, source):
    """Same frames, same ops in the same order (uint8 antialiased bicubic, fused float32 normalisation): exact."""
    processor = _processor(rule)
    given, frames, metadata = _source(source, request)
    out = processor(videos=[frames], video_metadata=[metadata], return_metadata=True, return_tensors="pt")
    kwargs = dict(video_fps=metadata.fps, duration=metadata.duration) if source == "array" else {}
    ours = process_video(given, rule=rule, resize="torchvision", **kwargs)
    assert ours.frame_indices == [out["video_metadata"][0].frames_indices.tolist()]
    assert ours.timestamps == [[float(t) for t in out["video_metadata"][0].timestamps[::2]]]
    assert torch.equal(ours.grid_thw, out["video_grid_thw"])
    assert torch.equal(ours.pixel_values, out["pixel_values_videos"])


def test_torchvision_resize_without_torchvision_is_a_clear_error(monkeypatch):
    for name in ("torchvision", "torchvision.transforms.v2"):  # None in sys.modules: import fails, even if loaded
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValueError, match="resize='torchvision' needs torchvision"):
        process_video(CLIP, resize="torchvision")


# --- decoding only what is sampled, in bounded memory ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["gif", "mp4"])
def test_decoding_stops_after_the_last_sampled_frame(request, monkeypatch, kind):
    decoded = []
    spend = video_files._PixelBudget.spend
    monkeypatch.setattr(video_files._PixelBudget, "spend", lambda self, w, h: decoded.append(1) or spend(self, w, h))
    path = CLIP if kind == "gif" else request.getfixturevalue("videos")["mp4"]
    out = process_video(path)  # 2 fps: 20 frames at 10 fps → 0, 5, 10, 15; 45 at 29.97 → 0, 15, 30, 30
    last = max(out.frame_indices[0])
    assert len(decoded) == last + 1 < probe(path).frames


BOMB_SCRIPT = """
import sys
from glmvit.processing import process_video

def status_kib(key):  # this process's own memory (VmHWM is per address space; ru_maxrss survives exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))

process_video(sys.argv[1], max_pixels=28 * 28 * 2 * 64)  # warm up: imports, allocator pools
before = status_kib("VmRSS:")
out = process_video(sys.argv[2], max_pixels=28 * 28 * 2 * 64)
print(before, status_kib("VmHWM:"), out.grid_thw.tolist())
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS / VmHWM from /proc (Linux)")
def test_a_small_gif_of_huge_frames_decodes_in_bounded_memory(tmp_path):
    """120 frames of 2000 × 2000 in a 3 KB file: its RGB frames are 1.4 GB, and used to be held twice (a list,
    then np.stack: 2.8 GB). Measured in a fresh process on its resident set (PIL's canvases are not Python
    allocations), the peak may grow by 20 frames' worth at most, a constant whatever the frame count: PIL's canvas
    and converted copy, our RGB array, its resize, and allocator slack (74 MiB measured; 2.8 GB before)."""
    warm = tiny_frames_gif(tmp_path / "warm.gif", 200, 200, 6)
    bomb = tiny_frames_gif(tmp_path / "bomb.gif", 2000, 2000, 120)
    assert bomb.stat().st_size < 3000
    run = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(warm), str(bomb)], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    before_kib, peak_kib, grid = run.stdout.split(maxsplit=2)
    frame_kib = 2000 * 2000 * 3 // 1024
    assert int(peak_kib) - int(before_kib) < 20 * frame_kib, run.stdout
    assert grid.strip() == "[[12, 4, 4]]"  # 12 s at 2 fps: 24 frames, resized to fit max_pixels


@pytest.mark.timeout(60)
def test_a_small_gif_claiming_too_many_pixels_is_refused_before_decoding(tmp_path):
    """2,000 frames of 9000 × 9000 (each under PIL's per-image limit) in 40 KB: 162 G pixels to decode."""
    bomb = tiny_frames_gif(tmp_path / "bomb.gif", 9000, 9000, 2000, delay_cs=1)
    assert bomb.stat().st_size < 50_000
    with pytest.raises(DecodeLimitError, match=rf"video {bomb}: decoding frames 0\.\.\d+ of 9000×9000"):
        process_video(bomb, max_frame_pixels=9000 * 9000)  # each frame allowed: the total is what is refused
    assert MAX_DECODED_PIXELS < 2000 * 9000 * 9000


def test_frames_that_grow_past_the_stated_size_are_caught_while_decoding(tmp_path):
    """A 100 × 100 GIF whose frames sit at (2999, 2999): PIL grows the canvas to 3000 × 3000 on the second frame."""
    grows = tiny_frames_gif(tmp_path / "grows.gif", 100, 100, 8, delay_cs=50,
                            offset=lambda k: (2999, 2999) if k else (0, 0))
    with pytest.raises(DecodeLimitError, match="grow beyond the size the file states"):
        process_video(grows, max_decoded_pixels=1_000_000)
    assert probe(grows).width == 100


@pytest.mark.timeout(30)
def test_a_frame_above_max_frame_pixels_is_refused_from_the_header(tmp_path):
    """Two 15000 × 15000 frames in a few bytes (the default limit is 8192²): refused by probe, before decoding."""
    bomb = tiny_frames_gif(tmp_path / "huge.gif", 15000, 15000, 2)
    Image.MAX_IMAGE_PIXELS, limit = None, Image.MAX_IMAGE_PIXELS  # so that our bound, not PIL's, is what refuses
    try:
        for call in (lambda: probe(bomb), lambda: process_video(bomb)):
            with pytest.raises(DecodeLimitError, match=rf"video {bomb}: 15000×15000 is 225,000,000 pixels, more "
                                                       rf"than max_frame_pixels=67,108,864") as err:
                call()
            assert "\n" not in str(err.value)
    finally:
        Image.MAX_IMAGE_PIXELS = limit
    at_the_limit = tiny_frames_gif(tmp_path / "ok.gif", 600, 600, 4)
    assert len(process_video(at_the_limit, max_frame_pixels=600 * 600)) == 1  # the bound is inclusive


def test_frames_that_grow_past_max_frame_pixels_are_caught_while_decoding(tmp_path):
    grows = tiny_frames_gif(tmp_path / "grows.gif", 100, 100, 8, delay_cs=50,
                            offset=lambda k: (2999, 2999) if k else (0, 0))
    with pytest.raises(DecodeLimitError, match="a decoded frame: 3000×3000 is 9,000,000 pixels, more than "
                                               "max_frame_pixels=1,000,000"):
        process_video(grows, max_frame_pixels=1_000_000)


def raw_h264(width: int, height: int, frames: int) -> bytes:
    """An Annex B H.264 stream (no container): concatenating two gives a stream whose frame size changes."""
    av = pytest.importorskip("av")
    import io

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="h264") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k in range(frames):
            frame = np.full((height, width, 3), 40 * k, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def test_pyav_frames_are_bounded_by_the_header_and_while_decoding(tmp_path):
    """PyAV frames get the same bounds as PIL's: the stated size first, then every decoded frame, and FFmpeg itself
    is told the limit (its max_pixels, twice ours for its row alignment), so a stream whose frames grow from 64²
    to 512² is stopped before, or right after, FFmpeg allocates one."""
    stated = tmp_path / "stated.h264"
    stated.write_bytes(raw_h264(256, 256, 2))
    with pytest.raises(DecodeLimitError, match=r"256×256 is 65,536 pixels, more than max_frame_pixels=10,000"):
        process_video(stated, max_frame_pixels=10_000, video_fps=10)
    grows = tmp_path / "grows.h264"
    grows.write_bytes(raw_h264(64, 64, 4) + raw_h264(512, 512, 4))
    assert (probe(grows).width, probe(grows).height) == (64, 64)
    info, every = probe(grows), list(range(8))
    assert [f.shape for _, f in video_files.decode(grows, info, every)][-1] == (512, 512, 3)  # within the default
    with pytest.raises(DecodeLimitError, match=r"a decoded frame: 512×512 is 262,144 pixels"):
        list(video_files.decode(grows, info, every, max_frame_pixels=200_000))  # FFmpeg's 400,000 lets it through
    with pytest.raises(ValueError, match=r"FFmpeg refuses frames above max_frame_pixels=100,000") as err:
        list(video_files.decode(grows, info, every, max_frame_pixels=100_000))  # FFmpeg's 200,000: it refuses
    assert "\n" not in str(err.value)


PROBE_SCRIPT = """
import sys
from pathlib import Path
from glmvit import video

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

video.probe(Path(sys.argv[1]))  # warm up: PyAV, FFmpeg's decoder
before = peak_kib()
try:
    video.probe(Path(sys.argv[2]), max_frame_pixels=int(sys.argv[3]))
except video.DecodeLimitError:
    pass
print(peak_kib() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM from /proc (Linux)")
def test_probing_a_container_decodes_no_frame_above_the_limit(tmp_path):
    """FFmpeg decodes a frame while it probes a container's streams (avformat_find_stream_info): 4096² costs it
    about 70 MB. Told the bound per stream, it decodes none above it (5 MB measured); the limit is 1,000 here."""
    av = pytest.importorskip("av")
    small = write_video(tmp_path / "small.mkv", moving_frames(2), "libx264", Fraction(10))
    big = tmp_path / "big.mkv"
    with av.open(str(big), "w") as container:
        stream = container.add_stream("libx264", rate=10, options={"preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = 4096, 4096, "yuv420p"
        frame = av.VideoFrame(4096, 4096, "yuv420p")
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    run = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, str(small), str(big), "1000"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) < 4096 * 4096 * 3 // 2 // 1024 // 2, run.stdout  # under half of one frame's YUV


# --- bad files -------------------------------------------------------------------------------------------------------


def test_missing_pyav_is_a_one_line_error_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "av", None)
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(64))  # an mp4 header: not an image PIL knows
    with pytest.raises(ValueError, match=rf"video {path}: .*pip install av") as err:
        process_video(path)
    assert "\n" not in str(err.value)


def _bad_files(tmp_path: Path, cases: dict[str, bytes]) -> None:
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match=rf"video {path}: ") as err:
            process_video(path)
        assert "\n" not in str(err.value)


def test_bad_animation_files_are_one_line_errors_naming_the_file(tmp_path):
    _bad_files(tmp_path, {"half.gif": CLIP.read_bytes()[:30_000], "head.gif": CLIP.read_bytes()[:20]})
    still = tmp_path / "still.png"
    Image.open(PHOTO).save(still)
    with pytest.raises(ValueError, match="still PNG image, not a video"):
        process_video(still)
    with pytest.raises(FileNotFoundError, match="no such file"):
        process_video(tmp_path / "missing.gif")


def test_bad_pyav_files_are_one_line_errors_naming_the_file(videos, tmp_path):
    _bad_files(tmp_path, {"empty.mp4": b"", "half.mp4": videos["mp4"].read_bytes()[:3000],
                          "notes.mov": b"not a video", "half.webm": videos["webm"].read_bytes()[:2000]})


def test_an_animation_without_frame_durations_needs_video_fps(tmp_path):
    path = tiny_frames_gif(tmp_path / "timeless.gif", 56, 56, 4, delay_cs=0)
    with pytest.raises(ValueError, match="states no frame rate .* pass video_fps"):
        process_video(path)
    assert process_video(path, video_fps=2).frame_indices == [[0, 1, 2, 3]]


def test_decode_refuses_indices_outside_the_video():
    info = probe(CLIP)
    for indices in ([], [-1, 3], [0, 20]):
        with pytest.raises(ValueError, match=r"frame indices must lie in \[0, 20\)"):
            video_files.decode(CLIP, info, indices)


def test_the_tiny_gif_writer_is_what_pil_reads(tmp_path):
    path = tiny_frames_gif(tmp_path / "t.gif", 5, 4, 3, delay_cs=7, offset=lambda k: (k, k))
    with Image.open(path) as im:
        assert (im.size, im.n_frames) == ((5, 4), 3)
        im.seek(2)
        assert np.asarray(im.convert("L")).tolist()[2][2] == 255
    with path.open("rb") as fp:
        assert video_files._gif_delays(fp) == [70, 70, 70]


def gifs_of_one_size(counts: tuple[int, ...]) -> list[bytes]:
    """Animated GIFs of ``counts`` frames each, padded to one size (bytes after the trailer are ignored by every
    reader)."""
    frames = [Image.fromarray(f) for f in moving_frames(max(counts))]
    gifs = []
    for count in counts:
        out = io.BytesIO()
        frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:count], duration=100, loop=0)
        gifs.append(out.getvalue())
    size = max(len(gif) for gif in gifs)
    return [gif.ljust(size, b"\0") for gif in gifs]


def rewrite_in_place(path: Path, data: bytes) -> None:
    """``data`` written over ``path`` (same inode, same size), its modification time set back as ``cp -p``,
    ``touch -r`` and ``rsync --inplace -t`` do: only its change time tells."""
    before = path.stat()
    with path.open("r+b") as fp:
        fp.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)


def test_probe_reads_the_file_on_every_call(tmp_path, monkeypatch):
    """probe keeps no answers (a caller that needs one again passes it along): every call walks the file, and
    checks the caller's bound."""
    path = tmp_path / "clip.gif"
    frames = [Image.fromarray(f) for f in moving_frames(6)]
    frames[0].save(path, save_all=True, append_images=frames[1:4], duration=100, loop=0)
    walks = []
    real = video_files._probe
    monkeypatch.setattr(video_files, "_probe", lambda p, m: walks.append(p) or real(p, m))
    assert probe(path).frames == probe(path).frames == 4 and len(walks) == 2
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    assert probe(path).frames == 6 and len(walks) == 3
    with pytest.raises(DecodeLimitError):
        probe(path, max_frame_pixels=10)


def test_probe_reads_a_file_rewritten_in_place_with_its_size_and_time_restored(tmp_path):
    """A file written again in place at the same size, its modification time set back, keeps path, inode, size
    and mtime: probe still answers for what the file holds now."""
    four, six = gifs_of_one_size((4, 6))
    path = tmp_path / "clip.gif"
    path.write_bytes(four)
    assert probe(path).frames == 4
    rewrite_in_place(path, six)
    assert probe(path).frames == 6


def test_process_video_samples_by_the_callers_probe_without_probing_again(tmp_path, monkeypatch):
    """Given ``info`` (the caller's probe of the file), process_video reads no metadata itself and gives what it
    gives when it probes; the frame bound is still the call's own."""
    path = tmp_path / "clip.gif"
    path.write_bytes(gifs_of_one_size((6,))[0])
    info, want = probe(path), process_video(path)
    walks = []
    real = video_files._probe
    monkeypatch.setattr(video_files, "_probe", lambda p, m: walks.append(p) or real(p, m))
    got = process_video(path, info=info)
    assert not walks and got.frame_indices == want.frame_indices
    assert torch.equal(got.pixel_values, want.pixel_values) and torch.equal(got.grid_thw, want.grid_thw)
    with pytest.raises(DecodeLimitError, match=f"video {path}"):
        process_video(path, info=info, max_frame_pixels=10)
    with pytest.raises(ValueError, match="info describes a video file"):
        process_video(moving_frames(4), video_fps=10, info=info)


def pil_gif(frames: int = 4) -> bytes:
    """An animated GIF as PIL writes it: a NETSCAPE2.0 loop extension, then per frame a graphic control block."""
    out = io.BytesIO()
    images = [Image.fromarray(f) for f in moving_frames(frames)]
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=100, loop=0)
    return out.getvalue()


def pil_frames(path: Path) -> int | str:
    """PIL's own frame count of ``path``, or the name of what it raises counting."""
    try:
        with Image.open(path) as im:
            return im.n_frames
    except Exception as err:  # noqa: BLE001 - what PIL raises is the point
        return type(err).__name__


def _second_frame_gce(gif: bytes) -> int:
    first = gif.index(b"\x21\xf9\x04")
    return gif.index(b"\x21\xf9\x04", first + 1)


@pytest.mark.parametrize("cut, message", [
    ("netscape-without-loop", "NETSCAPE2.0 extension at offset .* has no loop sub-block"),
    ("empty-extension", "the extension at offset .* holds no data"),
    ("short-graphic-control", "graphic control block at offset .* has 2 of its 4 bytes"),
])
def test_a_gif_pil_would_misread_is_refused_in_one_line(tmp_path, cut, message):
    """Blocks that make PIL's walk lose its place (it counts other frames than the blocks describe, or raises):
    refused by the probe's own walk, which stands in for PIL's count, in one line naming the file."""
    gif = pil_gif()
    if cut == "netscape-without-loop":  # the name sub-block only: PIL reads one sub-block more
        at = gif.index(b"\x21\xff\x0bNETSCAPE2.0") + 14
        gif = gif[:at] + gif[at + 4:]  # drop "03 01 00 00", keep the terminator
    elif cut == "empty-extension":  # a plain-text extension of no data before the second frame
        at = _second_frame_gce(gif)
        gif = gif[:at] + b"\x21\x01\x00" + gif[at:]
    else:  # the second frame's graphic control block cut to 2 bytes
        at = _second_frame_gce(gif)
        gif = gif[:at] + b"\x21\xf9\x02" + gif[at + 3:at + 5] + gif[at + 7:]
    path = tmp_path / f"{cut}.gif"
    path.write_bytes(gif)
    assert pil_frames(path) != 4  # PIL misreads it: the refusal is not over caution
    with pytest.raises(ValueError, match=f"^video {path}: .*{message}") as err:
        probe(path)
    assert "\n" not in str(err.value)


def test_an_empty_comment_is_a_gif_pil_reads_alike(tmp_path):
    """A comment extension of no data is the one empty extension PIL skips correctly: accepted, 4 frames both ways."""
    gif = pil_gif()
    at = _second_frame_gce(gif)
    path = tmp_path / "comment.gif"
    path.write_bytes(gif[:at] + b"\x21\xfe\x00" + gif[at:])
    assert pil_frames(path) == 4 and probe(path).frames == 4
    with io.BytesIO(path.read_bytes()) as fp:  # a file object without a descriptor: read, not mapped
        assert video_files._gif_delays(fp) == [100] * 4


@contextlib.contextmanager
def ffmpeg_errors(caplog):
    """FFmpeg's error lines in ``caplog`` (PyAV passes them to Python's logging while its level is set)."""
    av_logging = pytest.importorskip("av.logging")
    was, skipped = av_logging.get_level(), av_logging.get_skip_repeated()
    av_logging.set_level(av_logging.ERROR)
    av_logging.set_skip_repeated(False)  # PyAV drops a line that repeats the one before it: a re-run test's line
    try:
        with caplog.at_level(logging.ERROR, logger="libav"):
            yield
    finally:
        av_logging.set_level(was)
        av_logging.set_skip_repeated(skipped)


PROBED_CONTAINERS = {"matroska": 40, "mp4": 41, "h264": 42, "mpegts": 43}


@pytest.mark.parametrize("fmt", PROBED_CONTAINERS)
def test_ffmpeg_is_told_the_frame_bound_while_it_probes_any_container(fmt, tmp_path, caplog):
    """The one ``av.open(path, options=...)`` gives FFmpeg max_pixels (twice the frame limit) for the frames its
    probe decodes, on every PyAV the package allows, in containers that name their streams up front (Matroska, MP4)
    and in those that find them while probing (a raw H.264 stream, MPEG-TS); each still opens. A 64×64 frame is
    above the bound here: FFmpeg logs that it refused it (the probe does not fail: its header gave the size)."""
    av = pytest.importorskip("av")
    path = tmp_path / f"clip.{fmt}"
    with av.open(str(path), "w", format=fmt) as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for k in range(3):
            frame = np.full((64, 64, 3), 40 * k, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    limit = PROBED_CONTAINERS[fmt]
    with ffmpeg_errors(caplog), video_files._open_pyav(av, path, limit) as container:
        assert container.streams.video[0].codec_context.width == 64
    assert f"64x64 exceeds specified max pixel count {2 * limit}" in caplog.text, caplog.text


def test_ffmpeg_is_told_the_frame_bound_for_every_stream_of_a_container_of_many(tmp_path, caplog):
    """A container of 257 streams, the last one's frame above the bound: FFmpeg's probe of that stream is bounded
    too (the bound is not given to a fixed number of streams, which a hostile file could outnumber)."""
    av = pytest.importorskip("av")
    path = tmp_path / "many.mkv"
    with av.open(str(path), "w") as container:
        streams = []
        for k in range(257):
            stream = container.add_stream("libx264", rate=10, options={"preset": "ultrafast"})
            stream.width = stream.height = 64 if k == 256 else 16
            stream.pix_fmt = "yuv420p"
            streams.append(stream)
        for stream in streams:
            frame = np.zeros((stream.height, stream.width, 3), np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
    with ffmpeg_errors(caplog), video_files._open_pyav(av, path, 1000) as container:
        assert len(container.streams.video) == 257
    assert "64x64 exceeds specified max pixel count 2000" in caplog.text, caplog.text
