"""Engine overhead per item against raw pgmq and PgQueuer, on one database server in one run.

Six ways to move N jobs through Postgres with nothing to do per item, one consumer each:
- PgQueuer (asyncpg, uvloop), the baseline of a Postgres job queue in Python: its own database,
  `run(batch_size=50, mode=drain)` with a no-op entrypoint, timed from its first dequeue to the
  end of the drain (it deletes each job row at the end and appends to its log);
- raw pgmq: `pgmq.read(q, vt, batch)` then `pgmq.delete(q, msg_ids)` until the queue is empty;
- thumbq's queue: `thumbq.claim` (rate limit, job rows to processing with a lease) then
  `thumbq.complete` (job rows to completed, messages deleted, group counters updated);
- thumbq's whole batch (`run_batch`) of jobs of a no-op task (bench/noop_tasks.py's
  `bench_noop_thread`, run in the batch's threads as PgQueuer runs its no-op entrypoint):
  claims sized by prediction, worker threads, buffered completions, release, the batch_runs
  row; and (`thumbq_batch_thumbnail`) the same for thumbnail jobs with a no-op storage and
  renderer, the thumbnail pipeline's Python on top (three storage calls, each bounded);
- the contract's floor: only the writes DESIGN asks of any engine that keeps its job rows, and
  nothing else: `pgmq.read` and one UPDATE of the job rows to `processing` with a lease (their
  columns back as JSON), then one UPDATE to `completed` and `pgmq.delete`, with the groups
  trigger. No priority bands, row locks, classification, buckets, ordering keys or retries, and
  no Python layer. It is not a queue anyone should run (a lease that expires is taken twice);
  it shows how close to raw pgmq any engine under that contract can get on this machine.

Each round runs the six drains one after another, so that the server's load is alike for
all of them; the result is each one's median over the rounds and its ratio to PgQueuer's and
to raw pgmq's medians, and the CPU each spent per job: the consumer's process and its server
backend (read from /proc where the server runs on this machine), steadier than the wall clock
when other work shares the machine. PgQueuer runs only where it is installed (the `test`
extra; `--no-pgqueuer` leaves it out).

Run: python -m bench.queue [--items 5000] [--rounds 5]  (as a module: run by path, this file
would shadow the standard library's queue module)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.common import (
    NoopPool,
    NoopStorage,
    median,
    pgmq_install,
    scratch_database,
    server_url,
    write_result,
)
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue

BATCH = 50
_TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a server backend on this machine (from /proc), or None
    where the server runs elsewhere. Other load on the machine stretches a drain's wall time
    far more than the CPU its backend spends."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


class Cpu:
    """CPU seconds spent by this process and by one server backend between start and stop."""

    def __init__(self, backend_pid: int) -> None:
        self.pid = backend_pid
        self.client = time.process_time()
        self.server = backend_cpu_s(backend_pid)

    def per_item_us(self, n: int) -> tuple[float, float | None]:
        client = (time.process_time() - self.client) / n * 1e6
        end = backend_cpu_s(self.pid)
        server = None if end is None or self.server is None else (end - self.server) / n * 1e6
        return client, server


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


def fill_tasks(conn: db.Conn, n: int, tag: str) -> None:
    """`n` jobs of the no-op task that runs in the batch's own threads."""
    q = Queue(conn)
    for i in range(0, n, 1000):
        q.enqueue_jobs([{"task": "bench_noop_thread"}] * min(1000, n - i), tag)


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


def pgqueuer_database(name: str) -> dict[str, Any] | None:
    """A fresh database `name` with PgQueuer's schema; asyncpg's connect arguments for it, or
    None where PgQueuer or asyncpg is not installed."""
    try:
        import asyncpg  # noqa: F401
        import pgqueuer  # noqa: F401
    except ImportError:
        return None
    base = server_url()
    with db.connect(make_conninfo(base, dbname="postgres")) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')
        admin.execute(f'create database "{name}"')
    parts = conninfo_to_dict(make_conninfo(base, dbname=name))
    kwargs: dict[str, Any] = {
        k: parts[k] for k in ("host", "user", "password", "database") if parts.get(k)
    }
    kwargs["database"] = name
    if parts.get("port"):
        kwargs["port"] = int(str(parts["port"]))
    asyncio.run(_pgqueuer_install(kwargs))
    return kwargs


