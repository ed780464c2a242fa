"""Hostile input at scale: 1 000 files, a third from the bad-input corpus, through one worker.

A worker process (`python -m bench.harness drive`, calling `run_batch` in a loop) drains the
files with concurrency 2 while a thread samples the resident memory of it and its render
processes every 20 ms. Reports every run's duration against budget - buffer, the peak memory,
and every file whose job did not end with its expected status and error_code.

    .venv/bin/python -m bench.hostile [--files 1000] [--budget-ms 10000] [--buffer-ms 2000]
                                      [--hogs 4]

`--hogs N` adds N legal 8000x8000 RGBA PNGs (under the pixel limit, about 530 MB each to
render): two render processes may hold one each at the same time. With the default per-process
memory limit they end too_large.

The database server is BENCH_DATABASE_URL, TEST_DATABASE_URL or DATABASE_URL (else embedded).
tests/system/test_faults.py runs the same scenario (1 000 files and 4 hogs) at budget 3 s.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import uuid
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.common import scratch_database, write_result
from bench.harness import hostile_run

# What an invocation may run past budget - buffer (thread joins, last flush, finish_run).
MARGIN_MS = 600


def drop_database(url: str) -> None:
    """Drop the scratch database (its files are gone too: nothing is kept but the figures)."""
    name = conninfo_to_dict(url)["dbname"]
    with psycopg.connect(make_conninfo(url, dbname="postgres"), autocommit=True) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=1000)
    parser.add_argument("--budget-ms", type=int, default=10_000)
    parser.add_argument("--buffer-ms", type=int, default=2_000)
    parser.add_argument("--hogs", type=int, default=4)
    args = parser.parse_args()

    url = scratch_database(f"thumbq_bench_hostile_{uuid.uuid4().hex[:8]}")
    work = Path(tempfile.mkdtemp(prefix="thumbq-hostile-"))
    try:
        figures = hostile_run(
            work,
            url,
            args.files,
            budget_ms=args.budget_ms,
            buffer_ms=args.buffer_ms,
            hogs=args.hogs,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        drop_database(url)
    limit_ms = args.budget_ms - args.buffer_ms + MARGIN_MS
    durations = figures.pop("durations_ms")
    figures.update(
        {
            "limit_ms": limit_ms,
            "runs_over_limit": sum(1 for d in durations if d > limit_ms),
            "runs_over_deadline": sum(1 for d in durations if d > limit_ms - MARGIN_MS),
            "median_duration_ms": durations[len(durations) // 2],
            "memory_limit_mb": 1024,
            "ok": not figures["wrong_outcomes"]
            and all(d <= limit_ms for d in durations)
            and figures["peak_rss_tree_mb"] < 1024,
        }
    )
    write_result("hostile", figures)


if __name__ == "__main__":
    main()
