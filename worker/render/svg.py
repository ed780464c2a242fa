"""SVG drawings to thumbnails with resvg (a static SVG renderer: no scripts, no network).

resvg itself reads any file path an `<image>` names (`/etc/...`, `../secret.png`), so the drawing
is first parsed here and cleaned: only in-document references (`#id`) and embedded raster
images (`data:image/png;base64,...`, pixel count checked) survive; scripts and foreign objects
go. The XML parser is expat, which refuses entity expansion bombs ("billion laughs") by its
amplification limit and never loads external entities.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import xml.etree.ElementTree as ET

from PIL import Image

from worker.errors import CORRUPT_INPUT, TOO_LARGE, ThumbqError
from worker.render import RenderOptions, Thumbnail
from worker.render.output import finish
from worker.render.sniff import SVG

# An SVG is text: anything larger is generated data (a plot with millions of points) or hostile.
MAX_SVG_BYTES = 20 * 1024 * 1024
MAX_ELEMENTS = 200_000
_DATA_IMAGE = re.compile(r"data:image/(png|jpeg|jpg|gif|webp);base64,", re.IGNORECASE)
_DROPPED_TAGS = frozenset({"script", "foreignObject", "iframe", "audio", "video"})


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
            )
        else:
            png = resvg_py.svg_to_bytes(svg_string=markup, width=opts.size, height=opts.size)
    except ValueError as exc:
        raise ThumbqError(CORRUPT_INPUT, f"SVG cannot be rendered: {str(exc)[:200]}") from None
    img = Image.open(io.BytesIO(png), formats=["PNG"])
    img.load()
    return finish(img, opts, SVG, degraded=opts.degraded)


def sanitise(data: bytes, opts: RenderOptions) -> str:
    """The drawing as markup that refers to nothing outside itself.

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
                opts.degraded and _local(child.tag) == "image"
            ):
                parent.remove(child)
        for name in list(parent.attrib):
            local = _local(name)
            # Event handlers never run in resvg; they go anyway, so the markup holds no script.
            unsafe_href = local == "href" and not _safe_reference(parent.attrib[name], opts)
            if unsafe_href or local.startswith("on"):
                del parent.attrib[name]
    if _local(root.tag) != "svg":
        raise ThumbqError(CORRUPT_INPUT, f"the document's root is <{_local(root.tag)}>, not <svg>")
    return ET.tostring(root, encoding="unicode")


def _local(tag: object) -> str:
    text = tag if isinstance(tag, str) else ""
    return text.rsplit("}", 1)[-1]


def _safe_reference(value: str, opts: RenderOptions) -> bool:
    """An in-document fragment, or an embedded raster image whose header declares a size
    within the pixel limit. Files, URLs and embedded SVGs (which could refer to files in turn)
    are not."""
    value = value.strip()
    if value.startswith("#"):
        return True
    match = _DATA_IMAGE.match(value)
    if not match:
        return False
    try:
        raw = base64.b64decode(value[match.end() :], validate=False)
        with Image.open(io.BytesIO(raw)) as img:
            width, height = img.size
    except (binascii.Error, ValueError, OSError, Image.DecompressionBombError):
        return False
    return width * height <= opts.max_pixels
