"""A still WebP is decoded at its thumbnail's size by libwebp's scaler (render/webp.py): the
thumbnail a user gets is the one a whole decode and a Lanczos resize would give, upright, with its
transparency, and a damaged file still ends `corrupt_input`."""

from __future__ import annotations

import functools
import io
import math

from PIL import Image, ImageChops, ImageStat

from bench.corpus import BLUE, GREEN, RED, photo_image, quadrant_image
from worker.engine.errors import CORRUPT_INPUT, ThumbqError
from worker.thumbnails.render import RenderOptions, render, webp

OPTS = RenderOptions()


@functools.cache
def _photo() -> Image.Image:
    return photo_image(2000, 1500, seed=3)


def _webp(img: Image.Image, **params: object) -> bytes:
    out = io.BytesIO()
    img.save(out, "WEBP", **params)
    return out.getvalue()


def _psnr(a: Image.Image, b: Image.Image) -> float:
    diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
    mse = sum(v * v for v in ImageStat.Stat(diff).rms) / 3
    return 10 * math.log10(255**2 / mse) if mse else 99.0


def _decoded(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def test_libwebp_is_at_hand_and_decodes_straight_to_the_thumbnails_size() -> None:
    # Pillow's wheel ships libwebp: without it every WebP would take the slow whole decode.
    assert webp.available()
    data = _webp(_photo(), quality=80)
    small = webp.decode_scaled(data, (512, 384), alpha=False)
    assert small is not None and small.size == (512, 384) and small.mode == "RGB"
    whole = _decoded(data).resize((512, 384), Image.Resampling.LANCZOS)
    # The rescaler averages areas, as the JPEG path's box step does: far above what WebP
    # quality 80 keeps of either (about 32 dB).
    assert _psnr(small, whole) > 40


def test_a_large_webp_photo_gives_the_thumbnail_of_a_whole_decode() -> None:
    source = _photo()
    thumb = render(_webp(source, quality=90), None, OPTS)
    assert (thumb.width, thumb.height) == (512, 384)
    reference = source.resize((512, 384), Image.Resampling.LANCZOS)
    assert _psnr(_decoded(thumb.data), reference) > 30


def test_a_rotated_webp_is_shown_upright() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 clockwise to display
    thumb = render(_webp(quadrant_image(1600, 1200), quality=90, exif=exif.tobytes()), None, OPTS)
    assert (thumb.width, thumb.height) == (384, 512)
    img = _decoded(thumb.data).convert("RGB")
    # The stored top-left (red) quadrant shows at the top right.
    for (x, y), colour in (((288, 128), RED), ((288, 384), GREEN), ((96, 128), BLUE)):
        pixel = img.getpixel((x, y))
        assert isinstance(pixel, tuple)
        assert all(abs(a - b) <= 40 for a, b in zip(pixel, colour, strict=True)), (x, y, pixel)


def test_a_webp_with_transparency_keeps_it() -> None:
    img = Image.new("RGBA", (2000, 1000), (0, 0, 0, 0))
    img.paste((*BLUE, 255), (0, 0, 1000, 1000))
    thumb = _decoded(render(_webp(img, lossless=True), None, OPTS).data)
    assert thumb.mode == "RGBA" and thumb.size == (512, 256)
    assert thumb.getpixel((128, 128))[3] == 255
    assert thumb.getpixel((384, 128))[3] == 0


def test_a_truncated_webp_is_corrupt_input() -> None:
    data = _webp(_photo(), quality=80)
    try:
        render(data[: len(data) // 2], None, OPTS)
    except ThumbqError as exc:
        assert exc.code == CORRUPT_INPUT, exc
    else:
        raise AssertionError("a truncated WebP was rendered")
