"""Interactive mode: how long a click waits for the thumbnail of a photo it just uploaded.

thumbq: `POST /api/jobs {"task": "thumbnail", "payload": {"source_key"}, "wait_ms": 5000}` on a
warm app (its render process started by an earlier call), over HTTP on loopback: storage is
asked for the etag, the job is enqueued, claimed under the rate limit with a lease, rendered in
the app's render process, stored, recorded, and answered with its result.

Baseline: what a strong engineer writes without a queue, a synchronous Flask endpoint on the
same HTTP server that reads the photo from the same storage, makes the same 512 px WebP with
Pillow in the request thread (reduced-scale JPEG decode, EXIF orientation) and stores it. The
ratio is what the queue's bookkeeping and the process boundary cost a click.

Each round uploads a new 12 MP JPEG (4032 x 3024) first, as a phone would, so that neither side
reads a cached file. For scale, the same call for tasks that do nothing (bench/noop_tasks.py), in
a render process and in the request's thread: what the engine's own round trips cost.
Run: python -m bench.interactive [--rounds 15]
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import median, scratch_database, write_result
from worker.engine.config import Config
from worker.local.server import ServerThread
from worker.storage import open_storage

SECRET = "bench-interactive-secret-0123"


def photo(seed: int) -> bytes:
    """A 12 MP phone-like JPEG: gradients, shapes and sensor-like noise (about 2-4 MB)."""
    from PIL import Image, ImageChops, ImageDraw

    w, h = 4032, 3024
    base = Image.linear_gradient("L").resize((w, h))
    img = Image.merge(
        "RGB",
        (base, base.rotate(90, expand=False).resize((w, h)), Image.new("L", (w, h), 90 + seed)),
    )
    draw = ImageDraw.Draw(img)
    for i in range(12):
        x, y = (seed * 311 + i * 397) % w, (seed * 173 + i * 241) % h
        draw.ellipse((x, y, x + 600, y + 400), fill=((i * 40) % 256, 120, (seed * 30) % 256))
    noise = Image.effect_noise((w, h), 18).convert("RGB")
    img = ImageChops.add(img, noise, scale=1.0, offset=-64)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=90)
    return out.getvalue()


def baseline_app(storage: Any, size: int) -> Any:
    """A synchronous thumbnail endpoint: no queue, Pillow in the request thread."""
    from flask import Flask, jsonify, request
    from PIL import Image, ImageOps

    app = Flask("baseline")

    @app.post("/thumbnail")
    def thumbnail() -> Any:
        key = request.get_json()["source_key"]
        data, _ = storage.get(key)
        img = Image.open(io.BytesIO(data))
        img.draft("RGB", (size, size))
        img.thumbnail((size, size), Image.Resampling.LANCZOS)
        img = ImageOps.exif_transpose(img)
        out = io.BytesIO()
        img.save(out, "WEBP", quality=80)
        thumb_key = f"baseline/{key}.webp"
        storage.put(thumb_key, out.getvalue(), "image/webp")
        return jsonify({"thumbnail_key": thumb_key, "width": img.width, "height": img.height})

    return app


def post(port: int, path: str, body: Any, token: str | None = None) -> tuple[int, Any, float]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    started = time.perf_counter()
    conn.request("POST", path, json.dumps(body), headers)
    resp = conn.getresponse()
    raw = resp.read()
    ms = (time.perf_counter() - started) * 1000
    conn.close()
    return resp.status, json.loads(raw), ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()

    from api import create_app

    url = scratch_database("thumbq_bench_interactive")
    folder = Path(tempfile.mkdtemp(prefix="thumbq-bench-interactive-"))
    config = Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_HOME": str(folder / "home"),
            "THUMBQ_STORAGE_URL": (folder / "storage").as_uri(),
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_TASKS": "bench.noop_tasks",
        }
    )
    storage = open_storage(config)
    app = create_app(config)
    thumbq_server = ServerThread(app, "127.0.0.1", 0).start()
    base_server = ServerThread(baseline_app(storage, config.thumb_size), "127.0.0.1", 0).start()
    sizes = []
    thumbq_ms: list[float] = []
    server_ms: list[float] = []
    base_ms: list[float] = []
    noop_ms: dict[str, list[float]] = {"bench_noop": [], "bench_noop_thread": []}
    try:
        for i in range(args.rounds + 1):
            key = f"uploads/photo-{i}.jpg"
            data = photo(i)
            sizes.append(len(data))
            storage.put(key, data, "image/jpeg")
            body = {"task": "thumbnail", "payload": {"source_key": key}, "wait_ms": 5000}
            status, answer, ms = post(thumbq_server.port, "/api/jobs", body, SECRET)
            assert status == 200 and answer["status"] == "completed", answer
            status, base, bms = post(base_server.port, "/thumbnail", {"source_key": key})
            assert status == 200, base
            if i == 0:
                continue  # the first call starts the app's render process: not a warm click
            thumbq_ms.append(ms)
            server_ms.append(answer["wait"]["duration_ms"])
            base_ms.append(bms)
            for name, times in noop_ms.items():
                body = {"task": name, "payload": i, "wait_ms": 5000}
                status, answer, ms = post(thumbq_server.port, "/api/jobs", body, SECRET)
                assert status == 200 and answer["job"]["result"] == i, answer
                times.append(ms)
    finally:
        thumbq_server.close()
        base_server.close()
        app.extensions["thumbq"].close()
        shutil.rmtree(folder, ignore_errors=True)  # about 80 MB of photos

    result = {
        "rounds": args.rounds,
        "photo": {"pixels": "4032 x 3024", "median_bytes": int(median([float(s) for s in sizes]))},
        "thumbnail": {"size": config.thumb_size, "format": config.thumb_format},
        "thumbq_interactive_ms": {
            "median": round(median(thumbq_ms), 1),
            "max": round(max(thumbq_ms), 1),
            "run_median": round(median([float(s) for s in server_ms]), 1),
        },
        "baseline_sync_pillow_ms": {
            "median": round(median(base_ms), 1),
            "max": round(max(base_ms), 1),
        },
        "ratio_median": round(median(thumbq_ms) / median(base_ms), 2),
        "noop_task_interactive_ms": {
            "process": round(median(noop_ms["bench_noop"]), 1),
            "thread": round(median(noop_ms["bench_noop_thread"]), 1),
        },
    }
    write_result("interactive", result)


if __name__ == "__main__":
    main()
