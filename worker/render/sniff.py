"""Detect a file's type from its first bytes, whatever type its uploader declared.

Stored content types are often wrong (`application/octet-stream`, or a text file named `.pdf`), so
the renderer is chosen from magic bytes alone.
"""

from __future__ import annotations

import re

PDF = "application/pdf"
JPEG = "image/jpeg"
PNG = "image/png"
GIF = "image/gif"
WEBP = "image/webp"
TIFF = "image/tiff"
BMP = "image/bmp"

#: Raster types `render_image` handles, with the Pillow format that reads each one.
IMAGE_FORMATS: dict[str, str] = {
    JPEG: "JPEG",
    PNG: "PNG",
    GIF: "GIF",
    WEBP: "WEBP",
    TIFF: "TIFF",
    BMP: "BMP",
}

# Acrobat accepts a header anywhere in the first 1024 bytes (PDF 1.7, annex H), and real files
# carry such junk (mail headers, a BOM, a printer job preamble), so MuPDF's repair does too.
_PDF_HEADER_WINDOW = 1024
_PDF_HEADER = re.compile(rb"%PDF-\d")
# The DIB header that follows BMP's 14-byte file header starts with its own length; these are the
# lengths of the header versions that exist, which keeps a text file starting "BM" from passing.
_BMP_DIB_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})


def sniff(data: bytes) -> str | None:
    """Return the MIME type that `data`'s magic bytes show, or None when nothing is recognised.

    Types thumbq cannot render (SVG, XML, plain text, ZIP, ...) are named where known so an error
    message can say what the file really was.
    """
    head = data[:16]
    if head.startswith(b"\xff\xd8\xff"):
        return JPEG
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return PNG
    if head.startswith((b"GIF87a", b"GIF89a")):
        return GIF
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return WEBP
    # Classic TIFF and BigTIFF, little- and big-endian.
    if head.startswith((b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")):
        return TIFF
    if (
        head.startswith(b"BM")
        and len(data) >= 18
        and int.from_bytes(data[14:18], "little") in _BMP_DIB_SIZES
    ):
        return BMP
    if _PDF_HEADER.search(data, 0, _PDF_HEADER_WINDOW + 8):
        return PDF
    return _sniff_other(data)


def _sniff_other(data: bytes) -> str | None:
    """Name common types thumbq does not render, so that errors can say what a file really was."""
    head = data[:16]
    if head.startswith(b"PK\x03\x04"):
        return "application/zip"
    if head[4:8] == b"ftyp":
        brand = head[8:12]
        if brand in (b"heic", b"heix", b"mif1", b"msf1"):
            return "image/heic"
        if brand in (b"avif", b"avis"):
            return "image/avif"
        return "video/mp4"
    if head.startswith(b"\x00\x00\x01\x00"):
        return "image/x-icon"
    if head.startswith(b"8BPS"):
        return "image/vnd.adobe.photoshop"
    if head.startswith(b"\x1f\x8b"):
        return "application/gzip"
    text = _as_text(data[:1024])
    if text is None:
        return None
    lowered = text.lstrip().lower()
    if "<svg" in lowered:
        return "image/svg+xml"
    if lowered.startswith("<?xml"):
        return "application/xml"
    if lowered.startswith(("<!doctype html", "<html")):
        return "text/html"
    return "text/plain"


def _as_text(sample: bytes) -> str | None:
    """Decode `sample` as UTF-8 (a multibyte character may be cut at the end), or None if binary."""
    if b"\x00" in sample:
        return None
    sample = sample.removeprefix(b"\xef\xbb\xbf")
    try:
        return sample.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(sample) - 3:
            return None
        return sample[: exc.start].decode("utf-8")
