"""Every format beyond PDF and raster images, as a user sees it: a thumbnail of the right shape
at every configured size that is not blank (and a video's that is not its black first second),
or the right error for a hostile file, quickly and under the render processes' memory limit;
end to end through a batch.

The corpus is made by the tools that write these formats (tests/support/formats_corpus.py). Office
documents need LibreOffice: without `soffice` those tests skip naming it (in CI they fail:
CI installs it). One render pool, and so one LibreOffice, serves the whole module.
"""

from __future__ import annotations

import base64
import io
import math
import os
import random
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageChops, ImageDraw, ImageStat

from bench import corpus
from bench.corpus import BLUE, GREEN, RED
from tests.support import formats_corpus as fc
from tests.support.httpstub import HttpStub
from tests.support.pgtools import require, requires
from tests.system.test_progress_page import browser  # noqa: F401  (a fixture: headless chromium)
from worker.engine import db, ratelimit
from worker.engine.batch import run_batch
from worker.engine.config import Config, ConfigError
from worker.engine.errors import (
    CORRUPT_INPUT,
    RENDER_TIMEOUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    ThumbqError,
)
from worker.engine.queue import Queue
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.render import RenderOptions, Thumbnail, heif, image, render
from worker.thumbnails.render.office import OfficeConverter, find_soffice
from worker.thumbnails.render.output import dominant_color, thumbhash
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.render.sniff import HEIC
from worker.thumbnails.task import thumbnail_key

SOFFICE = find_soffice()
NO_SOFFICE = (
    "LibreOffice (soffice) is not installed: apt-get install libreoffice-impress "
    "libreoffice-writer libreoffice-calc"
)
SIZES = (128, 256, 512)
OPTS = RenderOptions(sizes=SIZES, soffice=SOFFICE)
MEMORY_MB = 320  # the default for two render processes in a 1 GB function


@pytest.fixture(scope="module")
def pool() -> Iterator[RenderPool]:
    with RenderPool(OPTS, workers=2, memory_limit_mb=MEMORY_MB) as p:
        yield p


def decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def has_colour(img: Image.Image, colour: tuple[int, int, int], tolerance: int = 45) -> bool:
    raw = img.convert("RGB").tobytes()
    return any(
        all(abs(raw[i + c] - colour[c]) <= tolerance for c in range(3))
        for i in range(0, len(raw), 3)
    )


def check_renditions(thumb: Thumbnail, aspect: float) -> Image.Image:
    """Every size is there, decodes to what it claims, fits its box, keeps the aspect."""
    assert [r.size for r in thumb.renditions] == list(SIZES)
    for r in thumb.renditions:
        img = decode(r.data)
        assert img.size == (r.width, r.height)
        assert max(img.size) <= r.size
        if aspect:
            assert abs(r.width / r.height - aspect) / aspect < 0.04, (r, aspect)
    largest = thumb.renditions[-1]
    assert (thumb.data, thumb.width, thumb.height) == (largest.data, largest.width, largest.height)
    assert thumb.thumbhash and base64.b64decode(thumb.thumbhash)
    assert thumb.dominant_color and len(thumb.dominant_color) == 7
    return decode(thumb.data)


# -- every format --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(fc.FORMATS))
def test_each_format_gives_thumbnails_of_its_shape_at_every_size_that_are_not_blank(
    pool: RenderPool, name: str
) -> None:
    expect = fc.FORMATS[name]
    require(not expect.needs_soffice or SOFFICE is not None, NO_SOFFICE)
    make = expect.make
    assert callable(make)
    thumb = pool.render(make(), None, timeout_s=60)
    assert not thumb.degraded
    img = check_renditions(thumb, expect.aspect)
    # Not blank: a white page or a black frame has (almost) no spread.
    assert max(ImageStat.Stat(img.convert("RGB")).stddev) > 10, name
    if expect.colour is not None:
        assert has_colour(img, expect.colour), (name, expect.colour)


