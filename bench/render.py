"""Milliseconds per thumbnail: thumbq's renderer against the baselines a user would otherwise use,
in the same run, on the same files (from bench/corpus.py, made in memory).

- PDF (page 1 of a 960x540 pt slide with text, vector shapes and a 2400x1600 photo):
  thumbq (rendered straight at the box size) against rendering at 72 dpi and resizing with
  Lanczos, and against poppler's `pdftoppm -scale-to 512` (a subprocess per file, as a user
  would pay it) and `pdftoppm -singlefile -r <dpi>`.
- JPEG 4000x3000 and 8000x6000 (photo-like): thumbq against a full decode + Lanczos resize
  (naive), Pillow's own `thumbnail()` defaults, and the floor: libjpeg's reduced-scale decode
  (draft + load) with nothing else done.
- RenderPool: start-up, per-render overhead against calling render() in-process, time to kill
  a render at its timeout, and the render just after a kill (a new child).

Every thumbq and Pillow baseline encodes the same WebP (quality 80, method 0), so the
comparison is between pipelines, not encoders; pdftoppm writes JPEG, its cheapest output.
The cases of a group run round-robin, so background load hits them alike; medians reported.

Run: python -m bench.render [--runs 15]   (as a module: run by path, bench/queue.py would shadow
the standard library's queue module)
"""

from __future__ import annotations

import argparse
import io
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pymupdf
from PIL import Image

from bench.common import write_result
from bench.corpus import a4_pdf, jpeg_4000x3000, jpeg_8000x6000, slide_pdf, slow_pdf, small_jpeg
from worker.engine.errors import RENDER_TIMEOUT, ThumbqError
from worker.thumbnails.render import RenderOptions, render
from worker.thumbnails.render.image import encode
from worker.thumbnails.render.process import RenderPool

OPTS = RenderOptions()


def round_robin(cases: dict[str, Callable[[], object]], runs: int) -> dict[str, float]:
    """Median milliseconds of each case, after one warm-up call each."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, fn in cases.items():
            started = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - started) * 1000)
    return {name: round(statistics.median(ts), 2) for name, ts in times.items()}


# -- baselines -------------------------------------------------------------------------------------


def pdf_72dpi_then_resize(data: bytes) -> bytes:
    """The common recipe: render the page at 72 dpi, shrink it with Lanczos, encode."""
    doc = pymupdf.open(stream=data, filetype="pdf")
    pix = doc[0].get_pixmap(alpha=False)
    img = Image.frombuffer(
        "RGB", (pix.width, pix.height), pix.samples_mv, "raw", "RGB", pix.stride, 1
    )
    img = img.resize(_fit(img.size), Image.Resampling.LANCZOS)
    doc.close()
    return encode(img, OPTS)[0]


def pdftoppm(path: Path, out: Path, *extra: str) -> None:
    subprocess.run(
        [
            "pdftoppm",
            "-f",
            "1",
            "-l",
            "1",
            "-jpeg",
            "-jpegopt",
            "quality=80",
            *extra,
            str(path),
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def image_naive(data: bytes) -> bytes:
    """Full-size decode, then a Lanczos resize to the box, then encode."""
    img = Image.open(io.BytesIO(data))
    img.load()
    img = img.resize(_fit(img.size), Image.Resampling.LANCZOS)
    return encode(img, OPTS)[0]


def image_pillow_thumbnail(data: bytes) -> bytes:
    """What Pillow's docs suggest: `thumbnail()` with its defaults (draft at 2x, bicubic)."""
    img = Image.open(io.BytesIO(data))
    img.thumbnail((OPTS.size, OPTS.size))
    return encode(img, OPTS)[0]


def jpeg_floor(data: bytes) -> Image.Image:
    """The least any JPEG thumbnailer can do: libjpeg's reduced-scale decode, nothing else."""
    img = Image.open(io.BytesIO(data))
    img.draft("RGB", (OPTS.size, OPTS.size))
    img.load()
    return img


def _fit(size: tuple[int, int]) -> tuple[int, int]:
    w, h = size
    scale = OPTS.size / max(w, h)
    return max(1, round(w * scale)), max(1, round(h * scale))


# -- groups ---------------------------------------------------------------------------------------


def bench_pdf(runs: int, tmp: Path) -> dict[str, Any]:
    data = slide_pdf()
    path = tmp / "slide.pdf"
    path.write_bytes(data)
    width_pt = pymupdf.open(stream=data, filetype="pdf")[0].rect.width
    dpi = f"{OPTS.size / width_pt * 72:.2f}"
    cases: dict[str, Callable[[], object]] = {
        "thumbq": lambda: render(data, "application/pdf", OPTS),
        "render_72dpi_then_resize": lambda: pdf_72dpi_then_resize(data),
    }
    poppler = shutil.which("pdftoppm")
    if poppler:
        cases["pdftoppm_scale_to_512"] = lambda: pdftoppm(
            path, tmp / "a", "-scale-to", str(OPTS.size)
        )
        cases[f"pdftoppm_singlefile_r{dpi}"] = lambda: pdftoppm(
            path, tmp / "b", "-singlefile", "-r", dpi
        )
    ms = round_robin(cases, runs)
    result: dict[str, Any] = {"file": f"slide_pdf page 1, {len(data):,} bytes", "median_ms": ms}
    speedups = {"vs_render_72dpi_then_resize": ms["render_72dpi_then_resize"] / ms["thumbq"]}
    if poppler:
        speedups["vs_pdftoppm_scale_to_512"] = ms["pdftoppm_scale_to_512"] / ms["thumbq"]
        speedups["vs_pdftoppm_singlefile"] = ms[f"pdftoppm_singlefile_r{dpi}"] / ms["thumbq"]
    else:
        result["note"] = "pdftoppm not installed: poppler baselines skipped"
    result["thumbq_speedup"] = {k: round(v, 2) for k, v in speedups.items()}
    return result


