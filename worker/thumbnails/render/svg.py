"""SVG drawings to thumbnails with resvg (a static SVG renderer: no scripts, no network).

resvg itself reads any file path an `<image>` names (`/etc/...`, `../secret.png`), so the drawing
is first parsed here and cleaned: only in-document references (`#id`) and embedded images
(`data:` URIs) survive; scripts and foreign objects go. An embedded image is decoded here and
embedded again in the one form resvg reads: PNG, JPEG, GIF and WebP as clean base64 (pixel count
checked), other rasters Pillow reads (BMP, TIFF, ICO, ...) converted to PNG, and an SVG or SVGZ
cleaned like the drawing itself (two levels deep at most). The XML parser is expat, which refuses
entity expansion bombs ("billion laughs") by its amplification limit and never loads external
entities.

A drawing that cannot finish in its window (a filter such as `feMorphology` with a huge radius
costs minutes) gets a degraded render: half the size, no anti-aliasing, no embedded images and no
filters.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import urllib.parse
import xml.etree.ElementTree as ET
import zlib

from PIL import Image

from worker.engine.errors import CORRUPT_INPUT, TOO_LARGE, ThumbqError
from worker.thumbnails.render import RenderOptions, Thumbnail
from worker.thumbnails.render.output import finish
from worker.thumbnails.render.sniff import SVG

# An SVG is text: anything larger is generated data (a plot with millions of points) or hostile.
MAX_SVG_BYTES = 20 * 1024 * 1024
MAX_ELEMENTS = 200_000
# CSS's pixels an inch, which sizes in pt, mm, cm and in are converted with; resvg-py's default
# of 0 made every such size zero ("SVG has an invalid size": 35 of 897 SVGs of this machine's
# packages, graphviz output among them).
CSS_DPI = 96.0
_DATA_URI = re.compile(r"data:([^,]*),", re.IGNORECASE)
# Embedded SVGs inside embedded SVGs: deeper ones are dropped.
MAX_NESTING = 2
_DROPPED_TAGS = frozenset({"script", "foreignObject", "iframe", "audio", "video"})
# What resvg decodes itself, by the type sniff() gives.
_RESVG_RASTERS = {
    "image/png": "image/png",
    "image/jpeg": "image/jpeg",
    "image/gif": "image/gif",
    "image/webp": "image/webp",
}
_CSS_FILTER = re.compile(r"(?<![-\w])filter\s*:[^;}]*;?", re.IGNORECASE)


def render_svg(data: bytes, opts: RenderOptions) -> Thumbnail:
    """Render the drawing to fill the largest box (a vector scales crisply, so a small viewBox is
    drawn large), on a transparent background."""
    import resvg_py

    if len(data) > MAX_SVG_BYTES:
        raise ThumbqError(
            TOO_LARGE, f"SVG is {len(data):,} bytes, over the limit of {MAX_SVG_BYTES:,}"
        )
    markup = sanitise(data, opts)
    try:
        if opts.degraded:
            size = max(16, opts.size // 2)
            png = resvg_py.svg_to_bytes(
                svg_string=markup,
                width=size,
                height=size,
                shape_rendering="optimize_speed",  # no anti-aliasing
                text_rendering="optimize_speed",
                image_rendering="optimize_speed",
                dpi=CSS_DPI,
            )
        else:
            png = resvg_py.svg_to_bytes(
                svg_string=markup, width=opts.size, height=opts.size, dpi=CSS_DPI
            )
    except ValueError as exc:
        raise ThumbqError(CORRUPT_INPUT, f"SVG cannot be rendered: {str(exc)[:200]}") from None
    img = Image.open(io.BytesIO(png), formats=["PNG"])
    img.load()
    return finish(img, opts, SVG, degraded=opts.degraded)


def sanitise(data: bytes, opts: RenderOptions, depth: int = 0) -> str:
    """The drawing as markup that refers to nothing outside itself (degraded: without embedded
    images and filters either).

    Raises `too_large` for an entity expansion bomb or too many elements, `corrupt_input` for
    markup that is not well-formed XML."""
    # Not defusedxml: expat (2.4+) refuses entity amplification itself, and ElementTree never
    # resolves external entities; both are what defusedxml would guard against.
    parser = ET.XMLParser()  # noqa: S314
    try:
        parser.feed(data)
        root = parser.close()
    except ET.ParseError as exc:
        text = str(exc)
        if "amplification" in text or "recursive entity" in text:
            raise ThumbqError(
                TOO_LARGE, f"SVG expands its entities beyond a safe size: {text[:200]}"
            ) from None
        raise ThumbqError(CORRUPT_INPUT, f"SVG is not well-formed XML: {text[:200]}") from None
    for count, parent in enumerate(root.iter(), start=1):
        if count > MAX_ELEMENTS:
            raise ThumbqError(TOO_LARGE, f"SVG has over {MAX_ELEMENTS:,} elements")
        for child in list(parent):
            if _local(child.tag) in _DROPPED_TAGS or (
                opts.degraded and _local(child.tag) in ("image", "filter")
            ):
                parent.remove(child)
        if opts.degraded and _local(parent.tag) == "style" and parent.text:
            parent.text = _CSS_FILTER.sub("", parent.text)
        for name in list(parent.attrib):
            local = _local(name)
            # Event handlers never run in resvg; they go anyway, so the markup holds no script.
            if local.startswith("on") or (opts.degraded and local == "filter"):
                del parent.attrib[name]
            elif local == "href":
                reference = _safe_reference(parent.attrib[name], opts, depth)
                if reference is None:
                    del parent.attrib[name]
                else:
                    parent.attrib[name] = reference
            elif local == "style" and opts.degraded:
                parent.attrib[name] = _CSS_FILTER.sub("", parent.attrib[name])
    if _local(root.tag) != "svg":
        raise ThumbqError(CORRUPT_INPUT, f"the document's root is <{_local(root.tag)}>, not <svg>")
    return ET.tostring(root, encoding="unicode")


def _local(tag: object) -> str:
    text = tag if isinstance(tag, str) else ""
    return text.rsplit("}", 1)[-1]


def _safe_reference(value: str, opts: RenderOptions, depth: int) -> str | None:
    """An in-document fragment as it is, an embedded image as resvg reads it (see the module's
    docstring), else None: files, URLs, and embedded data that is no picture or is over the
    pixel limit are dropped."""
    value = value.strip()
    if value.startswith("#"):
        return value
    match = _DATA_URI.match(value)
    if not match:
        return None
    params = [p.strip().lower() for p in match.group(1).split(";")]
    payload = value[match.end() :]
    try:
        if "base64" in params:
            raw = base64.b64decode(
                re.sub(r"[^A-Za-z0-9+/=_-]", "", payload).replace("-", "+").replace("_", "/") + "=="
            )
        else:
            raw = urllib.parse.unquote_to_bytes(payload)
        return _embedded_image(raw, opts, depth)
    except (binascii.Error, ValueError, OSError, ThumbqError, Image.DecompressionBombError):
        return None


def _embedded_image(raw: bytes, opts: RenderOptions, depth: int) -> str | None:
    from worker.thumbnails.render.sniff import IMAGE_FORMATS, sniff

    if raw.startswith(b"\x1f\x8b"):  # SVGZ
        inflate = zlib.decompressobj(wbits=31)
        raw = inflate.decompress(raw, MAX_SVG_BYTES)
        if inflate.unconsumed_tail:
            return None
    kind = sniff(raw)
    if kind == SVG:
        if depth >= MAX_NESTING:
            return None
        markup = sanitise(raw, opts, depth + 1).encode()
        return "data:image/svg+xml;base64," + base64.b64encode(markup).decode()
    if kind not in IMAGE_FORMATS:
        return None
    with Image.open(io.BytesIO(raw)) as img:
        width, height = img.size
        if width * height > opts.max_pixels:
            return None
        if kind in _RESVG_RASTERS:
            return f"data:{_RESVG_RASTERS[kind]};base64," + base64.b64encode(raw).decode()
        # Another raster resvg cannot decode: as PNG (its first frame).
        img.load()
        out = io.BytesIO()
        picture = img if img.mode in ("1", "L", "LA", "RGB", "RGBA", "P") else img.convert("RGBA")
        picture.save(out, "PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
