"""The degraded render of an office document LibreOffice could not finish in its window and
that carries no embedded thumbnail: its first words, drawn on a page of its shape.

The words come straight from the file, bounded (a few hundred KB of markup read, a few thousand
characters kept): the main XML part of OOXML and ODF, RTF with its control words stripped, a
Word 97 file's text (at the offset its FIB gives), a PowerPoint file's text atoms. Layout,
pictures and styles are not shown; the thumbnail is marked `degraded`. A legacy spreadsheet
shows the strings of its shared string table (BIFF8) in the order they were first used.
"""

from __future__ import annotations

import html
import io
import re
import struct
import zipfile
import zlib

from PIL import Image, ImageDraw, ImageFont

from worker.thumbnails.render.ole2 import Malformed
from worker.thumbnails.render.sniff import (
    DOC,
    DOCX,
    ODG,
    ODP,
    ODS,
    ODT,
    PPT,
    PPTX,
    RTF,
    XLS,
    XLSX,
)

MAX_MARKUP_BYTES = 512 * 1024
MAX_CHARS = 4000
LETTER = 8.5 / 11
SLIDE = 4 / 3
_SLIDES = frozenset({PPTX, ODP, PPT, ODG})
_PARTS = {
    DOCX: ("word/document.xml",),
    PPTX: ("ppt/slides/slide1.xml",),
    XLSX: ("xl/sharedStrings.xml",),
    ODT: ("content.xml",),
    ODP: ("content.xml",),
    ODS: ("content.xml",),
    ODG: ("content.xml",),
}
# Where a paragraph (or cell) ends in each markup, and what holds text.
_PARAGRAPH_END = re.compile(
    rb"</(?:w:p|a:p|text:p|text:h|si|c)>|<(?:w:br|a:br|text:line-break)\b[^>]*/>"
)
_TAG = re.compile(rb"<[^>]*>")
# Elements whose content is an identifier, not words (a table's style GUID, field code names).
_NOT_TEXT = re.compile(rb"<(a:tableStyleId|w:instrText)\b[^>]*>.*?</\1>", re.S)
_RTF_TOKEN = re.compile(
    rb"\\([a-z]+)(-?\d+)? ?|\\'([0-9a-f]{2})|\\(.)|([{}])|([^\\{}]+)", re.I | re.S
)
# Groups that hold no text of the page: tables, metadata, pictures, embedded objects.
_RTF_SKIP = frozenset(
    {b"fonttbl", b"colortbl", b"stylesheet", b"info", b"pict", b"object", b"header", b"footer",
     b"themedata", b"colorschememapping", b"latentstyles", b"datastore", b"listtable",
     b"listoverridetable", b"rsidtbl", b"generator", b"xmlnstbl", b"fldinst"}
)  # fmt: skip
_RTF_BREAKS = frozenset({b"par", b"line", b"row", b"page", b"sect", b"cell"})
_WORD_FIELD_CODE = re.compile(r"\x13[^\x13\x14\x15]*\x14?")
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def document_lines(data: bytes, source_type: str) -> list[str]:
    """The document's first paragraphs as lines of text ([] when none can be read)."""
    try:
        if source_type in _PARTS:
            text = _markup_text(_part(data, _PARTS[source_type]))
        elif source_type == RTF:
            text = _rtf_text(data[:MAX_MARKUP_BYTES])
        elif source_type == DOC:
            text = _word_text(data)
        elif source_type == PPT:
            text = _powerpoint_text(data)
        elif source_type == XLS:
            text = _excel_text(data)
        else:
            return []
    except (
        zipfile.BadZipFile,
        OSError,
        ValueError,
        EOFError,
        struct.error,
        KeyError,
        IndexError,
        NotImplementedError,
        RuntimeError,  # zipfile: an encrypted part
        zlib.error,
        Malformed,
    ):
        return []  # damaged: no words to show
    text = _CONTROL_CHARS.sub("", text[:MAX_CHARS])
    lines = [" ".join(line.split()) for line in text.splitlines()]
    return [line for line in lines if line]


