"""Engine overhead per item against raw pgmq, on the same database in the same run.

Three ways to move N messages through Postgres with nothing to do per item:
- raw pgmq: `pgmq.read(q, vt, batch)` then `pgmq.delete(q, msg_ids)` until the queue is empty;
- thumbq's queue: `thumbq.claim` (rate limit, job rows to processing with a lease) then
  `thumbq.complete` (job rows to completed, messages deleted, group counters updated);
- thumbq's whole batch (`run_batch`) with a no-op storage and renderer: claims sized by
  prediction, worker threads, buffered completions, release, the batch_runs row.

Run: python -m bench.queue [--items 5000] [--rounds 3]  (as a module: run by path, this file
would shadow the standard library's queue module)
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import (
    NoopPool,
    NoopStorage,
    median,
    pgmq_install,
    scratch_database,
    write_result,
)
from worker import db
from worker.batch import run_batch
from worker.config import Config
from worker.queue import Queue

BATCH = 50


def fill_raw(conn: db.Conn, n: int) -> None:
    conn.execute("select pgmq.create('bench_raw')")
    conn.execute(
        "select pgmq.send_batch('bench_raw', array_agg(jsonb_build_object('i', i)))"
        " from generate_series(1, %s) i",
        [n],
    )


def drain_raw(conn: db.Conn) -> int:
    done = 0
    while True:
        ids = [
            r["msg_id"]
            for r in conn.execute("select msg_id from pgmq.read('bench_raw', 30, %s)", [BATCH])
        ]
        if not ids:
            return done
        conn.execute("select pgmq.delete('bench_raw', %s::bigint[])", [ids])
        done += len(ids)


def fill_thumbq(conn: db.Conn, n: int, tag: str) -> None:
    items = [{"source_key": f"{tag}/{i}.jpg", "etag": "e"} for i in range(n)]
    q = Queue(conn)
    for i in range(0, n, 1000):
        q.enqueue(items[i : i + 1000], tag)


def drain_queue(conn: db.Conn) -> int:
    q = Queue(conn, bucket=None)
    done = 0
    while True:
        jobs = q.claim("bench", BATCH, 30).jobs
        if not jobs:
            return done
        done += q.complete("bench", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs])


def drain_batch(conn: db.Conn, config: Config) -> int:
    done = 0
    while True:
        r = run_batch(config, conn, NoopStorage(), NoopPool())  # type: ignore[arg-type]
        done += r.succeeded
        if r.stopped_reason == "drained":
            return done


def measure(url: str, items: int, rounds: int) -> dict[str, Any]:
    """The three drains, round after round, on one database; rates and shares of raw pgmq."""
    config = Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_BUDGET_MS": "60000",
            "THUMBQ_BUFFER_MS": "2000",
            "THUMBQ_BATCH_SIZE": "10000",
            "THUMBQ_CONCURRENCY": "2",
        }
    )
    rates: dict[str, list[float]] = {"raw_pgmq": [], "thumbq_queue": [], "thumbq_batch": []}
    with db.connect(url) as conn:
        install = pgmq_install(conn)
        conn.execute("update thumbq.rate_limits set capacity = 1e9, tokens = 1e9")
        for r in range(rounds):
            for name in rates:
                if name == "raw_pgmq":
                    conn.execute(
                        "select pgmq.drop_queue('bench_raw')"
                        " where exists (select 1 from pgmq.list_queues()"
                        " where queue_name = 'bench_raw')"
                    )
                    fill_raw(conn, items)
                    t = time.perf_counter()
                    n = drain_raw(conn)
                else:
                    fill_thumbq(conn, items, f"{name}-{r}")
                    # Steady state: autovacuum has analyzed a table this size within a minute.
                    conn.execute("analyze thumbq.jobs")
                    t = time.perf_counter()
                    n = drain_queue(conn) if name == "thumbq_queue" else drain_batch(conn, config)
                assert n == items, (name, n)
                rates[name].append(n / (time.perf_counter() - t))
    raw = median(rates["raw_pgmq"])
    return {
        "pgmq": install,
        "items_per_s_median": {k: round(median(v), 1) for k, v in rates.items()},
        "items_per_s_all": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "share_of_raw": {k: round(median(v) / raw, 3) for k, v in rates.items()},
        "us_per_item_median": {k: round(1e6 / median(v), 1) for k, v in rates.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # Both ways thumbq meets pgmq: the package's SQL (the embedded default) and, where the
    # server offers it, the extension (Supabase's), whose read and delete are cheaper.
    runs = {
        "sql": measure(scratch_database("thumbq_bench_queue_sql", "sql"), args.items, args.rounds)
    }
    ext = scratch_database("thumbq_bench_queue")
    with db.connect(ext) as conn:
        has_extension = pgmq_install(conn).startswith("extension")
    if has_extension:
        runs["extension"] = measure(ext, args.items, args.rounds)
    result: dict[str, Any] = {
        "items": args.items,
        "claim_batch": BATCH,
        "rounds": args.rounds,
        "runs": runs,
        "target": "thumbq >= 0.5 of raw pgmq's rate",
    }
    write_result("queue", result)


if __name__ == "__main__":
    main()
