"""Cover crops (THUMBQ_THUMB_FIT=cover): how often the square keeps the picture's subject, thumbq's
attention crop against a centre crop and against libvips' own attention crop (pyvips'
`smartcrop`), on pictures made here whose subject's place is known; and what the crop costs.

The corpus: scenes of 3:2, 4:3, 16:9 and 2:3 with one subject (a face: skin tones and dark eyes;
a saturated object; a textured object in a colour close to its background) at a random place,
on one of four backgrounds (a smooth gradient, out-of-focus blotches, fine grain all over, a
busy texture with a bright stripe elsewhere in the picture). A square keeps the subject when it
holds at least 90% of the subject's extent along the side the square slides on.

Run: python -m bench.crop [--pictures 200] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from PIL import Image, ImageDraw, ImageFilter

from bench.common import write_result
from worker.thumbnails.render import RenderOptions, render
from worker.thumbnails.render.output import attention_offset

ASPECTS = ((1500, 1000), (1600, 1200), (1920, 1080), (1000, 1500))
SUBJECTS = ("face", "saturated", "textured")
BACKGROUNDS = ("gradient", "blotches", "grain", "busy")
KEEP = 0.9


def scene(seed: int) -> tuple[Image.Image, tuple[int, int], dict[str, Any]]:
    """A picture, its subject's extent along the longer side (start, end), and what it holds."""
    rng = random.Random(seed)
    width, height = rng.choice(ASPECTS)
    subject, background = rng.choice(SUBJECTS), rng.choice(BACKGROUNDS)
    base = tuple(rng.randrange(90, 200) for _ in range(3))
    img = Image.new("RGB", (width, height), base)  # type: ignore[arg-type]
    draw = ImageDraw.Draw(img)
    for y in range(0, height, 4):  # a sky-like gradient under everything
        shade = tuple(max(0, min(255, c - 30 + 60 * y // height)) for c in base)
        draw.rectangle([0, y, width, y + 4], fill=shade)  # type: ignore[arg-type]
    if background in ("blotches", "busy"):
        for _ in range(60):
            x, y, r = rng.randrange(width), rng.randrange(height), rng.randrange(20, 120)
            c = tuple(max(0, min(255, v + rng.randrange(-40, 40))) for v in base)
            draw.ellipse([x - r, y - r, x + r, y + r], fill=c)  # type: ignore[arg-type]
        img = img.filter(ImageFilter.GaussianBlur(10 if background == "blotches" else 1))
        draw = ImageDraw.Draw(img)
    if background == "busy":
        for _ in range(300):  # twigs, gravel: edges everywhere
            x, y = rng.randrange(width), rng.randrange(height)
            c = tuple(max(0, min(255, v + rng.randrange(-60, 60))) for v in base)
            draw.line([x, y, x + rng.randrange(-40, 40), y + rng.randrange(-40, 40)], fill=c)  # type: ignore[arg-type]
        # A bright stripe (a road sign, a towel) somewhere else in the picture.
        sx = rng.randrange(width)
        draw.rectangle([sx, 0, sx + 25, height // 5], fill=(250, 200, 0))
    landscape = width > height
    long_side, short_side = (width, height) if landscape else (height, width)
    size = int(short_side * rng.uniform(0.22, 0.4))
    # Anywhere along the longer side, mostly away from the middle (where a centre crop would do).
    centre = int(rng.uniform(size / 2 + 5, long_side - size / 2 - 5))
    across = rng.randrange(size // 2 + 5, short_side - size // 2 - 5)
    cx, cy = (centre, across) if landscape else (across, centre)
    box = [cx - size // 2, cy - size // 2, cx + size // 2, cy + size // 2]
    if subject == "face":
        draw.ellipse(box, fill=(222, 170, 138))
        e, ey = max(3, size // 16), cy - size // 8
        for dx in (-size // 6, size // 6):
            draw.ellipse([cx + dx - e, ey - e, cx + dx + e, ey + e], fill=(35, 25, 25))
        mouth = [cx - size // 5, cy, cx + size // 5, cy + size // 4]
        draw.arc(mouth, 20, 160, fill=(120, 40, 40), width=3)
    elif subject == "saturated":
        draw.rounded_rectangle(box, radius=size // 6, fill=(30, 90, 230))
        q = size // 4
        draw.ellipse([cx - q, cy - q, cx + q, cy + q], fill=(240, 40, 30))
    else:
        tone = tuple(max(0, min(255, v + 35)) for v in base)
        draw.rectangle(box, fill=tone)  # type: ignore[arg-type]
        for i in range(box[0], box[2], max(4, size // 12)):
            draw.line([i, box[1], i, box[3]], fill=(20, 20, 20), width=2)
        for j in range(box[1], box[3], max(4, size // 12)):
            draw.line([box[0], j, box[2], j], fill=(20, 20, 20), width=2)
    extent = (box[0], box[2]) if landscape else (box[1], box[3])
    return img, extent, {"subject": subject, "background": background, "size": [width, height]}


def kept(offset: int, side: int, extent: tuple[int, int]) -> bool:
    start, end = extent
    inside = max(0, min(end, offset + side) - max(start, offset))
    return inside >= KEEP * (end - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pictures", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    import pyvips

    pyvips.cache_set_max(0)
    counts = {"thumbq": 0, "centre": 0, "libvips": 0}
    by_kind: dict[str, dict[str, int]] = {}
    crop_ms: list[float] = []
    for i in range(args.pictures):
        img, extent, what = scene(args.seed * 100_000 + i)
        # The crop sees what finish() sees: the picture fitted so that its shorter side is 512.
        width, height = img.size
        scale = 512 / min(width, height)
        fitted = img.resize((round(width * scale), round(height * scale)), Image.Resampling.LANCZOS)
        extent_fitted = (round(extent[0] * scale), round(extent[1] * scale))
        started = time.perf_counter()
        offset = attention_offset(fitted)
        crop_ms.append((time.perf_counter() - started) * 1000)
        long_side = max(fitted.size)
        centre = (long_side - 512) // 2
        vips = pyvips.Image.new_from_memory(
            fitted.tobytes(), fitted.width, fitted.height, 3, "uchar"
        )
        cropped = vips.smartcrop(512, 512, interesting="attention")
        vips_offset = -(cropped.xoffset if width > height else cropped.yoffset)
        results = {
            "thumbq": kept(offset, 512, extent_fitted),
            "centre": kept(centre, 512, extent_fitted),
            "libvips": kept(vips_offset, 512, extent_fitted),
        }
        for name, ok in results.items():
            counts[name] += ok
            row = by_kind.setdefault(f"{what['subject']}/{what['background']}", {"pictures": 0})
            row[name] = row.get(name, 0) + ok
        by_kind[f"{what['subject']}/{what['background']}"]["pictures"] += 1
    # The whole render's cost, cover against contain, timed in turns: a 12 MP JPEG and a
    # 1920x1080 PNG.
    from bench.formats import jpeg_12mp, png_screenshot

    costs = {}
    for name, data in (("jpeg_12mp", jpeg_12mp()), ("png_screenshot", png_screenshot(1))):
        times: dict[str, list[float]] = {"contain": [], "cover": []}
        for _ in range(11):
            for fit in times:
                started = time.perf_counter()
                render(data, None, RenderOptions(fit=fit))
                times[fit].append((time.perf_counter() - started) * 1000)
        costs[name] = {f"{fit}_ms": round(statistics.median(t[1:]), 1) for fit, t in times.items()}
    n = args.pictures
    result = {
        "pictures": n,
        "kept_subject": {k: v for k, v in counts.items()},
        "kept_share": {k: round(v / n, 3) for k, v in counts.items()},
        "by_subject_and_background": by_kind,
        "attention_ms_median": round(statistics.median(crop_ms), 2),
        "attention_ms_p90": round(sorted(crop_ms)[int(0.9 * len(crop_ms))], 2),
        "render_ms": costs,
        "keep_rule": f"the square holds >= {KEEP:.0%} of the subject's extent along its side",
    }
    write_result("crop", result)


if __name__ == "__main__":
    main()
