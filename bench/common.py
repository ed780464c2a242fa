"""Shared by the benchmarks: a scratch database, timing helpers, writing results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from worker.engine import db
from worker.storage import ObjectInfo
from worker.thumbnails.render import Thumbnail

RESULTS = Path(__file__).resolve().parent / "results"


def server_url() -> str:
    """BENCH_DATABASE_URL, TEST_DATABASE_URL, DATABASE_URL, else the embedded Postgres."""
    for name in ("BENCH_DATABASE_URL", "TEST_DATABASE_URL", "DATABASE_URL"):
        if os.environ.get(name):
            return os.environ[name]
    from worker.local.embedded import embedded_database_url

    return embedded_database_url(Path(".thumbq-bench").resolve())


def scratch_database(name: str, pgmq: str = "default") -> str:
    """A fresh database `name` with the thumbq schema on the bench server; returns its URL.

    `pgmq`: "default" takes what `thumbq db init` takes (the extension where the server offers
    it), "sql" the `pgmq` package's SQL (what the embedded default runs on)."""
    base = server_url()
    with psycopg.connect(make_conninfo(base, dbname="postgres"), autocommit=True) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')
        admin.execute(f'create database "{name}"')
    url = make_conninfo(base, dbname=name)
    with db.connect(url) as conn:
        if pgmq == "sql":
            from pgmq.install import get_embedded_install_sql, install_pgmq_sql

            with conn.transaction():
                install_pgmq_sql(get_embedded_install_sql(), conn=conn)  # type: ignore[arg-type]
        db.init_schema(conn)
    return url


def pgmq_install(conn: db.Conn) -> str:
    """Which pgmq a database has: "extension <version>" or "sql (the pgmq package)"."""
    row = conn.execute("select extversion from pg_extension where extname = 'pgmq'").fetchone()
    return f"extension {row['extversion']}" if row else "sql (the pgmq package)"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.99 * len(xs)) - 1)]


def timed_ms(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return (time.perf_counter() - t) * 1000, out


def write_result(name: str, result: dict[str, Any]) -> None:
    """Print the result as JSON and keep it in bench/results/<name>.json."""
    result = {
        "bench": name,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **result,
    }
    RESULTS.mkdir(exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    (RESULTS / f"{name}.json").write_text(text + "\n")
    print(text)


class NoopStorage:
    """Storage that holds nothing and costs nothing: isolates the engine's own overhead."""

    url = "noop://"
    may_stall = False  # nothing to bound: the batch calls it directly (worker.storage)

    def head(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, "e", 1)

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        return b"x", ObjectInfo(key, "e", 1)

    def put(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        return ObjectInfo(key, "t", len(data))

    def exists(self, key: str) -> bool:
        return False

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return iter(())


class NoopPool:
    """A renderer that does nothing, or only waits `sleep_ms` (an I/O-bound handler: no CPU)."""

    def __init__(self, sleep_ms: float = 0.0) -> None:
        self.sleep_s = sleep_ms / 1000

    def render(
        self,
        data: bytes,
        declared_type: str | None,
        *,
        timeout_s: float,
        degrade_after_s: float | None = None,
    ) -> Thumbnail:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return Thumbnail(b"t", "image/webp", 1, 1, "image/jpeg")

    def close(self) -> None:
        pass
