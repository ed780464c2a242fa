"""What a real archive holds beyond the common formats: legacy binary Office and RTF, icons and
cursors, SVGs with embedded pictures, 10/12-bit and HDR HEIC/AVIF, and files whose fault must end
with a permanent code (never `internal`) or a cheaper render (never `render_timeout`).

Legacy Office samples come from python-oletools' own test data (tests/fixtures/formats/README.md
names each file and its licence); the rest is made here by the tools that write these formats.
Tests that need LibreOffice are skipped, naming it, where `soffice` is missing (CI installs it).
"""

from __future__ import annotations

import base64
import gzip
import io
import os
import random
import signal
import struct
import textwrap
import time
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from bench.corpus import BLUE, RED
from tests.support import archive_corpus as ac
from tests.support import formats_corpus as fc
from tests.support.httpstub import HttpStub
from tests.support.pgtools import requires
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.errors import (
    CORRUPT_INPUT,
    ENCRYPTED_INPUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    ThumbqError,
)
from worker.engine.queue import Queue
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.render import RenderOptions, render
from worker.thumbnails.render.office import OfficeConverter, _soffice_groups, find_soffice
from worker.thumbnails.render.office_text import document_lines
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.render.sniff import CUR, DOC, ICO, ODG, OLE2, PPT, RTF, XLS, sniff

SOFFICE = find_soffice()
NO_SOFFICE = "LibreOffice (soffice) is not installed: apt-get install libreoffice-writer"
SIZES = (128, 512)
OPTS = RenderOptions(sizes=SIZES, soffice=SOFFICE)


@pytest.fixture(scope="module")
def pool() -> Iterator[RenderPool]:
    with RenderPool(OPTS, workers=2, memory_limit_mb=320) as p:
        yield p


fixture = ac.fixture


def decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img.convert("RGB")


def has_colour(img: Image.Image, colour: tuple[int, int, int], tolerance: int = 45) -> bool:
    raw = img.convert("RGB").tobytes()
    return any(
        all(abs(raw[i + c] - colour[c]) <= tolerance for c in range(3))
        for i in range(0, len(raw), 3)
    )


def ink(img: Image.Image) -> float:
    """The share of pixels darker than mid grey: text on a page, not a blank sheet."""
    grey = img.convert("L")
    return sum(grey.histogram()[:128]) / (grey.width * grey.height)


# -- legacy office ---------------------------------------------------------------------------------


@requires(SOFFICE is not None, NO_SOFFICE)
@pytest.mark.parametrize(
    ("name", "source_type", "landscape"),
    [
        ("harmless-clean.doc", DOC, False),
        ("embedded-simple-2007.xls", XLS, False),
        ("sample_with_lnk_file.pps", PPT, True),
    ],
)
def test_legacy_binary_office_documents_are_drawn_by_libreoffice(
    pool: RenderPool, name: str, source_type: str, landscape: bool
) -> None:
    data = fixture(name)
    thumb = pool.render(data, "application/octet-stream", timeout_s=60)
    assert thumb.source_type == source_type and not thumb.degraded
    assert [r.size for r in thumb.renditions] == list(SIZES)
    img = decode(thumb.data)
    assert (img.width > img.height) == landscape and max(img.size) == 512
    assert 0.0005 < ink(img) < 0.5  # words on a page, neither blank nor black


@requires(SOFFICE is not None, NO_SOFFICE)
def test_an_rtf_letter_is_drawn_by_libreoffice(pool: RenderPool) -> None:
    thumb = pool.render(b"\xef\xbb\xbf" + ac.rtf_letter(), "text/plain", timeout_s=60)
    img = decode(thumb.data)
    assert thumb.source_type == RTF and img.height > img.width
    assert 0.0005 < ink(img) < 0.5


@pytest.mark.parametrize(
    "make",
    [ac.encrypted_doc, ac.encrypted_xls, ac.encrypted_ppt, ac.encrypted_ooxml, ac.odt_encrypted],
)
@pytest.mark.parametrize("soffice", [None, SOFFICE], ids=["embedded", "libreoffice"])
def test_a_password_protected_office_document_ends_encrypted_input(
    pool: RenderPool, make: object, soffice: str | None
) -> None:
    assert callable(make)
    data = make()
    with pytest.raises(ThumbqError) as info:
        if soffice is None:
            render(data, None, RenderOptions(sizes=SIZES))
        else:
            pool.render(data, None, timeout_s=30)
    assert info.value.code == ENCRYPTED_INPUT and info.value.permanent
    assert "password" in info.value.message


