"""What a user sees of the renderer: the right thumbnail or the right error for every kind of file,
and render processes that are stopped at their deadline or memory limit and keep working."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
import warnings

import pymupdf
import pytest
from PIL import Image

from bench import corpus
from bench.corpus import BLUE, CORPUS, GREEN, RED
from worker.engine.errors import (
    CORRUPT_INPUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    ThumbqError,
)
from worker.thumbnails.render import RenderOptions, Thumbnail, render
from worker.thumbnails.render.sniff import sniff

OPTS = RenderOptions()
# The slow PDF takes minutes in-process; it is exercised through RenderPool below.
IN_PROCESS = sorted(name for name in CORPUS if name != "slow_pdf")


def decode(thumb: Thumbnail) -> Image.Image:
    img = Image.open(io.BytesIO(thumb.data))
    img.load()
    return img


def close_to(pixel: object, colour: tuple[int, int, int], tolerance: int = 40) -> bool:
    assert isinstance(pixel, tuple)
    return all(abs(a - b) <= tolerance for a, b in zip(pixel[:3], colour, strict=True))


def render_error(
    data: bytes, declared: str | None = None, opts: RenderOptions = OPTS
) -> ThumbqError:
    with pytest.raises(ThumbqError) as info:
        render(data, declared, opts)
    return info.value


# -- every corpus file ends as its table says -----------------------------------------------------


@pytest.mark.parametrize("name", IN_PROCESS)
def test_every_corpus_file_gives_its_expected_thumbnail_or_error(name: str) -> None:
    sample = CORPUS[name]
    if sample.error_code is None:
        thumb = render(sample.data, sample.declared_type, OPTS)
        assert thumb.content_type == "image/webp"
        img = decode(thumb)
        assert img.format == "WEBP"
        assert img.size == (thumb.width, thumb.height)
        assert max(img.size) <= 512
        assert thumb.source_type == sniff(sample.data)
    else:
        error = render_error(sample.data, sample.declared_type)
        assert error.code == sample.error_code
        assert error.message  # a sentence for a person
        expected = "unsupported" if error.code == UNSUPPORTED_TYPE else "failed"
        assert sample.status == expected


def test_a_text_file_declared_as_pdf_is_unsupported_and_the_message_names_both_types() -> None:
    error = render_error(corpus.text_declared_pdf(), "application/pdf")
    assert error.code == UNSUPPORTED_TYPE
    assert "application/pdf" in error.message and "text/plain" in error.message


def test_the_type_comes_from_the_bytes_not_the_declared_type() -> None:
    thumb = render(corpus.small_jpeg(), "image/png", OPTS)
    assert thumb.source_type == "image/jpeg"
    thumb = render(corpus.a4_pdf(), "application/octet-stream", OPTS)
    assert thumb.source_type == "application/pdf"


def test_sniff_recognises_what_it_must() -> None:
    assert sniff(corpus.junk_prefixed_pdf()) == "application/pdf"
    assert sniff(corpus.tiff_little_endian()) == "image/tiff"
    assert sniff(corpus.tiff_big_endian()) == "image/tiff"
    assert sniff(corpus.bmp_image()) == "image/bmp"
    assert sniff(corpus.animated_webp()) == "image/webp"
    assert sniff(corpus.svg_image()) == "image/svg+xml"
    assert sniff(b"BM is how this note starts, not a bitmap") == "text/plain"
    assert sniff(b"\x00\x01\x02\x03" * 10) is None


def test_a_file_over_the_byte_limit_is_too_large_before_decoding() -> None:
    error = render_error(corpus.small_jpeg(), "image/jpeg", RenderOptions(max_bytes=1000))
    assert error.code == TOO_LARGE


# -- PDF ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "size"),
    [
        (corpus.a4_pdf, (362, 512)),  # 595 x 842 pt
        (corpus.tiny_page_pdf, (512, 256)),  # 100 x 50 pt: rendered up, not left tiny
        (corpus.huge_page_pdf, (512, 512)),  # 5000 x 5000 pt: rendered straight down
        (corpus.slide_pdf, (512, 288)),  # 960 x 540 pt
    ],
)
def test_a_pdf_page_fills_the_box_whatever_its_size_in_points(make: object, size: tuple) -> None:
    assert callable(make)
    thumb = render(make(), "application/pdf", OPTS)
    assert (thumb.width, thumb.height) == size
    img = decode(thumb).convert("RGB")
    # The top-left quarter of these pages is red, the bottom-right blue, the rest white paper.
    if make is not corpus.slide_pdf:
        w, h = img.size
        assert close_to(img.getpixel((w // 4, h // 4)), (220, 31, 31))
        assert close_to(img.getpixel((w * 3 // 4, h * 3 // 4)), (31, 61, 220))
        assert close_to(img.getpixel((w // 4, h * 3 // 4)), (255, 255, 255), 10)


def test_a_tiny_page_is_rasterised_crisply_at_the_final_size() -> None:
    # Rendered straight at 512 px, the edge between red and white is sharp: at most one pixel
    # of blend, where rendering 100 pt at 72 dpi and enlarging would smear it over five.
    img = decode(render(corpus.tiny_page_pdf(), None, OPTS)).convert("RGB")
    row = [img.getpixel((x, 60)) for x in range(240, 272)]
    blended = [p for p in row if not close_to(p, (220, 31, 31), 12) and min(p) < 240]
    assert len(blended) <= 2


def test_a_rotated_page_is_shown_as_a_viewer_shows_it() -> None:
    # A4 portrait with /Rotate 90 displays landscape; its top-left (red) ends at the top right.
    thumb = render(corpus.rotated_pdf(), None, OPTS)
    assert (thumb.width, thumb.height) == (512, 362)
    img = decode(thumb).convert("RGB")
    assert close_to(img.getpixel((512 * 3 // 4, 362 // 4)), (220, 31, 31))
    assert close_to(img.getpixel((512 // 4, 362 * 3 // 4)), (31, 61, 220))


def test_the_configured_page_is_rendered_and_a_short_document_falls_back_to_its_last_page() -> None:
    data = corpus.multipage_pdf()
    pages = {n: render(data, None, RenderOptions(pdf_page=n)).data for n in (1, 3, 5, 99)}
    assert pages[1] != pages[3] != pages[5]
    assert pages[99] == pages[5]


def test_a_pdf_with_thousands_of_pages_renders_its_first_page_quickly() -> None:
    started = time.monotonic()
    thumb = render(corpus.many_pages_pdf(), None, OPTS)
    assert time.monotonic() - started < 2.0
    assert (thumb.width, thumb.height) == (362, 512)
    error = render_error(corpus.many_pages_pdf(), None, RenderOptions(max_pages=1000))
    assert error.code == TOO_LARGE and "3,000 pages" in error.message


def test_an_owner_password_alone_does_not_stop_rendering() -> None:
    assert render(corpus.owner_password_pdf(), None, OPTS).width == 362


def test_a_truncated_pdf_is_corrupt_input() -> None:
    error = render_error(corpus.truncated_pdf(), "application/pdf")
    assert error.code == CORRUPT_INPUT


# -- images ---------------------------------------------------------------------------------------


def test_a_large_photo_fits_the_box_with_its_aspect_kept() -> None:
    thumb = render(corpus.jpeg_4000x3000(), "image/jpeg", OPTS)
    assert (thumb.width, thumb.height) == (512, 384)


def test_an_image_smaller_than_the_box_is_not_enlarged() -> None:
    thumb = render(corpus.small_png(), None, OPTS)
    assert (thumb.width, thumb.height) == (100, 80)
    thumb = render(corpus.tiff_big_endian(), None, OPTS)
    assert (thumb.width, thumb.height) == (64, 48)


def test_exif_orientation_is_applied() -> None:
    # Stored 800x600 with orientation 6 (rotate 90 clockwise to display): portrait, and the stored
    # top-left red quadrant shows at the top right.
    thumb = render(corpus.exif_rotated_jpeg(), "image/jpeg", OPTS)
    assert (thumb.width, thumb.height) == (384, 512)
    img = decode(thumb).convert("RGB")
    assert close_to(img.getpixel((384 * 3 // 4, 512 // 4)), RED)
    assert close_to(img.getpixel((384 * 3 // 4, 512 * 3 // 4)), GREEN)
    assert close_to(img.getpixel((384 // 4, 512 // 4)), BLUE)


def test_transparency_is_kept_in_webp_and_flattened_on_white_in_jpeg() -> None:
    webp = decode(render(corpus.png_alpha(), None, OPTS))
    assert webp.mode == "RGBA"
    assert webp.getpixel((100, 100))[3] == 255
    assert webp.getpixel((400, 100))[3] == 0

    thumb = render(corpus.png_alpha(), None, RenderOptions(format="jpeg"))
    jpeg = decode(thumb)
    assert jpeg.mode == "RGB"
    assert close_to(jpeg.getpixel((100, 100)), BLUE)
    assert close_to(jpeg.getpixel((400, 100)), (255, 255, 255), 6)


def test_a_palette_image_with_a_transparent_colour_keeps_it() -> None:
    img = decode(render(corpus.png_palette_transparent(), None, RenderOptions(format="jpeg")))
    assert close_to(img.getpixel((150, 150)), RED)
    assert close_to(img.getpixel((10, 10)), (255, 255, 255), 6)


def test_cmyk_colours_come_out_right() -> None:
    img = decode(render(corpus.cmyk_jpeg(), "image/jpeg", OPTS)).convert("RGB")
    assert img.size == (512, 256)
    left, right = img.getpixel((128, 128)), img.getpixel((384, 128))
    assert isinstance(left, tuple) and isinstance(right, tuple)
    assert left[0] > 200 and left[1] < 60 and left[2] < 60  # red, not cyan (inverted CMYK)
    assert right[2] > 200 and right[0] < 60 and right[1] < 60  # blue


def test_16_bit_grey_keeps_its_tones() -> None:
    # A ramp from 0 to 65535: dark on the left, mid-grey in the middle, light on the right,
    # where clipping to 8 bits would make almost all of it white.
    img = decode(render(corpus.png_16bit_grey(), "image/png", OPTS)).convert("L")
    assert img.size == (512, 128)
    left, middle, right = (img.getpixel((x, 64)) for x in (5, 256, 506))
    assert isinstance(left, int) and isinstance(middle, int) and isinstance(right, int)
    assert left < 15 and 110 < middle < 145 and right > 240


@pytest.mark.parametrize("make", [corpus.animated_gif, corpus.animated_webp])
def test_an_animation_gives_its_first_frame(make: object) -> None:
    assert callable(make)
    img = decode(render(make(), None, OPTS)).convert("RGB")
    assert close_to(img.getpixel((100, 75)), RED)


def webp_codec(data: bytes) -> str:
    """The codec chunk of a WebP file: "VP8L" (lossless) or "VP8 " (lossy)."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    pos = 12
    while pos + 8 <= len(data):
        fourcc, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if fourcc in (b"VP8L", b"VP8 "):
            return fourcc.decode()
        pos += 8 + size + (size & 1)
    raise AssertionError("no image chunk in the WebP file")


