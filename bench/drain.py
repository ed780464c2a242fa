"""Time to drain 500 mixed files: the scheduler with chaining, against one call per 5-minute tick.

500 small files (PDF slide decks of 1 to 4 pages and JPEG photos of 0.3 to 3 MP, generated
here) are enqueued as one group. Both ways run against a real app (create_app under waitress on
loopback) and a real queue, each in a fresh database:

- chained: `worker.local.cron.CronScheduler` on the default `*/5 * * * *` cron, first tick at once,
  chaining calls while runs stop on `time_budget`/`max_items`. Measured on the wall clock from
  the first tick until every job is terminal.
- one call per tick (the baseline): the same HTTP call, once per tick. The calls are real and
  timed, but the 5-minute waits between them are not slept: they are added arithmetically, so
  its time to drain is (calls - 1) x 300 s + the last call's duration.

    .venv/bin/python -m bench.drain [--files 500] [--budget-ms 10000] [--small-batch 50]

Two scenarios: the default configuration (THUMBQ_BATCH_SIZE 500), and a fixed 50 items per
call (as a straightforward design has), where one invocation cannot do it all and chaining
decides the result.

The database server is BENCH_DATABASE_URL, TEST_DATABASE_URL or DATABASE_URL (else embedded).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from bench.common import scratch_database, server_url, write_result
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.local.cron import BATCH_PATH, CronScheduler, cron_trigger, post_json
from worker.local.server import ServerThread
from worker.storage import Storage, open_storage
from worker.thumbnails.files import enqueue_keys

SECRET = "bench-drain-secret"
GROUP = "drain-500"
TICK_S = 300
TARGET_S = 180


def jpeg(rng: random.Random) -> bytes:
    """A photo-like JPEG of 0.3 to 3 MP: gradients, shapes and grain (compresses like a photo)."""
    from PIL import Image, ImageDraw, ImageFilter

    w, h = rng.choice([(640, 480), (1024, 768), (1600, 1200), (2048, 1536), (1200, 1600)])
    small = (w // 8, h // 8)
    base = Image.merge(
        "RGB",
        (
            Image.linear_gradient("L").resize(small),
            Image.linear_gradient("L").rotate(rng.choice([90, 180, 270])).resize(small),
            Image.effect_noise(small, 30 + rng.random() * 30).filter(ImageFilter.GaussianBlur(1)),
        ),
    ).resize((w, h), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(base)
    for _ in range(8):
        x, y, r = rng.randrange(w), rng.randrange(h), rng.randrange(h // 20, h // 5)
        colour = (rng.randrange(256), rng.randrange(256), rng.randrange(256))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    out = io.BytesIO()
    base.save(out, "JPEG", quality=85)
    return out.getvalue()


def pdf(rng: random.Random, n: int) -> bytes:
    """A small slide deck: 1 to 4 pages of titles, bullets and vector shapes."""
    import pymupdf

    doc = pymupdf.open()
    for p in range(rng.randint(1, 4)):
        page = doc.new_page(width=960, height=540)
        page.draw_rect(page.rect, color=None, fill=(0.96, 0.97, 1.0))
        page.draw_rect(pymupdf.Rect(0, 0, 960, 70), color=None, fill=(0.1, 0.2, 0.45))
        page.insert_text((40, 48), f"Talk {n}, slide {p + 1}", fontsize=30, color=(1, 1, 1))
        for i in range(rng.randint(2, 5)):
            page.insert_text((60, 130 + 44 * i), f"- point {i + 1} of talk {n}", fontsize=22)
        colour = (rng.random(), rng.random(), rng.random())
        page.draw_circle((760, 330), 90 + rng.randrange(60), color=colour, fill=colour)
    data = bytes(doc.tobytes(garbage=3, deflate=True))
    doc.close()
    return data


def make_files(storage: Storage, count: int, seed: int = 500) -> tuple[list[dict[str, Any]], dict]:
    """Write `count` files, half PDFs and half JPEGs, interleaved; return items and a summary."""
    rng = random.Random(seed)
    items = []
    kinds: Counter[str] = Counter()
    total = 0
    for i in range(count):
        if i % 2:
            key, data, ctype = f"drain/photos/img-{i:03d}.jpg", jpeg(rng), "image/jpeg"
        else:
            key, data, ctype = f"drain/talks/deck-{i:03d}.pdf", pdf(rng, i), "application/pdf"
        info = storage.put(key, data, ctype)
        items.append({"source_key": key, "etag": info.etag, "content_type": ctype})
        kinds[ctype] += 1
        total += len(data)
    return items, {"by_type": dict(kinds), "bytes_total": total}


def _config(url: str, storage_dir: Path, home: Path, args: argparse.Namespace) -> Config:
    env = {
        "THUMBQ_HOME": str(home),
        "DATABASE_URL": url,
        "THUMBQ_STORAGE_URL": storage_dir.as_uri(),
        "THUMBQ_CRON_SECRET": SECRET,
        "THUMBQ_BUDGET_MS": str(args.budget_ms),
        "THUMBQ_SCHEDULE": "*/5 * * * *",
    }
    if args.concurrency:
        env["THUMBQ_CONCURRENCY"] = str(args.concurrency)
    return Config.from_env(env)


def _settled(q: Queue) -> dict[str, Any] | None:
    p = q.progress(GROUP)
    return p if p and p["pending"] + p["processing"] == 0 else None


def _serve(config: Config) -> tuple[Any, ServerThread]:
    from api import create_app

    app = create_app(config)
    return app, ServerThread(app).start()


def run_chained(config: Config, items: list[dict[str, Any]], storage: Storage) -> dict[str, Any]:
    """The scheduler with chaining; wall-clock seconds from its first tick to all terminal."""
    url = db.database_url(config)
    app, server = _serve(config)
    try:
        with db.connect(url) as conn:
            enqueue_keys(conn, storage, config, items, GROUP)
            q = Queue(conn)
            sched = CronScheduler(config, api_url=server.url, trigger=cron_trigger(config.schedule))
            started = time.monotonic()
            sched.start(run_now=True)
            try:
                # Checked five times a second: finer polling would compete for the GIL with
                # the server's batch threads in this same process.
                while (done := _settled(q)) is None:
                    time.sleep(0.2)
                elapsed = time.monotonic() - started
            finally:
                sched.shutdown()
            runs = db.run(conn, "runs_since", {"run_id": 0})
    finally:
        server.close()
        app.extensions["thumbq"].close()
    return {
        "seconds_to_all_terminal": round(elapsed, 2),
        "calls": len(runs),
        "ticks": len(sched.ticks),
        "calls_per_tick": [t.calls for t in sched.ticks],
        "run_duration_ms": [r["duration_ms"] for r in runs],
        "stopped_reasons": dict(Counter(r["stopped_reason"] for r in runs)),
        "files_per_second": round(len(items) / elapsed, 1),
        "final": _counts(done),
    }


def run_one_per_tick(
    config: Config, items: list[dict[str, Any]], storage: Storage
) -> dict[str, Any]:
    """One real call per tick; the ticks' 5-minute gaps added arithmetically, not slept."""
    url = db.database_url(config)
    app, server = _serve(config)
    durations: list[float] = []
    reasons: Counter[str] = Counter()
    try:
        with db.connect(url) as conn:
            enqueue_keys(conn, storage, config, items, GROUP)
            q = Queue(conn)
            while (done := _settled(q)) is None:
                t = time.monotonic()
                resp = post_json(server.url + BATCH_PATH, SECRET, config.budget_ms / 1000 + 15)
                durations.append(time.monotonic() - t)
                assert resp.status == 200 and resp.body, resp
                reasons[resp.body["stopped_reason"]] += 1
                if len(durations) > 1000:
                    raise RuntimeError("the baseline does not converge")
    finally:
        server.close()
        app.extensions["thumbq"].close()
    simulated = (len(durations) - 1) * TICK_S + durations[-1]
    return {
        "simulated_seconds_to_all_terminal": round(simulated, 1),
        "calls": len(durations),
        "call_seconds": [round(d, 2) for d in durations],
        "measured_work_seconds": round(sum(durations), 2),
        "stopped_reasons": dict(reasons),
        "final": _counts(done),
    }


