"""The formats work against the baselines a user would otherwise use, ratios measured in one run
on files made here (nothing downloaded).

- video: a representative frame of a 10 s 1080p H.264 clip (thumbq through its render pool)
  against `ffmpeg -ss <10%> -i clip -frames:v 1 -vf scale=512:-2 out.webp` (Debian's ffmpeg, a
  process per file, as a user would pay it). Target: faster than the CLI and under 300 ms.
- HEIC 12 MP, as one picture (what pillow-heif writes) and as a grid of 512 px tiles (what a
  phone writes): thumbq (FFmpeg's HEVC decoder, tiles shrunk as they come out; also on one
  decode thread, and its earlier libheif path) against a full decode (pillow-heif) + Lanczos
  resize + the same WebP. Target: >= 2x.
- PPTX: first slide of N decks with one LibreOffice reused through the render pool, against one
  `soffice --headless --convert-to pdf` per deck (profile kept between calls) + the same PDF
  render. Target: >= 3x.
- Three sizes (128, 256, 512) from one decode against three separate renders, over a 12 MP JPEG,
  a 12 MP HEIC, a slide PDF and a PNG screenshot, timed in turns; CPU time beside wall time.
  Target: >= 2x.
- Raster formats (JPEG, PNG, WebP, GIF, TIFF, HEIC, AVIF), one file each: thumbq's 512 px WebP
  against libvips (`pyvips.Image.thumbnail_buffer(data, 512)` + WebP at the same quality and
  effort 0: the pyvips-binary wheel, which has no HEVC decoder; with BENCH_SYSTEM_VIPS_PYTHON
  naming a Python whose pyvips binds the system's libvips, HEIC is timed there, in another
  process) and against the decode alone. Targets: at least as fast as libvips, and >= 0.6 of
  the decode floor.
- The whole pipeline against its floor: thumbnails per busy second of one budget-bound
  invocation (10 s budget, 2 s buffer, 2 render processes, local storage, Postgres) on a mixed
  corpus (slides, 12 MP photos, PNG screenshots, text PDFs), against two processes that only
  decode the same files (PDF page rasterised at the target scale, JPEG at reduced scale, PNG
  decoded by libspng; nothing resized, encoded or stored), run before and after each invocation.
  Target: >= 0.6. And how much of its work window (budget - buffer) that invocation uses.
  Target: >= 90%.

Run: python -m bench.formats [--runs 7] [--decks 12] [--items 1500] [--rounds 3]
    [--only video,heic,pptx,sizes,raster,pipeline] [--format webp|jpeg|avif (the pipeline's output)]
(--quick: fewer runs and files, for development; the numbers are then rough)
"""

from __future__ import annotations

import argparse
import functools
import io
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from bench.common import scratch_database, write_result
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.render import RenderOptions, render
from worker.thumbnails.render.image import decode_outside_pillow
from worker.thumbnails.render.office import find_soffice
from worker.thumbnails.render.output import encode, fit_inside
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.task import render_options

OPTS = RenderOptions()


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 1)


# -- inputs ----------------------------------------------------------------------------------------


