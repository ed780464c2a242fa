"""The batch end to end: real Postgres, real storage (a folder and moto's S3 over HTTP), real
renderer processes, the bad-input corpus."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.corpus import CORPUS
from worker.engine import db
from worker.engine.batch import BatchResult, run_batch
from worker.engine.budget import size_class
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import Storage, open_storage
from worker.thumbnails.files import backfill, enqueue_keys
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.task import thumbnail_key

# Every test on the pgmq package's SQL and on the pgmq extension 1.4.4 and 1.5.1 (conftest).
pytestmark = pytest.mark.pgmq_versions

# What an invocation may run past budget - buffer: thread joins, the last flush, finish_run.
MARGIN_MS = 600


@pytest.fixture
def pool(config: Config) -> Iterator[RenderPool]:
    from worker.thumbnails.task import render_options

    with RenderPool(render_options(config), config.concurrency, config.render_memory_mb) as p:
        yield p


def drain(
    config: Config,
    conn: db.Conn,
    storage: Storage,
    pool: RenderPool,
    group: str,
    max_runs: int = 12,
) -> list[BatchResult]:
    """Run invocations until the group has nothing pending or processing."""
    runs = []
    q = Queue(conn)
    for _ in range(max_runs):
        runs.append(run_batch(config, conn, storage, pool))
        p = q.progress(group)
        assert p is not None
        if p["pending"] + p["processing"] == 0:
            return runs
    raise AssertionError(f"group {group} not drained after {max_runs} runs: {q.progress(group)}")


def jobs_by_key(conn: db.Conn) -> dict[str, dict]:
    return {r["source_key"]: r for r in conn.execute("select * from thumbq.jobs")}


def test_every_bad_input_ends_right_and_no_run_overruns(
    config: Config, conn: db.Conn, pool: RenderPool
) -> None:
    storage = open_storage(config)
    samples = {n: s for n, s in CORPUS.items() if n != "slow_pdf"}
    for name, sample in samples.items():
        storage.put(f"corpus/{name}", sample.data, sample.declared_type or "")
    items = [
        {"source_key": f"corpus/{n}", "content_type": s.declared_type} for n, s in samples.items()
    ]
    items.append({"source_key": "corpus/was-deleted.pdf"})
    enqueue_keys(conn, storage, config, items, "corpus")

    runs = drain(config, conn, storage, pool, "corpus")

    for r in runs:
        assert r.duration_ms <= config.deadline_ms + MARGIN_MS, r
    jobs = jobs_by_key(conn)
    for name, sample in samples.items():
        job = jobs[f"corpus/{name}"]
        assert (job["status"], job["error_code"]) == (sample.status, sample.error_code), name
        if sample.status == "completed":
            assert job["thumbnail_key"] == thumbnail_key(
                f"corpus/{name}", job["source_etag"], 512, "webp"
            )
            data, _ = storage.get(job["thumbnail_key"])
            assert data[:4] == b"RIFF" and data[8:12] == b"WEBP", name
            assert max(job["width"], job["height"]) <= 512
        else:
            assert job["last_error"], name  # a sentence for a person
    missing = jobs["corpus/was-deleted.pdf"]
    assert (missing["status"], missing["error_code"]) == ("cancelled", "source_missing")
    p = Queue(conn).progress("corpus")
    assert p["pending"] == p["processing"] == 0
    assert float(p["progress_percentage"]) == 100.0


def test_a_slow_item_cannot_make_the_invocation_overrun(tmp_path: Path, db_url: str) -> None:
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "s").as_uri(),
            "THUMBQ_BUDGET_MS": "4000",
            "THUMBQ_BUFFER_MS": "1000",
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_MAX_ATTEMPTS": "1",
        }
    )
    storage = open_storage(config)
    storage.put("slow.pdf", CORPUS["slow_pdf"].data, "application/pdf")
    storage.put("quick.jpg", CORPUS["small_jpeg"].data, "image/jpeg")
    with db.connect(db_url) as conn:
        enqueue_keys(
            conn, storage, config, [{"source_key": "slow.pdf"}, {"source_key": "quick.jpg"}], "g"
        )
        started = time.monotonic()
        result = run_batch(config, conn, storage)
        wall_ms = (time.monotonic() - started) * 1000
        jobs = jobs_by_key(conn)
    assert result.duration_ms <= 3000 + MARGIN_MS
    assert wall_ms <= 3000 + MARGIN_MS + 1500  # + starting and stopping the render processes
    assert jobs["quick.jpg"]["status"] == "completed"  # the other job was not harmed
    slow = jobs["slow.pdf"]
    assert (slow["status"], slow["error_code"]) == ("failed", "render_timeout")
    assert "render" in slow["last_error"]


def test_running_again_does_no_work_twice(config: Config, conn: db.Conn, pool: RenderPool) -> None:
    storage = open_storage(config)
    storage.put("a.jpg", CORPUS["small_jpeg"].data, "image/jpeg")
    enqueue_keys(conn, storage, config, [{"source_key": "a.jpg"}], "g")
    first = run_batch(config, conn, storage, pool)
    assert (first.succeeded, first.stopped_reason) == (1, "drained")
    again = enqueue_keys(conn, storage, config, [{"source_key": "a.jpg"}], "g")
    assert again["enqueued"] == 0 and again["existing"] == 1
    second = run_batch(config, conn, storage, pool)
    assert (second.processed, second.stopped_reason) == (0, "drained")


def test_a_changed_object_is_rendered_in_its_new_version(
    config: Config, conn: db.Conn, pool: RenderPool
) -> None:
    storage = open_storage(config)
    storage.put("a.jpg", CORPUS["small_jpeg"].data, "image/jpeg")
    enqueue_keys(conn, storage, config, [{"source_key": "a.jpg"}], "g")
    time.sleep(0.01)
    storage.put("a.jpg", CORPUS["small_png"].data, "image/png")  # replaced after enqueue
    drain(config, conn, storage, pool, "g")
    rows = conn.execute(
        "select source_etag, status, error_code from thumbq.jobs order by id"
    ).fetchall()
    current = storage.head("a.jpg").etag
    assert [(r["status"], r["error_code"]) for r in rows] == [
        ("cancelled", "superseded"),
        ("completed", None),
    ]
    assert rows[1]["source_etag"] == current


def test_backfill_enqueues_only_files_lacking_a_thumbnail(
    config: Config, conn: db.Conn, pool: RenderPool
) -> None:
    storage = open_storage(config)
    for i in range(3):
        storage.put(f"uploads/{i}.jpg", CORPUS["small_jpeg"].data, "image/jpeg")
    assert backfill(conn, storage, config, "uploads/", "bf")["enqueued"] == 3
    drain(config, conn, storage, pool, "bf")
    storage.put("uploads/new.png", CORPUS["small_png"].data, "image/png")
    result = backfill(conn, storage, config, "uploads/", "bf2")
    assert (result["listed"], result["have_thumbnail"], result["enqueued"]) == (4, 3, 1)


def test_claimed_work_that_does_not_fit_is_released_at_once(tmp_path: Path, db_url: str) -> None:
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "s").as_uri(),
            "THUMBQ_BUDGET_MS": "2500",
            "THUMBQ_BUFFER_MS": "500",
            "THUMBQ_CONCURRENCY": "2",
        }
    )
    n = 300  # far more than 2 s of slides on 2 cores
    storage = open_storage(config)
    for i in range(n):
        storage.put(f"p/{i}.pdf", CORPUS["slide_pdf"].data, "application/pdf")
    from worker.thumbnails.task import render_options

    with (
        db.connect(db_url) as conn,
        RenderPool(render_options(config), 2, config.render_memory_mb) as pool,
    ):
        enqueue_keys(conn, storage, config, [{"source_key": f"p/{i}.pdf"} for i in range(n)], "g")
        result = run_batch(config, conn, storage, pool)
        p = Queue(conn).progress("g")
    assert result.stopped_reason == "time_budget"
    assert result.duration_ms <= 2000 + MARGIN_MS
    assert 0 < result.succeeded < n
    assert p["processing"] == 0  # nothing is left leased after the run
    assert p["completed"] == result.succeeded
    assert p["pending"] == n - result.succeeded == result.remaining


def test_a_batch_over_s3_through_http(
    tmp_path: Path, db_url: str, s3_storage_url: tuple[str, str]
) -> None:
    url, endpoint = s3_storage_url
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": url,
            "THUMBQ_S3_ENDPOINT_URL": endpoint,
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_THUMB_FORMAT": "jpeg",
        }
    )
    storage = open_storage(config)
    storage.put("in/slide.pdf", CORPUS["slide_pdf"].data, "application/pdf")
    storage.put("in/photo.jpg", CORPUS["exif_rotated_jpeg"].data, "image/jpeg")
    with db.connect(db_url) as conn:
        assert backfill(conn, storage, config, "in/", "s3")["enqueued"] == 2
        result = run_batch(config, conn, storage)
        jobs = jobs_by_key(conn)
    assert result.succeeded == 2
    for key in ("in/slide.pdf", "in/photo.jpg"):
        info = storage.head(jobs[key]["thumbnail_key"])
        assert info.content_type == "image/jpeg" and info.size == jobs[key]["bytes"]


def test_demo_runs_end_to_end_on_the_embedded_default(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "THUMBQ_STORAGE_URL", "TEST_DATABASE_URL")
    }
    env["THUMBQ_HOME"] = str(tmp_path / "home")
    _run_demo(tmp_path, env)


def _run_demo(tmp_path: Path, env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "demo"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "100.0% done" in out
    counts = dict(
        line.split()
        for line in out.splitlines()
        if line.split()[:1]
        and line.split()[0] in ("completed", "failed", "unsupported")
        and len(line.split()) == 2
    )
    assert counts == {"completed": "9", "failed": "1", "unsupported": "1"}
    thumbs = list((tmp_path / "home" / "storage" / "thumbnails").rglob("*.webp"))
    assert len(thumbs) == 9
    # The next command finds the demo's database (the demo stopped the server; status starts
    # it again, and stops it too).
    assert "stopped the embedded Postgres" in proc.stderr
    status = subprocess.run(
        [sys.executable, "-m", "worker.cli", "status"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0 and "demo-" in status.stdout
    assert "stopped the embedded Postgres" in status.stderr


def test_an_item_predicted_longer_than_any_window_still_gets_its_attempts(
    tmp_path: Path, db_url: str
) -> None:
    # Regression: history saying "PDFs of this size take 60 s" kept such a job from ever
    # starting (it never fit), so it stayed pending for ever instead of ending.
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "s").as_uri(),
            "THUMBQ_BUDGET_MS": "3000",
            "THUMBQ_BUFFER_MS": "1000",
            "THUMBQ_CONCURRENCY": "1",
            "THUMBQ_MAX_ATTEMPTS": "1",
        }
    )
    storage = open_storage(config)
    storage.put("slow.pdf", CORPUS["slow_pdf"].data, "application/pdf")
    size = storage.head("slow.pdf").size
    with db.connect(db_url) as conn:
        conn.execute(
            "insert into thumbq.render_stats (kind, size_class, samples, ewma_ms, max_ms)"
            " values ('pdf', %s, 100, 60000, 60000)",
            [size_class(size)],
        )
        enqueue_keys(conn, storage, config, [{"source_key": "slow.pdf"}], "g")
        result = run_batch(config, conn, storage)
        job = conn.execute("select status, error_code from thumbq.jobs").fetchone()
        stats = conn.execute("select ewma_ms from thumbq.render_stats").fetchone()
    assert result.duration_ms <= 2000 + MARGIN_MS
    assert (job["status"], job["error_code"]) == ("failed", "render_timeout")
    assert stats["ewma_ms"] == 60000  # the killed render taught the predictor nothing