def test_without_libreoffice_a_legacy_document_shows_its_summary_thumbnail() -> None:
    thumb = render(ac.doc_with_summary_thumbnail(), None, RenderOptions(sizes=SIZES))
    img = decode(thumb.data)
    assert thumb.source_type == DOC and img.size == (64, 48)  # never enlarged
    assert has_colour(img, RED) and has_colour(img, BLUE)
    with pytest.raises(ThumbqError) as info:
        render(ac.rtf_letter(), None, RenderOptions(sizes=SIZES))
    assert info.value.code == UNSUPPORTED_TYPE
    assert "LibreOffice (soffice) is not installed" in info.value.message


@requires(SOFFICE is not None, NO_SOFFICE)
def test_a_legacy_document_whose_conversion_overruns_shows_its_summary_thumbnail_degraded() -> None:
    # A fresh pool: LibreOffice's start alone overruns the first share of the window.
    with RenderPool(OPTS, workers=1, memory_limit_mb=320) as fresh:
        thumb = fresh.render(
            ac.doc_with_summary_thumbnail(), None, timeout_s=10, degrade_after_s=0.3
        )
    img = decode(thumb.data)
    assert thumb.degraded and has_colour(img, RED) and has_colour(img, BLUE)


def test_an_ole2_file_that_is_not_an_office_document_is_unsupported_and_named() -> None:
    data = ac.ole2_file({"__substg1.0_0037001F": "Subject".encode("utf-16-le")})
    assert sniff(data) == OLE2
    with pytest.raises(ThumbqError) as info:
        render(data, "application/vnd.ms-outlook", RenderOptions())
    assert info.value.code == UNSUPPORTED_TYPE and OLE2 in info.value.message


def test_a_damaged_compound_file_is_no_office_document() -> None:
    data = fixture("harmless-clean.doc")
    for broken in (data[:700], data[:512] + b"\xff" * 4096, data[:0x30] + b"\xff" * 4):
        assert sniff(broken) == OLE2


# -- icons and cursors -----------------------------------------------------------------------------


@pytest.mark.parametrize("bitmap_format", ["png", "bmp"])
@pytest.mark.parametrize("cursor", [False, True], ids=["ico", "cur"])
def test_an_icon_or_cursor_gives_its_largest_image(bitmap_format: str, cursor: bool) -> None:
    data = ac.icon((16, 48, 256), bitmap_format=bitmap_format, cursor=cursor)
    thumb = render(data, "application/octet-stream", RenderOptions(sizes=SIZES))
    assert thumb.source_type == (CUR if cursor else ICO)
    assert (thumb.width, thumb.height) == (256, 256)  # the 256 entry, never enlarged to 512
    img = decode(thumb.data)
    assert has_colour(img, RED) and has_colour(img, BLUE)


def test_a_damaged_icon_is_corrupt_input_and_a_huge_one_too_large() -> None:
    data = ac.icon((16, 32))
    with pytest.raises(ThumbqError) as info:
        render(data[:40], None, RenderOptions())
    assert info.value.code == CORRUPT_INPUT
    # Entries whose PNGs declare 65535 x 65535 pixels (a decompression bomb).
    bomb = bytearray(data)
    png_at = data.find(b"\x89PNG")
    while png_at >= 0:
        bomb[png_at + 16 : png_at + 24] = struct.pack(">II", 65535, 65535)
        crc = zlib.crc32(bytes(bomb[png_at + 12 : png_at + 29]))
        bomb[png_at + 29 : png_at + 33] = struct.pack(">I", crc)
        png_at = data.find(b"\x89PNG", png_at + 1)
    with pytest.raises(ThumbqError) as info:
        render(bytes(bomb), None, RenderOptions())
    assert info.value.code == TOO_LARGE


# -- SVG: embedded pictures, never a fetch, a render without filters -------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _as(picture_format: str) -> bytes:
    out = io.BytesIO()
    Image.open(io.BytesIO(fc.quadrant_png(40, 40))).convert("RGB").save(out, picture_format)
    return out.getvalue()