def text_page(lines: list[str], source_type: str, size: int) -> Image.Image:
    """`lines` drawn in black on a white page of the document's shape that fits `size`."""
    aspect = SLIDE if source_type in _SLIDES else LETTER
    width, height = (size, round(size / aspect)) if aspect > 1 else (round(size * aspect), size)
    page = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(page)
    margin = round(min(width, height) / 11)
    font_px = max(6, round(height / (18 if aspect > 1 else 50)))
    font = ImageFont.load_default(size=font_px)
    y = margin
    for line in lines:
        for row in _wrap(line, font, width - 2 * margin):
            if y + font_px > height - margin:
                return page
            draw.text((margin, y), row, fill="black", font=font)
            y += round(font_px * 1.35)
        y += round(font_px * 0.4)
    return page


def _wrap(line: str, font: ImageFont.FreeTypeFont | ImageFont.ImageFont, width: int) -> list[str]:
    rows: list[str] = []
    row = ""
    for word in line.split(" "):
        candidate = f"{row} {word}" if row else word
        if row and font.getlength(candidate) > width:
            rows.append(row)
            row = word
        else:
            row = candidate
    return [*rows, row] if row else rows


def _part(data: bytes, names: tuple[str, ...]) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        if names == _PARTS[PPTX]:
            names = (*_first_slide(archive), *names)
        for name in names:
            try:
                info = archive.getinfo(name)
            except KeyError:
                continue
            with archive.open(info) as part:
                return part.read(MAX_MARKUP_BYTES)
    return b""


def _first_slide(archive: zipfile.ZipFile) -> tuple[str, ...]:
    """The part of a deck's first slide in show order (the first of presentation.xml's slide
    list), which need not be slide1.xml; () when it cannot be read."""
    try:
        with archive.open("ppt/presentation.xml") as part:
            presentation = part.read(MAX_MARKUP_BYTES)
        with archive.open("ppt/_rels/presentation.xml.rels") as part:
            rels = part.read(MAX_MARKUP_BYTES)
    except KeyError:
        return ()
    first = re.search(rb"<p:sldId\b[^>]*\br:id=\"([^\"]+)\"", presentation)
    if first is None:
        return ()
    for rel in re.finditer(rb"<Relationship\b[^>]*>", rels):
        if re.search(rb'\bId="' + re.escape(first.group(1)) + rb'"', rel.group(0)):
            target = re.search(rb'\bTarget="([^"]+)"', rel.group(0))
            if target is not None:
                return ("ppt/" + target.group(1).decode("utf-8", "replace").lstrip("/"),)
    return ()


def _markup_text(markup: bytes) -> str:
    markup = _NOT_TEXT.sub(b"", markup)
    paragraphs = _PARAGRAPH_END.split(markup)
    text = "\n".join(_TAG.sub(b"", p).decode("utf-8", "replace") for p in paragraphs)
    return html.unescape(text)


def _rtf_text(rtf: bytes) -> str:
    """The text of an RTF document: groups that hold no page text (tables, pictures, fields'
    instructions, any `{\\*...}` destination) skipped, paragraph marks as line breaks."""
    out = bytearray()
    depth = 0
    skip_below: int | None = None  # inside a skipped group opened at this depth
    fresh_group = False
    for word, _arg, hexbyte, symbol, brace, text in (m.groups() for m in _RTF_TOKEN.finditer(rtf)):
        if brace == b"{":
            depth += 1
            fresh_group = True
            continue
        if brace == b"}":
            depth -= 1
            if skip_below is not None and depth < skip_below:
                skip_below = None
            continue
        first, fresh_group = fresh_group, False
        if skip_below is not None:
            continue
        if (word and first and word.lower() in _RTF_SKIP) or (symbol == b"*" and first):
            skip_below = depth
        elif word:
            if word.lower() in _RTF_BREAKS:
                out += b"\n"
            elif word.lower() == b"tab":
                out += b" "
        elif hexbyte:
            out.append(int(hexbyte, 16))
        elif symbol in (b"\\", b"{", b"}"):
            out += symbol
        elif text:
            out += text.replace(b"\r", b"").replace(b"\n", b"")
    return out.decode("cp1252", "replace")


