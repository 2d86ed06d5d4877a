"""Rebuild data/clip.gif: a slow zoom into data/images/coffee.jpg, 20 frames at 10 fps (deterministic).

10 fps because GIF stores frame durations in centiseconds: 100 ms is exact, 125 ms (8 fps) is not.
Usage: python data/make_clip.py
"""
from pathlib import Path

from PIL import Image

HERE = Path(__file__).resolve().parent
FRAMES, FPS = 20, 10
SIZE = (240, 160)  # output width, height (3:2 like the photo)
START = (0.0, 0.0, 600.0, 400.0)  # crop boxes (left, top, right, bottom) in source pixels
END = (150.0, 60.0, 450.0, 260.0)  # half-size box around the cup


def crop_box(k: int) -> tuple[float, float, float, float]:
    """The crop box of frame k, eased (smoothstep) from START to END."""
    s = k / (FRAMES - 1)
    s = s * s * (3 - 2 * s)
    return tuple(float(a + (b - a) * s) for a, b in zip(START, END, strict=False))


def main() -> None:
    with Image.open(HERE / "images" / "coffee.jpg") as im:
        photo = im.convert("RGB")
    frames = [photo.resize(SIZE, Image.Resampling.BICUBIC, box=crop_box(k)) for k in range(FRAMES)]
    palette = frames[0].quantize(colors=256, dither=Image.Dither.NONE)
    paletted = [f.quantize(palette=palette, dither=Image.Dither.NONE) for f in frames]
    paletted[0].save(
        HERE / "clip.gif", save_all=True, append_images=paletted[1:], duration=1000 // FPS, loop=0, optimize=False
    )


if __name__ == "__main__":
    main()
