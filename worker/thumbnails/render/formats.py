"""The format registry: each family of formats the thumbnail task renders, in one list.

A family names the content types its module renders (as sniffed from the bytes: sniff.py), the
renderer in its module, and what the engine's predictor knows its files by before they are read
(a kind, from the declared type or the file's name, with the duration it assumes before anything
was observed). A new format is a module in this folder and one entry in FAMILIES (its magic bytes
in sniff.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.thumbnails.render.sniff import (
    IMAGE_FORMATS,
    MUPDF_FORMATS,
    OFFICE_TYPES,
    SVG,
    VIDEO_TYPES,
)

if TYPE_CHECKING:
    from worker.thumbnails.render import RenderOptions, Thumbnail

Renderer = Callable[[bytes, str, "RenderOptions"], "Thumbnail"]


# The renderers are imported when called, so that importing the registry loads neither PyMuPDF
# nor Pillow (the progress endpoint and the CLI start fast).
def _document(data: bytes, detected: str, opts: RenderOptions) -> Thumbnail:
    from worker.thumbnails.render.pdf import render_document

    return render_document(data, detected, opts)


def _image(data: bytes, detected: str, opts: RenderOptions) -> Thumbnail:
    from worker.thumbnails.render.image import render_image

    return render_image(data, opts)


def _svg(data: bytes, detected: str, opts: RenderOptions) -> Thumbnail:
    from worker.thumbnails.render.svg import render_svg

    return render_svg(data, opts)


def _video(data: bytes, detected: str, opts: RenderOptions) -> Thumbnail:
    from worker.thumbnails.render.video import render_video

    return render_video(data, detected, opts)


def _office(data: bytes, detected: str, opts: RenderOptions) -> Thumbnail:
    from worker.thumbnails.render.office import render_embedded_thumbnail

    return render_embedded_thumbnail(data, detected, opts)


@dataclass(frozen=True)
class Family:
    """One family of formats: what it renders and how the predictor knows its files."""

    types: Collection[str]  # sniffed content types this family's renderer takes
    render: Renderer
    kind: str  # the predictor's name for its files (thumbq.render_stats.kind)
    # A file is of this kind when its declared content type begins with one of these (one with
    # a slash) or contains it (one without), or its name ends with one of these extensions.
    declared: tuple[str, ...]
    extensions: tuple[str, ...]


FAMILIES: tuple[Family, ...] = (
    Family(MUPDF_FORMATS, _document, "pdf", ("application/pdf",), (".pdf",)),
    Family(
        IMAGE_FORMATS,
        _image,
        "image",
        ("image/",),
        (
            ".jpg",
            ".jpeg",
            ".png",
            ".gif",
            ".webp",
            ".tif",
            ".tiff",
            ".bmp",
            ".heic",
            ".heif",
            ".avif",
            ".psd",
        ),
    ),
    Family(frozenset({SVG}), _svg, "image", ("image/",), (".svg",)),
    Family(VIDEO_TYPES, _video, "video", ("video/",), (".mp4", ".m4v", ".mov", ".webm", ".mkv")),
    Family(
        OFFICE_TYPES,
        _office,
        "office",
        ("officedocument", "opendocument"),
        (".pptx", ".docx", ".xlsx", ".odp", ".odt", ".ods"),
    ),
)

# What an item of each kind costs before anything was observed (fetch + render + upload), in ms.
# An office document's first conversion includes LibreOffice's start (1-2 s). Any other kind
# gets the engine's prior (worker.engine.budget).
PRIOR_MS = {"pdf": 400.0, "image": 300.0, "video": 400.0, "office": 1500.0}


def family_of(detected: str | None) -> Family | None:
    """The family that renders the sniffed type `detected`, if any."""
    for family in FAMILIES:
        if detected in family.types:
            return family
    return None


def kind_of(content_type: str | None, key: str) -> str:
    """The kind of a file for prediction, from its declared type or its name ("other" when no
    family claims it)."""
    ct = (content_type or "").lower()
    low = key.lower()
    for family in FAMILIES:
        if _declared(ct, family) or low.endswith(family.extensions):
            return family.kind
    return "other"


def _declared(ct: str, family: Family) -> bool:
    # "application/pdf" and "image/" begin a declared type; "opendocument" is a part of one.
    return any(ct.startswith(d) if "/" in d else d in ct for d in family.declared)