def _counts(p: dict[str, Any]) -> dict[str, int]:
    return {k: p[k] for k in ("total", "completed", "failed", "unsupported", "cancelled")}


def run_scenario(
    name: str,
    batch_size: int | None,
    items: list[dict[str, Any]],
    storage_dir: Path,
    work: Path,
    args: argparse.Namespace,
    databases: list[str],
) -> dict[str, Any]:
    """Chained and one-call-per-tick on the same files, each in a fresh database."""
    storage = open_storage(Config.from_env({"THUMBQ_STORAGE_URL": storage_dir.as_uri()}))
    out: dict[str, Any] = {}
    for way, runner in (("chained", run_chained), ("one_call_per_tick", run_one_per_tick)):
        dbname = f"bench_drain_{uuid.uuid4().hex[:10]}"
        databases.append(dbname)
        config = _config(scratch_database(dbname), storage_dir, work / dbname, args)
        if batch_size:
            config = config.with_(batch_size=batch_size)
        out["config"] = {
            "budget_ms": config.budget_ms,
            "buffer_ms": config.buffer_ms,
            "concurrency": config.concurrency,
            "batch_size": config.batch_size,
            "schedule": config.schedule,
        }
        out[way] = runner(config, items, storage)
    out["speedup"] = round(
        out["one_call_per_tick"]["simulated_seconds_to_all_terminal"]
        / out["chained"]["seconds_to_all_terminal"],
        1,
    )
    print(
        f"drain: {name}: chained {out['chained']['seconds_to_all_terminal']} s in "
        f"{out['chained']['calls']} calls; one call per tick "
        f"{out['one_call_per_tick']['simulated_seconds_to_all_terminal']} s in "
        f"{out['one_call_per_tick']['calls']} calls",
        file=sys.stderr,
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--budget-ms", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=None, help="default: CPU count")
    parser.add_argument(
        "--small-batch",
        type=int,
        default=50,
        help="THUMBQ_BATCH_SIZE of the second scenario (0: skip it)",
    )
    args = parser.parse_args()

    # Other work on the machine shows up in these timings: say how busy it was.
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="thumbq-drain-"))
    databases: list[str] = []
    scenarios: dict[str, Any] = {}
    try:
        storage_dir = work / "storage"
        storage = open_storage(Config.from_env({"THUMBQ_STORAGE_URL": storage_dir.as_uri()}))
        t = time.monotonic()
        items, files = make_files(storage, args.files)
        files["generated_in_s"] = round(time.monotonic() - t, 1)
        # Warm-up, not reported: the first batch of a process pays imports and cold caches.
        run_scenario("warm-up", None, items[:40], storage_dir, work, args, databases)
        scenarios["default"] = run_scenario(
            "default", None, items, storage_dir, work, args, databases
        )
        if args.small_batch:
            # A fixed batch per call, as a straightforward design has: chaining matters more.
            name = f"batch_size_{args.small_batch}"
            scenarios[name] = run_scenario(
                name, args.small_batch, items, storage_dir, work, args, databases
            )
    finally:
        with psycopg.connect(
            make_conninfo(server_url(), dbname="postgres"), autocommit=True
        ) as admin:
            for name in databases:
                admin.execute(f'drop database if exists "{name}" with (force)')
        shutil.rmtree(work, ignore_errors=True)

    default = scenarios["default"]
    write_result(
        "drain",
        {
            "files": {"count": args.files, **files},
            "chained_seconds": default["chained"]["seconds_to_all_terminal"],
            "one_call_per_tick_seconds": default["one_call_per_tick"][
                "simulated_seconds_to_all_terminal"
            ],
            "load_average_1_5_15": {
                "before": [round(x, 2) for x in load_before],
                "after": [round(x, 2) for x in os.getloadavg()],
            },
            "target_seconds": TARGET_S,
            "meets_target": all(
                s["chained"]["seconds_to_all_terminal"] < TARGET_S for s in scenarios.values()
            ),
            "baseline_method": (
                "one real HTTP batch call per tick, each measured; the 300 s between ticks "
                "are added arithmetically (not slept): (calls - 1) * 300 s + last call"
            ),
            "scenarios": scenarios,
        },
    )


if __name__ == "__main__":
    main()
