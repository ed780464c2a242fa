"""Sample and hostile inputs, made in memory (nothing downloaded), with the outcome each must have.

Each maker function returns bytes and caches them for the life of the process. `CORPUS`
maps a name to a `Sample`: its declared content type and the terminal job outcome thumbq must reach
(status, error_code), so the renderer tests, the batch tests and bench/hostile.py share one list.
`tiny_png`, `photo_jpeg` and `vector_pdf` make many distinct cheap files from a seed.

It lives in bench/ because benchmarks make their inputs with it (and bench/ imports nothing from
tests/); the tests import it from here.
"""

from __future__ import annotations

import functools
import io
import math
import random
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from PIL import Image, ImageDraw

# Colours the tests look for in the rendered thumbnails.
RED = (220, 30, 30)
BLUE = (30, 60, 220)
GREEN = (30, 180, 60)

# About 1.5 ms per draw at 512 px on a 2-CPU cloud machine (measured): 100 000 draws take minutes.
SLOW_PDF_DRAWS = 100_000


# --------------------------------------------------------------------------------------------------
# Raw PDF writing, for inputs PyMuPDF would refuse to write (or would write too tidily).


def build_pdf(objects: list[tuple[str, bytes | None]], *, header: bytes = b"%PDF-1.7") -> bytes:
    """Write a classic-xref PDF. Object i+1 is `objects[i]` (a dictionary, and its stream if any);
    object 1 must be the catalog."""
    out = bytearray(header + b"\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, (dictionary, stream) in enumerate(objects, start=1):
        offsets.append(len(out))
        if stream is None:
            out += f"{number} 0 obj\n{dictionary}\nendobj\n".encode()
        else:
            assert dictionary.endswith(">>")
            out += f"{number} 0 obj\n{dictionary[:-2]} /Length {len(stream)} >>\nstream\n".encode()
            out += stream + b"\nendstream\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for offset in offsets:
        out += f"{offset:010d} 00000 n \n".encode()
    out += (
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    )
    return bytes(out)


# --------------------------------------------------------------------------------------------------
# Images


def _noise(size: tuple[int, int], seed: int) -> Image.Image:
    """Uniform grey noise, deterministic for a seed (Pillow's effect_noise is neither)."""
    return Image.frombytes("L", size, random.Random(seed).randbytes(size[0] * size[1]))


@functools.cache
def photo_image(width: int, height: int, *, seed: int = 0) -> Image.Image:
    """A photo-like RGB image: smooth gradients, hard-edged shapes, mid-scale texture and grain,
    so that it neither compresses trivially nor averages out to a flat thumbnail.

    Cached: callers must not modify it."""
    rng = random.Random(seed)
    small = (max(width // 40, 16), max(height // 40, 16))
    red = Image.linear_gradient("L").rotate(30 + seed).resize(small)
    green = Image.radial_gradient("L").resize(small)
    blue = Image.linear_gradient("L").transpose(Image.Transpose.ROTATE_90).resize(small)
    img = Image.merge("RGB", (red, green, blue)).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(40):
        x, y = rng.randrange(width), rng.randrange(height)
        w, h = rng.randrange(width // 30, width // 5), rng.randrange(height // 30, height // 5)
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        if rng.random() < 0.5:
            draw.ellipse((x, y, x + w, y + h), fill=colour)
        else:
            draw.rectangle((x, y, x + w, y + h), fill=colour, outline=(0, 0, 0), width=3)
    # Texture visible at thumbnail scale (like foliage or fabric), then per-pixel sensor grain.
    tile = 1024
    texture_small = Image.merge("RGB", [_noise((tile // 8, tile // 8), seed + i) for i in range(3)])
    texture = texture_small.resize((tile, tile), Image.Resampling.BILINEAR)
    grain = Image.merge("RGB", [_noise((tile, tile), seed + 10 + i) for i in range(3)])
    pattern = Image.blend(texture, grain, 0.5)
    overlay = Image.new("RGB", (width, height))
    for ty in range(0, height, tile):
        for tx in range(0, width, tile):
            # Flipping alternate tiles hides the repetition; JPEG never sees across 8x8 blocks.
            flip = (tx // tile + ty // tile) % 2
            overlay.paste(
                pattern.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else pattern, (tx, ty)
            )
    return Image.blend(img, overlay, 0.3)


def _save(img: Image.Image, fmt: str, **params: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


@functools.cache
def large_jpeg(width: int = 4000, height: int = 3000) -> bytes:
    """A camera-like JPEG (quality 90, photo-like content), e.g. 4000x3000 (12 MP) or 8000x6000."""
    if width >= 6000 and width % 2 == 0 and height % 2 == 0:
        # Four mirrored copies of the half-size picture: the same work per pixel for a decoder
        # (JPEG never looks beyond an 8x8 block), made in a fraction of the time.
        half = photo_image(width // 2, height // 2)
        img = Image.new("RGB", (width, height))
        img.paste(half, (0, 0))
        img.paste(half.transpose(Image.Transpose.FLIP_LEFT_RIGHT), (width // 2, 0))
        img.paste(half.transpose(Image.Transpose.FLIP_TOP_BOTTOM), (0, height // 2))
        img.paste(half.transpose(Image.Transpose.ROTATE_180), (width // 2, height // 2))
        return _save(img, "JPEG", quality=90)
    return _save(photo_image(width, height), "JPEG", quality=90)


def jpeg_4000x3000() -> bytes:
    """A 12 MP camera-like JPEG."""
    return large_jpeg(4000, 3000)


def jpeg_8000x6000() -> bytes:
    """A 48 MP camera-like JPEG."""
    return large_jpeg(8000, 6000)


def quadrant_image(width: int, height: int) -> Image.Image:
    """RGB image whose top-left quadrant is red, top-right green, bottom-left blue, rest white."""
    img = Image.new("RGB", (width, height), (255, 255, 255))
    img.paste(RED, (0, 0, width // 2, height // 2))
    img.paste(GREEN, (width // 2, 0, width, height // 2))
    img.paste(BLUE, (0, height // 2, width // 2, height))
    return img


@functools.cache
def small_jpeg() -> bytes:
    """A plain 1024x768 JPEG with coloured quadrants."""
    return _save(quadrant_image(1024, 768), "JPEG", quality=90)


@functools.cache
def exif_rotated_jpeg() -> bytes:
    """A JPEG stored landscape 800x600 with EXIF orientation 6: it displays as 600x800 portrait,
    and the stored top-left (red) quadrant shows at the top right."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(quadrant_image(800, 600), "JPEG", quality=90, exif=exif.tobytes())


@functools.cache
def cmyk_jpeg() -> bytes:
    """A CMYK JPEG (Pillow writes Adobe-style inverted CMYK): left half red, right half blue."""
    img = Image.new("CMYK", (800, 400), (0, 255, 255, 0))
    img.paste((255, 255, 0, 0), (400, 0, 800, 400))
    return _save(img, "JPEG", quality=92)


@functools.cache
def png_16bit_grey() -> bytes:
    """A 16-bit greyscale PNG, 2048x512, a horizontal ramp from 0 to 65535 (4x the box, so that
    the resize first reduces by a whole factor, which Pillow cannot do in 16-bit modes)."""
    width, height = 2048, 512
    row = b"".join(struct.pack("<H", x * 65535 // (width - 1)) for x in range(width))
    img = Image.frombytes("I;16", (width, height), row * height)
    return _save(img, "PNG")


@functools.cache
def png_alpha() -> bytes:
    """An RGBA PNG, 600x400: left half opaque blue, right half fully transparent."""
    img = Image.new("RGBA", (600, 400), (0, 0, 0, 0))
    img.paste((*BLUE, 255), (0, 0, 300, 400))
    return _save(img, "PNG")


@functools.cache
def png_palette_transparent() -> bytes:
    """A palette PNG with a transparent colour (tRNS): a red square on transparency."""
    img = Image.new("RGBA", (300, 300), (0, 0, 0, 0))
    img.paste((*RED, 255), (75, 75, 225, 225))
    return _save(img.convert("P", palette=Image.Palette.ADAPTIVE, colors=8), "PNG")


@functools.cache
def small_png() -> bytes:
    """A 100x80 PNG, smaller than the box, so the thumbnail keeps its size."""
    return _save(quadrant_image(100, 80), "PNG")


@functools.cache
def animated_gif() -> bytes:
    """A 3-frame animated GIF, 200x150: red, then green, then blue."""
    frames = [Image.new("RGB", (200, 150), colour) for colour in (RED, GREEN, BLUE)]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


@functools.cache
def animated_webp() -> bytes:
    """A 2-frame animated WebP, 200x150: red then blue."""
    frames = [Image.new("RGB", (200, 150), colour) for colour in (RED, BLUE)]
    return _save(frames[0], "WEBP", save_all=True, append_images=frames[1:], duration=100)


@functools.cache
def tiff_little_endian() -> bytes:
    """An LZW-compressed little-endian ("II") TIFF, 640x480."""
    return _save(quadrant_image(640, 480), "TIFF", compression="tiff_lzw")


@functools.cache
def tiff_big_endian() -> bytes:
    """An uncompressed big-endian ("MM") TIFF, 64x48, written by hand: grey ramp, 8-bit."""
    width, height = 64, 48
    pixels = bytes((x * 4) % 256 for _ in range(height) for x in range(width))
    entries = [
        (256, 3, 1, width),  # ImageWidth
        (257, 3, 1, height),  # ImageLength
        (258, 3, 1, 8),  # BitsPerSample
        (259, 3, 1, 1),  # Compression: none
        (262, 3, 1, 1),  # Photometric: black is zero
        (273, 4, 1, 0),  # StripOffsets, patched below
        (277, 3, 1, 1),  # SamplesPerPixel
        (278, 3, 1, height),  # RowsPerStrip
        (279, 4, 1, len(pixels)),  # StripByteCounts
    ]
    ifd_offset = 8
    pixel_offset = ifd_offset + 2 + 12 * len(entries) + 4
    ifd = struct.pack(">H", len(entries))
    for tag, kind, count, value in entries:
        value = pixel_offset if tag == 273 else value
        packed = struct.pack(">HH", value, 0) if kind == 3 else struct.pack(">I", value)
        ifd += struct.pack(">HHI", tag, kind, count) + packed
    return b"MM\x00*" + struct.pack(">I", ifd_offset) + ifd + b"\x00\x00\x00\x00" + pixels


@functools.cache
def bmp_image() -> bytes:
    """A 24-bit BMP, 320x240."""
    return _save(quadrant_image(320, 240), "BMP")


@functools.cache
def webp_image() -> bytes:
    """A lossy WebP photo, 1600x1200."""
    return _save(photo_image(1600, 1200, seed=3), "WEBP", quality=85)


@functools.cache
def png_bomb(width: int = 30_000, height: int = 30_000) -> bytes:
    """A decompression bomb: a ~100 KB 1-bit PNG that declares 900 megapixels (all of it valid
    data, so only a pixel limit checked before decoding stops it)."""
    row = b"\x00" + b"\x00" * ((width + 7) // 8)  # filter byte + packed pixels
    compressor = zlib.compressobj(9)
    chunks = [compressor.compress(row * 500) for _ in range(height // 500)]
    chunks.append(compressor.compress(row * (height % 500)))
    chunks.append(compressor.flush())
    idat = b"".join(chunks)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@functools.cache
def memory_hog_png() -> bytes:
    """A legal 8000x8000 RGBA PNG (64 MP, under the default pixel limit) that needs about 256 MB
    decoded: refused with too_large by a render process whose memory limit is lower than that."""
    return _save(Image.new("RGBA", (8000, 8000), (*GREEN, 200)), "PNG", compress_level=1)


@functools.cache
def corrupt_jpeg() -> bytes:
    """A JPEG whose entropy-coded data is overwritten with garbage after the first few bytes."""
    data = bytearray(_save(photo_image(640, 480, seed=5), "JPEG", quality=85))
    start = data.find(b"\xff\xda") + 20
    data[start : start + 4000] = b"\xff" * 4000
    return bytes(data)


@functools.cache
def truncated_jpeg() -> bytes:
    """The first half of a JPEG, as a cut-off upload leaves it."""
    data = _save(photo_image(640, 480, seed=6), "JPEG", quality=85)
    return data[: len(data) // 2]


# --------------------------------------------------------------------------------------------------
# PDFs


@functools.cache
def slide_pdf() -> bytes:
    """A 16:9 presentation slide (960x540 pt): title and bullet text, vector shapes and a large
    embedded photo (2400x1600 JPEG), then three more slides."""
    import pymupdf

    photo = _save(photo_image(2400, 1600, seed=7), "JPEG", quality=88)
    doc = pymupdf.open()
    for number in range(1, 5):
        page = doc.new_page(width=960, height=540)
        page.draw_rect(pymupdf.Rect(0, 0, 960, 90), color=None, fill=(0.1, 0.2, 0.45))
        page.insert_text(
            (40, 60), f"Quarterly review: slide {number}", fontsize=34, color=(1, 1, 1)
        )
        bullets = [
            "Revenue grew 18% year over year",
            "Thumbnail backlog cleared in 40 minutes",
            "Three regions now on the new pipeline",
            "Next: office documents and video",
        ]
        for i, text in enumerate(bullets):
            page.draw_circle((55, 148 + i * 50), 6, color=None, fill=(0.9, 0.4, 0.1))
            page.insert_text((75, 156 + i * 50), text, fontsize=22, color=(0.1, 0.1, 0.1))
        shape = page.new_shape()
        for i, height in enumerate([60, 95, 80, 130, 150]):
            shape.draw_rect(pymupdf.Rect(60 + i * 70, 500 - height, 110 + i * 70, 500))
        shape.finish(color=(0, 0, 0), fill=(0.2, 0.6, 0.3), width=1)
        shape.draw_bezier((60, 380), (200, 300), (300, 480), (420, 360))
        shape.finish(color=(0.8, 0.1, 0.1), width=3)
        shape.commit()
        page.insert_image(pymupdf.Rect(500, 110, 920, 390), stream=photo)
        page.insert_text(
            (500, 420), "Figure 1: the new pipeline", fontsize=14, color=(0.3, 0.3, 0.3)
        )
    return doc.tobytes(garbage=3, deflate=True)


def _page_pdf(width: float, height: float, *, rotate: int = 0, pages: int = 1) -> bytes:
    """PDF pages of a given size in points with a red frame-filling quadrant at the top left."""
    import pymupdf

    doc = pymupdf.open()
    for number in range(pages):
        page = doc.new_page(width=width, height=height)
        page.draw_rect(
            pymupdf.Rect(0, 0, width / 2, height / 2), color=None, fill=(0.86, 0.12, 0.12)
        )
        page.draw_rect(
            pymupdf.Rect(width / 2, height / 2, width, height), color=None, fill=(0.12, 0.24, 0.86)
        )
        page.insert_text(
            (width * 0.55, height * 0.25), str(number + 1), fontsize=min(width, height) / 5
        )
        if rotate:
            page.set_rotation(rotate)
    return doc.tobytes()


@functools.cache
def a4_pdf() -> bytes:
    """A one-page A4 portrait PDF (595x842 pt)."""
    return _page_pdf(595, 842)


@functools.cache
def tiny_page_pdf() -> bytes:
    """A 100x50 pt page: must be rendered up to fill the box, crisply."""
    return _page_pdf(100, 50)


@functools.cache
def huge_page_pdf() -> bytes:
    """A 5000x5000 pt page (a poster): must be rendered straight down to the box."""
    return _page_pdf(5000, 5000)


@functools.cache
def rotated_pdf() -> bytes:
    """An A4 portrait page with /Rotate 90: it displays landscape (842x595)."""
    return _page_pdf(595, 842, rotate=90)


@functools.cache
def multipage_pdf() -> bytes:
    """Five A4 landscape pages, each showing its number."""
    return _page_pdf(842, 595, pages=5)


@functools.cache
def many_pages_pdf(pages: int = 3000) -> bytes:
    """A PDF with thousands of pages (3000), each with a line of text; only page 1 is rendered.

    Written directly (PyMuPDF's page-by-page API takes seconds for this many pages)."""
    objects: list[tuple[str, bytes | None]] = [
        ("<< /Type /Catalog /Pages 2 0 R >>", None),
        ("", None),  # the page tree, filled in below once the page numbers are known
        ("<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>", None),
    ]
    kids = []
    for number in range(1, pages + 1):
        page_ref = len(objects) + 1
        kids.append(f"{page_ref} 0 R")
        objects.append(
            (
                "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] "
                f"/Resources << /Font << /F1 3 0 R >> >> /Contents {page_ref + 1} 0 R >>",
                None,
            )
        )
        text = f"BT /F1 18 Tf 72 770 Td (Page {number} of {pages}) Tj ET"
        objects.append(("<< >>", text.encode()))
    objects[1] = (f"<< /Type /Pages /Kids [{' '.join(kids)}] /Count {pages} >>", None)
    return build_pdf(objects)


@functools.cache
def encrypted_pdf() -> bytes:
    """A PDF that needs a user password to open (AES-256)."""
    import pymupdf

    doc = pymupdf.open(stream=a4_pdf(), filetype="pdf")
    return doc.tobytes(
        encryption=pymupdf.PDF_ENCRYPT_AES_256, user_pw="open sesame", owner_pw="owner secret"
    )


@functools.cache
def owner_password_pdf() -> bytes:
    """A PDF encrypted with an owner password only (printing restricted): anyone may open it."""
    import pymupdf

    doc = pymupdf.open(stream=a4_pdf(), filetype="pdf")
    return doc.tobytes(
        encryption=pymupdf.PDF_ENCRYPT_AES_256,
        owner_pw="owner secret",
        permissions=pymupdf.PDF_PERM_ACCESSIBILITY,
    )


@functools.cache
def truncated_pdf() -> bytes:
    """The slide deck cut at 40%: with object streams its page tree lives at the end, so what is
    left has no pages, as when an upload is cut off."""
    import pymupdf

    doc = pymupdf.open(stream=slide_pdf(), filetype="pdf")
    data = doc.tobytes(garbage=3, deflate=True, use_objstms=1)
    return data[: len(data) * 2 // 5]


@functools.cache
def junk_prefixed_pdf() -> bytes:
    """A PDF after 600 bytes of mail headers; viewers accept a header within the first 1024."""
    junk = b"".join(
        b"X-Header-%03d: some value that a mail gateway added\r\n" % i for i in range(12)
    )
    return junk[:600] + a4_pdf()


@functools.cache
def slow_pdf(draws: int = SLOW_PDF_DRAWS) -> bytes:
    """A 5 KB PDF whose page takes minutes to render: nested form XObjects each drawing the one
    below ten times, down to a 200-point star polygon filled across the page ("billion laughs"
    for content streams). The render time is proportional to `draws` (about 1.5 ms each here)."""
    points = []
    for i in range(200):
        angle = 2 * math.pi * i * 7 / 200
        points.append((300 + 280 * math.cos(angle), 200 + 180 * math.sin(angle)))
    star = f"{points[0][0]:.1f} {points[0][1]:.1f} m " + " ".join(
        f"{x:.1f} {y:.1f} l" for x, y in points[1:]
    )
    # Factor `draws` into levels of ten and one remainder level.
    fan_outs = []
    remaining = max(int(draws), 1)
    while remaining >= 10:
        fan_outs.append(10)
        remaining //= 10
    if remaining > 1 or not fan_outs:
        fan_outs.append(remaining)
    forms: list[tuple[str, bytes | None]] = []
    base = 5
    forms.append(
        (
            "<< /Type /XObject /Subtype /Form /BBox [0 0 600 400] >>",
            f"0.2 0.3 0.6 rg {star} h f*".encode(),
        )
    )
    for level, fan_out in enumerate(fan_outs, start=1):
        body = b" ".join(b"q 1 0 0 1 0.01 0 cm /C Do Q" for _ in range(fan_out))
        child = base + level - 1
        forms.append(
            (
                "<< /Type /XObject /Subtype /Form /BBox [0 0 600 400] "
                f"/Resources << /XObject << /C {child} 0 R >> >> >>",
                body,
            )
        )
    top = base + len(forms) - 1
    objects: list[tuple[str, bytes | None]] = [
        ("<< /Type /Catalog /Pages 2 0 R >>", None),
        ("<< /Type /Pages /Kids [3 0 R] /Count 1 >>", None),
        (
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 600 400] "
            f"/Resources << /XObject << /Top {top} 0 R >> >> /Contents 4 0 R >>",
            None,
        ),
        ("<< >>", b"/Top Do"),
        *forms,
    ]
    return build_pdf(objects)


def empty_file() -> bytes:
    """Zero bytes, as a failed upload leaves behind."""
    return b""


def text_declared_pdf() -> bytes:
    """A plain-text file that its uploader called application/pdf."""
    return b"Meeting notes\n\n- the slides will follow as a PDF\n- budget approved\n" * 20


def svg_image() -> bytes:
    """An SVG drawing (vector XML), rendered by resvg."""
    return (
        b'<?xml version="1.0" encoding="UTF-8"?>\n'
        b'<svg xmlns="http://www.w3.org/2000/svg" width="200" height="100">'
        b'<rect width="200" height="100" fill="red"/></svg>\n'
    )


def zip_archive() -> bytes:
    """A ZIP archive (as an office document would be), declared as octet-stream."""
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        archive.writestr("word/document.xml", "<w:document/>")
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Many distinct cheap files, from a seed


def tiny_png(seed: int, size: tuple[int, int] = (48, 32)) -> bytes:
    """A small PNG whose colour depends on `seed` (each file distinct, all cheap)."""
    img = Image.new("RGB", size, (seed % 256, (seed // 256) % 256, 120))
    img.putpixel((seed % size[0], 0), (255, 255, 255))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def photo_jpeg(seed: int, size: tuple[int, int] = (1600, 1200)) -> bytes:
    """A photo-like JPEG of a few hundred KB (tens of ms to thumbnail)."""
    img = Image.new("RGB", size, ((seed * 37) % 256, 90, 160))
    draw = ImageDraw.Draw(img)
    for i in range(12):
        x, y = (seed * 53 + i * 131) % size[0], (seed * 29 + i * 97) % size[1]
        draw.ellipse((x, y, x + 300, y + 200), fill=((i * 40) % 256, (seed * 7) % 256, 60))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85)
    return out.getvalue()


def vector_pdf(seed: int, draws: int = 60) -> bytes:
    """A few-KB PDF whose page takes about 1.5 ms per draw to render (nested forms, as in the
    corpus's slow PDF, but bounded); `seed` makes each file's bytes distinct."""
    return slow_pdf(draws) + f"% file {seed}\n".encode()


# --------------------------------------------------------------------------------------------------
# The table


@dataclass(frozen=True)
class Sample:
    """One corpus file: how to make it, what its uploader declared, and how its job must end."""

    name: str
    make: Callable[[], bytes]
    declared_type: str | None
    status: str  # terminal job status: "completed", "failed" or "unsupported"
    error_code: str | None  # None for completed
    note: str = ""

    @property
    def data(self) -> bytes:
        return self.make()


def _sample(
    name: str,
    make: Callable[[], bytes],
    declared_type: str | None,
    error_code: str | None = None,
    note: str = "",
) -> Sample:
    if error_code is None:
        status = "completed"
    elif error_code == "unsupported_type":
        status = "unsupported"
    else:
        status = "failed"
    return Sample(name, make, declared_type, status, error_code, note)


CORPUS: dict[str, Sample] = {
    s.name: s
    for s in [
        _sample("slide_pdf", slide_pdf, "application/pdf"),
        _sample("multipage_pdf", multipage_pdf, "application/pdf"),
        _sample("a4_pdf", a4_pdf, "application/pdf"),
        _sample("tiny_page_pdf", tiny_page_pdf, "application/pdf"),
        _sample("huge_page_pdf", huge_page_pdf, "application/pdf"),
        _sample("rotated_pdf", rotated_pdf, "application/pdf"),
        _sample(
            "many_pages_pdf", many_pages_pdf, "application/pdf", note="3000 pages, under max_pages"
        ),
        _sample("owner_password_pdf", owner_password_pdf, "application/pdf"),
        _sample("junk_prefixed_pdf", junk_prefixed_pdf, "application/pdf"),
        _sample("pdf_declared_octet_stream", a4_pdf, "application/octet-stream"),
        _sample("empty_file", empty_file, "application/pdf", "corrupt_input"),
        _sample("truncated_pdf", truncated_pdf, "application/pdf", "corrupt_input"),
        _sample("encrypted_pdf", encrypted_pdf, "application/pdf", "encrypted_input"),
        _sample(
            "slow_pdf",
            slow_pdf,
            "application/pdf",
            "render_timeout",
            note="transient: retried until max_attempts, then dead-lettered",
        ),
        _sample("text_declared_pdf", text_declared_pdf, "application/pdf", "unsupported_type"),
        _sample("svg_image", svg_image, "image/svg+xml"),
        _sample("zip_archive", zip_archive, "application/octet-stream", "unsupported_type"),
        _sample("png_bomb", png_bomb, "image/png", "too_large"),
        _sample("corrupt_jpeg", corrupt_jpeg, "image/jpeg", "corrupt_input"),
        _sample("truncated_jpeg", truncated_jpeg, "image/jpeg", "corrupt_input"),
        _sample("small_jpeg", small_jpeg, "image/jpeg"),
        _sample("jpeg_4000x3000", jpeg_4000x3000, "image/jpeg"),
        _sample("jpeg_8000x6000", jpeg_8000x6000, "image/jpeg"),
        _sample("exif_rotated_jpeg", exif_rotated_jpeg, "image/jpeg"),
        _sample("cmyk_jpeg", cmyk_jpeg, "image/jpeg"),
        _sample("png_16bit_grey", png_16bit_grey, "image/png"),
        _sample("png_alpha", png_alpha, "image/png"),
        _sample("png_palette_transparent", png_palette_transparent, "image/png"),
        _sample("small_png", small_png, "image/png"),
        _sample("animated_gif", animated_gif, "image/gif"),
        _sample("animated_webp", animated_webp, "image/webp"),
        _sample("webp_image", webp_image, "image/webp"),
        _sample("tiff_little_endian", tiff_little_endian, "image/tiff"),
        _sample("tiff_big_endian", tiff_big_endian, "image/tiff"),
        _sample("bmp_image", bmp_image, "image/bmp"),
        _sample("jpeg_declared_png", small_jpeg, "image/png", note="type comes from the bytes"),
    ]
}


# --------------------------------------------------------------------------------------------------
# HEIF grids, as phones write them: pillow-heif writes one picture per file, so each tile is
# encoded on its own and the tiles are put into a `grid` item here (ISO/IEC 23008-12). libheif
# reading the result back is what the tests check it against.


def _box(kind: bytes, *payload: bytes) -> bytes:
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def _full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def _heic_parts(picture: Image.Image, quality: int) -> tuple[bytes, bytes, bytes]:
    """The decoder configuration (hvcC payload), colour box (`colr`, whole) and coded data of one
    picture, from a one-picture HEIC that pillow-heif wrote (its `mdat` holds only that
    picture)."""
    import pillow_heif

    out = io.BytesIO()
    pillow_heif.from_pillow(picture).save(out, quality=quality)
    data = out.getvalue()

    def box(kind: bytes) -> tuple[int, int]:
        at = data.index(kind)
        (size,) = struct.unpack_from(">I", data, at - 4)
        return at - 4, at - 4 + size

    start, end = box(b"hvcC")
    hvcc = data[start + 8 : end]
    start, end = box(b"colr")
    colr = data[start:end]
    start, end = box(b"mdat")
    return hvcc, colr, data[start + 8 : end]


def heic_grid(
    picture: Image.Image,
    tile: int = 512,
    *,
    quality: int = 60,
    rotation: int = 0,
    mirror: int | None = None,
) -> bytes:
    """`picture` as a HEIC whose primary item is a grid of `tile` px HEVC tiles, as an iPhone
    writes a photo; `rotation` (quarter turns anticlockwise, the `irot` box) and `mirror` (the
    `imir` box: 0 exchanges top and bottom, 1 left and right), applied in that order, as a
    camera records how to show it."""
    width, height = picture.size
    columns, rows = -(-width // tile), -(-height // tile)
    canvas = Image.new("RGB", (columns * tile, rows * tile))
    canvas.paste(picture.convert("RGB"))
    coded = []
    hvcc = colr = b""
    for row in range(rows):
        for column in range(columns):
            box = (column * tile, row * tile, (column + 1) * tile, (row + 1) * tile)
            hvcc, colr, data = _heic_parts(canvas.crop(box), quality)
            coded.append(data)
    grid_id, first_tile = 1, 2
    tile_ids = list(range(first_tile, first_tile + len(coded)))
    infe = [_full_box(b"infe", 2, 0, struct.pack(">HH4s", grid_id, 0, b"grid"), b"\0")]
    infe += [_full_box(b"infe", 2, 1, struct.pack(">HH4s", i, 0, b"hvc1"), b"\0") for i in tile_ids]
    properties = [
        _box(b"hvcC", hvcc),
        _full_box(b"ispe", 0, 0, struct.pack(">II", tile, tile)),
        _full_box(b"ispe", 0, 0, struct.pack(">II", width, height)),
        colr,
    ]
    grid_props = [(3, False), (4, False)]
    if rotation:
        properties.append(_box(b"irot", bytes([rotation & 3])))
        grid_props.append((len(properties), True))
    if mirror is not None:
        properties.append(_box(b"imir", bytes([mirror & 1])))
        grid_props.append((len(properties), True))
    associations = [
        struct.pack(">HB", grid_id, len(grid_props))
        + bytes(index | (0x80 if essential else 0) for index, essential in grid_props)
    ]
    associations += [struct.pack(">HBBBB", i, 3, 1 | 0x80, 2, 4) for i in tile_ids]
    grid = struct.pack(">BBBBHH", 0, 0, rows - 1, columns - 1, width, height)

    def meta(mdat_start: int) -> bytes:
        locations = [struct.pack(">HHHHII", grid_id, 1, 0, 1, 0, len(grid))]
        offset = mdat_start
        for i, data in zip(tile_ids, coded, strict=True):
            locations.append(struct.pack(">HHHHII", i, 0, 0, 1, offset, len(data)))
            offset += len(data)
        return _full_box(
            b"meta",
            0,
            0,
            _full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, b"pict"), b"\0"),
            _full_box(b"pitm", 0, 0, struct.pack(">H", grid_id)),
            _full_box(b"iinf", 0, 0, struct.pack(">H", len(infe)), *infe),
            _full_box(
                b"iref",
                0,
                0,
                _box(
                    b"dimg",
                    struct.pack(">HH", grid_id, len(tile_ids)),
                    *(struct.pack(">H", i) for i in tile_ids),
                ),
            ),
            _box(
                b"iprp",
                _box(b"ipco", *properties),
                _full_box(b"ipma", 0, 0, struct.pack(">I", len(associations)), *associations),
            ),
            _full_box(b"iloc", 1, 0, struct.pack(">BBH", 0x44, 0x00, len(locations)), *locations),
            _box(b"idat", grid),
        )

    ftyp = _box(b"ftyp", b"heic", struct.pack(">I", 0), b"mif1", b"heic")
    head = len(ftyp) + len(meta(0)) + 8
    return ftyp + meta(head) + _box(b"mdat", *coded)
