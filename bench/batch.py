"""Thumbnails per invocation (10 s budget, 2 s buffer) on a mixed corpus: thumbq's batch against a
sequential one-at-a-time loop with the same renderer, in the same run, on the same database.

The sequential loop is what a straightforward implementation does: claim one job, download,
render in-process, upload, complete, and stop starting new items once budget - buffer has
passed. It has no way to stop a render that is already running.

Part two puts a PDF page that takes 30 s or more to render at the head of the queue: thumbq's
longest invocation must stay under 8.3 s; the sequential loop's invocation lasts as long as that
page.

Run: python -m bench.batch [--invocations 3] [--slow-draws 32000] [--skip-slow-baseline]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import median, scratch_database, write_result
from bench.corpus import (
    jpeg_4000x3000,
    multipage_pdf,
    png_alpha,
    slide_pdf,
    slow_pdf,
    small_jpeg,
)
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.local.samples import photo
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.render import render
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.task import render_options, thumbnail_key

MIX = [
    ("slide.pdf", slide_pdf, "application/pdf"),
    ("slide2.pdf", slide_pdf, "application/pdf"),
    ("deck.pdf", multipage_pdf, "application/pdf"),
    ("photo-4000x3000.jpg", jpeg_4000x3000, "image/jpeg"),
    ("photo-2400x1600.jpg", lambda: photo(2400, 1600, 3), "image/jpeg"),
    ("small.jpg", small_jpeg, "image/jpeg"),
    ("logo.png", png_alpha, "image/png"),
    ("slide3.pdf", slide_pdf, "application/pdf"),
]


def make_config(url: str, home: Path) -> Config:
    return Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_HOME": str(home),
            "THUMBQ_STORAGE_URL": (home / "storage").as_uri(),
            "THUMBQ_BUDGET_MS": "10000",
            "THUMBQ_BUFFER_MS": "2000",
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_BATCH_SIZE": "500",
        }
    )


def fill(config: Config, conn: db.Conn, group: str, n: int, slow: bytes | None = None) -> None:
    storage = open_storage(config)
    blobs = {name: make() for name, make, _ in MIX}
    items = []
    if slow is not None:
        storage.put(f"{group}/0-slow.pdf", slow, "application/pdf")
        items.append({"source_key": f"{group}/0-slow.pdf", "content_type": "application/pdf"})
    for i in range(n):
        name, _, ct = MIX[i % len(MIX)]
        key = f"{group}/{i:04d}-{name}"
        storage.put(key, blobs[name], ct)
        items.append({"source_key": key, "content_type": ct})
    enqueue_keys(conn, storage, config, items, group)
    conn.execute("analyze thumbq.jobs")


def sequential_invocation(config: Config, conn: db.Conn) -> dict[str, Any]:
    """The straightforward loop: one item at a time, in-process, until the deadline passes."""
    storage = open_storage(config)
    q = Queue(conn, bucket=config.rate_bucket)
    opts = render_options(config)
    started = time.monotonic()
    deadline = started + config.deadline_ms / 1000
    done = 0
    while time.monotonic() < deadline:
        jobs = q.claim("sequential", 1, 30).jobs
        if not jobs:
            break
        job = jobs[0]
        data, info = storage.get(job.source_key)
        thumb = render(data, job.content_type, opts)
        key = thumbnail_key(job.source_key, info.etag, config.thumb_size, config.thumb_ext)
        storage.put(key, thumb.data, thumb.content_type)
        done += q.complete("sequential", [{"job_id": job.id, "msg_id": job.msg_id}])
    return {"thumbnails": done, "duration_ms": round((time.monotonic() - started) * 1000)}


def thumbq_invocation(config: Config, conn: db.Conn, pool: RenderPool) -> dict[str, Any]:
    started = time.monotonic()
    r = run_batch(config, conn, open_storage(config), pool)
    return {
        "thumbnails": r.succeeded,
        "duration_ms": r.duration_ms,
        "wall_ms": round((time.monotonic() - started) * 1000),
        "stopped_reason": r.stopped_reason,
        "retried": r.retried,
        "released": r.released,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--invocations", type=int, default=3)
    ap.add_argument("--slow-draws", type=int, default=32_000)
    ap.add_argument("--skip-slow-baseline", action="store_true")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="thumbq-bench-batch-"))
    url = scratch_database("thumbq_bench_batch")
    config = make_config(url, home)
    result: dict[str, Any] = {
        "budget_ms": 10_000,
        "buffer_ms": 2_000,
        "concurrency": 2,
        "corpus": [name for name, _, _ in MIX],
    }
    with (
        db.connect(url) as conn,
        RenderPool(render_options(config), 2, config.render_memory_mb) as pool,
    ):
        # Warm both paths once (imports, render processes, predictor history) on their own
        # group, so that neither side pays a start-up the other does not.
        fill(config, conn, "warmup", 16)
        thumbq_invocation(config, conn, pool)
        sequential_invocation(config, conn)
        conn.execute("select thumbq.cancel('warmup')")

        seq, tq = [], []
        for i in range(args.invocations):
            fill(config, conn, f"seq{i}", 300)
            seq.append(sequential_invocation(config, conn))
            conn.execute("select thumbq.cancel(%s)", [f"seq{i}"])
            fill(config, conn, f"tq{i}", 800)
            tq.append(thumbq_invocation(config, conn, pool))
            conn.execute("select thumbq.cancel(%s)", [f"tq{i}"])
        seq_med = median([s["thumbnails"] for s in seq])
        tq_med = median([t["thumbnails"] for t in tq])
        result["throughput"] = {
            "sequential_thumbnails_per_invocation": seq_med,
            "thumbq_thumbnails_per_invocation": tq_med,
            "speedup": round(tq_med / seq_med, 2),
            "sequential_runs": seq,
            "thumbq_runs": tq,
            "target": ">= 1.8x on 2 cores",
        }

        # A page that takes far longer than any budget, first in the queue.
        slow = slow_pdf(args.slow_draws)
        t = time.monotonic()
        render(slow, "application/pdf", render_options(config))
        result["slow_page_render_s"] = round(time.monotonic() - t, 1)
        fill(config, conn, "slow", 800, slow=slow)
        slow_runs = [thumbq_invocation(config, conn, pool) for _ in range(args.invocations)]
        conn.execute("select thumbq.cancel('slow')")
        result["with_slow_page"] = {
            "thumbq_runs": slow_runs,
            "thumbq_longest_invocation_ms": max(r["duration_ms"] for r in slow_runs),
            "thumbq_longest_wall_ms": max(r["wall_ms"] for r in slow_runs),
            "target": "longest invocation < 8300 ms",
        }
        if not args.skip_slow_baseline:
            fill(config, conn, "slowseq", 40, slow=slow)
            result["with_slow_page"]["sequential_run"] = sequential_invocation(config, conn)
            conn.execute("select thumbq.cancel('slowseq')")
    write_result("batch", result)


if __name__ == "__main__":
    main()
