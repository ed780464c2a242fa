"""Files of the formats beyond PDF and raster images, made in memory by the tools that write them
(python-pptx, python-docx, ebooklib, PyAV, pillow-heif, Pillow), and hostile ones.

Each maker is cached for the life of the process. `FORMATS` maps a name to how the job must end
and what its thumbnail must look like; `HOSTILE` the same for files built to hurt.
"""

from __future__ import annotations

import functools
import io
import random
import struct
import zipfile
import zlib
from dataclasses import dataclass
from fractions import Fraction

from PIL import Image, ImageDraw

from bench.corpus import BLUE, RED, build_pdf

PPTX = "application/vnd.openxmlformats-officedocument.presentationml.presentation"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
XLSX = "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
ODP = "application/vnd.oasis.opendocument.presentation"
ODT = "application/vnd.oasis.opendocument.text"


# -- office documents ------------------------------------------------------------------------------


@functools.cache
def pptx_deck() -> bytes:
    """A 16:9 deck of three slides; the first has a title and a large red rectangle."""
    from pptx import Presentation
    from pptx.dml.color import RGBColor
    from pptx.util import Inches

    prs = Presentation()
    prs.slide_width, prs.slide_height = Inches(13.333), Inches(7.5)
    slide = prs.slides.add_slide(prs.slide_layouts[5])
    slide.shapes.title.text = "Quarterly review"
    box = slide.shapes.add_shape(1, Inches(1), Inches(2), Inches(8), Inches(4.5))
    box.fill.solid()
    box.fill.fore_color.rgb = RGBColor(*RED)
    for i in range(2):
        prs.slides.add_slide(prs.slide_layouts[1]).shapes.title.text = f"Slide {i + 2}"
    out = io.BytesIO()
    prs.save(out)
    return out.getvalue()


@functools.cache
def docx_letter() -> bytes:
    """A portrait US-letter document: a heading and paragraphs of text."""
    from docx import Document

    doc = Document()
    doc.add_heading("Minutes of the meeting", level=0)
    for i in range(12):
        doc.add_paragraph(f"Item {i + 1}: " + "the committee discussed the budget. " * 6)
    out = io.BytesIO()
    doc.save(out)
    return out.getvalue()