EMBEDDED = {
    "png": lambda: f"data:image/png;base64,{_b64(fc.quadrant_png(40, 40))}",
    "jpeg_wrapped": lambda: (
        "data:image/jpeg;base64," + "\n".join(textwrap.wrap(_b64(_as("JPEG")), 76))
    ),
    "bmp": lambda: f"data:image/bmp;base64,{_b64(_as('BMP'))}",
    "no_type": lambda: f"data:;base64,{_b64(fc.quadrant_png(40, 40))}",
    "svg": lambda: f"data:image/svg+xml;base64,{_b64(ac.svg_red_square())}",
    "svgz": lambda: f"data:image/svg+xml;base64,{_b64(gzip.compress(ac.svg_red_square()))}",
    "svg_percent": lambda: (
        "data:image/svg+xml;utf8," + urllib.parse.quote(ac.svg_red_square().decode())
    ),
}


@pytest.mark.parametrize("name", list(EMBEDDED))
def test_an_svg_shows_the_picture_embedded_in_a_data_uri(name: str) -> None:
    thumb = render(ac.svg_embedding(EMBEDDED[name]()), None, RenderOptions(sizes=SIZES))
    img = decode(thumb.data)
    # The picture's red quarter fills the drawing's top-left quarter.
    assert has_colour(img.crop((0, 0, 200, 200)), RED, tolerance=30)
    assert not has_colour(img.crop((300, 300, 512, 512)), RED, tolerance=60)


@pytest.fixture
def http_recorder() -> Iterator[HttpStub]:
    """A loopback server that records every request (and answers each with a PNG)."""
    stub = HttpStub(lambda _req: (200, {"Content-Type": "image/png"}, fc.quadrant_png(8, 8)))
    yield stub
    stub.close()


