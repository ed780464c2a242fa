"""Files of what a real archive adds (tests/system/test_formats_archive.py): legacy binary Office in
OLE2 compound files written by hand, RTF, icons and cursors, SVGs with embedded pictures,
10/12-bit and HDR pictures, password-protected documents, and samples from other projects' test
corpora (tests/fixtures/formats/README.md). `ARCHIVE_FORMATS` maps a name to how its job must end,
as `tests.support.formats_corpus.FORMATS` does.
"""

from __future__ import annotations

import functools
import gzip
import io
import random
import struct
from pathlib import Path

from PIL import Image

from bench.corpus import RED
from tests.support import scheduling
from tests.support.formats_corpus import ODT, Expect, _zip, quadrant_png

# -- legacy binary office (OLE2 compound files) ----------------------------------------------------

_OLE2_MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
_SUMMARY_FMTID = bytes.fromhex("e0859ff2f94f6810ab9108002b27b3d9")


def ole2_file(streams: dict[str, bytes]) -> bytes:
    """A version 3 compound file holding `streams` (each padded with zeros to at least 4 KiB, so
    that none lives in the mini stream): the container of .doc, .xls and .ppt files."""
    sector = 512
    names = list(streams)
    bodies = [
        data.ljust(max(4096, -(-len(data) // sector) * sector), b"\0") for data in streams.values()
    ]
    dir_sectors = -(-(len(names) + 1) // 4)
    fat: list[int] = [0xFFFFFFFD]  # sector 0 holds the FAT itself
    for i in range(dir_sectors):
        fat.append(len(fat) + 1 if i < dir_sectors - 1 else 0xFFFFFFFE)
    starts = []
    for body in bodies:
        n = len(body) // sector
        starts.append(len(fat))
        fat.extend([len(fat) + 1 + i for i in range(n - 1)] + [0xFFFFFFFE])
    assert len(fat) <= 128, "one FAT sector only"
    fat += [0xFFFFFFFF] * (128 - len(fat))

    def entry(name: str, kind: int, child: int, right: int, start: int, size: int) -> bytes:
        encoded = (name + "\0").encode("utf-16-le")
        return (
            encoded.ljust(64, b"\0")
            + struct.pack("<HBBIII", len(encoded), kind, 1, 0xFFFFFFFF, right, child)
            + b"\0" * 36
            + struct.pack("<IQ", start, size)
        )

    directory = entry("Root Entry", 5, 1 if names else 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFE, 0)
    for i, name in enumerate(names):
        right = i + 2 if i + 1 < len(names) else 0xFFFFFFFF
        directory += entry(name, 2, 0xFFFFFFFF, right, starts[i], len(bodies[i]))
    directory = directory.ljust(dir_sectors * sector, b"\0")
    header = (
        _OLE2_MAGIC
        + b"\0" * 16
        + struct.pack("<HHHHH", 0x3E, 3, 0xFFFE, 9, 6)
        + b"\0" * 6
        + struct.pack("<IIIIIIIIII", 0, 1, 1, 0, 4096, 0xFFFFFFFE, 0, 0xFFFFFFFE, 0, 0)
    )
    header = header[:0x4C] + struct.pack("<I", 0) + b"\xff" * (4 * 108)
    header = header.ljust(sector, b"\0")
    return header + struct.pack("<128I", *fat) + directory + b"".join(bodies)


def _summary_with_thumbnail(picture: Image.Image) -> bytes:
    """A SummaryInformation property set whose thumbnail (PIDSI_THUMBNAIL) is a DIB."""
    out = io.BytesIO()
    picture.convert("RGB").save(out, "BMP")
    dib = out.getvalue()[14:]
    value = struct.pack("<IIiI", 71, 8 + len(dib), -1, 8) + dib
    section = struct.pack("<IIII", 16 + len(value), 1, 0x11, 16) + value
    return (
        struct.pack("<HHI", 0xFFFE, 0, 0)
        + b"\0" * 16
        + struct.pack("<I", 1)
        + _SUMMARY_FMTID
        + struct.pack("<I", 48)
        + section
    )


def _word_fib(encrypted: bool) -> bytes:
    """The start of a WordDocument stream: a FIB whose flags say whether it is encrypted."""
    flags = 0x0100 if encrypted else 0  # fEncrypted
    return struct.pack("<6H", 0xA5EC, 0xC1, 0, 0x0409, 0, flags) + b"\0" * 20


@functools.cache
def doc_with_summary_thumbnail() -> bytes:
    """A Word 97 file LibreOffice cannot read (its text is missing) that stores a red and blue
    preview in SummaryInformation."""
    picture = Image.open(io.BytesIO(quadrant_png(64, 48)))
    return ole2_file(
        {
            "WordDocument": _word_fib(False),
            "\x05SummaryInformation": _summary_with_thumbnail(picture),
        }
    )


def encrypted_doc() -> bytes:
    return ole2_file({"WordDocument": _word_fib(True)})


def encrypted_xls() -> bytes:
    bof = struct.pack("<HH", 0x0809, 16) + b"\0" * 16
    filepass = struct.pack("<HH", 0x002F, 6) + b"\1\0\1\0\1\0"
    return ole2_file({"Workbook": bof + filepass})


def encrypted_ppt() -> bytes:
    current_user = struct.pack("<HHII", 0, 0x0FF6, 20, 20) + struct.pack("<I", 0xF3D1C4DF)
    return ole2_file({"PowerPoint Document": b"\0" * 64, "Current User": current_user})


def encrypted_ooxml() -> bytes:
    """A DOCX saved with a password: an OLE2 container whose EncryptedPackage is the ZIP."""
    return ole2_file({"EncryptionInfo": b"\4\0\4\0" + b"\0" * 60, "EncryptedPackage": b"\0" * 64})


def rtf_letter(lines: int = 30) -> bytes:
    """A letter of `lines` lines in RTF, written by hand."""
    body = "".join(
        f"\\par Line {i}: the quick brown fox jumps over the lazy dog." for i in range(lines)
    )
    return (
        "{\\rtf1\\ansi\\deff0{\\fonttbl{\\f0 Helvetica;}}\\f0\\fs24 {\\b Report}" + body + "}"
    ).encode()


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"


def fixture(name: str) -> bytes:
    """A sample file from another project's test corpus (tests/fixtures/formats/README.md)."""
    return gzip.decompress((FIXTURES / f"{name}.gz").read_bytes())


@functools.cache
def doc_sample() -> bytes:
    return fixture("harmless-clean.doc")


@functools.cache
def xls_sample() -> bytes:
    return fixture("embedded-simple-2007.xls")


@functools.cache
def pps_sample() -> bytes:
    return fixture("sample_with_lnk_file.pps")


def ico_icon() -> bytes:
    return icon((16, 48, 256))


def cur_cursor() -> bytes:
    return icon((16, 32, 256), cursor=True)


def svg_with_png_data_uri() -> bytes:
    import base64

    png = base64.b64encode(quadrant_png(40, 40)).decode()
    return svg_embedding(f"data:image/png;base64,{png}")


#: What a real archive adds (tests/system/test_formats_archive.py), in the same form.
ARCHIVE_FORMATS: dict[str, Expect] = {
    "doc": Expect(doc_sample, 0, needs_soffice=True),
    "xls": Expect(xls_sample, 0, needs_soffice=True),
    "pps": Expect(pps_sample, 4 / 3, needs_soffice=True),
    "rtf": Expect(rtf_letter, 0, needs_soffice=True),
    "ico": Expect(ico_icon, 1.0, colour=RED),
    "cur": Expect(cur_cursor, 1.0, colour=RED),
    "svg_data_image": Expect(svg_with_png_data_uri, 1.0, colour=RED),
    "avif_hdr_ictcp": Expect(lambda: grey_avif(148, transfer=PQ_TRANSFER, matrix=ICTCP), 128 / 96),
}


# -- icons and cursors -----------------------------------------------------------------------------


def icon(sizes: tuple[int, ...], *, bitmap_format: str = "png", cursor: bool = False) -> bytes:
    """A Windows icon of the red-and-blue picture at each of `sizes` (PNG or BMP entries); as a
    cursor its directory says type 2 and each entry carries a hotspot of (3, 5)."""
    out = io.BytesIO()
    picture = Image.open(io.BytesIO(quadrant_png(max(sizes), max(sizes)))).convert("RGBA")
    picture.save(out, "ICO", sizes=[(s, s) for s in sizes], bitmap_format=bitmap_format)
    data = bytearray(out.getvalue())
    if cursor:
        data[2] = 2
        for i in range(int.from_bytes(data[4:6], "little")):
            data[6 + 16 * i + 4 : 6 + 16 * i + 8] = struct.pack("<HH", 3, 5)
    return bytes(data)


# -- SVG with embedded pictures --------------------------------------------------------------------


def svg_embedding(href: str) -> bytes:
    """A white 100 x 100 drawing whose only picture is the `<image>` that `href` names."""
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        'width="100" height="100"><rect width="100" height="100" fill="white"/>'
        f'<image x="0" y="0" width="100" height="100" xlink:href="{href}"/></svg>'
    ).encode()


def svg_red_square(extra: str = "") -> bytes:
    """A 40 x 40 drawing whose top-left quarter is red (and whatever `extra` markup adds)."""
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink" '
        f'width="40" height="40"><rect width="20" height="20" fill="rgb(220,30,30)"/>{extra}</svg>'
    ).encode()


def svg_slow_filter(radius: int = 60) -> bytes:
    """A drawing with a red square dilated by `feMorphology`: resvg takes about a minute at
    512 px for a radius of 50 (cost grows with the radius), so only a render without filters
    finishes in a window of seconds."""
    return (
        '<svg xmlns="http://www.w3.org/2000/svg" width="200" height="200">'
        f'<filter id="f"><feMorphology operator="dilate" radius="{radius}"/></filter>'
        "<style>.s { filter: url(#f) }</style>"
        '<rect width="200" height="200" fill="white"/>'
        '<rect x="50" y="50" width="100" height="100" fill="rgb(220,30,30)" filter="url(#f)"/>'
        '<rect class="s" x="0" y="0" width="20" height="20" fill="rgb(30,60,220)"/></svg>'
    ).encode()


# -- 10/12-bit and HDR pictures --------------------------------------------------------------------

# nclx codes (ITU-T H.273): BT.2020 primaries, PQ and HLG transfers, BT.2020 NCL/CL and ICtCp.
BT2020, PQ_TRANSFER, HLG_TRANSFER, SDR_TRANSFER = 9, 16, 18, 1
BT2020_NCL, BT2020_CL, ICTCP = 9, 10, 14


def grey_avif(
    level: int, *, transfer: int, matrix: int, size: tuple[int, int] = (128, 96)
) -> bytes:
    """A 10-bit AVIF of one grey code value (0-255 scale) with the given nclx colour, encoded by
    SVT-AV1 (PyAV's wheel)."""
    import av

    buf = io.BytesIO()
    # The encoder makes its caller real-time when run as root (tests/support/scheduling.py).
    with scheduling.kept(), av.open(buf, "w", format="avif") as container:
        stream = container.add_stream("libsvtav1", rate=1)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p10le"
        context = stream.codec_context
        context.color_primaries, context.color_trc, context.colorspace = BT2020, transfer, matrix
        frame = av.VideoFrame.from_image(Image.new("RGB", size, (level,) * 3))
        for packet in stream.encode(frame.reformat(format="yuv420p10le")):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def grey_heic(
    level: int, *, transfer: int, bits: int = 10, size: tuple[int, int] = (128, 96)
) -> bytes:
    """A 10- or 12-bit HEIC of one grey code value (0-255 scale), BT.2020 with `transfer`."""
    import pillow_heif

    value = (level << 8).to_bytes(2, "little")
    picture = pillow_heif.from_bytes(mode="RGB;16", size=size, data=value * 3 * size[0] * size[1])
    buf = io.BytesIO()
    previous = pillow_heif.options.SAVE_HDR_TO_12_BIT
    pillow_heif.options.SAVE_HDR_TO_12_BIT = bits == 12
    try:
        picture.save(
            buf,
            format="HEIF",
            quality=90,
            color_primaries=BT2020,
            transfer_characteristics=transfer,
            matrix_coefficients=BT2020_NCL,
            full_range_flag=1,
        )
    finally:
        pillow_heif.options.SAVE_HDR_TO_12_BIT = previous
    return buf.getvalue()


def odt_encrypted() -> bytes:
    """An ODT saved with a password: its manifest says how content.xml is encrypted (the part
    itself is noise)."""
    manifest = (
        '<?xml version="1.0" encoding="UTF-8"?><manifest:manifest xmlns:manifest="urn:oasis:names:'
        'tc:opendocument:xmlns:manifest:1.0" manifest:version="1.2"><manifest:file-entry '
        f'manifest:full-path="/" manifest:media-type="{ODT}"/><manifest:file-entry manifest:'
        'full-path="content.xml" manifest:media-type="text/xml" manifest:size="900">'
        '<manifest:encryption-data manifest:checksum-type="SHA1/1K" manifest:checksum="AAAA">'
        '<manifest:algorithm manifest:algorithm-name="Blowfish CFB" '
        'manifest:initialisation-vector="AAAAAAAAAAA="/><manifest:key-derivation '
        'manifest:key-derivation-name="PBKDF2" manifest:iteration-count="1024" '
        'manifest:salt="AAAAAAAAAAAAAAAAAAAAAA=="/></manifest:encryption-data>'
        "</manifest:file-entry></manifest:manifest>"
    )
    noise = random.Random(7).randbytes(900)
    return _zip(
        {"mimetype": ODT, "content.xml": noise, "META-INF/manifest.xml": manifest},
        stored_first="mimetype",
    )


def black_heic_10bit(size: tuple[int, int] = (6000, 4000)) -> bytes:
    """A 24 MP 10-bit HEIC, all black (x265's fastest preset: about 2 s). libheif needs some
    150 MB to decode it, beyond what a render process of 160 MB has left."""
    import pillow_heif

    picture = pillow_heif.from_bytes(mode="RGB;16", size=size, data=bytes(6 * size[0] * size[1]))
    buf = io.BytesIO()
    picture.save(buf, format="HEIF", quality=50, enc_params={"preset": "ultrafast"})
    return buf.getvalue()
