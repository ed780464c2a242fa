"""Turn the bytes of a file into a thumbnail. Knows nothing of queues or storage.

`render()` runs in the calling process; `RenderPool` (in `process.py`) runs it in child processes
that are killed at a deadline or on a memory limit.
"""

from __future__ import annotations

from dataclasses import dataclass


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