def _zip(parts: dict[str, bytes | str], *, stored_first: str | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        if stored_first is not None:
            # ODF and EPUB: an uncompressed "mimetype" first, so that its bytes sit at offset 38.
            archive.writestr(zipfile.ZipInfo(stored_first), parts[stored_first], zipfile.ZIP_STORED)
        for name, content in parts.items():
            if name != stored_first:
                archive.writestr(name, content)
    return out.getvalue()


@functools.cache
def xlsx_sheet() -> bytes:
    """A minimal workbook written part by part (the smallest set of parts Excel opens)."""
    rows = "".join(
        f'<row r="{r}"><c r="A{r}" t="inlineStr"><is><t>Region {r}</t></is></c>'
        f'<c r="B{r}"><v>{r * 1234}</v></c></row>'
        for r in range(1, 30)
    )
    return _zip(
        {
            "[Content_Types].xml": (
                '<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats'
                '.org/package/2006/content-types"><Default Extension="rels" ContentType="applicati'
                'on/vnd.openxmlformats-package.relationships+xml"/><Default Extension="xml" Conten'
                'tType="application/xml"/><Override PartName="/xl/workbook.xml" ContentType="appli'
                'cation/vnd.openxmlformats-officedocument.spreadsheetml.sheet.main+xml"/><Override'
                ' PartName="/xl/worksheets/sheet1.xml" ContentType="application/vnd.openxmlformats'
                '-officedocument.spreadsheetml.worksheet+xml"/></Types>'
            ),
            "_rels/.rels": (
                '<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxm'
                'lformats.org/package/2006/relationships"><Relationship Id="rId1" Type="http://sch'
                'emas.openxmlformats.org/officeDocument/2006/relationships/officeDocument" Target'
                '="xl/workbook.xml"/></Relationships>'
            ),
            "xl/workbook.xml": (
                '<?xml version="1.0" encoding="UTF-8"?><workbook xmlns="http://schemas.openxmlform'
                'ats.org/spreadsheetml/2006/main" xmlns:r="http://schemas.openxmlformats.org/offic'
                'eDocument/2006/relationships"><sheets><sheet name="Sales" sheetId="1" r:id="rId1"'
                "/></sheets></workbook>"
            ),
            "xl/_rels/workbook.xml.rels": (
                '<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxm'
                'lformats.org/package/2006/relationships"><Relationship Id="rId1" Type="http://sch'
                'emas.openxmlformats.org/officeDocument/2006/relationships/worksheet" Target="work'
                'sheets/sheet1.xml"/></Relationships>'
            ),
            "xl/worksheets/sheet1.xml": (
                '<?xml version="1.0" encoding="UTF-8"?><worksheet xmlns="http://schemas.openxmlfor'
                f'mats.org/spreadsheetml/2006/main"><sheetData>{rows}</sheetData></worksheet>'
            ),
        }
    )


def _odf(mimetype: str, body: str, thumbnail: bytes | None = None) -> bytes:
    office = "urn:oasis:names:tc:opendocument:xmlns:office:1.0"
    content = (
        f'<?xml version="1.0" encoding="UTF-8"?><office:document-content xmlns:office="{office}" '
        'xmlns:text="urn:oasis:names:tc:opendocument:xmlns:text:1.0" '
        'xmlns:draw="urn:oasis:names:tc:opendocument:xmlns:drawing:1.0" '
        'xmlns:presentation="urn:oasis:names:tc:opendocument:xmlns:presentation:1.0" '
        'xmlns:svg="urn:oasis:names:tc:opendocument:xmlns:svg-compatible:1.0" '
        f'office:version="1.2"><office:body>{body}</office:body></office:document-content>'
    )
    manifest = (
        '<?xml version="1.0" encoding="UTF-8"?><manifest:manifest xmlns:manifest="urn:oasis:names:'
        'tc:opendocument:xmlns:manifest:1.0" manifest:version="1.2"><manifest:file-entry manifest:'
        f'full-path="/" manifest:media-type="{mimetype}"/><manifest:file-entry manifest:full-path='
        '"content.xml" manifest:media-type="text/xml"/></manifest:manifest>'
    )
    parts: dict[str, bytes | str] = {
        "mimetype": mimetype,
        "content.xml": content,
        "META-INF/manifest.xml": manifest,
    }
    if thumbnail is not None:
        parts["Thumbnails/thumbnail.png"] = thumbnail
    return _zip(parts, stored_first="mimetype")


@functools.cache
def odt_text() -> bytes:
    """An OpenDocument text of a few paragraphs, written part by part."""
    paragraphs = "".join(
        f"<text:p>Paragraph {i}: the quick brown fox jumps over the lazy dog.</text:p>"
        for i in range(20)
    )
    return _odf(ODT, f"<office:text><text:h>Report</text:h>{paragraphs}</office:text>")


@functools.cache
def odp_slides() -> bytes:
    """An OpenDocument presentation with one slide holding a text frame."""
    body = (
        '<office:presentation><draw:page draw:name="one"><draw:frame svg:x="2cm" svg:y="2cm" '
        'svg:width="20cm" svg:height="4cm"><draw:text-box><text:p>Welcome to the event</text:p>'
        "</draw:text-box></draw:frame></draw:page></office:presentation>"
    )
    return _odf(ODP, body)


def quadrant_png(width: int, height: int) -> bytes:
    img = Image.new("RGB", (width, height), BLUE)
    ImageDraw.Draw(img).rectangle((0, 0, width // 2, height // 2), fill=RED)
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


@functools.cache
def odp_with_embedded_thumbnail() -> bytes:
    """An ODP whose Thumbnails/thumbnail.png shows a picture (red and blue, 256x192)."""
    return _odf(ODP, "<office:presentation/>", quadrant_png(256, 192))


@functools.cache
def pptx_zip_bomb() -> bytes:
    """A real deck plus one media part of 512 MiB of zeros that deflates to about 0.5 MB."""
    deck = zipfile.ZipFile(io.BytesIO(pptx_deck()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in deck.infolist():
            archive.writestr(info, deck.read(info))
        with archive.open("ppt/media/image99.bin", "w", force_zip64=True) as part:
            chunk = bytes(8 * 1024 * 1024)
            for _ in range(64):
                part.write(chunk)
    return out.getvalue()


@functools.cache
def pptx_with_thumbnail() -> bytes:
    """The deck, with a picture (red and blue) as its docProps/thumbnail.jpeg instead of the
    plain white one python-pptx writes."""
    deck = zipfile.ZipFile(io.BytesIO(pptx_deck()))
    img = Image.open(io.BytesIO(quadrant_png(256, 144))).convert("RGB")
    picture = io.BytesIO()
    img.save(picture, "JPEG", quality=90)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in deck.infolist():
            if info.filename == "docProps/thumbnail.jpeg":
                archive.writestr(info, picture.getvalue())
            else:
                archive.writestr(info, deck.read(info))
    return out.getvalue()


# -- e-books and other documents -------------------------------------------------------------------


@functools.cache
def epub_book() -> bytes:
    """An EPUB (ebooklib) whose first chapter opens with a red heading."""
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("thumbq-test-book")
    book.set_title("A test book")
    book.set_language("en")
    chapter = epub.EpubHtml(title="One", file_name="one.xhtml", lang="en")
    chapter.content = (
        "<html><body><h1 style='color:#dc1e1e'>Chapter one</h1><p>"
        + "It was a bright cold day in April. " * 40
        + "</p></body></html>"
    )
    book.add_item(chapter)
    book.toc = (chapter,)
    book.spine = [chapter]
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    out = io.BytesIO()
    epub.write_epub(out, book)
    return out.getvalue()


@functools.cache
def fb2_book() -> bytes:
    return (
        '<?xml version="1.0" encoding="utf-8"?>'
        '<FictionBook xmlns="http://www.gribuser.ru/xml/fictionbook/2.0"><body><section>'
        "<title><p>The first chapter</p></title>"
        + "<p>Once upon a time there was a thumbnail. </p>" * 30
        + "</section></body></FictionBook>"
    ).encode()


@functools.cache
def cbz_comic() -> bytes:
    """A comic archive of three portrait pages (2:3), the first red over blue."""
    pages: dict[str, bytes | str] = {}
    for i in range(3):
        img = Image.new("RGB", (800, 1200), BLUE)
        ImageDraw.Draw(img).rectangle((0, 0, 800, 600), fill=RED if i == 0 else (40, 40, 40))
        out = io.BytesIO()
        img.save(out, "JPEG", quality=90)
        pages[f"page{i:02d}.jpg"] = out.getvalue()
    return _zip(pages)


@functools.cache
def xps_document() -> bytes:
    """An XPS document: one A4-ish fixed page with a red rectangle over a blue one."""
    fixed_page = (
        '<FixedPage xmlns="http://schemas.microsoft.com/xps/2005/06" Width="816" Height="1056" '
        'xml:lang="en"><Path Data="M 0,0 L 816,0 816,1056 0,1056 Z" Fill="#FF1E3CDC"/>'
        '<Path Data="M 0,0 L 408,0 408,528 0,528 Z" Fill="#FFDC1E1E"/></FixedPage>'
    )
    return _zip(
        {
            "[Content_Types].xml": (
                '<?xml version="1.0" encoding="utf-8"?><Types xmlns="http://schemas.openxmlformats'
                '.org/package/2006/content-types"><Default Extension="fdseq" ContentType="applicat'
                'ion/vnd.ms-package.xps-fixeddocumentsequence+xml"/><Default Extension="fdoc" Cont'
                'entType="application/vnd.ms-package.xps-fixeddocument+xml"/><Default Extension="f'
                'page" ContentType="application/vnd.ms-package.xps-fixedpage+xml"/><Default Extens'
                'ion="rels" ContentType="application/vnd.openxmlformats-package.relationships+xml"'
                "/></Types>"
            ),
            "_rels/.rels": (
                '<?xml version="1.0" encoding="utf-8"?><Relationships xmlns="http://schemas.openxm'
                'lformats.org/package/2006/relationships"><Relationship Type="http://schemas.micro'
                'soft.com/xps/2005/06/fixedrepresentation" Target="/FixedDocumentSequence.fdseq" I'
                'd="R0"/></Relationships>'
            ),
            "FixedDocumentSequence.fdseq": (
                '<FixedDocumentSequence xmlns="http://schemas.microsoft.com/xps/2005/06"><Document'
                'Reference Source="/Documents/1/FixedDocument.fdoc"/></FixedDocumentSequence>'
            ),
            "Documents/1/FixedDocument.fdoc": (
                '<FixedDocument xmlns="http://schemas.microsoft.com/xps/2005/06"><PageContent Sour'
                'ce="/Documents/1/Pages/1.fpage"/></FixedDocument>'
            ),
            "Documents/1/Pages/1.fpage": fixed_page,
        }
    )


# -- pictures --------------------------------------------------------------------------------------


def portrait_picture(width: int = 600, height: int = 900) -> Image.Image:
    """Red top half, blue bottom half, and a grey band: never uniform, orientation visible."""
    img = Image.new("RGB", (width, height), BLUE)
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 0, width, height // 2), fill=RED)
    draw.rectangle((0, height // 2 - 20, width, height // 2 + 20), fill=(128, 128, 128))
    return img


@functools.cache
def heic_photo() -> bytes:
    """A portrait HEIC written by pillow-heif (libheif + x265)."""
    import pillow_heif

    out = io.BytesIO()
    pillow_heif.from_pillow(portrait_picture()).save(out, quality=70)
    return out.getvalue()


@functools.cache
def avif_photo() -> bytes:
    """A portrait AVIF written by Pillow."""
    out = io.BytesIO()
    portrait_picture().save(out, "AVIF", quality=60, speed=10)
    return out.getvalue()


@functools.cache
def psd_image() -> bytes:
    """A Photoshop file with no layers: its composite is the picture (raw RGB, planar)."""
    img = portrait_picture(300, 450)
    width, height = img.size
    header = struct.pack(">4sH6xHIIHH", b"8BPS", 1, 3, height, width, 8, 3)
    planes = b"".join(channel.tobytes() for channel in img.split())
    sections = struct.pack(">I", 0) * 3  # colour mode data, image resources, layers: empty
    return header + sections + struct.pack(">H", 0) + planes


@functools.cache
def svg_drawing() -> bytes:
    """A landscape (2:1) SVG with a gradient background and text: PyMuPDF would draw the gradient
    black."""
    return (
        b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 400 200">'
        b'<defs><linearGradient id="g"><stop offset="0" stop-color="#dc1e1e"/>'
        b'<stop offset="1" stop-color="#1e3cdc"/></linearGradient></defs>'
        b'<rect width="400" height="200" fill="url(#g)"/>'
        b'<text x="20" y="120" font-size="60" fill="white">Logo</text></svg>'
    )


# -- video -----------------------------------------------------------------------------------------


def write_video(
    codec: str,
    container: str,
    *,
    width: int = 320,
    height: int = 180,
    seconds: float = 4,
    black_seconds: float = 1,
    fps: int = 25,
    gop: int = 25,
) -> bytes:
    """A video whose first `black_seconds` are black, then blue with a red box moving; a
    keyframe every `gop` frames."""
    import av

    out = io.BytesIO()
    with av.open(out, "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = gop
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "keyint": str(gop), "scenecut": "0"}
        elif codec == "libvpx-vp9":
            stream.options = {"deadline": "realtime", "cpu-used": "8"}
        stream.time_base = Fraction(1, fps)
        for i in range(int(seconds * fps)):
            if i < black_seconds * fps:
                img = Image.new("RGB", (width, height), (0, 0, 0))
            else:
                img = Image.new("RGB", (width, height), BLUE)
                x = (i * 7) % (width // 2)
                ImageDraw.Draw(img).rectangle(
                    (x, height // 4, x + width // 4, height // 2), fill=RED
                )
            frame = av.VideoFrame.from_image(img)
            frame.pts = i
            for packet in stream.encode(frame):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return out.getvalue()


@functools.cache
def mp4_video() -> bytes:
    return write_video("libx264", "mp4")


@functools.cache
def mov_video() -> bytes:
    return write_video("libx264", "mov")


@functools.cache
def webm_video() -> bytes:
    return write_video("libvpx-vp9", "webm")


@functools.cache
def mkv_video() -> bytes:
    return write_video("libx264", "matroska")


# -- hostile ---------------------------------------------------------------------------------------


def svg_with_references(server: str, local_png: str) -> bytes:
    """An SVG that names a local file (by path and by file:// URL), /etc/passwd, and remote URLs
    on `server` in every way SVG and CSS allow; a safe renderer draws only the green rectangle."""
    return f"""<?xml version="1.0"?>
<?xml-stylesheet type="text/css" href="{server}/stylesheet.css"?>
<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink"
     width="200" height="100">
  <style>@import url({server}/import.css); rect.r {{ fill: url({server}/paint.svg#p) }}</style>
  <rect width="200" height="100" fill="#1eb43c"/>
  <image href="{local_png}" x="0" y="0" width="100" height="100"/>
  <image xlink:href="file://{local_png}" x="100" y="0" width="100" height="100"/>
  <image href="file:///etc/passwd" width="10" height="10"/>
  <image href="{server}/remote.png" width="50" height="50"/>
  <use href="{server}/sprite.svg#icon"/>
  <filter id="f"><feImage href="{server}/filter.png"/></filter>
  <rect class="r" width="5" height="5" filter="url(#f)"/>
  <script href="{server}/script.js">fetch("{server}/fetched")</script>
  <foreignObject width="100" height="100"><iframe xmlns="http://www.w3.org/1999/xhtml"
     src="{server}/iframe.html"/></foreignObject>
</svg>""".encode()


def svg_external_entity(server: str) -> bytes:
    """An SVG whose DTD declares external entities (a file and a URL) and uses them."""
    return f"""<?xml version="1.0"?>
<!DOCTYPE svg [
  <!ENTITY passwd SYSTEM "file:///etc/passwd">
  <!ENTITY remote SYSTEM "{server}/entity.xml">
]>
<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><text>&passwd;&remote;</text></svg>
""".encode()


@functools.cache
def svg_billion_laughs() -> bytes:
    """Ten levels of ten entities each: 10^9 'lol's, about 3 GB once expanded."""
    entities = ['<!ENTITY lol0 "lol">']
    for level in range(1, 10):
        entities.append(f'<!ENTITY lol{level} "{f"&lol{level - 1};" * 10}">')
    return (
        '<?xml version="1.0"?><!DOCTYPE svg [' + "".join(entities) + "]>"
        '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><text>&lol9;</text></svg>'
    ).encode()


def _ebml_id(data: bytes, pos: int) -> tuple[int, int]:
    first = data[pos]
    length = 1
    while length <= 4 and not first & (0x80 >> (length - 1)):
        length += 1
    return int.from_bytes(data[pos : pos + length], "big"), pos + length


def _ebml_size(data: bytes, pos: int) -> tuple[int, int]:
    first = data[pos]
    length = 1
    while length <= 8 and not first & (0x80 >> (length - 1)):
        length += 1
    value = first & (0xFF >> length)
    for b in data[pos + 1 : pos + length]:
        value = (value << 8) | b
    unknown = value == (1 << (7 * length)) - 1
    return (-1 if unknown else value), pos + length


def _ebml_element(element_id: int, body: bytes) -> bytes:
    id_bytes = element_id.to_bytes((element_id.bit_length() + 7) // 8, "big")
    return id_bytes + (0x01 << 56 | len(body)).to_bytes(8, "big") + body


# Matroska masters on the way from the file to a video track's PixelWidth/PixelHeight.
_SEGMENT, _TRACKS, _TRACK_ENTRY, _VIDEO = 0x18538067, 0x1654AE6B, 0xAE, 0xE0
_PIXEL_WIDTH, _PIXEL_HEIGHT = 0xB0, 0xBA


def _rewrite(data: bytes, start: int, end: int, width: int, height: int) -> bytes:
    """Copy the EBML elements in data[start:end], with every PixelWidth/PixelHeight replaced and
    the masters that hold them re-sized."""
    out = bytearray()
    pos = start
    while pos < end:
        element_id, body_start = _ebml_id(data, pos)
        size, body_start = _ebml_size(data, body_start)
        body_end = end if size < 0 else body_start + size
        if element_id in (_SEGMENT, _TRACKS, _TRACK_ENTRY, _VIDEO):
            body = _rewrite(data, body_start, body_end, width, height)
            out += _ebml_element(element_id, body)
        elif element_id in (_PIXEL_WIDTH, _PIXEL_HEIGHT):
            value = width if element_id == _PIXEL_WIDTH else height
            out += _ebml_element(element_id, value.to_bytes(4, "big"))
        else:
            out += data[pos:body_end]
        pos = body_end
    return bytes(out)


@functools.cache
def mkv_huge_header(width: int = 100_000, height: int = 100_000) -> bytes:
    """A small FFV1 video in Matroska whose track header claims `width` x `height` pixels (FFV1
    takes its frame size from the container, so nothing corrects the claim)."""
    small = write_video("ffv1", "matroska", width=64, height=64, seconds=1, black_seconds=0)
    return _rewrite(small, 0, len(small), width, height)


@functools.cache
def heic_huge_header() -> bytes:
    """A small HEIC whose 'ispe' box (the image's declared size) says 100 000 x 100 000."""
    data = bytearray(heic_photo())
    pos = data.find(b"ispe")
    assert pos > 0
    # ispe: size, 'ispe', version and flags (4 bytes), width (4), height (4).
    struct.pack_into(">II", data, pos + 8, 100_000, 100_000)
    return bytes(data)


@functools.cache
def image_heavy_pdf(draws: int = 2_000) -> bytes:
    """A page that draws a 1024 px noise image `draws` times through nested forms: about 6 ms a
    draw at full quality (each resamples the image), 0.2 ms with images skipped (measured)."""
    side = 1024
    raw = random.Random(3).randbytes(side * side * 3)
    fan_outs = []
    remaining = draws
    while remaining >= 10:
        fan_outs.append(10)
        remaining //= 10
    if remaining > 1 or not fan_outs:
        fan_outs.append(remaining)
    first_form = 6
    forms: list[tuple[str, bytes | None]] = [
        (
            "<< /Type /XObject /Subtype /Form /BBox [0 0 600 400] "
            "/Resources << /XObject << /I 5 0 R >> >> >>",
            b"q 600 0 0 400 0 0 cm /I Do Q",
        )
    ]
    for level, fan_out in enumerate(fan_outs, start=1):
        body = b" ".join(b"q 1 0 0 1 0.01 0 cm /C Do Q" for _ in range(fan_out))
        forms.append(
            (
                "<< /Type /XObject /Subtype /Form /BBox [0 0 600 400] "
                f"/Resources << /XObject << /C {first_form + level - 1} 0 R >> >> >>",
                body,
            )
        )
    top = first_form + len(forms) - 1
    objects: list[tuple[str, bytes | None]] = [
        ("<< /Type /Catalog /Pages 2 0 R >>", None),
        ("<< /Type /Pages /Kids [3 0 R] /Count 1 >>", None),
        (
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 600 400] "
            f"/Resources << /XObject << /Top {top} 0 R >> >> /Contents 4 0 R >>",
            None,
        ),
        ("<< >>", b"/Top Do"),
        (
            f"<< /Type /XObject /Subtype /Image /Width {side} /Height {side} "
            "/ColorSpace /DeviceRGB /BitsPerComponent 8 /Filter /FlateDecode >>",
            zlib.compress(raw, 1),
        ),
        *forms,
    ]
    return build_pdf(objects)


# -- the tables ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """How a good file's thumbnail must look: its aspect (width / height) and whether LibreOffice
    is needed to make it."""

    make: object
    aspect: float
    needs_soffice: bool = False
    colour: tuple[int, int, int] | None = None  # a colour that must be in the thumbnail


FORMATS: dict[str, Expect] = {
    "pptx": Expect(pptx_deck, 16 / 9, needs_soffice=True, colour=RED),
    "docx": Expect(docx_letter, 8.5 / 11, needs_soffice=True),
    "xlsx": Expect(xlsx_sheet, 0, needs_soffice=True),
    "odt": Expect(odt_text, 0, needs_soffice=True),
    "odp": Expect(odp_slides, 0, needs_soffice=True),
    "epub": Expect(epub_book, 400 / 600, colour=RED),
    "fb2": Expect(fb2_book, 400 / 600),
    "cbz": Expect(cbz_comic, 2 / 3, colour=RED),
    "xps": Expect(xps_document, 816 / 1056, colour=RED),
    "heic": Expect(heic_photo, 2 / 3, colour=RED),
    "avif": Expect(avif_photo, 2 / 3, colour=RED),
    "psd": Expect(psd_image, 2 / 3, colour=RED),
    "svg": Expect(svg_drawing, 2.0),
    "mp4": Expect(mp4_video, 16 / 9, colour=BLUE),
    "mov": Expect(mov_video, 16 / 9, colour=BLUE),
    "webm": Expect(webm_video, 16 / 9, colour=BLUE),
    "mkv": Expect(mkv_video, 16 / 9, colour=BLUE),
}
