"""Detect a file's type from its first bytes, whatever type its uploader declared.

Stored content types are often wrong (`application/octet-stream`, or a text file named `.pdf`), so
the renderer is chosen from magic bytes alone. ZIP containers (office documents, e-books, comic
archives) are told apart by their central directory, read with a bounded walk that decompresses
nothing.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

PDF = "application/pdf"
JPEG = "image/jpeg"
PNG = "image/png"
GIF = "image/gif"
WEBP = "image/webp"
TIFF = "image/tiff"
BMP = "image/bmp"
HEIC = "image/heic"
HEIF = "image/heif"
AVIF = "image/avif"
PSD = "image/vnd.adobe.photoshop"
ICO = "image/vnd.microsoft.icon"
CUR = "image/x-win-bitmap"  # freedesktop's name for a Windows cursor
SVG = "image/svg+xml"
MP4 = "video/mp4"
MOV = "video/quicktime"
WEBM = "video/webm"
MKV = "video/x-matroska"
PPTX = "application/vnd.openxmlformats-officedocument.presentationml.presentation"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
ODP = "application/vnd.oasis.opendocument.presentation"
ODT = "application/vnd.oasis.opendocument.text"
ODS = "application/vnd.oasis.opendocument.spreadsheet"
ODG = "application/vnd.oasis.opendocument.graphics"
DOC = "application/msword"
XLS = "application/vnd.ms-excel"
PPT = "application/vnd.ms-powerpoint"
RTF = "application/rtf"
# An OOXML document saved with a password: an OLE2 container whose `EncryptedPackage` stream is
# the encrypted ZIP (there is no registered type for it).
ENCRYPTED_OFFICE = "application/x-ms-encrypted-package"
# Any other OLE2 compound file (Outlook message, Visio drawing, Thumbs.db, ...).
OLE2 = "application/x-ole-storage"
EPUB = "application/epub+zip"
XPS = "application/oxps"
CBZ = "application/vnd.comicbook+zip"
FB2 = "application/x-fictionbook+xml"
ZIP = "application/zip"

#: Raster types `render_image` handles, with the Pillow format that reads each one.
IMAGE_FORMATS: dict[str, str] = {
    JPEG: "JPEG",
    PNG: "PNG",
    GIF: "GIF",
    WEBP: "WEBP",
    TIFF: "TIFF",
    BMP: "BMP",
    HEIC: "HEIF",
    HEIF: "HEIF",
    AVIF: "AVIF",
    PSD: "PSD",
    ICO: "ICO",
    CUR: "ICO",  # read as the icon it is laid out like (see image.py)
}
#: Documents MuPDF lays out or draws, with the `filetype` it opens each one as.
MUPDF_FORMATS: dict[str, str] = {PDF: "pdf", EPUB: "epub", XPS: "xps", CBZ: "cbz", FB2: "fb2"}
VIDEO_TYPES = frozenset({MP4, MOV, WEBM, MKV})
#: Office documents LibreOffice converts, with the short name used in messages and file names.
OFFICE_TYPES: dict[str, str] = {
    PPTX: "pptx",
    DOCX: "docx",
    XLSX: "xlsx",
    ODP: "odp",
    ODT: "odt",
    ODS: "ods",
    ODG: "odg",
    DOC: "doc",
    XLS: "xls",
    PPT: "ppt",
    RTF: "rtf",
}
#: Office types held in an OLE2 compound file (legacy binary Office).
OLE2_OFFICE_TYPES = frozenset({DOC, XLS, PPT})

# Acrobat accepts a header anywhere in the first 1024 bytes (PDF 1.7, annex H), and real files
# carry such junk (mail headers, a BOM, a printer job preamble), so MuPDF's repair does too.
_PDF_HEADER_WINDOW = 1024
_PDF_HEADER = re.compile(rb"%PDF-\d")
# The DIB header that follows BMP's 14-byte file header starts with its own length; these are the
# lengths of the header versions that exist, which keeps a text file starting "BM" from passing.
_BMP_DIB_SIZES = frozenset({12, 16, 40, 52, 56, 64, 108, 124})
_HEVC_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx"})
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
_QUICKTIME_FIRST_BOXES = frozenset({b"moov", b"mdat", b"wide", b"free", b"skip", b"pnot"})
# A central directory is read up to this many entries: enough for any real document, and a
# hostile archive with millions of entries costs a bounded walk.
ZIP_MAX_ENTRIES = 5000
_COMIC_IMAGE_EXT = (".jpg", ".jpeg", ".png", ".gif", ".webp", ".bmp", ".tif", ".tiff")
# Matched as prefixes, so templates ("...text-template": .ott, .otp, .ots, .otg) are drawn like
# the documents they make.
_ODF_MIMETYPES = {
    b"application/vnd.oasis.opendocument.presentation": ODP,
    b"application/vnd.oasis.opendocument.text": ODT,
    b"application/vnd.oasis.opendocument.spreadsheet": ODS,
    b"application/vnd.oasis.opendocument.graphics": ODG,
    b"application/epub+zip": EPUB,
}


def sniff(data: bytes) -> str | None:
    """Return the MIME type that `data`'s magic bytes show, or None when nothing is recognised.

    Types thumbq cannot render (XML, plain text, a plain ZIP, ...) are named where known so an
    error message can say what the file really was.
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
    if head[4:8] == b"ftyp":
        return _sniff_ftyp(data)
    if head[4:8] in _QUICKTIME_FIRST_BOXES and int.from_bytes(head[:4], "big") >= 8:
        return MOV
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        # EBML; the DocType element near the start says which flavour of Matroska.
        return WEBM if b"webm" in data[:64] else MKV
    if head.startswith(b"8BPS"):
        return PSD
    # ICONDIR (type 1 icon, 2 cursor) then 16-byte entries whose fourth byte is reserved 0.
    if (
        head.startswith((b"\x00\x00\x01\x00", b"\x00\x00\x02\x00"))
        and len(data) >= 6 + 16
        and data[9] == 0
        and int.from_bytes(data[4:6], "little") > 0
    ):
        return ICO if head[2] == 1 else CUR
    if head.startswith(b"PK\x03\x04"):
        return _sniff_zip(data)
    if head.startswith(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"):
        return _sniff_ole2(data)
    if data[:64].lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{\\rtf"):
        return RTF
    return _sniff_other(data)


def _sniff_ole2(data: bytes) -> str:
    """Legacy Office documents are OLE2 compound files: the directory's stream names say which
    application wrote one (a bounded walk of the directory, nothing else is read)."""
    from worker.thumbnails.render.ole2 import open_compound

    compound = open_compound(data)
    names = compound.names() if compound is not None else set()
    if "EncryptedPackage" in names:
        return ENCRYPTED_OFFICE
    if "WordDocument" in names:
        return DOC
    if "Workbook" in names or "Book" in names:
        return XLS
    if "PowerPoint Document" in names:
        return PPT
    return OLE2


def _sniff_ftyp(data: bytes) -> str:
    """ISO base media files: HEIF/AVIF images and MP4/QuickTime video share the `ftyp` box."""
    size = int.from_bytes(data[:4], "big")
    major = data[8:12]
    brands = {major}
    end = min(max(size, 16), len(data), 256)
    brands.update(data[i : i + 4] for i in range(16, end - 3, 4))
    if brands & _AVIF_BRANDS:
        return AVIF
    if brands & _HEVC_BRANDS:
        return HEIC
    if major in (b"mif1", b"msf1"):
        return HEIF
    if major == b"qt  ":
        return MOV
    return MP4


def _sniff_zip(data: bytes) -> str:
    """Office documents, EPUB, XPS and comic archives are ZIPs: tell them apart by their names."""
    # ODF and EPUB put an uncompressed "mimetype" entry first, so its content sits at offset 38.
    if data[30:38] == b"mimetype":
        for mimetype, kind in _ODF_MIMETYPES.items():
            if data[38 : 38 + len(mimetype)] == mimetype:
                return kind
    names = zip_names(data)
    if not names:
        return ZIP
    lowered = {n.lower() for n in names}
    if "[content_types].xml" in lowered:
        if "ppt/presentation.xml" in lowered:
            return PPTX
        if "word/document.xml" in lowered:
            return DOCX
        if "xl/workbook.xml" in lowered:
            return XLSX
    if any(n.endswith(".fdseq") for n in lowered):
        return XPS
    if "meta-inf/container.xml" in lowered and any(n.endswith(".opf") for n in lowered):
        return EPUB
    files = [n for n in lowered if not n.endswith("/")]
    if (
        files
        and all(n.endswith((*_COMIC_IMAGE_EXT, ".xml")) for n in files)
        and any(n.endswith(_COMIC_IMAGE_EXT) for n in files)
    ):
        # Comic archives hold page images (and at most a ComicInfo.xml).
        return CBZ
    return ZIP


_EOCD = struct.Struct("<4s4H2LH")
_CDIR = struct.Struct("<4s6H3L5H2L")


class ZipEntry(NamedTuple):
    """One central directory record: its name and its declared sizes."""

    name: str
    compressed: int
    uncompressed: int


def zip_entries(data: bytes, limit: int = ZIP_MAX_ENTRIES) -> list[ZipEntry]:
    """The records of a ZIP's central directory, at most `limit` of them; [] when none can be
    read. Nothing is decompressed."""
    eocd = data.rfind(b"PK\x05\x06", max(0, len(data) - 65_557))
    if eocd < 0 or eocd + _EOCD.size > len(data):
        return []
    _sig, _disk, _cd_disk, _n_here, total, _cd_size, cd_offset, _comment = _EOCD.unpack_from(
        data, eocd
    )
    entries: list[ZipEntry] = []
    pos = cd_offset
    for _ in range(min(total, limit) if total != 0xFFFF else limit):
        if pos + _CDIR.size > len(data) or data[pos : pos + 4] != b"PK\x01\x02":
            break
        fields = _CDIR.unpack_from(data, pos)
        compressed, uncompressed = fields[8], fields[9]
        name_len, extra_len, comment_len = fields[10], fields[11], fields[12]
        name = data[pos + _CDIR.size : pos + _CDIR.size + name_len].decode("utf-8", "replace")
        entries.append(ZipEntry(name, compressed, uncompressed))
        pos += _CDIR.size + name_len + extra_len + comment_len
    return entries


def zip_names(data: bytes, limit: int = ZIP_MAX_ENTRIES) -> list[str]:
    """The names in a ZIP's central directory (see `zip_entries`)."""
    return [e.name for e in zip_entries(data, limit)]


def _sniff_other(data: bytes) -> str | None:
    """Name common types thumbq does not render, so that errors can say what a file really was."""
    head = data[:16]
    if head.startswith(b"\x1f\x8b"):
        return "application/gzip"
    text = _as_text(data[:1024])
    if text is None:
        return None
    lowered = text.lstrip().lower()
    if "<svg" in lowered:
        return SVG
    if "<fictionbook" in lowered:
        return FB2
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