def text_page_pdf() -> bytes:
    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    for line in range(40):
        page.insert_text(
            (50, 60 + 18 * line), f"Line {line}: the quick brown fox jumps over", fontsize=11
        )
    return doc.tobytes()


def test_a_text_page_is_stored_exactly_in_fewer_bytes_than_the_lossy_encoding() -> None:
    # A page of text is a few colours on white: WebP's lossless mode keeps every letter exact
    # (no ringing around the strokes) in fewer bytes than the lossy mode's artefacts cost.
    data = text_page_pdf()
    thumb = render(data, None, OPTS)
    assert webp_codec(thumb.data) == "VP8L"
    page = pymupdf.open(stream=data)[0]
    scale = 512 / max(page.rect.width, page.rect.height)
    pix = page.get_pixmap(matrix=pymupdf.Matrix(scale, scale), alpha=False)
    raster = Image.frombytes("RGB", (pix.width, pix.height), pix.samples)
    assert decode(thumb).convert("RGB").tobytes() == raster.tobytes()
    lossy = io.BytesIO()
    raster.save(lossy, "WEBP", quality=OPTS.quality, method=0)
    assert len(thumb.data) < 0.8 * len(lossy.getvalue())


def test_photos_and_dithered_pictures_stay_lossy() -> None:
    # A photo has thousands of colours; a picture of 256 dithered colours (a GIF of a photo)
    # has few, but no background, and lossless would make it twice the size.
    photo = corpus.photo_image(800, 600, seed=3)
    dithered = photo.convert("P", palette=Image.Palette.ADAPTIVE, colors=256)
    for picture in (photo, dithered):
        out = io.BytesIO()
        picture.save(out, "PNG")
        assert webp_codec(render(out.getvalue(), None, OPTS).data) == "VP8 "


