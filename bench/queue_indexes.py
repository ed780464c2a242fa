"""What each index of thumbq.jobs costs a transition, and which the live functions' plans read.

1. Costs: on one scratch database, for each index of thumbq.jobs (the primary key aside), the
   same drain as bench/queue.py's `thumbq_queue` (`claim` + `complete`, batch 50, 5 000 no-op
   jobs) with that index dropped, against the drain with every index; the variants interleave
   round after round and each starts from an empty table (TRUNCATE). Reported per variant: the
   wall time and the server backend's CPU time (from /proc, so that other load on the machine
   counts less) per job, the difference to the full set, and how many of the job rows' updates
   were HOT (pg_stat_user_tables).
2. Plans: the statements `enqueue_batch`, `claim`, `complete_jobs`, `progress_v2` run inside
   their plpgsql bodies (auto_explain with nested statements), and the indexes of thumbq.jobs
   those plans read.

3. Variants (`--compare a.sql,b.sql`): the drain on a database per SQL file applied after the
   schema (bench/queue_variants/: a fillfactor, an index set, the group trigger off), beside
   the schema as it is, interleaved round after round.

Run: python -m bench.queue_indexes [--items 5000] [--rounds 5] [--only NAME,NAME]
     python -m bench.queue_indexes --plans-only [--apply variant.sql]
     python -m bench.queue_indexes --compare bench/queue_variants/<name>.sql,... [--rounds 5]
Results: bench/results/queue_indexes.json, queue_plans.json, queue_compare.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.common import median, scratch_database, write_result
from bench.queue import BATCH, backend_cpu_s, drain_queue, fill_thumbq
from worker.engine import db
from worker.engine.queue import Queue


def indexes(conn: db.Conn) -> dict[str, str]:
    return {
        r["indexname"]: r["indexdef"]
        for r in conn.execute(
            "select indexname, indexdef from pg_indexes"
            " where schemaname = 'thumbq' and tablename = 'jobs' order by indexname"
        )
    }


def one_drain(conn: db.Conn, items: int, tag: str, drop: str | None = None) -> dict[str, float]:
    """Fill, drop the index `drop` (after the fill: enqueue names the unique constraint), drain;
    the time and CPU per job and the share of HOT updates."""
    conn.execute("truncate thumbq.jobs, thumbq.groups")
    fill_thumbq(conn, items, tag)
    if drop == "jobs_source_version_key":
        # A constraint's index goes with its constraint.
        conn.execute("alter table thumbq.jobs drop constraint jobs_source_version_key")
    elif drop:
        conn.execute(f"drop index thumbq.{drop}")
    conn.execute("analyze thumbq.jobs")
    conn.execute("select pg_stat_reset_single_table_counters('thumbq.jobs'::regclass)")
    pid = conn.info.backend_pid
    cpu0 = backend_cpu_s(pid)
    t = time.perf_counter()
    n = drain_queue(conn)
    wall = time.perf_counter() - t
    cpu1 = backend_cpu_s(pid)
    assert n == items, (tag, n)
    # The statistics collector sees the counts at the end of each transaction, a moment later.
    time.sleep(0.6)
    conn.execute("select pg_stat_clear_snapshot()")
    row = conn.execute(
        "select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables"
        " where schemaname = 'thumbq' and relname = 'jobs'"
    ).fetchone()
    assert row is not None
    return {
        "wall_us": wall / n * 1e6,
        "server_cpu_us": ((cpu1 - cpu0) / n * 1e6) if cpu0 is not None and cpu1 else float("nan"),
        "hot_share": (row["n_tup_hot_upd"] / row["n_tup_upd"]) if row["n_tup_upd"] else 0.0,
    }


def costs(url: str, items: int, rounds: int, only: list[str] | None) -> dict[str, Any]:
    with db.connect(url) as conn:
        conn.execute("update thumbq.rate_limits set capacity = 1e9, tokens = 1e9")
        defs = indexes(conn)
        names = [n for n in defs if n != "jobs_pkey" and (not only or n in only)]
        samples: dict[str, list[dict[str, float]]] = {"(all)": [], **{n: [] for n in names}}
        for r in range(rounds):
            for variant in samples:
                drop = None if variant == "(all)" else variant
                try:
                    samples[variant].append(one_drain(conn, items, f"{variant}-{r}", drop))
                finally:
                    if variant != "(all)":
                        conn.execute("truncate thumbq.jobs, thumbq.groups")
                        if variant == "jobs_source_version_key":
                            conn.execute(
                                "alter table thumbq.jobs add constraint jobs_source_version_key"
                                " unique (source_key, source_etag)"
                            )
                        else:
                            conn.execute(defs[variant])
    out: dict[str, Any] = {}
    base = {k: median([s[k] for s in samples["(all)"]]) for k in ("wall_us", "server_cpu_us")}
    for variant, ss in samples.items():
        m = {k: median([s[k] for s in ss]) for k in ("wall_us", "server_cpu_us", "hot_share")}
        out[variant] = {
            "definition": defs.get(variant, "every index"),
            "wall_us_per_job": round(m["wall_us"], 1),
            "server_cpu_us_per_job": round(m["server_cpu_us"], 1),
            # What the index costs a job's two transitions: the drain with it minus without.
            "cost_wall_us": round(base["wall_us"] - m["wall_us"], 1),
            "cost_server_cpu_us": round(base["server_cpu_us"] - m["server_cpu_us"], 1),
            "hot_share": round(m["hot_share"], 3),
        }
    return out


def compare(files: list[str], items: int, rounds: int) -> dict[str, Any]:
    """The drain on a database with the schema as it is, and on one per SQL file applied after
    it (an index set, a fillfactor), interleaved round after round."""
    urls = {"(schema)": scratch_database("thumbq_bench_queue_cmp0")}
    for i, f in enumerate(files, 1):
        urls[f] = scratch_database(f"thumbq_bench_queue_cmp{i}")
        with db.connect(urls[f]) as conn:
            conn.execute(Path(f).read_text().encode())
    conns = {k: db.connect(u) for k, u in urls.items()}
    try:
        for conn in conns.values():
            conn.execute("update thumbq.rate_limits set capacity = 1e9, tokens = 1e9")
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in conns}
        for r in range(rounds):
            for k, conn in conns.items():
                samples[k].append(one_drain(conn, items, f"cmp-{r}"))
    finally:
        for conn in conns.values():
            conn.close()
    out: dict[str, Any] = {}
    for k, ss in samples.items():
        m = {x: median([s[x] for s in ss]) for x in ("wall_us", "server_cpu_us", "hot_share")}
        out[k] = {
            "wall_us_per_job": round(m["wall_us"], 1),
            "server_cpu_us_per_job": round(m["server_cpu_us"], 1),
            "hot_share": round(m["hot_share"], 3),
            "wall_us_all": [round(s["wall_us"], 1) for s in ss],
            "server_cpu_us_all": [round(s["server_cpu_us"], 1) for s in ss],
        }
    return out


def _plans(conn: db.Conn, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    notices: list[str] = []

    def notice(diag: Any) -> None:
        notices.append(diag.message_primary or "")

    conn.add_notice_handler(notice)
    try:
        with conn.transaction():
            for setting in (
                "load 'auto_explain'",
                "set local auto_explain.log_min_duration = 0",
                "set local auto_explain.log_nested_statements = on",
                "set local auto_explain.log_format = json",
                "set local client_min_messages = log",
            ):
                conn.execute(setting)
            conn.execute(sql, params)
    finally:
        conn.remove_notice_handler(notice)
    return [json.loads(n[n.index("{") :]) for n in notices if "{" in n]


def _index_reads(plan: dict[str, Any]) -> set[str]:
    found = set()
    if plan.get("Relation Name") == "jobs" and plan.get("Index Name"):
        found.add(str(plan["Index Name"]))
    for child in plan.get("Plans", []):
        found |= _index_reads(child)
    return found


def plans(url: str) -> dict[str, list[str]]:
    """The indexes of thumbq.jobs each live function's statements read, with 20 000 jobs in
    the table: 10 000 completed, 50 running (10 of them past their lease), the rest waiting;
    analyzed."""
    with db.connect(url) as conn:
        conn.execute("truncate thumbq.jobs, thumbq.groups")
        conn.execute("select pgmq.purge_queue('thumbq_jobs')")
        q = Queue(conn, bucket=None)
        fill_thumbq(conn, 20000, "plans")
        done = q.claim("w", 10000, 60).jobs
        q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in done])
        q.claim("w", 50, 60)
        conn.execute(
            "update thumbq.jobs set lease_expires_at = now() - interval '1 minute'"
            " where id in (select id from thumbq.jobs where status = 'processing' limit 10)"
        )
        conn.execute("analyze thumbq.jobs")
        running = conn.execute(
            "select id, msg_id from thumbq.jobs where status = 'processing'"
            " and lease_expires_at > now() limit %s",
            [BATCH],
        ).fetchall()
        results = json.dumps([{"job_id": r["id"], "msg_id": r["msg_id"]} for r in running])
        calls = {
            "enqueue_batch": (
                "select * from thumbq.enqueue_batch(%s::jsonb, 'g', 3)",
                [json.dumps([{"source_key": "plans/new.jpg", "etag": "e"}])],
            ),
            "claim": ("select thumbq.claim('w', %s, 60, null, 60)", [BATCH]),
            "complete_jobs": (
                "select * from thumbq.complete_jobs('w', %s::jsonb, true)",
                [results],
            ),
            "progress_v2": ("select * from thumbq.progress_v2('plans')", []),
            "reap_stale": ("select thumbq.reap_stale(5000)", []),
            "metrics": ("select * from thumbq.metrics", []),
            "operator_overview": ("select thumbq.operator_overview(50)", []),
            "cancel": ("select thumbq.cancel('nope')", []),
        }
        out = {}
        for name, (sql, params) in calls.items():
            got = _plans(conn, sql, params)
            out[name] = sorted(set().union(*(_index_reads(p["Plan"]) for p in got)))
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", help="comma-separated index names (default: every one)")
    ap.add_argument("--database", default="thumbq_bench_queue_indexes")
    ap.add_argument("--plans-only", action="store_true")
    ap.add_argument(
        "--compare", help="comma-separated SQL files: the drain with each applied, side by side"
    )
    ap.add_argument("--apply", help="a SQL file applied after the schema (a variant to compare)")
    args = ap.parse_args()
    if args.compare:
        files = args.compare.split(",")
        compared = compare(files, args.items, args.rounds)
        write_result(
            "queue_compare", {"items": args.items, "rounds": args.rounds, "compare": compared}
        )
        return
    url = scratch_database(args.database)
    with db.connect(url) as conn:
        if args.apply:
            conn.execute(Path(args.apply).read_text().encode())
        full = indexes(conn)
    if args.plans_only:
        write_result("queue_plans", {"applied": args.apply, "plans_read": plans(url)})
        return
    result = {
        "items": args.items,
        "claim_batch": BATCH,
        "rounds": args.rounds,
        "indexes": full,
        "costs": costs(url, args.items, args.rounds, args.only.split(",") if args.only else None),
        "plans_read": plans(url),
    }
    write_result("queue_indexes", result)


if __name__ == "__main__":
    main()