def photo(width: int, height: int, seed: int) -> Image.Image:
    """Photo-like: gradients, shapes, grain (compresses like a photo, not like a flat image)."""
    rng = random.Random(seed)
    small = Image.merge(
        "RGB",
        (
            Image.linear_gradient("L").rotate(20 + seed).resize((64, 48)),
            Image.radial_gradient("L").resize((64, 48)),
            Image.linear_gradient("L").transpose(Image.Transpose.ROTATE_90).resize((64, 48)),
        ),
    )
    img = small.resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(60):
        x, y = rng.randrange(width), rng.randrange(height)
        r = rng.randrange(20, width // 6)
        draw.ellipse((x, y, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
    grain = Image.frombytes("L", (width, height), rng.randbytes(width * height))
    return Image.blend(img, Image.merge("RGB", (grain, grain, grain)), 0.08)


@functools.cache
def jpeg_12mp(seed: int = 1) -> bytes:
    out = io.BytesIO()
    photo(4000, 3000, seed).save(out, "JPEG", quality=88)
    return out.getvalue()


@functools.cache
def heic_12mp() -> bytes:
    import pillow_heif

    out = io.BytesIO()
    pillow_heif.from_pillow(photo(4032, 3024, 2)).save(out, quality=60)
    return out.getvalue()


def png_screenshot(seed: int) -> bytes:
    """A 1920x1080 UI screenshot: flat panels, text, an embedded photo."""
    rng = random.Random(seed)
    img = Image.new("RGB", (1920, 1080), (245, 246, 248))
    draw = ImageDraw.Draw(img)
    draw.rectangle((0, 0, 1920, 64), fill=(32, 40, 60))
    draw.rectangle((0, 64, 280, 1080), fill=(230, 232, 236))
    for i in range(40):
        y = 90 + i * 24
        draw.text((300, y), f"Row {i}: " + "lorem ipsum dolor sit amet " * 4, fill=(30, 30, 30))
        draw.text((20, y), f"Menu item {i}", fill=(60, 60, 60))
    img.paste(photo(600, 400, seed), (1250, 120 + rng.randrange(200)))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def slide_pdf(seed: int) -> bytes:
    """A 16:9 slide: title, bullet text, vector shapes and a photo."""
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=960, height=540)
    page.draw_rect(pymupdf.Rect(0, 0, 960, 90), color=None, fill=(0.1, 0.2, 0.5))
    page.insert_text((40, 60), f"Quarterly review {seed}", fontsize=36, color=(1, 1, 1))
    for i in range(6):
        page.insert_text((40, 150 + 45 * i), f"- point {i}: revenue grew by {i * 7}%", fontsize=22)
    for i in range(12):
        page.draw_circle((700 + 15 * i, 300), 40, color=(0.8, 0.1, 0.1), width=2)
    buf = io.BytesIO()
    photo(1200, 800, seed).save(buf, "JPEG", quality=85)
    page.insert_image(pymupdf.Rect(560, 330, 920, 520), stream=buf.getvalue())
    return doc.tobytes()


def text_pdf(seed: int) -> bytes:
    """A4 pages of running text."""
    import pymupdf

    doc = pymupdf.open()
    for p in range(3):
        page = doc.new_page()
        text = f"Report {seed}, page {p + 1}. " + "The committee reviewed the figures. " * 90
        page.insert_textbox(pymupdf.Rect(60, 60, 535, 780), text, fontsize=11)
    return doc.tobytes()


def pptx_deck(i: int) -> bytes:
    from pptx import Presentation
    from pptx.dml.color import RGBColor
    from pptx.util import Inches

    prs = Presentation()
    prs.slide_width, prs.slide_height = Inches(13.333), Inches(7.5)
    for s in range(6):
        slide = prs.slides.add_slide(prs.slide_layouts[5])
        slide.shapes.title.text = f"Deck {i}, slide {s + 1}"
        box = slide.shapes.add_shape(1, Inches(1), Inches(2), Inches(6), Inches(4))
        box.fill.solid()
        box.fill.fore_color.rgb = RGBColor(40 * s % 255, 90, 160)
    out = io.BytesIO()
    prs.save(out)
    return out.getvalue()


def video_1080p(seconds: int = 10) -> bytes:
    """H.264 1080p at 25 fps, a keyframe every 2 s, the first second black."""
    import av

    out = io.BytesIO()
    background = photo(1920, 1080, 5)
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 1920, 1080, "yuv420p"
        stream.options = {"preset": "veryfast", "keyint": "50", "crf": "23"}
        stream.time_base = Fraction(1, 25)
        for i in range(seconds * 25):
            if i < 25:
                img = Image.new("RGB", (1920, 1080))
            else:
                img = background.copy()
                ImageDraw.Draw(img).rectangle((i * 6, 300, i * 6 + 400, 700), fill=(220, 30, 30))
            frame = av.VideoFrame.from_image(img)
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


# -- sections --------------------------------------------------------------------------------------


def bench_video(work: Path, runs: int) -> dict[str, Any]:
    clip = video_1080p()
    path = work / "clip.mp4"
    path.write_bytes(clip)
    with RenderPool(OPTS, 1, 512) as pool:
        thumbq = median_ms(lambda: pool.render(clip, "video/mp4", timeout_s=30), runs)
    cli = median_ms(
        lambda: subprocess.run(
            [
                *("ffmpeg", "-v", "error", "-y", "-ss", "1", "-i", str(path)),
                *("-frames:v", "1", "-vf", "scale=512:-2", str(work / "frame.webp")),
            ],
            check=True,
        ),
        runs,
    )
    return {
        "clip": "1920x1080 H.264, 10 s, keyframe every 2 s, first second black",
        "clip_bytes": len(clip),
        "thumbq_ms": thumbq,
        "ffmpeg_cli_ms": cli,
        "speedup": round(cli / thumbq, 2),
        "target": "faster than the CLI and < 300 ms",
    }


@functools.cache
def heic_12mp_grid() -> bytes:
    """The same photo as a grid of 512 px tiles (8 x 6), as an iPhone writes one."""
    from bench.corpus import heic_grid

    return heic_grid(photo(4032, 3024, 2), 512)


def bench_heic(runs: int) -> dict[str, Any]:
    import pillow_heif

    from worker.thumbnails.render import image

    pillow_heif.register_heif_opener()
    out: dict[str, Any] = {}
    for name, data in (("one_picture", heic_12mp()), ("grid_512px_tiles", heic_12mp_grid())):

        def baseline(data: bytes = data) -> bytes:
            img = Image.open(io.BytesIO(data))
            img.load()
            img = img.resize((512, 384), Image.Resampling.LANCZOS)
            return encode(img, OPTS)[0]

        def thumbq(data: bytes = data) -> object:
            return render(data, "image/heic", OPTS)

        threads = image.HEIC_THREADS
        fast_path = image.open_heic
        try:
            ms = median_ms(thumbq, runs)
            image.HEIC_THREADS = 1
            one_thread = median_ms(thumbq, runs)
            image.HEIC_THREADS = threads
            image.open_heic = lambda *_: None  # type: ignore[assignment]
            libheif_path = median_ms(thumbq, runs)
        finally:
            image.HEIC_THREADS, image.open_heic = threads, fast_path
        full = median_ms(baseline, runs)
        out[name] = {
            "file_bytes": len(data),
            "thumbq_ms": ms,
            "thumbq_one_decode_thread_ms": one_thread,
            "thumbq_libheif_path_ms": libheif_path,
            "full_decode_lanczos_ms": full,
            "speedup": round(full / ms, 2),
            "speedup_one_decode_thread": round(full / one_thread, 2),
        }
    out["file"] = "4032x3024 HEIC (pillow-heif, quality 60)"
    out["decode_threads"] = image.HEIC_THREADS
    out["target"] = ">= 2x"
    return out


def bench_pptx(work: Path, decks: int) -> dict[str, Any]:
    soffice = find_soffice()
    if soffice is None:
        return {"skipped": "LibreOffice (soffice) is not installed"}
    files = [pptx_deck(i) for i in range(decks)]
    started = time.perf_counter()
    with RenderPool(RenderOptions(soffice=soffice), 1, 512) as pool:
        for data in files:
            pool.render(data, None, timeout_s=60)
    reused_ms = (time.perf_counter() - started) * 1000
    profile = (work / "lo-profile").as_uri()
    convert = [soffice, f"-env:UserInstallation={profile}", "--headless", "--convert-to", "pdf"]
    convert += ["--outdir", str(work / "out")]
    # Warm the baseline's profile once, so that its first-start cost is not counted against it.
    (work / "warm.pptx").write_bytes(files[0])
    subprocess.run(
        [*convert, str(work / "warm.pptx")],
        check=True,
        capture_output=True,
    )
    started = time.perf_counter()
    for i, data in enumerate(files):
        src = work / f"deck{i}.pptx"
        src.write_bytes(data)
        subprocess.run(
            [*convert, str(src)],
            check=True,
            capture_output=True,
        )
        render((work / "out" / f"deck{i}.pdf").read_bytes(), "application/pdf", OPTS)
    per_file_ms = (time.perf_counter() - started) * 1000
    return {
        "decks": decks,
        "thumbq_reused_ms_per_deck": round(reused_ms / decks, 1),
        "convert_to_per_file_ms_per_deck": round(per_file_ms / decks, 1),
        "speedup": round(per_file_ms / reused_ms, 2),
        "note": "thumbq's time includes starting its one LibreOffice; the baseline's profile "
        "was created before timing",
        "target": ">= 3x",
    }


def bench_sizes(runs: int) -> dict[str, Any]:
    """One decode against three renders, timed in turns (one, then the three, `runs` times over)
    so that whatever the machine does meanwhile falls on both sides. The CPU time is reported
    beside the wall time: with several sizes thumbq encodes the largest on a second thread."""
    files = {
        "jpeg_12mp": jpeg_12mp(),
        "heic_12mp": heic_12mp(),
        "slide_pdf": slide_pdf(1),
        "png_screenshot": png_screenshot(1),
    }
    three = RenderOptions(sizes=(128, 256, 512))
    singles = [RenderOptions(size=s) for s in (128, 256, 512)]
    out: dict[str, Any] = {}
    for name, data in files.items():
        sides: dict[str, Callable[[], object]] = {
            "one": lambda data=data: render(data, None, three),
            "three": lambda data=data: [render(data, None, o) for o in singles],
        }
        wall: dict[str, list[float]] = {side: [] for side in sides}
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        for fn in sides.values():
            fn()  # warm-up
        for _ in range(max(runs, 15)):
            for side, fn in sides.items():
                started, cpu_started = time.perf_counter(), time.process_time()
                fn()
                wall[side].append((time.perf_counter() - started) * 1000)
                cpu[side].append((time.process_time() - cpu_started) * 1000)
        one, separate = statistics.median(wall["one"]), statistics.median(wall["three"])
        one_cpu, separate_cpu = statistics.median(cpu["one"]), statistics.median(cpu["three"])
        out[name] = {
            "one_decode_ms": round(one, 1),
            "three_renders_ms": round(separate, 1),
            "speedup": round(separate / one, 2),
            "one_decode_cpu_ms": round(one_cpu, 1),
            "three_renders_cpu_ms": round(separate_cpu, 1),
            "cpu_speedup": round(separate_cpu / one_cpu, 2),
        }
    ratios = [v["speedup"] for v in out.values()]
    out["geometric_mean_speedup"] = round(statistics.geometric_mean(ratios), 2)
    out["lowest_speedup"] = min(ratios)
    out["target"] = ">= 2x"
    return out


def _saved(img: Image.Image, fmt: str, **params: Any) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **params)
    return out.getvalue()


def raster_files() -> dict[str, bytes]:
    """One file of each raster format, as a user would upload it."""
    six = photo(3000, 2000, 3)
    return {
        "jpeg_12mp": jpeg_12mp(),
        "png_screenshot": png_screenshot(1),
        "webp_6mp": _saved(six, "WEBP", quality=80),
        "gif_1200x900": _saved(photo(1200, 900, 4).quantize(256), "GIF"),
        "tiff_6mp_lzw": _saved(six, "TIFF", compression="tiff_lzw"),
        "heic_12mp": heic_12mp(),
        "avif_6mp": _saved(six, "AVIF", quality=60, speed=8),
    }


def _raster_floor(data: bytes) -> object:
    """Decode only, the least any thumbnailer must do, with thumbq's own decoders: JPEG at the
    reduced scale a 512 px box allows, a still WebP scaled by libwebp (render/webp.py), an 8-bit
    RGB(A) PNG through libspng (render/png.py), the others whole (HEIC through pillow-heif);
    nothing resized or encoded. The pipeline's floor decodes the same way."""
    img = Image.open(io.BytesIO(data))
    if img.format == "JPEG":
        img.draft("RGB", (512, 512))
    else:
        decoded = decode_outside_pillow(img, data, fit_inside(img.size, 512))
        if decoded is not None:
            return decoded
    img.load()
    return img


def bench_raster(runs: int) -> dict[str, Any]:
    """thumbq against libvips (pyvips' `thumbnail_buffer`, shrink-on-load, then WebP at
    thumbq's settings: quality 80, effort 0) and against the decode floor, per raster format,
    one thumbnail of 512 px in this process. The three are timed in turns, so that whatever
    the machine does meanwhile falls on all of them; CPU time beside wall time (libvips
    decodes and resizes on several threads)."""
    import pillow_heif
    import pyvips

    pillow_heif.register_heif_opener()
    pyvips.cache_set_max(0)  # the same buffer again must be decoded again
    out: dict[str, Any] = {}
    for name, data in raster_files().items():

        def libvips(data: bytes = data) -> object:
            thumb = pyvips.Image.thumbnail_buffer(data, 512)
            return thumb.webpsave_buffer(Q=OPTS.quality, effort=0)

        sides: dict[str, Callable[[], object]] = {
            "thumbq": lambda data=data: render(data, None, OPTS),
            "libvips": libvips,
            "floor": lambda data=data: _raster_floor(data),
        }
        wall: dict[str, list[float]] = {side: [] for side in sides}
        cpu: dict[str, list[float]] = {side: [] for side in sides}
        missing: dict[str, str] = {}
        for side, fn in list(sides.items()):
            try:
                fn()  # warm-up
            except Exception as exc:  # libvips without a decoder for the format
                missing[side] = str(exc).strip().splitlines()[-1][:200]
                del sides[side]
        for _ in range(max(runs, 9)):
            for side, fn in sides.items():
                started, cpu_started = time.perf_counter(), time.process_time()
                fn()
                wall[side].append((time.perf_counter() - started) * 1000)
                cpu[side].append((time.process_time() - cpu_started) * 1000)
        row: dict[str, Any] = {"file_bytes": len(data)}
        for side in sides:
            row[f"{side}_ms"] = round(statistics.median(wall[side]), 1)
            row[f"{side}_cpu_ms"] = round(statistics.median(cpu[side]), 1)
        if "libvips" in sides:
            # Above 1: thumbq is faster.
            row["libvips_over_thumbq"] = round(row["libvips_ms"] / row["thumbq_ms"], 2)
            row["libvips_over_thumbq_cpu"] = round(row["libvips_cpu_ms"] / row["thumbq_cpu_ms"], 2)
        else:
            row["libvips_missing"] = missing.get("libvips")
            other = os.environ.get("BENCH_SYSTEM_VIPS_PYTHON")
            if other:
                row.update(_libvips_elsewhere(other, data, max(runs, 9)))
                row["libvips_over_thumbq"] = round(row["libvips_ms"] / row["thumbq_ms"], 2)
                row["libvips_over_thumbq_cpu"] = round(
                    row["libvips_cpu_ms"] / row["thumbq_cpu_ms"], 2
                )
        row["floor_over_thumbq"] = round(row["floor_ms"] / row["thumbq_ms"], 2)
        out[name] = row
    out["libvips"] = pyvips.version(0), pyvips.version(1), pyvips.version(2)
    out["targets"] = "libvips_over_thumbq >= 1; floor_over_thumbq >= 0.6"
    return out


# Timed in the interpreter BENCH_SYSTEM_VIPS_PYTHON names: pyvips bound to the system's libvips
# (Debian's libvips42 reads HEIC through libheif with libde265, which pyvips-binary leaves out).
_LIBVIPS_ELSEWHERE = """
import statistics, sys, time
import pyvips
pyvips.cache_set_max(0)
data, runs = sys.stdin.buffer.read(), int(sys.argv[1])
wall, cpu = [], []
for i in range(runs + 1):
    started, cpu_started = time.perf_counter(), time.process_time()
    pyvips.Image.thumbnail_buffer(data, 512).webpsave_buffer(Q=int(sys.argv[2]), effort=0)
    if i:  # the first is a warm-up
        wall.append((time.perf_counter() - started) * 1000)
        cpu.append((time.process_time() - cpu_started) * 1000)
print(statistics.median(wall), statistics.median(cpu), pyvips.version(0), pyvips.version(1))
"""


def _libvips_elsewhere(python: str, data: bytes, runs: int) -> dict[str, Any]:
    """libvips' thumbnail of `data` in another interpreter (not timed in turns with thumbq)."""
    done = subprocess.run(
        [python, "-c", _LIBVIPS_ELSEWHERE, str(runs), str(OPTS.quality)],
        input=data,
        capture_output=True,
        # Python's view of the environment: the loaded pyvips-binary's libvips set variables in
        # the C environment (its own module folder) that the system's libvips must not see.
        env=dict(os.environ),
    )
    if done.returncode:
        raise RuntimeError(f"{python}: {done.stderr.decode(errors='replace')[-2000:]}")
    out = done.stdout.split()
    return {
        "libvips_ms": round(float(out[0]), 1),
        "libvips_cpu_ms": round(float(out[1]), 1),
        "libvips_elsewhere": f"system libvips {int(out[2])}.{int(out[3])}, {runs} runs",
    }


_FLOOR_CORPUS: list[tuple[str, bytes]] = []


def _floor_init(corpus: list[tuple[str, bytes]]) -> None:
    _FLOOR_CORPUS[:] = corpus


def _decode_only(index: int) -> float:
    """The floor: what any thumbnailer must do at least (no resize, encode or store). The files
    are already in the process, as a worker's would be after its download. Returns the CPU
    seconds it took."""
    started = time.process_time()
    kind, data = _FLOOR_CORPUS[index % len(_FLOOR_CORPUS)]
    if kind == "pdf":
        import pymupdf

        doc = pymupdf.open(stream=data, filetype="pdf")
        page = doc[0]
        scale = 512 / max(page.rect.width, page.rect.height)
        page.get_pixmap(matrix=pymupdf.Matrix(scale, scale), alpha=False)
        doc.close()
    else:
        _raster_floor(data)
    return time.process_time() - started


def _run_floor(procs: Any, files: int, seconds: float = 2.5) -> tuple[int, float, float]:
    """The floor on `procs` for about `seconds`: (files decoded, their CPU seconds, seconds)."""
    done, cpu = 0, 0.0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        cpu += sum(procs.map(_decode_only, range(files * 4), chunksize=1))
        done += files * 4
    return done, cpu, time.perf_counter() - started


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process on this machine (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def mixed_corpus() -> list[tuple[str, str, bytes]]:
    """(name, kind, bytes): slides, 12 MP photos, PNG screenshots and text PDFs, interleaved."""
    return [
        ("slide-1.pdf", "pdf", slide_pdf(1)),
        ("photo-1.jpg", "jpeg", jpeg_12mp(1)),
        ("screen-1.png", "png", png_screenshot(1)),
        ("text-1.pdf", "pdf", text_pdf(1)),
        ("slide-2.pdf", "pdf", slide_pdf(2)),
        ("photo-2.jpg", "jpeg", jpeg_12mp(2)),
        ("screen-2.png", "png", png_screenshot(2)),
        ("text-2.pdf", "pdf", text_pdf(2)),
    ]


def bench_pipeline(
    work: Path, items: int, rounds: int, thumb_format: str = "webp"
) -> dict[str, Any]:
    """Rounds of: the floor for about 2.5 s, one budget-bound invocation, the floor again. Two
    ratios per round: by wall time (thumbnails per busy second, as specified) and by CPU time
    (CPU seconds per file of the floor against CPU seconds per thumbnail of the pipeline: its
    render processes, the worker and its Postgres backend), which load from other processes on a
    shared machine does not move."""
    corpus = mixed_corpus()
    url = scratch_database("thumbq_bench_formats")
    home = work / "home"
    config = Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_HOME": str(home),
            "THUMBQ_STORAGE_URL": (home / "storage").as_uri(),
            "THUMBQ_BUDGET_MS": "10000",
            "THUMBQ_BUFFER_MS": "2000",
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_THUMB_FORMAT": thumb_format,
        }
    )
    storage = open_storage(config)
    runs = []
    floor_corpus = [(kind, data) for _, kind, data in corpus]
    with (
        multiprocessing.get_context("spawn").Pool(2, _floor_init, (floor_corpus,)) as procs,
        db.connect(url) as conn,
        RenderPool(render_options(config), 2, config.render_memory_mb) as pool,
    ):
        procs.map(_decode_only, range(len(corpus) * 2))  # warm: imports, caches
        backend = int(conn.execute("select pg_backend_pid() as pid").fetchone()["pid"])
        for round_no in range(rounds + 1):  # round 0 warms the pool and the predictor
            # The floor runs for 2.5 s before the invocation and 2.5 s after it, so that a
            # machine whose speed drifts (a shared VM's does, by 10% and more within a minute)
            # moves both sides of the ratio alike.
            before = _run_floor(procs, len(corpus))
            group = f"mix{round_no}"
            batch = []
            for i in range(items):
                name, _, data = corpus[i % len(corpus)]
                key = f"{group}/{i:05d}-{name}"
                storage.put(key, data, "")
                batch.append({"source_key": key})
            enqueue_keys(conn, storage, config, batch, group)
            conn.execute("analyze thumbq.jobs")
            pool.start()
            children = {pid: _cpu_seconds(pid) for pid in pool.pids()}
            own, db_cpu = time.process_time(), _cpu_seconds(backend)
            result = run_batch(config, conn, storage, pool)
            pipeline_cpu = (
                time.process_time()
                - own
                + _cpu_seconds(backend)
                - db_cpu
                + sum(_cpu_seconds(pid) - cpu for pid, cpu in children.items())
            )
            conn.execute("select thumbq.cancel(%s)", [group])
            after = _run_floor(procs, len(corpus))
            done, floor_cpu, floor_s = (a + b for a, b in zip(before, after, strict=True))
            floor_per_s = done / floor_s
            per_s = result.succeeded / (result.duration_ms / 1000)
            runs.append(
                {
                    "floor_per_s": round(floor_per_s, 1),
                    "floor_cpu_ms_per_file": round(1000 * floor_cpu / done, 2),
                    "succeeded": result.succeeded,
                    "duration_ms": result.duration_ms,
                    "stopped_reason": result.stopped_reason,
                    "claimed": result.claimed,
                    "per_busy_s": round(per_s, 1),
                    "cpu_ms_per_thumbnail": round(1000 * pipeline_cpu / result.succeeded, 2),
                    "ratio": round(per_s / floor_per_s, 2),
                    "cpu_ratio": round((floor_cpu / done) / (pipeline_cpu / result.succeeded), 2),
                    "window_used": round(result.duration_ms / config.deadline_ms, 3),
                }
            )
    measured = runs[1:]
    return {
        "corpus": [name for name, _, _ in corpus],
        "thumbnail_format": thumb_format,
        "floor_decode_only_per_s": statistics.median(r["floor_per_s"] for r in measured),
        "pipeline_per_busy_s": statistics.median(r["per_busy_s"] for r in measured),
        "ratio": statistics.median(r["ratio"] for r in measured),
        "cpu_ratio": statistics.median(r["cpu_ratio"] for r in measured),
        "ratio_target": ">= 0.6",
        "window_used": statistics.median(r["window_used"] for r in measured),
        "window_target": ">= 0.90",
        "runs": runs,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--decks", type=int, default=12)
    ap.add_argument("--items", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3, help="pipeline rounds after a warm-up")
    ap.add_argument("--quick", action="store_true", help="few runs and files (development)")
    ap.add_argument(
        "--format",
        default="webp",
        choices=("webp", "jpeg", "avif"),
        help="the pipeline's thumbnail format (THUMBQ_THUMB_FORMAT; webp is the default)",
    )
    ap.add_argument(
        "--only",
        default="video,heic,pptx,sizes,raster,pipeline",
        help="comma-separated sections",
    )
    args = ap.parse_args()
    if args.quick:
        args.runs, args.decks, args.items, args.rounds = 3, 3, 600, 1
    only = set(args.only.split(","))
    load = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="thumbq-bench-formats-"))
    result: dict[str, Any] = {"load_average_at_start": [round(x, 2) for x in load]}
    try:
        if "video" in only:
            result["video"] = bench_video(work, args.runs)
        if "heic" in only:
            result["heic"] = bench_heic(args.runs)
        if "pptx" in only:
            result["pptx"] = bench_pptx(work, args.decks)
        if "sizes" in only:
            result["sizes"] = bench_sizes(args.runs)
        if "raster" in only:
            result["raster"] = bench_raster(args.runs)
        if "pipeline" in only:
            result["pipeline"] = bench_pipeline(work, args.items, args.rounds, args.format)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["quick"] = args.quick
    name = "formats" + ("_quick" if args.quick else "")
    if only != set(ap.get_default("only").split(",")):
        name += "_" + "_".join(sorted(only))  # a part of the run never replaces the whole
    if args.format != "webp":
        name += f"_{args.format}"
    write_result(name, result)


if __name__ == "__main__":
    main()