def bench_jpeg(name: str, data: bytes, runs: int) -> dict[str, Any]:
    cases: dict[str, Callable[[], object]] = {
        "thumbq": lambda: render(data, "image/jpeg", OPTS),
        "naive_full_decode_lanczos": lambda: image_naive(data),
        "pillow_thumbnail_defaults": lambda: image_pillow_thumbnail(data),
        "floor_draft_decode_only": lambda: jpeg_floor(data),
    }
    ms = round_robin(cases, runs)
    return {
        "file": f"{name}, {len(data):,} bytes",
        "median_ms": ms,
        "thumbq_speedup_vs_naive": round(ms["naive_full_decode_lanczos"] / ms["thumbq"], 2),
        "thumbq_over_floor": round(ms["thumbq"] / ms["floor_draft_decode_only"], 3),
    }


def bench_pool(runs: int) -> dict[str, Any]:
    starts = []
    for _ in range(3):
        started = time.perf_counter()
        with RenderPool(OPTS, workers=2, memory_limit_mb=768) as pool:
            starts.append((time.perf_counter() - started) * 1000)
            closing = time.perf_counter()
        close_ms = (time.perf_counter() - closing) * 1000

    files = {
        "a4_pdf": a4_pdf(),
        "small_jpeg_1024x768": small_jpeg(),
        "jpeg_4000x3000": jpeg_4000x3000(),
    }
    overhead: dict[str, Any] = {}
    with RenderPool(OPTS, workers=1, memory_limit_mb=768) as pool:
        for name, data in files.items():
            ms = round_robin(
                {
                    "in_process": lambda data=data: render(data, None, OPTS),  # type: ignore[misc]
                    "pool": lambda data=data: pool.render(data, None, timeout_s=30),  # type: ignore[misc]
                },
                runs,
            )
            overhead[name] = {**ms, "overhead_ms": round(ms["pool"] - ms["in_process"], 2)}

        slow = slow_pdf()
        timeout_s = 0.5
        kills, after_kill = [], []
        for _ in range(5):
            started = time.perf_counter()
            try:
                pool.render(slow, None, timeout_s=timeout_s)
            except ThumbqError as exc:
                assert exc.code == RENDER_TIMEOUT
            kills.append((time.perf_counter() - started - timeout_s) * 1000)
            started = time.perf_counter()
            pool.render(files["a4_pdf"], None, timeout_s=30)
            after_kill.append((time.perf_counter() - started) * 1000)
    return {
        "startup_ms_2_workers": round(statistics.median(starts), 1),
        "close_ms": round(close_ms, 1),
        "per_render": overhead,
        "kill_ms_after_timeout": round(statistics.median(kills), 1),
        "a4_render_right_after_a_kill_ms": round(statistics.median(after_kill), 1),
        "a4_render_in_process_ms": overhead["a4_pdf"]["in_process"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs per case (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pdf = bench_pdf(args.runs, Path(tmp))
    jpeg_12mp = bench_jpeg("jpeg_4000x3000", jpeg_4000x3000(), args.runs)
    jpeg_48mp = bench_jpeg("jpeg_8000x6000", jpeg_8000x6000(), max(5, args.runs // 2))
    pool = bench_pool(args.runs)
    speed = pdf["thumbq_speedup"]
    targets = {
        "pdf_1.8x_faster_than_pdftoppm": speed.get("vs_pdftoppm_scale_to_512", 0) >= 1.8,
        "pdf_1.3x_faster_than_render_then_resize": speed["vs_render_72dpi_then_resize"] >= 1.3,
        "jpeg_4000x3000_3x_faster_than_naive": jpeg_12mp["thumbq_speedup_vs_naive"] >= 3.0,
        "jpeg_4000x3000_within_1.25x_of_floor": jpeg_12mp["thumbq_over_floor"] <= 1.25,
    }
    write_result(
        "render",
        {
            "versions": {
                "pymupdf": pymupdf.__version__,
                "mupdf": pymupdf.mupdf_version,
                "pillow": Image.__version__,
                "pdftoppm": _poppler_version(),
            },
            "options": {"size": OPTS.size, "format": OPTS.format, "quality": OPTS.quality},
            "runs": args.runs,
            "pdf_slide": pdf,
            "jpeg_4000x3000": jpeg_12mp,
            "jpeg_8000x6000": jpeg_48mp,
            "render_pool": pool,
            "targets_met": targets,
        },
    )


def _poppler_version() -> str | None:
    if not shutil.which("pdftoppm"):
        return None
    out = subprocess.run(["pdftoppm", "-v"], capture_output=True, text=True, check=False)
    return (out.stderr or out.stdout).splitlines()[0] if (out.stderr or out.stdout) else None


if __name__ == "__main__":
    main()