def test_an_svg_embedded_in_an_svg_still_fetches_nothing_and_reads_no_file(
    http_recorder: HttpStub, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.png"
    Image.new("RGB", (50, 50), BLUE).save(secret)
    file_image = f'<image href="{secret}" width="40" height="40"/>'
    inner = ac.svg_red_square(
        file_image + f'<image xlink:href="file://{secret}" width="40" height="40"/>'
        f'<image href="{http_recorder.url}/remote.png" width="40" height="40"/>'
        # One level deeper, the same again.
        f'<image href="data:image/svg+xml;base64,{_b64(ac.svg_red_square(file_image))}"/>'
    )
    svg = ac.svg_embedding(f"data:image/svg+xml;base64,{_b64(gzip.compress(inner))}")
    img = decode(render(svg, None, RenderOptions()).data)
    assert has_colour(img, RED) and not has_colour(img, BLUE), "a file was read"
    time.sleep(0.2)
    assert http_recorder.requests == []


def test_an_svg_whose_filter_cannot_finish_gets_a_render_without_filters(
    pool: RenderPool,
) -> None:
    started = time.monotonic()
    thumb = pool.render(ac.svg_slow_filter(), None, timeout_s=15, degrade_after_s=1.0)
    assert thumb.degraded and time.monotonic() - started < 15
    img = decode(thumb.data)
    assert has_colour(img, RED) and has_colour(img, BLUE)


# -- 10/12-bit and HDR HEIC/AVIF -------------------------------------------------------------------

# PQ's code for 203 cd/m^2, HDR's reference (paper) white (BT.2408), on a 0-255 scale; HLG's is 75%.
PQ_REFERENCE_WHITE = 148
HLG_REFERENCE_WHITE = 191


def grey_of(data: bytes) -> tuple[int, int, int]:
    thumb = render(data, None, RenderOptions(sizes=SIZES))
    img = decode(thumb.data)
    return img.getpixel((img.width // 2, img.height // 2))  # type: ignore[return-value]


@pytest.mark.parametrize("matrix", [ac.BT2020_CL, ac.ICTCP], ids=["bt2020_cl", "ictcp"])
def test_an_hdr_avif_whose_yuv_libavif_cannot_convert_still_gets_a_thumbnail(matrix: int) -> None:
    # libavif: "Conversion from YUV failed: Reformat failed", which ended `internal`.
    grey = grey_of(ac.grey_avif(PQ_REFERENCE_WHITE, transfer=ac.PQ_TRANSFER, matrix=matrix))
    assert max(grey) - min(grey) <= 12 and min(grey) >= 190, grey


@pytest.mark.parametrize(
    "make",
    [
        lambda v, t: ac.grey_avif(v, transfer=t, matrix=ac.BT2020_NCL),
        lambda v, t: ac.grey_heic(v, transfer=t),
        lambda v, t: ac.grey_heic(v, transfer=t, bits=12),
    ],
    ids=["avif_10bit", "heic_10bit", "heic_12bit"],
)
def test_pq_and_hlg_pictures_are_tone_mapped_to_srgb_and_sdr_ones_kept(make: object) -> None:
    assert callable(make)
    # Reference white is near SDR white, not the grey its code value would be if shown as sRGB.
    assert min(grey_of(make(PQ_REFERENCE_WHITE, ac.PQ_TRANSFER))) >= 190
    assert min(grey_of(make(HLG_REFERENCE_WHITE, ac.HLG_TRANSFER))) >= 190
    assert max(grey_of(make(0, ac.PQ_TRANSFER))) <= 12
    # An SDR picture with more bits keeps its tones.
    assert all(abs(c - 148) <= 8 for c in grey_of(make(148, ac.SDR_TRANSFER)))


# -- a file's fault is never `internal` ------------------------------------------------------------


def test_an_avif_whose_primary_item_is_missing_is_corrupt_input() -> None:
    # libavif raised RuntimeError("Failed to decode image: Missing or empty image item"), which
    # ended `internal` (transient: retried for nothing).
    data = bytearray(fc.avif_photo())
    pitm = data.index(b"pitm")
    data[pitm + 8 : pitm + 10] = (99).to_bytes(2, "big")  # an item id the file does not have
    with pytest.raises(ThumbqError) as info:
        render(bytes(data), None, RenderOptions())
    assert info.value.code == CORRUPT_INPUT and "image item" in info.value.message


def test_whatever_a_decoder_raises_on_a_file_ends_with_a_permanent_code() -> None:
    # Damaged copies of one file of each new family: every outcome is a thumbnail or a
    # permanent code, never `internal` (the render's boundary classifies what no module foresaw).
    rng = random.Random(22)
    seeds = [
        ac.icon((16, 48)),
        ac.icon((16, 32), bitmap_format="bmp", cursor=True),
        ac.doc_with_summary_thumbnail(),
        ac.svg_embedding(EMBEDDED["svgz"]()),
        ac.grey_heic(148, transfer=ac.PQ_TRANSFER),
        fc.avif_photo(),
        fc.mp4_video(),
        fc.odp_with_embedded_thumbnail(),
        fc.docx_letter(),
        fixture("sample_with_lnk_file.pps"),
    ]
    for i in range(400):
        damaged = bytearray(seeds[i % len(seeds)])
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        if rng.random() < 0.3:
            damaged = damaged[: rng.randrange(1, len(damaged))]
        try:
            # Every other one as the degraded render (an office document's words, an SVG
            # without filters).
            opts = RenderOptions(max_pixels=20_000_000, degraded=i % 2 == 1)
            render(bytes(damaged), None, opts)
        except ThumbqError as exc:
            assert exc.permanent, (i, exc)


@requires(SOFFICE is not None, NO_SOFFICE)
def test_a_long_rtf_is_drawn_from_its_head_in_seconds(pool: RenderPool) -> None:
    # 40,000 lines (2.4 MB): LibreOffice took 19.5 s to lay all of it out before page 1.
    data = ac.rtf_letter(40_000)
    pool.render(ac.rtf_letter(), None, timeout_s=60)  # LibreOffice's start is not measured
    started = time.monotonic()
    thumb = pool.render(data, None, timeout_s=30)
    assert time.monotonic() - started < 8
    assert thumb.source_type == RTF and 0.0005 < ink(decode(thumb.data)) < 0.5


@requires(SOFFICE is not None, NO_SOFFICE)
def test_libreoffice_dying_on_a_document_ends_it_corrupt_input_and_the_next_gets_a_fresh_one() -> (
    None
):
    assert SOFFICE is not None
    converter = OfficeConverter(SOFFICE)
    try:
        converter.convert_to_pdf(ac.rtf_letter(), RTF, time.monotonic() + 60)
        assert converter._proc is not None
        for group in _soffice_groups(converter._proc.pid):  # soffice dies under the helper
            os.killpg(group, signal.SIGKILL)
        with pytest.raises(ThumbqError) as info:
            converter.convert_to_pdf(ac.rtf_letter(), RTF, time.monotonic() + 60)
        assert info.value.code == CORRUPT_INPUT and "LibreOffice" in info.value.message
        assert converter.convert_to_pdf(ac.rtf_letter(), RTF, time.monotonic() + 60)
        assert converter.starts == 2
    finally:
        converter.close()


@requires(SOFFICE is not None, NO_SOFFICE)
def test_an_office_document_whose_conversion_overruns_without_a_thumbnail_shows_its_words() -> None:
    # python-docx and python-pptx write a plain white embedded thumbnail (which counts as none):
    # this ended render_timeout once LibreOffice overran.
    with RenderPool(OPTS, workers=1, memory_limit_mb=320) as fresh:
        # A fresh pool: LibreOffice's start alone overruns the first share of the window.
        letter = fresh.render(fc.docx_letter(), None, timeout_s=10, degrade_after_s=0.3)
        deck = fresh.render(
            fixture("sample_with_lnk_file.pps"), None, timeout_s=10, degrade_after_s=0.01
        )
    for thumb, landscape in ((letter, False), (deck, True)):
        img = decode(thumb.data)
        assert thumb.degraded and (img.width > img.height) == landscape
        assert 0.002 < ink(img) < 0.3  # lines of text on a white page


def test_odf_drawings_and_templates_are_office_documents() -> None:
    drawing = (
        '<office:drawing><draw:page draw:name="one"><draw:frame svg:x="2cm" svg:y="2cm" '
        'svg:width="10cm" svg:height="3cm"><draw:text-box><text:p>A drawing</text:p>'
        "</draw:text-box></draw:frame></draw:page></office:drawing>"
    )
    assert sniff(fc._odf(ODG, drawing)) == ODG
    assert sniff(fc._odf(ODG + "-template", drawing)) == ODG
    assert sniff(fc._odf(fc.ODT + "-template", "<office:text/>")) == fc.ODT


@requires(SOFFICE is not None, NO_SOFFICE)
def test_an_odf_drawing_is_drawn_by_libreoffice(pool: RenderPool) -> None:
    drawing = (
        '<office:drawing><draw:page draw:name="one"><draw:frame svg:x="2cm" svg:y="2cm" '
        'svg:width="14cm" svg:height="3cm"><draw:text-box><text:p>A drawing of many words on '
        "one line</text:p></draw:text-box></draw:frame></draw:page></office:drawing>"
    )
    thumb = pool.render(fc._odf(ODG, drawing), None, timeout_s=60)
    assert thumb.source_type == ODG and not thumb.degraded
    assert 0.0002 < ink(decode(thumb.data)) < 0.5


@pytest.mark.parametrize("size", ['width="300pt" height="150pt"', 'height="40mm"', 'width="2in"'])
def test_an_svg_sized_in_points_millimetres_or_inches_is_drawn(size: str) -> None:
    # Graphviz writes `height="200pt"`; resvg-py's default of 0 dpi made such sizes zero, and the
    # drawing ended corrupt_input ("SVG has an invalid size").
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" {size} viewBox="0 0 200 100">'
        '<rect width="100" height="100" fill="rgb(220,30,30)"/>'
        '<rect x="100" width="100" height="100" fill="rgb(30,60,220)"/></svg>'
    ).encode()
    thumb = render(svg, None, RenderOptions(sizes=SIZES))
    img = decode(thumb.data)
    assert (thumb.width, thumb.height) == (512, 256)
    assert has_colour(img.crop((0, 0, 256, 256)), RED) and has_colour(
        img.crop((256, 0, 512, 256)), BLUE
    )


# -- end to end ------------------------------------------------------------------------------------


def test_every_new_format_ends_with_thumbnails_through_a_batch(
    tmp_path: Path, db_url: str, pool: RenderPool
) -> None:
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_THUMB_SIZES": ",".join(map(str, SIZES)),
        }
    )
    if SOFFICE is not None:
        # LibreOffice's start (1-2 s, more on a loaded machine) is not what this test is about.
        pool.render(ac.rtf_letter(), None, timeout_s=60)
    storage = open_storage(config)
    expected: dict[str, tuple[str, str | None]] = {}
    for name, expect in ac.ARCHIVE_FORMATS.items():
        if expect.needs_soffice and SOFFICE is None:
            continue
        assert callable(expect.make)
        storage.put(f"archive/{name}", expect.make(), "application/octet-stream")
        expected[name] = ("completed", None)
    storage.put("archive/encrypted_doc", ac.encrypted_doc(), "application/msword")
    expected["encrypted_doc"] = ("failed", ENCRYPTED_INPUT)
    storage.put("archive/ole2_message", ac.ole2_file({"__substg1.0_0037001F": b"x"}), None)
    expected["ole2_message"] = ("unsupported", UNSUPPORTED_TYPE)
    with db.connect(db_url) as conn:
        enqueue_keys(
            conn, storage, config, [{"source_key": f"archive/{n}"} for n in expected], "arc"
        )
        for _ in range(6):
            run_batch(config, conn, storage, pool)
            progress = Queue(conn).progress("arc")
            assert progress is not None
            if progress["pending"] + progress["processing"] == 0:
                break
        jobs = {r["source_key"]: r for r in conn.execute("select * from thumbq.jobs")}
    for name, (status, code) in expected.items():
        job = jobs[f"archive/{name}"]
        assert (job["status"], job["error_code"]) == (status, code), (name, job["last_error"])
        if status == "completed":
            assert sorted(job["thumbnails"], key=int) == [str(s) for s in SIZES], name
            data, info = storage.get(job["thumbnails"]["512"])
            assert info.content_type == "image/webp" and max(decode(data).size) <= 512


