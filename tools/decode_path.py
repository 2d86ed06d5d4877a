"""CPU time of one decode worker's task (``glmvit.cli.serve_media.prepare_item``) per kind of media that
``bench-serve`` sends: a JSON content part with a base64 ``data:`` URL, decoded, checked, sampled and resized.

Media as ``bench-serve``'s random-mm makes them (seeded noise: the worst case for a compressor, as vLLM's random
images are): JPEG pictures of 224² and 448², clips of 8 frames of 224² and 16 frames of 448² as animated GIF, and as
MP4 where PyAV is installed. Each kind is run ``--repeats`` times after one warm-up call, in this one process; the
median and the fastest are reported, in ms per item, with the split ``prepare_item`` itself reports (decode:
the URL, the header's check, the frames' decoding; preprocess: the resize). ``--profile`` adds cProfile's top
functions by own time for one kind, over a repeat of its own, after the timed calls (a profiler is never attached
while a timed call runs)::

    python tools/decode_path.py
    python tools/decode_path.py --kinds gif448x16 --profile gif448x16 --top 12
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glmvit.cli.media_files import data_url, encode_clip, encode_image, mp4_available  # noqa: E402
from glmvit.cli.serve_media import MediaLimits, media_items, prepare_item  # noqa: E402

# name: (kind, frames, side, format)
KINDS = {"jpeg224": ("image", 1, 224, "jpeg"), "jpeg448": ("image", 1, 448, "jpeg"),
         "gif224x8": ("video", 8, 224, "gif"), "gif448x16": ("video", 16, 448, "gif"),
         "mp4224x8": ("video", 8, 224, "mp4"), "mp4448x16": ("video", 16, 448, "mp4")}
MERGE_AREA = 4  # the towers' 2 × 2 merge


def media_part(name: str, seed: int = 0) -> bytes:
    """A JSON body of one content part holding kind ``name`` as a data URL."""
    kind, frames, side, fmt = KINDS[name]
    pixels = np.random.default_rng(seed).integers(0, 256, (frames, side, side, 3), dtype=np.uint8)
    data = encode_image(pixels[0], fmt) if kind == "image" else encode_clip(pixels, fmt)
    return json.dumps({"content": [{"type": f"{kind}_url", f"{kind}_url": {"url": data_url(data, fmt)}}]}).encode()


def time_kind(name: str, repeats: int) -> dict[str, Any]:
    """ms per item of ``prepare_item`` on kind ``name``: median, fastest, and the median decode/preprocess split."""
    body = media_part(name)
    item = media_items("json", body)[0]
    limits = MediaLimits()
    prepare_item(0, item, limits, limits.max_request_pixels, MERGE_AREA)  # warm-up: imports, PIL plugins
    walls, splits = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        prepared = prepare_item(0, item, limits, limits.max_request_pixels, MERGE_AREA)
        walls.append(1000 * (time.perf_counter() - start))
        splits.append(prepared.timing)
    return {"kind": name, "bytes": len(body), "repeats": repeats, "median_ms": statistics.median(walls),
            "min_ms": min(walls), **{f"{step}_ms": statistics.median(1000 * s[step] for s in splits)
                                     for step in ("decode", "preprocess")}}


def profile_kind(name: str, top: int) -> str:
    """cProfile's top ``top`` functions by own time over one ``prepare_item`` of kind ``name``."""
    item, limits = media_items("json", media_part(name))[0], MediaLimits()
    profile = cProfile.Profile()
    profile.enable()
    prepare_item(0, item, limits, limits.max_request_pixels, MERGE_AREA)
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    available = [k for k, (_, _, _, fmt) in KINDS.items() if fmt != "mp4" or mp4_available()]
    parser.add_argument("--kinds", default=",".join(available), help=f"comma list of {', '.join(KINDS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", metavar="KIND", help="also profile one kind, after the timed calls")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for name in kinds + ([args.profile] if args.profile else []):
        if name not in KINDS:
            parser.error(f"unknown kind {name!r}: choose from {', '.join(KINDS)}")
        if KINDS[name][3] == "mp4" and not mp4_available():
            parser.error(f"{name} needs PyAV (pip install av)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    rows = [time_kind(name, args.repeats) for name in kinds]
    print(f"{'kind':<10} {'KiB':>7} {'median ms':>10} {'min ms':>8} {'decode':>8} {'preprocess':>10}")
    for r in rows:
        print(f"{r['kind']:<10} {r['bytes'] / 1024:>7.0f} {r['median_ms']:>10.2f} {r['min_ms']:>8.2f} "
              f"{r['decode_ms']:>8.2f} {r['preprocess_ms']:>10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.profile:
        print(profile_kind(args.profile, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
