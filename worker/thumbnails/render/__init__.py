"""Turn the bytes of a file into thumbnails. Knows nothing of queues or storage.

`render()` runs in the calling process; `RenderPool` (in `process.py`) runs it in child processes
that are killed at a deadline or on a memory limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from worker.engine.errors import (
    CORRUPT_INPUT,
    ENCRYPTED_INPUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    MemoryLimitExceeded,
    ThumbqError,
)
from worker.thumbnails.render.formats import family_of
from worker.thumbnails.render.sniff import (
    ENCRYPTED_OFFICE,
    MUPDF_FORMATS,
    sniff,
)

FORMATS = ("webp", "jpeg", "avif")


@dataclass(frozen=True)
class RenderOptions:
    """What to make and which limits refuse hostile input."""

    size: int = 512  # the largest size; `sizes` lists all of them
    format: str = "webp"  # "webp", "jpeg" or "avif"
    quality: int = 80
    pdf_page: int = 1  # 1-based; falls back to the last page when the document is shorter
    max_pixels: int = 80_000_000
    max_pages: int = 10_000
    max_bytes: int = 100 * 1024 * 1024
    # Every size to make from one decode (each a square box); empty means just `size`.
    sizes: tuple[int, ...] = ()
    # The LibreOffice executable that converts office documents (None: there is none, and only
    # an office document's embedded thumbnail can be shown).
    soffice: str | None = None
    # Cheaper rendering for an input that could not finish in its window: lower resolution, no
    # anti-aliasing, embedded images skipped. The thumbnail is marked `degraded`.
    degraded: bool = False
    # Modules of THUMBQ_TASKS: imported once by the zygote, so that its children run their
    # handlers (tasks that run in a process).
    tasks: tuple[str, ...] = ()
    # "contain": the whole picture inside each box; "cover": a square of each box, cut where the
    # picture's most salient part is (documents: the top of the page).
    fit: str = "contain"
    # Pages 1..`pages` of a multi-page document each get a thumbnail (page 1 is `pdf_page`).
    pages: int = 1
    # Set by render() for `cover`: the squares to cut, while `size` is the larger box the
    # renderer fits the picture into so that its shorter side still fills the largest square.
    crop_sizes: tuple[int, ...] = ()

    def all_sizes(self) -> tuple[int, ...]:
        """The sizes to make, ascending, without duplicates."""
        return tuple(sorted(set(self.sizes) | {self.size})) if self.sizes else (self.size,)


@dataclass(frozen=True)
class Rendition:
    """One size of a thumbnail: the box it was made for, its bytes and its pixel size, and the
    page of the document it shows (1 for anything that is not a multi-page document)."""

    size: int
    data: bytes
    width: int
    height: int
    page: int = 1


@dataclass(frozen=True)
class Thumbnail:
    """Encoded thumbnails of one source and what they are. `data`, `width` and `height` are the
    largest rendition's."""

    data: bytes
    content_type: str  # "image/webp", "image/jpeg" or "image/avif"
    width: int
    height: int
    source_type: str  # the sniffed type of the source, e.g. "application/pdf"
    # Page 1's sizes ascending, then each further page's (RenderOptions.pages).
    renditions: tuple[Rendition, ...] = field(default=())
    thumbhash: str | None = None  # base64 ThumbHash, a ~25-byte blurred placeholder
    dominant_color: str | None = None  # "#rrggbb"
    degraded: bool = False  # made by the cheaper fallback (see RenderOptions.degraded)


# What provides each renderer's optional module, and the command that installs it.
_INSTALL = {
    "av": ("av (PyAV, FFmpeg)", "pip install 'thumbq[video]'"),
    "pillow_heif": ("pillow-heif (libheif)", "pip install pillow-heif"),
    "resvg_py": ("resvg-py", "pip install resvg-py"),
    "pymupdf": ("pymupdf-lite (PyMuPDF)", "pip install pymupdf-lite"),
    "fitz": ("pymupdf-lite (PyMuPDF)", "pip install pymupdf-lite"),
    "PIL": ("pillow", "pip install pillow"),
}


def missing_library(exc: ModuleNotFoundError, source_type: str | None) -> ThumbqError:
    """`unsupported_type` for a file whose renderer's library is not installed, naming it."""
    module = (exc.name or str(exc)).split(".")[0]
    package, command = _INSTALL.get(module, (module, f"pip install {module}"))
    return ThumbqError(
        UNSUPPORTED_TYPE,
        f"cannot make a thumbnail of this {source_type or 'file'} here: it needs {package}, "
        f"which is not installed ({command})",
    )


def render(data: bytes, declared_type: str | None, opts: RenderOptions) -> Thumbnail:
    """Make thumbnails of `data`, choosing the renderer from its magic bytes, not `declared_type`.

    Raises ThumbqError with a stable code for empty, oversized, unsupported or damaged input,
    ValueError for options no file could satisfy (checked first: they are not the file's fault).
    """
    if opts.format not in FORMATS:
        raise ValueError(f"unknown thumbnail format {opts.format!r}")
    if not data:
        raise ThumbqError(CORRUPT_INPUT, "file is empty")
    if len(data) > opts.max_bytes:
        raise ThumbqError(
            TOO_LARGE, f"file is {len(data):,} bytes, over the limit of {opts.max_bytes:,}"
        )
    detected = sniff(data)
    if opts.fit == "cover" and not opts.crop_sizes and detected not in MUPDF_FORMATS:
        # A square of the largest box needs the picture's shorter side to fill it: the renderer
        # fits the picture into a box that much larger (PDF pages work out their own scale).
        from worker.thumbnails.render.output import cover_box

        opts = replace(
            opts, size=cover_box(data, detected, opts.size), sizes=(), crop_sizes=opts.all_sizes()
        )
    family = family_of(detected)
    try:
        if family is not None and detected is not None:
            return family.render(data, detected, opts)
        if detected == ENCRYPTED_OFFICE:
            raise ThumbqError(ENCRYPTED_INPUT, "this Office document is protected by a password")
    except MemoryError:
        raise MemoryLimitExceeded(detected or "file") from None
    except (ThumbqError, AssertionError):
        raise  # classified already; or this code's own broken promise, not the file's
    except ModuleNotFoundError as exc:
        # A lean install (a serverless function's) may lack a format's library: this machine
        # cannot render the type, and the message says what to install.
        raise missing_library(exc, detected) from None
    except Exception as exc:
        # The format modules classify what their decoders raise; anything a decoder raises
        # beyond that is still this file's doing (a malformed structure no check foresaw), and
        # retrying the same bytes cannot help: a permanent code, never `internal`.
        raise ThumbqError(
            CORRUPT_INPUT,
            f"the {detected} decoder failed on this file: {type(exc).__name__}: {exc}"[:300],
        ) from None
    raise ThumbqError(
        UNSUPPORTED_TYPE,
        f"cannot make a thumbnail of this file: declared as {declared_type or 'no type'}, "
        f"its content is {detected or 'not a recognised format'}",
    )
