"""Turn the bytes of a file into a thumbnail. Knows nothing of queues or storage.

`render()` runs in the calling process; `RenderPool` (in `process.py`) runs it in child processes
that are killed at a deadline or on a memory limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import CORRUPT_INPUT, TOO_LARGE, UNSUPPORTED_TYPE, ThumbqError
from worker.render.sniff import IMAGE_FORMATS, PDF, sniff


@dataclass(frozen=True)
class RenderOptions:
    """What to make and which limits refuse hostile input."""

    size: int = 512
    format: str = "webp"  # "webp" or "jpeg"
    quality: int = 80
    pdf_page: int = 1  # 1-based; falls back to the last page when the document is shorter
    max_pixels: int = 80_000_000
    max_pages: int = 10_000
    max_bytes: int = 100 * 1024 * 1024


@dataclass(frozen=True)
class Thumbnail:
    """An encoded thumbnail and what it is."""

    data: bytes
    content_type: str  # "image/webp" or "image/jpeg"
    width: int
    height: int
    source_type: str  # the sniffed type of the source, e.g. "application/pdf"


class MemoryLimitExceeded(ThumbqError):
    """Rendering ran out of memory: the input needs more than a render may use (`too_large`)."""

    def __init__(self, what: str) -> None:
        super().__init__(TOO_LARGE, f"rendering this {what} exceeded the memory limit")


def render(data: bytes, declared_type: str | None, opts: RenderOptions) -> Thumbnail:
    """Make a thumbnail of `data`, choosing the renderer from its magic bytes, not `declared_type`.

    Raises ThumbqError with a stable code for empty, oversized, unsupported or damaged input.
    """
    if not data:
        raise ThumbqError(CORRUPT_INPUT, "file is empty")
    if len(data) > opts.max_bytes:
        raise ThumbqError(
            TOO_LARGE, f"file is {len(data):,} bytes, over the limit of {opts.max_bytes:,}"
        )
    detected = sniff(data)
    # The renderers are imported here so that `import worker.render` loads neither PyMuPDF nor
    # Pillow (the progress endpoint and CLI start fast).
    try:
        if detected == PDF:
            from worker.render.pdf import render_pdf

            return render_pdf(data, opts)
        if detected in IMAGE_FORMATS:
            from worker.render.image import render_image

            return render_image(data, opts)
    except MemoryError:
        raise MemoryLimitExceeded(detected or "file") from None
    raise ThumbqError(
        UNSUPPORTED_TYPE,
        f"cannot make a thumbnail of this file: declared as {declared_type or 'no type'}, "
        f"its content is {detected or 'not a recognised format'}",
    )