async def _pgqueuer_install(kwargs: dict[str, Any]) -> None:
    import asyncpg
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(**kwargs)
    try:
        await Queries.from_asyncpg_connection(conn).install()
    finally:
        await conn.close()


async def _pgqueuer_drain(kwargs: dict[str, Any], items: int) -> tuple[float, Cpu]:
    """Fill PgQueuer's queue with `items` no-op jobs, drain it with one consumer (batch 50);
    returns jobs per second from its first dequeue to the end of the drain, and the CPU."""
    import asyncpg
    from pgqueuer import PgQueuer
    from pgqueuer.queries import Queries
    from pgqueuer.types import QueueExecutionMode

    conn = await asyncpg.connect(**kwargs)
    try:
        queries = Queries.from_asyncpg_connection(conn)
        await queries.clear_queue()
        await queries.clear_queue_log()
        await queries.clear_statistics_log()
        await queries.enqueue(["noop"] * items, [None] * items, [0] * items)
        await conn.execute("analyze")
        pgq = PgQueuer.from_asyncpg_connection(conn)
        done = 0

        @pgq.entrypoint("noop")
        async def noop(job: Any) -> None:
            nonlocal done
            done += 1

        first: list[tuple[float, Cpu]] = []
        dequeue = pgq.qm.queries.dequeue
        pid = conn.get_server_pid()

        async def timed_dequeue(*args: Any, **kwargs: Any) -> Any:
            if not first:
                first.append((time.perf_counter(), Cpu(pid)))
            return await dequeue(*args, **kwargs)

        pgq.qm.queries.dequeue = timed_dequeue  # type: ignore[method-assign]
        await pgq.run(batch_size=BATCH, mode=QueueExecutionMode.drain)
        elapsed = time.perf_counter() - first[0][0]
        assert done == items, ("pgqueuer", done)
        return items / elapsed, first[0][1]
    finally:
        await conn.close()


def drain_pgqueuer(kwargs: dict[str, Any], items: int) -> tuple[float, Cpu]:
    """One PgQueuer round on its own event loop (uvloop where installed, as PgQueuer's CLI)."""
    try:
        import uvloop

        return uvloop.run(_pgqueuer_drain(kwargs, items))
    except ImportError:
        return asyncio.run(_pgqueuer_drain(kwargs, items))


