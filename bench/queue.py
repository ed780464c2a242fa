"""Engine overhead per item against raw pgmq, on the same database in the same run.

Three ways to move N messages through Postgres with nothing to do per item:
- raw pgmq: `pgmq.read(q, vt, batch)` then `pgmq.delete(q, msg_ids)` until the queue is empty;
- thumbq's queue: `thumbq.claim` (rate limit, job rows to processing with a lease) then
  `thumbq.complete` (job rows to completed, messages deleted, group counters updated);
- thumbq's whole batch (`run_batch`) with a no-op storage and renderer: claims sized by
  prediction, worker threads, buffered completions, release, the batch_runs row;
- the contract's floor: only the writes DESIGN asks of any engine that keeps its job rows, and
  nothing else: `pgmq.read` and one UPDATE of the job rows to `processing` with a lease (their
  columns back as JSON), then one UPDATE to `completed` and `pgmq.delete`, with the groups
  trigger. No priority bands, row locks, classification, buckets, ordering keys or retries, and
  no Python layer. It is not a queue anyone should run (a lease that expires is taken twice);
  it shows how close to raw pgmq any engine under that contract can get on this machine.

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
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue

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
        q.enqueue_files(items[i : i + 1000], tag)


# Bench-only functions in the scratch database, not part of thumbq.
FLOOR_SQL = """
create schema if not exists bench_floor;
create or replace function bench_floor.claim(p_qty integer, p_vt_seconds integer)
returns jsonb language plpgsql as $$
declare
  v_ids bigint[];
  v_jobs jsonb;
begin
  select array_agg((m.message->>'job_id')::bigint) into v_ids
    from pgmq.read('thumbq_jobs', p_vt_seconds, p_qty) m;
  with u as (
    update thumbq.jobs j
       set status = 'processing', attempts = j.attempts + 1, worker_id = 'floor',
           started_at = clock_timestamp(), updated_at = clock_timestamp(),
           lease_expires_at = clock_timestamp() + make_interval(secs => p_vt_seconds)
     where j.id = any(v_ids)
    returning j.id, j.msg_id, j.group_id, j.task, j.source_key, j.source_etag,
              j.source_bytes, j.content_type, j.attempts, j.max_attempts, j.payload, j.state,
              j.priority, j.ordering_key, j.sequence, j.checkpoints, j.progress_done,
              j.progress_total, j.status)
  select coalesce(jsonb_agg(u), '[]') into v_jobs from u;
  return v_jobs;
end $$;
create or replace function bench_floor.complete(p_job_ids bigint[], p_msg_ids bigint[])
returns integer language plpgsql as $$
declare
  v_msgs bigint[];
begin
  with u as (
    update thumbq.jobs j
       set status = 'completed', completed_at = clock_timestamp(),
           updated_at = clock_timestamp(), lease_expires_at = null, msg_id = null
      from unnest(p_job_ids, p_msg_ids) as r(job_id, msg_id)
     where j.id = r.job_id and j.msg_id = r.msg_id and j.status = 'processing'
    returning r.msg_id)
  select array_agg(u.msg_id) into v_msgs from u;
  perform pgmq.delete('thumbq_jobs', v_msgs);
  return coalesce(cardinality(v_msgs), 0);
end $$;
"""


def drain_floor(conn: db.Conn) -> int:
    done = 0
    while True:
        row = conn.execute("select bench_floor.claim(%s, 30) as jobs", [BATCH]).fetchone()
        jobs = row["jobs"] if row else []
        if not jobs:
            return done
        row = conn.execute(
            "select bench_floor.complete(%s, %s) as n",
            [[j["id"] for j in jobs], [j["msg_id"] for j in jobs]],
        ).fetchone()
        done += int(row["n"]) if row else 0


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
    rates: dict[str, list[float]] = {
        "raw_pgmq": [],
        "contract_floor": [],
        "thumbq_queue": [],
        "thumbq_batch": [],
    }
    drains = {
        "contract_floor": lambda conn: drain_floor(conn),
        "thumbq_queue": lambda conn: drain_queue(conn),
        "thumbq_batch": lambda conn: drain_batch(conn, config),
    }
    with db.connect(url) as conn:
        install = pgmq_install(conn)
        conn.execute(FLOOR_SQL)
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
                    n = drains[name](conn)
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
