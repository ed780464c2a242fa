"""An 8-bit RGB or RGBA PNG decoded by libspng (the `pyspng` wheel) instead of Pillow's decoder.

A 1920x1080 screenshot: 13.4 ms of CPU in Pillow, 9 ms in libspng with the picture handed to
Pillow as is (bench/formats.py, `raster`). (Asking libspng for four bytes a pixel, Pillow's own
layout, saves the copy into Pillow but costs as much in the decode and in a resize of four
bands instead of three.)

Only the common case takes this path: Pillow has read the header (and the chunks before the
pixels: the ICC profile, EXIF), the picture is 8-bit RGB or RGBA without a transparent colour,
and no EXIF block follows the pixels; palette, grey, 16-bit grey and the rest are Pillow's as
before. Where pyspng is not installed, or refuses the file, this answers None and Pillow decodes
it (and names the damage).
"""

from __future__ import annotations

import functools
import struct
from types import ModuleType

from PIL import Image


@functools.cache
def _pyspng() -> ModuleType | None:
    try:
        import pyspng
    except ImportError:
        return None
    return pyspng


def available() -> bool:
    return _pyspng() is not None


def decode(data: bytes, header: Image.Image) -> Image.Image | None:
    """The pixels of the PNG in `data`, whose header Pillow opened as `header`, as an image of
    `header`'s mode and size with its `info`; None where this path does not apply."""
    if header.mode not in ("RGB", "RGBA") or "transparency" in header.info:
        return None
    if _exif_after_pixels(data):
        return None  # only Pillow's load reads it
    pyspng = _pyspng()
    if pyspng is None:
        return None
    try:
        pixels = pyspng.load(data, header.mode)
    except (RuntimeError, ValueError, MemoryError):
        return None
    if pixels.shape[:2] != (header.height, header.width):
        return None
    img = Image.frombuffer(header.mode, header.size, pixels, "raw", header.mode, 0, 1)
    img.info.update(header.info)
    return img


def _exif_after_pixels(data: bytes) -> bool:
    """Whether an eXIf chunk follows the first IDAT (a walk over the chunks' headers)."""
    offset, seen_pixels = 8, False
    while offset + 8 <= len(data):
        (length,) = struct.unpack_from(">I", data, offset)
        kind = data[offset + 4 : offset + 8]
        if kind == b"IDAT":
            seen_pixels = True
        elif kind == b"eXIf" and seen_pixels:
            return True
        elif kind == b"IEND":
            break
        offset += 12 + length
    return False