def measure(url: str, items: int, rounds: int, pgq: dict[str, Any] | None = None) -> dict[str, Any]:
    """The drains, round after round (PgQueuer on its own database, the others on `url`);
    rates, and shares of PgQueuer's and of raw pgmq's."""
    config = Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_BUDGET_MS": "60000",
            "THUMBQ_BUFFER_MS": "2000",
            "THUMBQ_BATCH_SIZE": "10000",
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_TASKS": "bench.noop_tasks",
        }
    )
    rates: dict[str, list[float]] = {
        "pgqueuer": [],
        "raw_pgmq": [],
        "contract_floor": [],
        "thumbq_queue": [],
        "thumbq_batch": [],
        "thumbq_batch_thumbnail": [],
    }
    if pgq is None:
        del rates["pgqueuer"]
    client_us: dict[str, list[float]] = {k: [] for k in rates}
    server_us: dict[str, list[float]] = {k: [] for k in rates}
    drains = {
        "contract_floor": lambda conn: drain_floor(conn),
        "thumbq_queue": lambda conn: drain_queue(conn),
        "thumbq_batch": lambda conn: drain_batch(conn, config),
        "thumbq_batch_thumbnail": lambda conn: drain_batch(conn, config),
    }
    with db.connect(url) as conn:
        install = pgmq_install(conn)
        conn.execute(FLOOR_SQL)
        conn.execute("update thumbq.rate_limits set capacity = 1e9, tokens = 1e9")
        for r in range(rounds):
            for name in rates:
                if name == "pgqueuer":
                    assert pgq is not None
                    rate, cpu = drain_pgqueuer(pgq, items)
                    rates[name].append(rate)
                    client, server = cpu.per_item_us(items)
                    client_us[name].append(client)
                    if server is not None:
                        server_us[name].append(server)
                    continue
                if name == "raw_pgmq":
                    conn.execute(
                        "select pgmq.drop_queue('bench_raw')"
                        " where exists (select 1 from pgmq.list_queues()"
                        " where queue_name = 'bench_raw')"
                    )
                    fill_raw(conn, items)
                    cpu = Cpu(conn.info.backend_pid)
                    t = time.perf_counter()
                    n = drain_raw(conn)
                else:
                    fill = fill_tasks if name == "thumbq_batch" else fill_thumbq
                    fill(conn, items, f"{name}-{r}")
                    # Steady state: autovacuum has analyzed a table this size within a minute.
                    conn.execute("analyze thumbq.jobs")
                    cpu = Cpu(conn.info.backend_pid)
                    t = time.perf_counter()
                    n = drains[name](conn)
                assert n == items, (name, n)
                rates[name].append(n / (time.perf_counter() - t))
                client, server = cpu.per_item_us(n)
                client_us[name].append(client)
                if server is not None:
                    server_us[name].append(server)
        hot = conn.execute(
            "select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables"
            " where schemaname = 'thumbq' and relname = 'jobs'"
        ).fetchone()
    med = {k: median(v) for k, v in rates.items()}
    out: dict[str, Any] = {
        "pgmq": install,
        "items_per_s_median": {k: round(v, 1) for k, v in med.items()},
        "items_per_s_all": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "share_of_raw": {k: round(v / med["raw_pgmq"], 3) for k, v in med.items()},
        "us_per_item_median": {k: round(1e6 / v, 1) for k, v in med.items()},
        # CPU per job, median: the consumer's process and its server backend (the batch's
        # worker threads share one connection, so one backend). Less noisy than the wall time
        # when other work shares the machine.
        "client_cpu_us_per_item": {k: round(median(v), 1) for k, v in client_us.items() if v},
        "server_cpu_us_per_item": {k: round(median(v), 1) for k, v in server_us.items() if v},
        "jobs_updates": hot,
    }
    if "pgqueuer" in med:
        out["x_pgqueuer"] = {k: round(v / med["pgqueuer"], 3) for k, v in med.items()}
    return out


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-pgqueuer", action="store_true", help="leave PgQueuer out")
    args = ap.parse_args()
    pgq = None if args.no_pgqueuer else pgqueuer_database("thumbq_bench_pgqueuer")
    # Both ways thumbq meets pgmq: the package's SQL (the embedded default) and, where the
    # server offers it, the extension (Supabase's), whose read and delete are cheaper.
    runs = {
        "sql": measure(
            scratch_database("thumbq_bench_queue_sql", "sql"), args.items, args.rounds, pgq
        )
    }
    ext = scratch_database("thumbq_bench_queue")
    with db.connect(ext) as conn:
        has_extension = pgmq_install(conn).startswith("extension")
    if has_extension:
        runs["extension"] = measure(ext, args.items, args.rounds, pgq)
    result: dict[str, Any] = {
        "items": args.items,
        "claim_batch": BATCH,
        "rounds": args.rounds,
        "runs": runs,
        "pgqueuer": _version("pgqueuer") if pgq else None,
        "targets": "thumbq_batch >= 1.0x PgQueuer; thumbq_queue >= 0.45 of raw pgmq",
    }
    write_result("queue", result)


if __name__ == "__main__":
    main()