def test_a_grey_photo_on_a_white_page_is_never_larger_than_its_lossy_encoding() -> None:
    # Few colours (256 greys at most) and a background, like a graphic, but a photo's gradients
    # cost lossless WebP four to five times the lossy bytes: the smaller encoding is kept.
    page = Image.new("L", (800, 600), 255)
    page.paste(corpus.photo_image(300, 300, seed=2).convert("L"), (40, 20))
    out = io.BytesIO()
    page.save(out, "PNG")
    thumb = render(out.getvalue(), None, OPTS)
    picture = decode(thumb).convert("RGB")
    lossy = io.BytesIO()
    page.convert("RGB").resize(picture.size, Image.Resampling.LANCZOS).save(
        lossy, "WEBP", quality=OPTS.quality, method=0
    )
    assert webp_codec(thumb.data) == "VP8 "
    assert len(thumb.data) <= 1.1 * len(lossy.getvalue())


def test_jpeg_output_on_request() -> None:
    thumb = render(corpus.slide_pdf(), None, RenderOptions(format="jpeg", quality=85))
    assert thumb.content_type == "image/jpeg"
    assert decode(thumb).format == "JPEG"


def test_a_bomb_under_pillows_own_limit_is_refused_by_ours_before_decoding() -> None:
    # 100 MP: above thumbq's 80 MP default but below the 179 MP at which Pillow itself refuses.
    bomb = corpus.png_bomb(10_000, 10_000)
    started = time.monotonic()
    error = render_error(bomb, "image/png")
    assert error.code == TOO_LARGE and "80,000,000" in error.message
    assert time.monotonic() - started < 0.5


def test_hostile_files_leave_no_output_or_warnings(capfd: pytest.CaptureFixture[str]) -> None:
    # A worker's stdout carries its JSON log lines; MuPDF and Pillow must not write into it.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        render_error(corpus.png_bomb(10_000, 10_000))
        render_error(corpus.png_bomb())
        render_error(corpus.truncated_pdf())
        render_error(corpus.corrupt_jpeg())
        render(corpus.junk_prefixed_pdf(), None, OPTS)
    out, err = capfd.readouterr()
    assert (out, err, [str(w.message) for w in caught]) == ("", "", [])


def test_importing_the_render_package_loads_neither_pymupdf_nor_pillow() -> None:
    code = (
        "import sys, worker.thumbnails.render, worker.thumbnails.render.process; "
        "assert 'pymupdf' not in sys.modules and 'PIL' not in sys.modules, sys.modules.keys()"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=os.path.dirname(__file__) + "/../.."
    )


# -- RenderPool -----------------------------------------------------------------------------------


# -- portability: the same code path on macOS ------------------------------------------------------