def _word_text(data: bytes) -> str:
    """The main text of a Word 97-2003 file, read where its FIB says (fcMin, ccpText): exact for
    a file saved whole, a fair start for one saved fast (pieces out of order)."""
    from worker.thumbnails.render import ole2

    compound = ole2.CompoundFile(data)
    fib = compound.stream("WordDocument", 2 * MAX_CHARS + 4096)
    fc_min = struct.unpack_from("<I", fib, 0x18)[0]
    ccp_text = min(struct.unpack_from("<I", fib, 0x4C)[0], MAX_CHARS)
    raw = fib[fc_min : fc_min + 2 * ccp_text]
    # Unicode Latin text has a zero in every other byte; 8-bit text has none.
    wide = raw[:ccp_text][1::2].count(0) > ccp_text // 8
    text = (
        raw.decode("utf-16-le", "replace") if wide else raw[:ccp_text].decode("cp1252", "replace")
    )
    text = text.replace("\r", "\n").replace("\x07", "\n").replace("\x0b", "\n")
    return _WORD_FIELD_CODE.sub("", text)


def _powerpoint_text(data: bytes) -> str:
    """The text atoms of a PowerPoint 97-2003 file, in file order (TextCharsAtom: UTF-16,
    TextBytesAtom: 8-bit)."""
    from worker.thumbnails.render import ole2

    stream = ole2.CompoundFile(data).stream("PowerPoint Document", 4 * 1024 * 1024)
    parts: list[str] = []
    for match in re.finditer(rb"\x00\x00(\xa0|\xa8)\x0f", stream):
        start = match.end() + 4
        (length,) = struct.unpack_from("<I", stream, match.end())
        raw = stream[start : start + min(length, 2 * MAX_CHARS)]
        parts.append(raw.decode("utf-16-le" if match.group(1) == b"\xa0" else "cp1252", "replace"))
        if sum(map(len, parts)) > MAX_CHARS:
            break
    return "\n".join(parts).replace("\r", "\n")


def _excel_text(data: bytes) -> str:
    """The shared strings of an Excel 97-2003 workbook (its SST record and the CONTINUE records
    that carry it on; each continuation of a string's characters restarts with a flags byte)."""
    from worker.thumbnails.render import ole2

    compound = ole2.CompoundFile(data)
    names = compound.names()
    book = compound.stream("Workbook" if "Workbook" in names else "Book", 8 * 1024 * 1024)
    pieces: list[bytes] = []
    pos = 0
    while pos + 4 <= len(book):
        kind, length = struct.unpack_from("<HH", book, pos)
        body = book[pos + 4 : pos + 4 + length]
        if kind == 0x00FC or (kind == 0x003C and pieces):
            pieces.append(body)
        elif pieces:
            break
        pos += 4 + length
    if not pieces:
        return ""
    strings: list[str] = []
    piece, at = 0, 8  # past cstTotal and cstUnique
    (unique,) = struct.unpack_from("<I", pieces[0], 4)
    while len(strings) < unique and sum(map(len, strings)) < MAX_CHARS and piece < len(pieces):
        if at >= len(pieces[piece]):
            piece, at = piece + 1, 0
            if piece >= len(pieces):
                break
        block = pieces[piece]
        count, flags = struct.unpack_from("<HB", block, at)
        at += 3
        runs = struct.unpack_from("<H", block, at)[0] if flags & 0x08 else 0
        at += 2 if flags & 0x08 else 0
        extra = struct.unpack_from("<I", block, at)[0] if flags & 0x04 else 0
        at += 4 if flags & 0x04 else 0
        chars: list[str] = []
        wide = bool(flags & 0x01)
        while len(chars) < count:
            if at >= len(pieces[piece]):
                piece += 1
                if piece >= len(pieces):
                    break
                wide, at = bool(pieces[piece][0] & 0x01), 1
            block = pieces[piece]
            take = min(count - len(chars), (len(block) - at) // (2 if wide else 1))
            raw = block[at : at + take * (2 if wide else 1)]
            chars.extend(raw.decode("utf-16-le" if wide else "latin-1", "replace"))
            at += len(raw)
            if take == 0:
                break
        strings.append("".join(chars))
        at += 4 * runs + extra  # formatting runs and phonetic data, which may cross a block
        while piece < len(pieces) and at > len(pieces[piece]):
            at -= len(pieces[piece])
            piece += 1
    return "\n".join(strings)
