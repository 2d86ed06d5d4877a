"""Rebuild data/images/ from scikit-image's bundled sample data (see README.md).

Usage: python data/make_images.py PATH/TO/site-packages/skimage/data
Needs only pillow; scikit-image itself need not be importable, only its data folder present.
"""
import sys
from pathlib import Path

from PIL import Image

# output name: (source file, crop box (left, top, right, bottom) or None for the whole photo)
IMAGES = {
    "astronaut.jpg": ("astronaut.png", None),  # 512×512, square
    "coffee.jpg": ("coffee.png", None),  # 600×400, landscape
    "chelsea.jpg": ("chelsea.png", None),  # 451×300, landscape with an odd width
    "rocket.jpg": ("rocket.jpg", (160, 0, 480, 427)),  # 320×427 portrait crop around the rocket
}


def main(skimage_data: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, (source, box) in IMAGES.items():
        with Image.open(skimage_data / source) as im:
            image = im.convert("RGB")
        if box is not None:
            image = image.crop(box)
        image.save(out / name, quality=90, optimize=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).resolve().parent / "images")
