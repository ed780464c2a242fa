"""Fault 4, storage failing: batches over S3 through a proxy that breaks ~30% of requests.

boto3 talks to moto's S3 server through `tests/support/faultproxy.py`, which answers 500/503, holds
connections past boto3's read timeout, resets connections (before and after the request was
done), cuts responses and uploads off mid-body. Transient errors are retried by boto3 first and
by thumbq's own backoff after that (fast-forwarded between runs with `pgmq.set_vt`); every file
must complete, and no reader may ever see a partial thumbnail.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections import Counter
from typing import Any

import pytest
from PIL import Image

from bench.corpus import photo_jpeg, tiny_png, vector_pdf
from tests.support.faultproxy import FaultProxy
from tests.support.pgtools import make_retries_due
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage.s3 import S3Storage
from worker.thumbnails.render.process import RenderPool

FILES = 40
SEED = 20261125
READ_TIMEOUT_S = 0.5
MAX_ATTEMPTS = 10
GROUP = "flaky-s3"


def _client(endpoint: str) -> Any:
    import boto3.session

    return boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")


def _sources(n: int) -> list[tuple[str, bytes, str]]:
    out = []
    for i in range(n):
        if i % 3 == 0:
            out.append((f"src/photo-{i}.jpg", photo_jpeg(i, (800, 600)), "image/jpeg"))
        elif i % 3 == 1:
            out.append((f"src/slide-{i}.pdf", vector_pdf(i, draws=20), "application/pdf"))
        else:
            out.append((f"src/icon-{i}.png", tiny_png(i, (640, 480)), "image/png"))
    return out


class PartialReader:
    """Polls the bucket directly (not through the proxy) during the run: every object under
    thumbnails/ must be whole (its bytes as long as its listing says) and decode."""

    def __init__(self, client: Any, bucket: str) -> None:
        self.client = client
        self.bucket = bucket
        self.reads = 0
        self.bad: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            listing = self.client.list_objects_v2(Bucket=self.bucket, Prefix="thumbnails/")
            for obj in listing.get("Contents", []):
                body = self.client.get_object(Bucket=self.bucket, Key=obj["Key"])["Body"].read()
                self.reads += 1
                problem = _whole_image_problem(body, obj["Size"])
                if problem:
                    self.bad.append(f"{obj['Key']}: {problem}")
            self.stop.wait(0.05)

    def __enter__(self) -> PartialReader:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _whole_image_problem(body: bytes, expected: int) -> str | None:
    if len(body) != expected:
        return f"{len(body)} bytes, expected {expected}"
    try:
        with Image.open(io.BytesIO(body)) as img:
            img.load()
    except Exception as exc:
        return f"does not decode: {exc}"
    return None


@pytest.mark.slow
def test_storage_faults_are_retried_and_no_partial_thumbnail_is_ever_visible(
    config: Config, conn: db.Conn, s3_storage_url: tuple[str, str]
) -> None:
    storage_url, moto_url = s3_storage_url
    bucket = storage_url.removeprefix("s3://")
    direct = _client(moto_url)
    items = []
    for key, data, ctype in _sources(FILES):
        etag = direct.put_object(Bucket=bucket, Key=key, Body=data, ContentType=ctype)["ETag"]
        items.append({"source_key": key, "etag": etag.strip('"'), "content_type": ctype})
    # Enough thumbq attempts that a seeded run of bad luck cannot dead-letter a file: what is
    # under test is that transient errors are retried, not the attempt limit.
    Queue(conn, max_attempts=MAX_ATTEMPTS).enqueue_files(items, GROUP)

    cfg = config.with_(
        budget_ms=4000,
        buffer_ms=1000,
        concurrency=2,
        storage_url=storage_url,
        max_attempts=MAX_ATTEMPTS,
    )
    runs: list[dict[str, Any]] = []
    started = time.monotonic()
    with (
        FaultProxy(moto_url, fault_rate=0.3, seed=SEED, hold_s=READ_TIMEOUT_S + 0.5) as proxy,
        PartialReader(direct, bucket) as reader,
        RenderPool(_render_options(cfg), cfg.concurrency, cfg.render_memory_mb) as pool,
    ):
        storage = S3Storage.from_url(
            storage_url,
            endpoint_url=proxy.url,
            connect_timeout=0.5,
            read_timeout=READ_TIMEOUT_S,
            # Two boto3 attempts rather than the default three, so that some errors outlast
            # boto3's retries (about 9% of calls) and thumbq's backoff is exercised too.
            max_attempts=2,
        )
        for _ in range(40):
            result = run_batch(cfg, conn, storage, pool)
            forwarded = make_retries_due(conn)
            runs.append({**result.response(), "fast_forwarded": forwarded})
            if _unfinished(conn) == 0:
                break
        faults = proxy.log.snapshot()
    elapsed = time.monotonic() - started

    statuses = _status_counts(conn)
    attempts = conn.execute(
        "select coalesce(sum(attempts), 0) as a, count(*) filter (where attempts > 1) as retried"
        " from thumbq.jobs"
    ).fetchone()
    assert attempts is not None
    figures = {
        "files": FILES,
        "runs": len(runs),
        "elapsed_s": round(elapsed, 1),
        "statuses": statuses,
        "job_attempts": int(attempts["a"]),
        "jobs_retried_by_thumbq": int(attempts["retried"]),
        "storage_errors_seen_by_thumbq": sum(r["retried"] for r in runs),
        "reader_reads": reader.reads,
        "proxy": faults,
    }
    print(json.dumps(figures))

    failed = conn.execute(
        "select source_key, error_code, last_error from thumbq.jobs where status <> 'completed'"
    ).fetchall()
    assert statuses == {"completed": FILES}, (figures, failed)
    assert not reader.bad, reader.bad[:5]
    assert reader.reads >= FILES, figures  # the reader did look while the runs went on
    # The injected share is about what was asked (seeded), and every kind occurred.
    assert 0.2 <= faults["faults_total"] / faults["requests"] <= 0.4, faults
    assert set(faults["faults"]) >= {"http_500", "http_503", "timeout", "reset", "truncated"}
    # Some failures outlasted boto3's three attempts and were retried by thumbq itself.
    assert figures["jobs_retried_by_thumbq"] >= 1, figures

    # Afterwards: every thumbnail is whole, decodes, and is exactly the job's recorded size.
    jobs = conn.execute(
        "select thumbnail_key, bytes, width, height from thumbq.jobs order by id"
    ).fetchall()
    listing = direct.list_objects_v2(Bucket=bucket, Prefix="thumbnails/")
    stored = {o["Key"]: o["Size"] for o in listing.get("Contents", [])}
    assert set(stored) == {j["thumbnail_key"] for j in jobs}
    for job in jobs:
        body = direct.get_object(Bucket=bucket, Key=job["thumbnail_key"])["Body"].read()
        assert _whole_image_problem(body, job["bytes"]) is None, job
        with Image.open(io.BytesIO(body)) as img:
            assert img.size == (job["width"], job["height"])
    assert not [k for k in _all_keys(direct, bucket) if "tmp" in k]


def _unfinished(conn: db.Conn) -> int:
    row = conn.execute(
        "select count(*) as n from thumbq.jobs where status in ('pending', 'processing')"
    ).fetchone()
    assert row is not None
    return int(row["n"])


def _status_counts(conn: db.Conn) -> dict[str, int]:
    rows = conn.execute("select status, count(*) as n from thumbq.jobs group by status").fetchall()
    return dict(Counter({r["status"]: int(r["n"]) for r in rows}))


def _all_keys(client: Any, bucket: str) -> list[str]:
    return [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def _render_options(cfg: Config) -> Any:
    from worker.thumbnails.task import render_options

    return render_options(cfg)


def test_a_download_cut_off_mid_body_is_a_storage_error_not_a_shorter_file(
    s3_storage_url: tuple[str, str],
) -> None:
    """Regression: `get(max_bytes=...)` returned the half of a body that arrived before the
    connection dropped, and the batch rendered it (a PDF repairs into a partial page) or failed
    it for good as corrupt_input."""
    from worker.storage import StorageError

    storage_url, moto_url = s3_storage_url
    bucket = storage_url.removeprefix("s3://")
    data = vector_pdf(1, draws=20)
    _client(moto_url).put_object(Bucket=bucket, Key="cut.pdf", Body=data)
    with FaultProxy(moto_url, fault_rate=1.0, kinds=["truncated"]) as proxy:
        storage = S3Storage.from_url(storage_url, endpoint_url=proxy.url, max_attempts=2)
        for max_bytes in (None, 100 * 1024 * 1024):
            with pytest.raises(StorageError, match=r"connection|IncompleteRead"):
                storage.get("cut.pdf", max_bytes=max_bytes)
        assert proxy.log.snapshot()["faults"] == {"truncated": 2}
    clean, _ = S3Storage.from_url(storage_url, endpoint_url=moto_url).get(
        "cut.pdf", max_bytes=10**8
    )
    assert clean == data
