"""PDF pages (and the other documents MuPDF opens: EPUB, XPS, CBZ, FB2) to thumbnails with
PyMuPDF, rendered straight at the size of the largest box.

Vectors and text are rasterised at the final resolution, so a page of any size in points comes out
crisp and filling the box, without rendering large and shrinking.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pymupdf
from PIL import Image

from worker.engine.errors import CORRUPT_INPUT, ENCRYPTED_INPUT, TOO_LARGE, ThumbqError
from worker.thumbnails.render import RenderOptions, Thumbnail
from worker.thumbnails.render.output import COVER_MAX_ASPECT, finish
from worker.thumbnails.render.sniff import MUPDF_FORMATS

# MuPDF reports recoverable damage on stdout by default; a worker's stdout carries its JSON log.
pymupdf.TOOLS.mupdf_display_errors(False)
pymupdf.TOOLS.mupdf_display_warnings(False)
# MuPDF's default anti-aliasing (8 bits: 256 levels) for graphics and text.
_AA_DEFAULT = 8
# How much of MuPDF's resource cache to free after each document, and the source size above
# which all of it is freed.
STORE_SHRINK_PERCENT = 25
STORE_KEEP_MAX_SOURCE_BYTES = 4 * 1024 * 1024
# A degraded render rasterises at this fraction of the size.
DEGRADED_SCALE = 0.5


def render_document(data: bytes, source_type: str, opts: RenderOptions) -> Thumbnail:
    """Render the first page of a document MuPDF opens (for a PDF: page `opts.pdf_page`), and
    the `opts.pages - 1` pages after it where the document has them."""
    try:
        doc = pymupdf.open(stream=data, filetype=MUPDF_FORMATS[source_type])
    except Exception as exc:
        raise _classify(exc, f"{_name(source_type)} cannot be opened") from None
    if opts.degraded:
        pymupdf.TOOLS.set_aa_level(0)
    try:
        return _render_document(doc, source_type, opts)
    finally:
        doc.close()
        if opts.degraded:
            pymupdf.TOOLS.set_aa_level(_AA_DEFAULT)
        # The warning log is a module-level list and the store a process-wide cache: both would
        # grow in a long-lived worker. The store is not emptied but shrunk by a quarter (least
        # recently used first) after each document, which bounds it at about three documents'
        # resources while the fonts and images documents share stay: emptying it each time
        # cost 3.3 of 12.3 ms per slide or text page (measured).
        # A large document may have filled it with its own images: those go at once, so that
        # the next file's Pillow (which cannot make MuPDF scavenge) has the process's memory.
        pymupdf.TOOLS.reset_mupdf_warnings()
        big = len(data) > STORE_KEEP_MAX_SOURCE_BYTES
        pymupdf.TOOLS.store_shrink(100 if big else STORE_SHRINK_PERCENT)


def _render_document(doc: pymupdf.Document, source_type: str, opts: RenderOptions) -> Thumbnail:
    name = _name(source_type)
    if doc.needs_pass and not doc.authenticate(""):
        raise ThumbqError(ENCRYPTED_INPUT, f"{name} is protected by a password")
    try:
        if doc.is_reflowable:
            # EPUB and FB2 are laid out on demand; counting their pages would lay out the whole
            # book. The first page (usually the cover) is what a shelf shows; further pages
            # (RenderOptions.pages) are loaded one by one until the book ends.
            first, last = 0, max(1, opts.pages) - 1
        else:
            page_count = doc.page_count
            if page_count > opts.max_pages:
                raise ThumbqError(
                    TOO_LARGE,
                    f"{name} has {page_count:,} pages, over the limit of {opts.max_pages:,}",
                )
            if page_count < 1:
                raise ThumbqError(CORRUPT_INPUT, f"{name} has no pages")
            first = min(max(opts.pdf_page, 1), page_count) - 1
            last = min(first + max(1, opts.pages), page_count) - 1
    except ThumbqError:
        raise
    except Exception as exc:
        raise _classify(exc, f"{name} cannot be read") from None
    thumb = _render_page(doc, first, name, source_type, opts, placeholders=True)
    renditions = list(thumb.renditions)
    for number in range(first + 1, last + 1):
        # A later page that cannot be drawn (damage, or a book that has ended) ends the list;
        # the pages before it are still shown. Running out of memory is the file's answer.
        try:
            more = _render_page(doc, number, name, source_type, opts)
        except ThumbqError:
            break
        renditions.extend(more.renditions)
    return replace(thumb, renditions=tuple(renditions))


def _render_page(
    doc: pymupdf.Document,
    number: int,
    name: str,
    source_type: str,
    opts: RenderOptions,
    *,
    placeholders: bool = False,
) -> Thumbnail:
    """Rasterise page `number` (0-based) to fill the largest box, or for `cover` its top square,
    and encode it at every size (the placeholders only for the first page rendered)."""
    try:
        page = doc.load_page(number)
        # page.rect is the crop box with /Rotate applied, starting at (0, 0); scaling its longer
        # side to exactly `size` gives a pixmap whose longer side is `size` (checked on 300
        # random page sizes, offsets and rotations).
        rect = page.rect
        if rect.is_empty or rect.is_infinite:
            raise ThumbqError(CORRUPT_INPUT, f"{name} page has an unusable size {rect}")
        clip = None
        if opts.fit == "cover":
            # The shorter side fills the square (a receipt-like strip at most COVER_MAX_ASPECT
            # times as long); finish() keeps the top. Unrotated, only that square is drawn: a
            # portrait A4 page then costs 0.71 of its whole.
            short, long = min(rect.width, rect.height), max(rect.width, rect.height)
            scale = min(opts.size / short, COVER_MAX_ASPECT * opts.size / long)
            if page.rotation == 0:
                side = min(short, opts.size / scale)
                left = (rect.width - side) / 2
                clip = pymupdf.Rect(left, 0, left + side, side)
        else:
            scale = opts.size / max(rect.width, rect.height)
        if opts.degraded:
            scale *= DEGRADED_SCALE
            if doc.is_pdf:
                _skip_images(page)
    except ThumbqError:
        raise
    except Exception as exc:
        raise _classify(exc, f"{name} page cannot be loaded") from None
    try:
        # Without alpha MuPDF clears the pixmap to white before drawing.
        pix = page.get_pixmap(
            matrix=pymupdf.Matrix(scale, scale), colorspace=pymupdf.csRGB, alpha=False, clip=clip
        )
    except Exception as exc:
        raise _classify(exc, f"{name} page cannot be rendered") from None
    # Pillow reads the pixmap's memory without a copy. MuPDF has no WebP encoder, and its JPEG
    # took 11.5 ms where Pillow's took 0.6 ms for a 512x288 slide (measured).
    img = Image.frombuffer(
        "RGB", (pix.width, pix.height), pix.samples_mv, "raw", "RGB", pix.stride, 1
    )
    return finish(
        img,
        opts,
        source_type,
        degraded=opts.degraded,
        page=number + 1,
        placeholders=placeholders,
    )


def _skip_images(page: pymupdf.Page) -> None:
    """Replace the page's images with a transparent pixel (in memory only): decoding a large scan
    or JPEG 2000 image is what most often makes a page slow."""
    for image in page.get_images(full=True):
        # An image MuPDF cannot replace is drawn as it is.
        with contextlib.suppress(Exception):
            page.delete_image(image[0])


def _name(source_type: str) -> str:
    return {"application/pdf": "PDF"}.get(source_type, MUPDF_FORMATS[source_type].upper())


def _classify(exc: Exception, what: str) -> BaseException:
    """A failed allocation becomes MemoryError (the memory limit decides); all else is damage."""
    text = _reason(exc)
    if isinstance(exc, MemoryError) or "malloc" in text or "out of memory" in text.lower():
        return MemoryError(f"{what}: {text}")
    return ThumbqError(CORRUPT_INPUT, f"{what}: {text}")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    # MuPDF prefixes its messages with "code=N: ", which means nothing to a person.
    if text.startswith("code=") and ": " in text:
        text = text.split(": ", 1)[1]
    return text[:200]
