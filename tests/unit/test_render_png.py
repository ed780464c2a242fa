"""8-bit RGB(A) PNGs are decoded by libspng (render/png.py): the thumbnail a user gets is Pillow's,
pixel for pixel, upright, with its transparency and colour profile; the other kinds of PNG and a
damaged file end as before."""

from __future__ import annotations

import io
import math
import struct
import zlib

import pytest
from PIL import Image, ImageChops, ImageStat

from bench.corpus import BLUE, RED, photo_image, quadrant_image
from worker.engine.errors import CORRUPT_INPUT, ThumbqError
from worker.thumbnails.render import RenderOptions, png, render

OPTS = RenderOptions()


def _png(img: Image.Image, **params: object) -> bytes:
    out = io.BytesIO()
    img.save(out, "PNG", **params)
    return out.getvalue()


def _header(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def _pillow(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _rgb16_png(width: int, height: int, pixel: tuple[int, int, int]) -> bytes:
    """A 16-bit RGB PNG of one colour (Pillow writes none)."""
    row = b"\x00" + struct.pack(">HHH", *pixel) * width
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(row * height))
        + _chunk(b"IEND", b"")
    )


def test_libspng_is_at_hand_and_gives_pillows_pixels_exactly() -> None:
    assert png.available()
    for img in (photo_image(900, 600, seed=4), photo_image(900, 600, seed=5).convert("RGBA")):
        data = _png(img)
        fast = png.decode(data, _header(data))
        assert fast is not None and fast.mode == img.mode and fast.size == img.size
        assert ImageChops.difference(fast, _pillow(data)).getbbox() is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: _png(Image.new("P", (60, 40))),  # palette
        lambda: _png(Image.new("L", (60, 40))),  # grey
        lambda: _png(Image.new("RGB", (60, 40)), transparency=(0, 0, 0)),  # a transparent colour
    ],
    ids=["palette", "grey", "rgb-with-trns"],
)
def test_other_kinds_of_png_stay_with_pillow(make: object) -> None:
    assert callable(make)
    data = make()
    assert png.decode(data, _header(data)) is None


def test_a_16_bit_rgb_png_gives_the_same_8_bit_picture_as_pillow() -> None:
    data = _rgb16_png(40, 20, (0xFF00, 0x8000, 0x0100))
    fast = png.decode(data, _header(data))
    assert fast is not None and fast.getpixel((0, 0)) == _pillow(data).getpixel((0, 0))


def test_a_large_png_gives_the_thumbnail_of_a_whole_decode_and_a_lanczos_resize() -> None:
    data = _png(photo_image(1920, 1080, seed=6))
    thumb = render(data, None, OPTS)
    assert (thumb.width, thumb.height) == (512, 288)
    reference = _pillow(data).resize((512, 288), Image.Resampling.LANCZOS, reducing_gap=1.0)
    diff = ImageChops.difference(_pillow(thumb.data).convert("RGB"), reference)
    mse = sum(v * v for v in ImageStat.Stat(diff).rms) / 3
    assert 10 * math.log10(255**2 / mse) > 30  # what WebP quality 80 keeps of any picture


def test_transparency_and_the_colour_profile_are_kept() -> None:
    from PIL import ImageCms

    profile = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    img = Image.new("RGBA", (1200, 600), (0, 0, 0, 0))
    img.paste((*BLUE, 255), (0, 0, 600, 600))
    thumb = render(_png(img, icc_profile=profile), None, OPTS)
    out = _pillow(thumb.data)
    assert out.mode == "RGBA" and out.getpixel((64, 64))[3] == 255
    assert out.getpixel((448, 64))[3] == 0
    assert out.info.get("icc_profile") == profile


def test_an_exif_orientation_after_the_pixels_is_still_applied() -> None:
    # A PNG's EXIF may follow its pixels, where only Pillow's full load reads it.
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 clockwise to display
    data = _png(quadrant_image(800, 600))
    end = data.rindex(b"IEND") - 4
    data = data[:end] + _chunk(b"eXIf", exif.tobytes()) + data[end:]
    thumb = render(data, None, OPTS)
    assert (thumb.width, thumb.height) == (384, 512)
    pixel = _pillow(thumb.data).convert("RGB").getpixel((288, 128))  # stored top-left, red
    assert isinstance(pixel, tuple)
    assert all(abs(a - b) <= 40 for a, b in zip(pixel, RED, strict=True)), pixel


def test_a_truncated_png_is_corrupt_input() -> None:
    data = _png(photo_image(900, 600, seed=4))
    with pytest.raises(ThumbqError) as info:
        render(data[: len(data) // 2], None, OPTS)
    assert info.value.code == CORRUPT_INPUT
