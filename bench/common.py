"""Shared by the benchmarks: a scratch database, timing helpers, writing results."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from worker import db

RESULTS = Path(__file__).resolve().parent / "results"


def server_url() -> str:
    """BENCH_DATABASE_URL, TEST_DATABASE_URL, DATABASE_URL, else the embedded Postgres."""
    for name in ("BENCH_DATABASE_URL", "TEST_DATABASE_URL", "DATABASE_URL"):
        if os.environ.get(name):
            return os.environ[name]
    from worker.embedded import embedded_database_url

    return embedded_database_url(Path(".thumbq-bench").resolve())


def scratch_database(name: str) -> str:
    """A fresh database `name` with the thumbq schema on the bench server; returns its URL."""
    base = server_url()
    with psycopg.connect(make_conninfo(base, dbname="postgres"), autocommit=True) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')
        admin.execute(f'create database "{name}"')
    url = make_conninfo(base, dbname=name)
    with db.connect(url) as conn:
        db.init_schema(conn)
    return url


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