@pytest.mark.parametrize("name", ["mp4", "mov", "webm", "mkv"])
def test_a_videos_thumbnail_is_not_its_black_first_second(pool: RenderPool, name: str) -> None:
    make = fc.FORMATS[name].make
    assert callable(make)
    img = decode(pool.render(make(), None, timeout_s=30).data).convert("RGB")
    # The first second is black; after it the picture is blue with a red box.
    assert ImageStat.Stat(img.convert("L")).mean[0] > 40
    assert has_colour(img, BLUE) and has_colour(img, RED)


def red_centre_x(img: Image.Image) -> float:
    """Where the red pixels are across the picture, 0 (left) to 1 (right)."""
    rgb = img.convert("RGB")
    raw, w = rgb.tobytes(), rgb.width
    xs = [(i // 3) % w for i in range(0, len(raw), 3) if raw[i] > 150 and raw[i + 2] < 100]
    assert xs, "no red in the picture"
    return sum(xs) / len(xs) / w


@requires(shutil.which("ffmpeg") is not None, "ffmpeg (the CLI) is not installed")
@pytest.mark.parametrize("rotate", [90, 270])
def test_a_phone_video_turned_by_its_display_matrix_is_shown_upright(
    pool: RenderPool, tmp_path: Path, rotate: int
) -> None:
    # Phones store a portrait video as landscape frames plus a rotation; ffmpeg's own frame
    # grab (autorotate) is the reference for which way up it is.
    source = tmp_path / "in.mp4"
    source.write_bytes(fc.mp4_video())
    turned, reference = tmp_path / "turned.mp4", tmp_path / "reference.png"
    ffmpeg = ["ffmpeg", "-v", "error", "-y", "-i"]
    meta = ["-c", "copy", "-metadata:s:v:0", f"rotate={rotate}"]
    subprocess.run([*ffmpeg, str(source), *meta, str(turned)], check=True)
    grab = ["-ss", "2", "-i", str(turned), "-frames:v", "1", str(reference)]
    subprocess.run([*ffmpeg[:-1], *grab], check=True)
    thumb = pool.render(turned.read_bytes(), None, timeout_s=30)
    img = decode(thumb.data)
    expected = Image.open(reference)
    assert img.height > img.width and expected.height > expected.width
    assert (red_centre_x(img) < 0.5) == (red_centre_x(expected) < 0.5)


def test_a_portrait_photo_stays_portrait_in_heic_avif_and_psd(pool: RenderPool) -> None:
    for make in (fc.heic_photo, fc.avif_photo, fc.psd_image):
        img = decode(pool.render(make(), None, timeout_s=30).data).convert("RGB")
        assert img.height > img.width
        # Red on top, blue below: upside down or sideways would move them.
        top = img.getpixel((img.width // 2, img.height // 8))
        bottom = img.getpixel((img.width // 2, img.height * 7 // 8))
        assert corpus_close(top, RED) and corpus_close(bottom, BLUE), (make, top, bottom)


def corpus_close(pixel: object, colour: tuple[int, int, int], tolerance: int = 45) -> bool:
    assert isinstance(pixel, tuple)
    return all(abs(a - b) <= tolerance for a, b in zip(pixel[:3], colour, strict=True))


# -- HEIC through FFmpeg's decoder ----------------------------------------------------------------


def psnr(a: Image.Image, b: Image.Image) -> float:
    assert a.size == b.size, (a.size, b.size)
    diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
    mse = sum(v * v for v in ImageStat.Stat(diff).rms) / 3
    return 99.0 if mse == 0 else 10 * math.log10(255**2 / mse)


def libheif(data: bytes) -> Image.Image:
    """The picture as libheif (pillow-heif) decodes it: the reference for the FFmpeg path."""
    import pillow_heif

    heif_file = pillow_heif.open_heif(io.BytesIO(data), convert_hdr_to_8bit=True)
    return heif_file.to_pillow().convert("RGB")


def grid_picture() -> Image.Image:
    """Detail everywhere and a red corner: a wrong tile place, turn or flip shows."""
    img = corpus.photo_image(700, 1000, seed=11).copy()
    ImageDraw.Draw(img).rectangle((0, 0, 200, 150), fill=RED)
    return img


def outcome(data: bytes, opts: RenderOptions) -> Image.Image | str:
    try:
        return decode(render(data, None, opts).data)
    except ThumbqError as exc:
        return exc.code


@pytest.mark.parametrize(
    ("rotation", "mirror"), [(0, None), (1, None), (2, 0), (3, 1), (0, 1)], ids=str
)
def test_a_heic_grid_decodes_through_ffmpeg_as_libheif_decodes_it(
    monkeypatch: pytest.MonkeyPatch, rotation: int, mirror: int | None
) -> None:
    # As a phone writes a photo: 256 px tiles (3 x 4, the last ones partly outside the
    # picture), turned and mirrored by irot/imir.
    data = corpus.heic_grid(grid_picture(), 256, rotation=rotation, mirror=mirror)
    reference = libheif(data)
    pic = heif.parse(data)
    assert (pic.columns, pic.rows, len(pic.tiles)) == (3, 4, 12)
    full, factor = heif.decode(pic, None, 2)
    assert factor == 1 and psnr(full, reference) > 40
    # Through the renderer, shrunk while decoding: as faithful to libheif's full decode +
    # Lanczos as the libheif path's thumbnail is (both after the WebP encode).
    opts = RenderOptions(size=256)
    assert image.open_heic(data, HEIC, opts) is not None
    thumb = outcome(data, opts)
    monkeypatch.setattr(image, "open_heic", lambda *_: None)
    before = outcome(data, opts)
    assert isinstance(thumb, Image.Image) and isinstance(before, Image.Image)
    assert thumb.size == before.size and (thumb.width > thumb.height) == (rotation % 2 == 1)
    expected = reference.resize(thumb.size, Image.Resampling.LANCZOS)
    assert psnr(thumb, expected) > psnr(before, expected) - 0.3


def test_a_single_picture_heic_takes_the_same_path_with_threads() -> None:
    data = fc.heic_photo()
    pic = heif.parse(data)
    assert (pic.columns, pic.rows, pic.matrix, pic.full_range) == (1, 1, "ITU601", True)
    for threads in (1, 2):
        full, _ = heif.decode(pic, None, threads)
        assert psnr(full, libheif(data)) > 40


def test_heic_shapes_the_ffmpeg_path_does_not_take_still_render_through_libheif(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pillow_heif

    # Alpha: an auxiliary alpha picture; the thumbnail keeps its transparency.
    rgba = grid_picture().convert("RGBA")
    rgba.putalpha(128)
    out = io.BytesIO()
    pillow_heif.from_pillow(rgba).save(out, quality=70)
    with pytest.raises(heif.NotForUs, match="alpha"):
        heif.parse(out.getvalue())
    thumb = decode(render(out.getvalue(), None, OPTS).data)
    assert thumb.mode == "RGBA" and thumb.getchannel("A").getextrema()[1] < 200
    # An essential property the reader does not know (here a renamed irot): libheif's call.
    turned = corpus.heic_grid(grid_picture(), 256, rotation=1)
    with pytest.raises(heif.NotForUs, match="essential"):
        heif.parse(turned.replace(b"irot", b"xrot"))
    # Cut off in the middle of its pictures: whatever libheif makes of it, as before.
    cut = turned[: len(turned) * 2 // 3]
    with pytest.raises(heif.NotForUs):
        heif.parse(cut)
    now = outcome(cut, OPTS)
    monkeypatch.setattr(image, "open_heic", lambda *_: None)
    before = outcome(cut, OPTS)
    if isinstance(now, Image.Image) and isinstance(before, Image.Image):
        assert now.tobytes() == before.tobytes()
    else:
        assert now == before


def test_a_coded_picture_larger_than_its_header_is_not_decoded_by_ffmpeg() -> None:
    # The HEVC stream says 600 x 900; the container says 60 x 90: FFmpeg refuses to allocate
    # beyond what the container declared and the file goes to libheif.
    data = bytearray(fc.heic_photo())
    at = data.find(b"ispe")
    struct.pack_into(">II", data, at + 8, 60, 90)
    pic = heif.parse(bytes(data))
    with pytest.raises(heif.NotForUs):
        heif.decode(pic, None, 1)


def test_several_sizes_are_the_same_pictures_as_one_size_at_a_time() -> None:
    # The largest size is encoded on a second thread while the smaller ones are made: each
    # rendition must still be the picture its size gives on its own, byte for byte.
    for data in (fc.xps_document(), corpus.jpeg_4000x3000(), fc.heic_photo()):
        thumb = render(data, None, RenderOptions(sizes=SIZES))
        alone = render(data, None, RenderOptions(size=SIZES[-1]))
        assert thumb.data == alone.data and (thumb.width, thumb.height) == (
            alone.width,
            alone.height,
        )
        assert [r.size for r in thumb.renditions] == list(SIZES)
        for smaller, larger in zip(thumb.renditions, thumb.renditions[1:], strict=False):
            assert max(smaller.width, smaller.height) < max(larger.width, larger.height)


def test_a_failed_encode_raises_and_leaves_no_thread_behind() -> None:
    threads = threading.active_count()
    with pytest.raises(ValueError, match="unknown thumbnail format"):
        render(corpus.jpeg_4000x3000(), None, RenderOptions(format="gif", sizes=SIZES))
    assert threading.active_count() == threads


def test_avif_is_a_third_output_format() -> None:
    thumb = render(fc.heic_photo(), None, RenderOptions(format="avif", sizes=SIZES))
    assert thumb.content_type == "image/avif"
    for r in thumb.renditions:
        img = decode(r.data)
        assert img.format == "AVIF" and img.size == (r.width, r.height)


def test_the_sizes_come_from_the_configuration() -> None:
    base = {"THUMBQ_HOME": "/tmp/thumbq-test-home"}
    config = Config.from_env({**base, "THUMBQ_THUMB_SIZES": " 512,128 , 256,128"})
    assert config.thumb_sizes == (128, 256, 512) and config.thumb_size == 512
    assert Config.from_env(base).all_thumb_sizes == (512,)
    assert Config.from_env({**base, "THUMBQ_THUMB_SIZE": "300"}).all_thumb_sizes == (300,)
    assert Config.from_env({**base, "THUMBQ_THUMB_FORMAT": "avif"}).thumb_ext == "avif"
    for bad in ("12", "abc", "128,,x", "5000", ","):
        with pytest.raises(ConfigError, match="THUMBQ_THUMB_SIZES"):
            Config.from_env({**base, "THUMBQ_THUMB_SIZES": bad})
    with pytest.raises(ConfigError, match="THUMBQ_THUMB_FORMAT"):
        Config.from_env({**base, "THUMBQ_THUMB_FORMAT": "gif"})


# -- placeholders --------------------------------------------------------------------------------

# Computed by an independent ThumbHash implementation (the thumbhash-python package) for the
# pictures `_hash_pictures()` draws: ours must agree byte for byte.
THUMBHASH_VECTORS = [
    "16kEFYQHxEhwrHWnZ6ZmePOuOCUJ",
    "lrkENQpqhFCot4h2aGaZiJS/wgbE",
    "XTeBDQAR84U7XGyGWZfQ+qJEgMR5V1YuRw==",
    "mvmCCYIil3bwojwLOp5E+ZB5lVmHl3c=",
    "HHo5hyAI9wiIh4hwj3CI+AiIgIAI94cP",
    "GgkFKo4VVzuQZh26mn+IA2Y=",
]


def _hash_pictures() -> list[Image.Image]:
    rng = random.Random(1)
    pictures = []
    for w, h, alpha in [
        (32, 24, False),
        (24, 32, False),
        (32, 32, True),
        (17, 5, True),
        (1, 1, False),
        (32, 10, False),
    ]:
        img = Image.new("RGBA", (w, h), (0, 0, 0, 0) if alpha else (10, 200, 30, 255))
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x, y = rng.randrange(w), rng.randrange(h)
            box = (x, y, x + rng.randrange(1, 12), y + rng.randrange(1, 12))
            fill = (
                rng.randrange(256),
                rng.randrange(256),
                rng.randrange(256),
                rng.randrange(256) if alpha else 255,
            )
            draw.rectangle(box, fill=fill)
        pictures.append(img)
    return pictures


def test_thumbhash_matches_an_independent_implementation() -> None:
    assert [thumbhash(p) for p in _hash_pictures()] == THUMBHASH_VECTORS


def test_the_dominant_colour_is_the_largest_area_not_the_average() -> None:
    flag = Image.new("RGBA", (30, 30), (*BLUE, 255))
    ImageDraw.Draw(flag).rectangle((0, 0, 29, 19), fill=(*RED, 255))
    assert dominant_color(flag) == "#{:02x}{:02x}{:02x}".format(*RED)
    # Transparent pixels do not count, whatever colour they carry.
    logo = Image.new("RGBA", (30, 30), (255, 255, 255, 0))
    ImageDraw.Draw(logo).rectangle((10, 10, 15, 15), fill=(*GREEN, 255))
    assert dominant_color(logo) == "#{:02x}{:02x}{:02x}".format(*GREEN)


def test_the_dominant_colour_of_fine_detail_is_a_colour_of_the_picture_not_a_blend() -> None:
    # Stripes a pixel or two wide (text, a pattern, a fabric): black covers 40% of the picture,
    # red, green and blue 20% each. An average of neighbouring pixels is a purple-grey that is
    # nowhere in the picture; the largest area is black.
    stripes = Image.new("RGB", (512, 384), (0, 0, 0))  # the largest size: not resampled
    draw = ImageDraw.Draw(stripes)
    for x in range(0, 512, 5):
        for i, colour in enumerate((RED, GREEN, BLUE)):
            draw.line((x + 2 + i, 0, x + 2 + i, 383), fill=colour)
    out = io.BytesIO()
    stripes.save(out, "PNG")
    for opts in (RenderOptions(), RenderOptions(sizes=SIZES)):
        assert render(out.getvalue(), None, opts).dominant_color == "#000000"


def test_the_progress_pages_thumbhash_decoder_gives_back_the_pictures_shape_and_colours(
    browser: Any,  # noqa: F811
) -> None:
    # The grid shows this decoder's picture while a thumbnail loads (api/static/thumbhash.js).
    thumb = render(fc.psd_image(), None, OPTS)  # portrait 2:3, red over blue
    assert thumb.thumbhash is not None
    script = (Path(__file__).resolve().parents[2] / "api" / "static" / "thumbhash.js").read_text()
    browser.get("about:blank")
    w, h, rgba = browser.execute_script(
        script + "; const p = window.thumbhash.toRGBA(arguments[0]);"
        "return [p.w, p.h, Array.from(p.rgba)];",
        thumb.thumbhash,
    )
    # Portrait, within the 32 px a decoded ThumbHash spans (its aspect is coarse: 5:7 for 2:3).
    assert h == 32 and 18 <= w <= 24, (w, h)

    def pixel(x: int, y: int) -> tuple[int, int, int]:
        i = 4 * (y * w + x)
        return rgba[i], rgba[i + 1], rgba[i + 2]

    top, bottom = pixel(w // 2, 3), pixel(w // 2, h - 4)
    assert top[0] > 150 and top[2] < 110, top
    assert bottom[2] > 150 and bottom[0] < 110, bottom


# -- office documents without LibreOffice ----------------------------------------------------------


def test_without_libreoffice_the_embedded_thumbnail_is_used_or_the_converter_is_named() -> None:
    opts = RenderOptions(sizes=SIZES, soffice=None)
    thumb = render(fc.odp_with_embedded_thumbnail(), None, opts)
    img = check_renditions(thumb, 256 / 192)
    assert has_colour(img, RED) and has_colour(img, BLUE)
    assert img.size == (256, 192)  # never enlarged
    # python-pptx and python-docx write a plain white thumbnail: that is no thumbnail.
    for make in (fc.pptx_deck, fc.docx_letter):
        with pytest.raises(ThumbqError) as info:
            render(make(), None, opts)
        assert info.value.code == UNSUPPORTED_TYPE
        assert "LibreOffice (soffice) is not installed" in info.value.message


@requires(SOFFICE is not None, NO_SOFFICE)
def test_a_document_libreoffice_cannot_open_still_shows_its_embedded_thumbnail(
    pool: RenderPool,
) -> None:
    thumb = pool.render(fc.odp_with_embedded_thumbnail(), None, timeout_s=30)
    assert has_colour(decode(thumb.data), RED) and not thumb.degraded


@requires(SOFFICE is not None, NO_SOFFICE)
def test_one_libreoffice_serves_every_office_document_of_a_pool(pool: RenderPool) -> None:
    for make in (fc.pptx_deck, fc.docx_letter, fc.odt_text, fc.pptx_deck):
        pool.render(make(), None, timeout_s=60)
    assert pool.office is not None
    assert pool.office.starts == 1 and pool.office.conversions >= 4


def soffice_processes() -> set[int]:
    """LibreOffice processes this test process started: their profile folders are named after
    the pid that made them (other xdist workers run LibreOffice at the same time)."""
    ours = f"thumbq-office-{os.getpid()}-".encode()
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"soffice" in cmdline and ours in cmdline:
                pids.add(int(entry.name))
    return pids


@requires(SOFFICE is not None, NO_SOFFICE)
def test_libreoffice_is_killed_at_its_deadline_and_leaves_no_process_or_file() -> None:
    assert SOFFICE is not None
    before = soffice_processes()
    scratch = f"thumbq-office-{os.getpid()}-*"
    folders = set(Path(tempfile.gettempdir()).glob(scratch))
    converter = OfficeConverter(SOFFICE)
    try:
        started = time.monotonic()
        with pytest.raises(ThumbqError) as info:
            # Its start alone takes longer than this.
            converter.convert_to_pdf(fc.pptx_deck(), fc.PPTX, time.monotonic() + 0.3)
        assert info.value.code == RENDER_TIMEOUT
        assert time.monotonic() - started < 2.5
        deadline = time.monotonic() + 5
        while soffice_processes() - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert soffice_processes() - before == set()
        # The next document starts a fresh LibreOffice.
        pdf = converter.convert_to_pdf(fc.pptx_deck(), fc.PPTX, time.monotonic() + 60)
        assert pdf.startswith(b"%PDF") and converter.starts == 2
    finally:
        converter.close()
    assert soffice_processes() - before == set()
    # Its profile and files are gone with it.
    assert set(Path(tempfile.gettempdir()).glob(scratch)) <= folders


# -- degraded rendering ----------------------------------------------------------------------------


def test_a_page_too_slow_for_its_window_gets_a_degraded_thumbnail(pool: RenderPool) -> None:
    started = time.monotonic()
    thumb = pool.render(fc.image_heavy_pdf(), None, timeout_s=6, degrade_after_s=3)
    elapsed = time.monotonic() - started
    assert thumb.degraded
    assert elapsed < 6.5
    # Half the resolution: the 512 box holds a 256 px picture, and the smaller sizes are there.
    assert max(thumb.width, thumb.height) == 256
    assert [r.size for r in thumb.renditions] == list(SIZES)


def test_when_even_the_degraded_render_cannot_finish_the_render_times_out(
    pool: RenderPool,
) -> None:
    started = time.monotonic()
    with pytest.raises(ThumbqError) as info:
        pool.render(corpus.slow_pdf(), "application/pdf", timeout_s=2, degrade_after_s=1)
    assert info.value.code == RENDER_TIMEOUT and "degraded" in info.value.message
    assert time.monotonic() - started < 3.5
    # The pool works again.
    assert pool.render(corpus.small_jpeg(), None, timeout_s=10).width > 0


@requires(SOFFICE is not None, NO_SOFFICE)
def test_an_office_document_whose_conversion_overruns_shows_its_embedded_thumbnail_degraded() -> (
    None
):
    # A fresh pool: LibreOffice's start alone overruns the first share of the window.
    with RenderPool(OPTS, workers=1, memory_limit_mb=MEMORY_MB) as fresh:
        thumb = fresh.render(fc.pptx_with_thumbnail(), None, timeout_s=10, degrade_after_s=0.3)
    assert thumb.degraded
    assert has_colour(decode(thumb.data), RED) and has_colour(decode(thumb.data), BLUE)


# -- hostile files ---------------------------------------------------------------------------------


@pytest.fixture
def http_recorder() -> Iterator[HttpStub]:
    """A loopback server that records every request (and answers each with a PNG)."""
    stub = HttpStub(lambda _req: (200, {"Content-Type": "image/png"}, fc.quadrant_png(8, 8)))
    yield stub
    stub.close()


def test_an_svg_fetches_nothing_and_reads_no_local_file(
    pool: RenderPool, http_recorder: HttpStub, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.png"
    Image.new("RGB", (50, 50), RED).save(secret)
    # The server answers, so a fetch would show: prove first that it records what it gets.
    import urllib.request

    urllib.request.urlopen(http_recorder.url + "/probe").read()
    assert [r.path for r in http_recorder.requests] == ["/probe"]
    http_recorder.requests.clear()

    svg = fc.svg_with_references(http_recorder.url, str(secret))
    thumb = pool.render(svg, "image/svg+xml", timeout_s=10)
    img = decode(thumb.data).convert("RGB")
    assert has_colour(img, GREEN)
    assert not has_colour(img, RED), "the local file was read into the thumbnail"
    time.sleep(0.2)
    assert http_recorder.requests == []

    with pytest.raises(ThumbqError) as info:
        pool.render(fc.svg_external_entity(http_recorder.url), None, timeout_s=10)
    assert info.value.code == CORRUPT_INPUT and "entity" in info.value.message
    time.sleep(0.2)
    assert http_recorder.requests == []


HOSTILE = {
    # name: (maker, code, what the message must say)
    "svg_billion_laughs": (fc.svg_billion_laughs, TOO_LARGE, "entities"),
    "mkv_16000x16000": (lambda: fc.mkv_huge_header(16_000, 16_000), TOO_LARGE, "pixels"),
    # FFmpeg itself refuses a frame of 10^10 pixels and reports no size; Matroska's header names it.
    "mkv_100000x100000": (fc.mkv_huge_header, TOO_LARGE, "10,000,000,000 pixels"),
    "pptx_zip_bomb": (fc.pptx_zip_bomb, TOO_LARGE, "compression bomb"),
    "heic_100000x100000": (fc.heic_huge_header, TOO_LARGE, "10,000,000,000 pixels"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_file_ends_with_its_code_quickly_and_the_pool_survives(
    pool: RenderPool, name: str
) -> None:
    make, code, words = HOSTILE[name]
    data = make()
    started = time.monotonic()
    with pytest.raises(ThumbqError) as info:
        pool.render(data, None, timeout_s=10)
    assert (info.value.code, time.monotonic() - started < 2.0) == (code, True), info.value
    assert words in info.value.message
    # Without LibreOffice the same refusal comes from the embedded-thumbnail path.
    if name == "pptx_zip_bomb":
        with pytest.raises(ThumbqError) as again:
            render(data, None, RenderOptions(soffice=None))
        assert again.value.code == TOO_LARGE
    assert pool.render(corpus.small_jpeg(), None, timeout_s=10).width > 0


# -- end to end through a batch --------------------------------------------------------------------


def test_every_format_and_hostile_file_ends_right_through_a_batch(
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
    storage = open_storage(config)
    expected: dict[str, tuple[str, str | None]] = {}
    for name, expect in fc.FORMATS.items():
        if expect.needs_soffice and SOFFICE is None:
            continue
        make = expect.make
        assert callable(make)
        storage.put(f"formats/{name}", make(), "application/octet-stream")
        expected[name] = ("completed", None)
    for name, (make, code, _words) in HOSTILE.items():
        storage.put(f"formats/{name}", make(), "application/octet-stream")
        expected[name] = ("failed", code)
    storage.put("formats/svg_billion_laughs", fc.svg_billion_laughs(), "image/svg+xml")
    # A page that cannot render in its window at full quality: a degraded thumbnail.
    storage.put("formats/image_heavy_pdf", fc.image_heavy_pdf(), "application/pdf")
    expected["image_heavy_pdf"] = ("completed", None)
    items = [{"source_key": f"formats/{name}"} for name in expected]
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "formats")
        runs = []
        for _ in range(6):
            runs.append(run_batch(config, conn, storage, pool))
            p = Queue(conn).progress("formats")
            assert p is not None
            if p["pending"] + p["processing"] == 0:
                break
        jobs = {r["source_key"]: r for r in conn.execute("select * from thumbq.jobs")}
    for r in runs:
        assert r.duration_ms <= config.deadline_ms + 600, r
    for name, (status, code) in expected.items():
        job = jobs[f"formats/{name}"]
        assert (job["status"], job["error_code"]) == (status, code), (name, job["last_error"])
        if status != "completed":
            assert job["thumbnails"] is None and job["thumbhash"] is None
            continue
        keys = {
            str(size): thumbnail_key(f"formats/{name}", job["source_etag"], size, "webp")
            for size in SIZES
        }
        # Every size in the job row, the largest also as thumbnail_key, and the placeholders.
        assert job["thumbnails"] == keys, name
        assert job["thumbnail_key"] == keys["512"]
        assert base64.b64decode(job["thumbhash"]) and len(job["dominant_color"]) == 7
        assert job["degraded"] is (name == "image_heavy_pdf"), name
        for size in SIZES:
            data, info = storage.get(keys[str(size)])
            assert info.content_type == "image/webp"
            assert max(decode(data).size) <= size

    # The API's job answer carries them too.
    from api import create_app

    app = create_app(config.with_(cron_secret="s3cret-for-the-formats-test"))
    try:
        job = jobs["formats/pptx" if SOFFICE else "formats/heic"]
        resp = app.test_client().get(
            f"/api/thumbnails/jobs/{job['id']}",
            headers={"Authorization": "Bearer s3cret-for-the-formats-test"},
        )
        assert resp.status_code == 200
        answer = resp.get_json()
        assert answer["thumbnails"] == job["thumbnails"]
        assert answer["thumbnail_key"] == job["thumbnails"]["512"]
        assert answer["thumbhash"] == job["thumbhash"]
        assert answer["dominant_color"] == job["dominant_color"]
        assert answer["degraded"] is False
    finally:
        app.extensions["thumbq"].close()


def test_a_budget_bound_invocation_of_small_files_uses_its_whole_work_window(
    tmp_path: Path, db_url: str
) -> None:
    # Regression: at the old default THUMBQ_BATCH_SIZE of 500, an invocation of small files
    # stopped on the claim cap (max_items) after about 6 of its 8 s of work.
    from bench.corpus import tiny_png

    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_BUDGET_MS": "4000",
            "THUMBQ_BUFFER_MS": "1000",
        }
    )
    storage = open_storage(config)
    items = []
    for i in range(2500):
        storage.put(f"small/{i:05d}.png", tiny_png(i), "image/png")
        items.append({"source_key": f"small/{i:05d}.png", "content_type": "image/png"})
    with db.connect(db_url) as conn:
        # The window, not the default bucket (1 000 + 100/s, which a run of tiny files at over
        # 300 a second can reach), is what this test measures.
        ratelimit.set_limit(conn, "thumbnail_generation", capacity=1e9, refill_per_second=1e9)
        enqueue_keys(conn, storage, config, items, "small")
        with RenderPool(RenderOptions(), 2, MEMORY_MB) as small_pool:
            small_pool.render(tiny_png(0), None, timeout_s=10)  # warm
            result = run_batch(config, conn, storage, small_pool)
    assert result.stopped_reason == "time_budget", result
    assert result.duration_ms >= 0.9 * config.deadline_ms, result


def test_each_format_is_rendered_by_one_family_of_the_registry() -> None:
    # The format registry (worker/thumbnails/render/formats.py) is the one list: a sniffed type
    # belongs to at most one family, and a file named like a family's files is predicted as its
    # kind before its bytes are read (the extension sets once lived apart, in the budget module).
    from worker.thumbnails.render import formats

    seen: dict[str, str] = {}
    for family in formats.FAMILIES:
        for t in family.types:
            assert t not in seen, (t, seen[t], family.kind)
            seen[t] = family.kind
            assert formats.family_of(t) is family
        for ext in family.extensions:
            assert formats.kind_of(None, f"a/b{ext.upper()}") == family.kind
    assert formats.family_of("text/plain") is None
    assert formats.kind_of("application/pdf", "x") == "pdf"
    assert formats.kind_of(None, "notes.txt") == "other"