def test_the_degraded_words_of_a_deck_are_those_of_its_first_slide_in_show_order() -> None:
    from pptx import Presentation

    deck = Presentation()
    for title in ("Shown second", "Shown first"):
        deck.slides.add_slide(deck.slide_layouts[0]).shapes.title.text = title
    slide_ids = deck.slides._sldIdLst
    slide_ids.insert(0, slide_ids[-1])  # slide2.xml is now the first one shown
    out = io.BytesIO()
    deck.save(out)
    lines = document_lines(out.getvalue(), fc.PPTX)
    assert lines[0] == "Shown first"
    thumb = render(out.getvalue(), None, RenderOptions(sizes=SIZES, degraded=True))
    img = decode(thumb.data)
    assert thumb.degraded and img.width > img.height and 0.0005 < ink(img) < 0.3


@pytest.mark.parametrize(
    ("make", "source_type", "first_words"),
    [
        (ac.doc_sample, DOC, "Test"),
        (ac.xls_sample, XLS, "This spreadsheet contains an embedded object"),
        (ac.pps_sample, PPT, "Test"),
        (lambda: ac.rtf_letter(3), RTF, "Report"),
    ],
    ids=["doc", "xls", "pps", "rtf"],
)
def test_a_legacy_documents_degraded_render_shows_its_first_words(
    make: object, source_type: str, first_words: str
) -> None:
    assert callable(make)
    data = make()
    assert document_lines(data, source_type)[0] == first_words
    thumb = render(data, None, RenderOptions(sizes=SIZES, degraded=True))
    assert thumb.degraded and 0.0005 < ink(decode(thumb.data)) < 0.3


def test_a_10bit_heic_too_big_for_the_render_memory_is_too_large_not_corrupt() -> None:
    # libheif: "Memory allocation error: Unspecified: Allocating 48000015 bytes failed", which
    # ended corrupt_input (pillow-heif's own 33 MP sample guitar_cw90.hif did at 320 MB).
    data = ac.black_heic_10bit()
    with (
        RenderPool(RenderOptions(), workers=1, memory_limit_mb=160) as small,
        pytest.raises(ThumbqError) as info,
    ):
        small.render(data, None, timeout_s=60)
    assert info.value.code == TOO_LARGE and "memory" in info.value.message
