"""Square thumbnails (THUMBQ_THUMB_FIT=cover) and a document's first pages (THUMBQ_PAGES), rendered
in this process."""

from __future__ import annotations

import io
import random

import pytest
from PIL import Image, ImageDraw, ImageFilter

from worker.engine.config import Config, ConfigError
from worker.thumbnails.render import RenderOptions, render
from worker.thumbnails.task import render_options

RED = (220, 30, 40)


def _scene(width: int, height: int, subject_x: float, seed: int = 1) -> bytes:
    """A soft, grey-blue background (sky, a wall) with a face-like subject, skin-toned with dark
    eyes and a red collar, centred at `subject_x` (a fraction of the width): a JPEG."""
    rng = random.Random(seed)
    img = Image.new("RGB", (width, height))
    draw = ImageDraw.Draw(img)
    for y in range(height):
        v = 140 + 60 * y // height
        draw.line([(0, y), (width, y)], fill=(v - 25, v - 10, v + 15))
    for _ in range(40):  # faint blotches, out of focus
        x, y, r = rng.randrange(width), rng.randrange(height), rng.randrange(20, 80)
        v = rng.randrange(130, 200)
        draw.ellipse([x - r, y - r, x + r, y + r], fill=(v - 20, v - 8, v + 10))
    img = img.filter(ImageFilter.GaussianBlur(12))
    draw = ImageDraw.Draw(img)
    cx, cy, r = int(subject_x * width), height // 2, height // 7
    draw.ellipse([cx - r, cy - int(1.3 * r), cx + r, cy + int(1.3 * r)], fill=(224, 172, 140))
    for dx in (-r // 3, r // 3):
        draw.ellipse(
            [cx + dx - 8, cy - r // 3 - 8, cx + dx + 8, cy - r // 3 + 8], fill=(30, 20, 20)
        )
    draw.rectangle([cx - r, cy + int(1.3 * r), cx + r, cy + int(1.3 * r) + r // 2], fill=RED)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.mark.parametrize("subject_x", [0.1, 0.9])
def test_cover_keeps_an_off_centre_subject_that_a_centre_crop_cuts_off(subject_x: float) -> None:
    data = _scene(1600, 900, subject_x)
    thumb = render(data, "image/jpeg", RenderOptions(sizes=SIZES, fit="cover"))
    big = _decode(thumb.renditions[-1].data)
    assert big.size == (512, 512)
    # The subject's red collar is in the square; a centre square (x 350-1250 of 1600) has none.
    assert any(_is_red(big.getpixel((x, y))) for x in range(0, 512, 4) for y in range(256, 512, 4))
    source = _decode(data)
    centre = source.crop((350, 0, 1250, 900))
    assert not any(
        _is_red(centre.getpixel((x, y))) for x in range(0, 900, 4) for y in range(450, 900, 4)
    )


def test_cover_makes_a_square_of_every_size_and_contain_keeps_the_aspect() -> None:
    photo = _scene(1600, 900, 0.5)
    portrait = _scene(900, 1600, 0.5)
    small = io.BytesIO()
    Image.new("RGB", (300, 200), (20, 120, 200)).save(small, "PNG")
    for data in (photo, portrait, _pdf(1), _pdf(1, 842, 595)):
        cover = render(data, None, RenderOptions(sizes=SIZES, fit="cover"))
        assert [(r.size, r.width, r.height) for r in cover.renditions] == [(s, s, s) for s in SIZES]
        for r in cover.renditions:
            assert _decode(r.data).size == (r.size, r.size)
        contain = render(data, None, RenderOptions(sizes=SIZES))
        assert max(contain.width, contain.height) == 512
        assert contain.width != contain.height
    # Whatever the renderer: HEIC (its size read from its boxes), and SVG and video, whose size
    # is not read before rendering (fitted into a box twice the square: 2:1 and 16:9 fill it;
    # the 320x180 clip is not enlarged).
    from tests.support import formats_corpus as fc

    for data, shorter in ((fc.heic_photo(), 4096), (fc.svg_drawing(), 4096), (fc.mp4_video(), 180)):
        cover = render(data, None, RenderOptions(sizes=SIZES, fit="cover"))
        squares = [(min(s, shorter), min(s, shorter)) for s in SIZES]
        assert [(r.width, r.height) for r in cover.renditions] == squares
    # A picture smaller than the box is not enlarged: its square is its shorter side.
    cover = render(small.getvalue(), None, RenderOptions(sizes=SIZES, fit="cover"))
    assert [(r.width, r.height) for r in cover.renditions] == [(128, 128), (200, 200), (200, 200)]


def test_cover_keeps_the_top_of_a_document_page() -> None:
    for width, height in ((595, 842), (842, 595)):  # a portrait page and a landscape slide
        thumb = render(_pdf(1, width, height), None, RenderOptions(sizes=SIZES, fit="cover"))
        big = _decode(thumb.renditions[-1].data)
        assert big.size == (512, 512)
        # The coloured band at the top is there, at the top; the page's black foot is not
        # (a portrait page's square ends at 595 of its 842 points).
        assert _is_red(big.getpixel((256, 5)))
        bottom = [big.getpixel((x, 508)) for x in range(0, 512, 16)]
        if height > width:
            assert all(min(p) > 200 for p in bottom)


def test_placeholders_follow_the_cropped_picture() -> None:
    # A wide picture: two thirds plain green, a textured red subject on the right. Contain's
    # dominant colour is the green; the square keeps the subject, and its colour is red.
    img = Image.new("RGB", (1500, 500), (40, 160, 60))
    draw = ImageDraw.Draw(img)
    draw.rectangle([1000, 0, 1500, 500], fill=RED)
    rng = random.Random(3)
    for _ in range(400):
        x, y = rng.randrange(1050, 1500), rng.randrange(0, 500)
        draw.rectangle([x, y, x + 30, y + 30], fill=(rng.randrange(190, 240), 30, 40))
    draw.rectangle([1000, 0, 1500, 500], outline=(0, 0, 0), width=3)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    contain = render(buf.getvalue(), None, RenderOptions(sizes=SIZES))
    cover = render(buf.getvalue(), None, RenderOptions(sizes=SIZES, fit="cover"))
    assert contain.dominant_color is not None and cover.dominant_color is not None
    g = int(contain.dominant_color[3:5], 16)
    assert g > 120  # green
    r, g = int(cover.dominant_color[1:3], 16), int(cover.dominant_color[3:5], 16)
    assert r > 150 and g < 100  # red
    assert cover.thumbhash != contain.thumbhash


def test_thumb_fit_and_pages_are_read_from_the_environment() -> None:
    assert Config.from_env({}).thumb_fit == "contain"
    assert Config.from_env({}).pages == 1
    config = Config.from_env({"THUMBQ_THUMB_FIT": "Cover", "THUMBQ_PAGES": "4"})
    assert (config.thumb_fit, config.pages) == ("cover", 4)
    opts = render_options(config)
    assert (opts.fit, opts.pages) == ("cover", 4)
    with pytest.raises(ConfigError, match="THUMBQ_THUMB_FIT must be contain or cover"):
        Config.from_env({"THUMBQ_THUMB_FIT": "fill"})
    with pytest.raises(ConfigError, match="THUMBQ_PAGES must be between 1 and 100"):
        Config.from_env({"THUMBQ_PAGES": "0"})


def test_pages_of_a_document_render_in_order_and_a_short_one_gives_what_it_has() -> None:
    data = _pdf(3)
    thumb = render(data, None, RenderOptions(sizes=SIZES, pages=5))
    assert [(r.page, r.size) for r in thumb.renditions] == [
        (p, s) for p in (1, 2, 3) for s in SIZES
    ]
    # The thumbnail itself, its size and placeholders are page 1's.
    assert thumb.data == thumb.renditions[2].data and thumb.thumbhash
    two = render(data, None, RenderOptions(sizes=SIZES, pages=2))
    assert [r.page for r in two.renditions] == [1, 1, 1, 2, 2, 2]
    one = render(data, None, RenderOptions(sizes=SIZES))
    assert [r.page for r in one.renditions] == [1, 1, 1]
    # A picture has one page whatever THUMBQ_PAGES says.
    photo = render(_scene(800, 600, 0.5), None, RenderOptions(sizes=SIZES, pages=5))
    assert [r.page for r in photo.renditions] == [1, 1, 1]


def _epub(chapters: int) -> bytes:
    """A book of `chapters` short chapters (a page each), chapter n headed "Chapter n"."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("thumbq-pages-book")
    book.set_title("A book of pages")
    book.set_language("en")
    items = []
    for n in range(1, chapters + 1):
        chapter = epub.EpubHtml(title=f"Chapter {n}", file_name=f"c{n}.xhtml", lang="en")
        chapter.content = f"<html><body><h1>Chapter {n}</h1><p>A short chapter.</p></body></html>"
        book.add_item(chapter)
        items.append(chapter)
    book.toc = tuple(items)
    book.spine = items
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    out = io.BytesIO()
    epub.write_epub(out, book)
    return out.getvalue()


def test_an_epubs_pages_until_the_book_ends() -> None:
    import pymupdf

    data = _epub(3)
    assert pymupdf.open(stream=data, filetype="epub").page_count == 3
    thumb = render(data, None, RenderOptions(size=256, pages=100))
    assert [r.page for r in thumb.renditions] == [1, 2, 3]
    two = render(data, None, RenderOptions(size=256, pages=2))
    assert [r.page for r in two.renditions] == [1, 2]


SIZES = (128, 256, 512)


def _decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def _pdf(pages: int, width: float = 595, height: float = 842) -> bytes:
    """A document whose page n has a coloured band across its top and "Page n" below it; the
    rest of each page is white, but for a black bar at its foot."""
    import pymupdf

    doc = pymupdf.open()
    for n in range(1, pages + 1):
        page = doc.new_page(width=width, height=height)
        page.draw_rect(pymupdf.Rect(0, 0, width, 60), color=None, fill=(0.86, 0.12, 0.16))
        page.insert_text((72, 120), f"Page {n}", fontsize=36)
        page.draw_rect(pymupdf.Rect(0, height - 60, width, height), color=None, fill=(0, 0, 0))
    return bytes(doc.tobytes())


def _is_red(pixel: tuple[int, ...]) -> bool:
    r, g, b = pixel[:3]
    return r > 170 and g < 90 and b < 90
