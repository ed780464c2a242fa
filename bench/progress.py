"""Progress endpoint latency with 100 000 jobs in one group, against the naive way, same run.

Server-side latency is measured around Flask's test client (the whole WSGI app: routing, auth,
the pooled connection, the query, JSON; no sockets). The naive way is a Flask route in this file
that selects every job of the group and counts in Python, as a straightforward implementation
does, on the same app and pool. The progress and access caches are off for these, so every
request reads the database. Also measured: the 304 answer, the user-JWT path (RLS), one
connection per request instead of the pool, client-observed latency through waitress on loopback
with a keep-alive connection, and the same requests with the default caches on (most polls then
come from memory).

    .venv/bin/python -m bench.progress [--jobs 100000] [--requests 1000] [--naive-requests 50]

The database server is BENCH_DATABASE_URL, TEST_DATABASE_URL or DATABASE_URL (else embedded).
"""

from __future__ import annotations

import argparse
import http.client
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import psycopg
from flask import Flask, Response
from psycopg.conninfo import make_conninfo

from api import create_app
from api.errors import json_response
from bench.common import median, p99, scratch_database, server_url, write_result
from worker.engine import db
from worker.engine.config import Config

SECRET = "bench-admin-secret"
JWT_SECRET = "bench-jwt-secret-" + "x" * 32
GROUP = "bench-100k"
ADMIN = {"Authorization": f"Bearer {SECRET}"}


def fill(url: str, jobs: int) -> None:
    """`jobs` jobs in GROUP (a realistic mix of statuses) plus 20 000 in 200 other groups, each
    set inserted by one statement so that the group triggers run once."""
    with db.connect(url) as conn:
        for group, n, key in ((GROUP, jobs, "'b/'"), (None, 20_000, "'o/'")):
            group_sql = "%(g)s" if group else "'other-' || (i %% 200)"
            conn.execute(
                f"""
                insert into thumbq.jobs (group_id, source_key, source_etag, status, attempts,
                                         completed_at, error_code)
                select {group_sql}, {key} || i || '.pdf', 'e' || i,
                       s.status,
                       case when s.status = 'pending' then 0 else 1 end,
                       case when s.status in ('completed', 'failed') then now() end,
                       case when s.status = 'failed' then 'corrupt_input' end
                  from generate_series(1, %(n)s) i
                  cross join lateral (select case
                      when i %% 100 < 60 then 'completed'
                      when i %% 100 < 63 then 'failed'
                      when i %% 100 < 65 then 'processing'
                      else 'pending' end as status) s
                """,
                {"g": group, "n": n},
            )
        conn.execute("insert into thumbq.group_members values (%s, 'alice')", [GROUP])
        conn.execute("analyze thumbq.jobs")
        conn.execute("analyze thumbq.groups")


def add_naive_route(app: Flask) -> None:
    """The straightforward way: every job of the group, counted in Python."""

    def naive() -> Response:
        from flask import request

        group_id = request.args["group_id"]
        st = app.extensions["thumbq"]
        with st.connection() as conn:
            rows = conn.execute(
                "select status, updated_at from thumbq.jobs where group_id = %s", [group_id]
            ).fetchall()
        counts = Counter(r["status"] for r in rows)
        total = len(rows)
        done = total - counts["pending"] - counts["processing"]
        return json_response(
            {
                "group_id": group_id,
                "total": total,
                **{s: counts[s] for s in ("pending", "processing", "completed", "failed")},
                "progress_percentage": round(100 * done / total, 1) if total else 0,
                "updated_at": max((r["updated_at"] for r in rows), default=None),
            }
        )

    app.add_url_rule("/bench/naive-progress", "naive_progress", naive)


def measure(fn: Callable[[], Any], n: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def measure_interleaved(
    fns: list[Callable[[], Any]], n: int, warmup: int = 20
) -> list[list[float]]:
    """Like measure, for several calls taken in turn, so that they see the same conditions."""
    out: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + n):
        for fn, xs in zip(fns, out, strict=True):
            t = time.perf_counter()
            fn()
            if i >= warmup:
                xs.append((time.perf_counter() - t) * 1000)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "median_ms": round(median(xs), 3), "p99_ms": round(p99(xs), 3)}


def get(client: Any, path: str, headers: dict[str, str], status: int) -> Callable[[], None]:
    def call() -> None:
        resp = client.get(path, headers=headers)
        assert resp.status_code == status, (resp.status_code, resp.get_data()[:200])

    return call


def over_waitress(app: Flask, path: str, headers: dict[str, str], n: int) -> dict[str, float]:
    """Client-observed latency through waitress on loopback, one keep-alive connection."""
    from waitress.server import create_server

    server: Any = create_server(app, host="127.0.0.1", port=0, threads=4)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            server.asyncore.loop(timeout=0.05, map=server._map, count=1)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    conn = http.client.HTTPConnection("127.0.0.1", int(server.effective_port), timeout=10)

    def call() -> None:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200, resp.status

    try:
        return summary(measure(call, n))
    finally:
        conn.close()
        stop.set()
        thread.join(5)
        server.task_dispatcher.shutdown()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--naive-requests", type=int, default=50)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    name = f"thumbq_bench_progress_{uuid.uuid4().hex[:8]}"
    url = scratch_database(name)
    try:
        t = time.perf_counter()
        fill(url, args.jobs)
        fill_s = time.perf_counter() - t
        config = Config.from_env(
            {
                "THUMBQ_HOME": str(Path(".thumbq-bench").resolve()),
                "DATABASE_URL": url,
                "THUMBQ_CRON_SECRET": SECRET,
                "THUMBQ_JWT_SECRET": JWT_SECRET,
                # Every request reads the database: this measures the query, not the caches.
                "THUMBQ_PROGRESS_CACHE_MS": "0",
                "THUMBQ_ACCESS_CACHE_MS": "0",
            }
        )
        app = create_app(config)
        add_naive_route(app)
        client = app.test_client()
        path = f"/api/thumbnails/progress?group_id={GROUP}"
        first = client.get(path, headers=ADMIN)
        body, etag = first.get_json(), first.headers["ETag"]
        assert body["total"] == args.jobs, body
        token = jwt.encode(
            {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 3600},
            JWT_SECRET,
            algorithm="HS256",
        )
        user = {"Authorization": f"Bearer {token}"}

        n = args.requests
        progress, not_modified, as_user = measure_interleaved(
            [
                get(client, path, ADMIN, 200),
                get(client, path, {**ADMIN, "If-None-Match": etag}, 304),
                get(client, path, user, 200),
            ],
            n,
        )
        naive = measure(
            get(client, f"/bench/naive-progress?group_id={GROUP}", ADMIN, 200),
            args.naive_requests,
            warmup=3,
        )
        # With the default caches, as deployed: polls within the interval come from memory.
        cached_app = create_app(config.with_(progress_cache_ms=500, access_cache_ms=30_000))
        cached = cached_app.test_client()
        cached_200, cached_304, cached_user = measure_interleaved(
            [
                get(cached, path, ADMIN, 200),
                get(cached, path, {**ADMIN, "If-None-Match": etag}, 304),
                get(cached, path, user, 200),
            ],
            n,
        )
        cached_app.extensions["thumbq"].close()
        per_request_app = create_app(config, pooled=False)
        per_request = measure(get(per_request_app.test_client(), path, ADMIN, 200), n // 5)
        loopback = over_waitress(app, path, ADMIN, n)
        app.extensions["thumbq"].close()

        result = {
            "method": "server-side latency around Flask's test client (full WSGI app, pooled "
            "connection, no sockets); 200, 304 and JWT requests taken in turn; naive = a route "
            "that selects every job of the group and counts in Python, same app, same pool, "
            "same run",
            "jobs_in_group": args.jobs,
            "jobs_in_other_groups": 20_000,
            "fill_seconds": round(fill_s, 2),
            "progress_200": summary(progress),
            "progress_304": summary(not_modified),
            "progress_200_user_jwt_rls": summary(as_user),
            "naive_select_all_and_count": summary(naive),
            "speedup_median": round(median(naive) / median(progress), 1),
            "progress_200_connection_per_request": summary(per_request),
            "cached_default_200": summary(cached_200),
            "cached_default_304": summary(cached_304),
            "cached_default_200_user_jwt": summary(cached_user),
            "progress_200_waitress_loopback_client_observed": loopback,
            "targets": {
                "median_le_5ms": median(progress) <= 5,
                "speedup_ge_20x": median(naive) / median(progress) >= 20,
                "not_modified_cheaper": median(not_modified) < median(progress),
            },
            "sample_body": body,
        }
        # Other work on the machine inflates every figure: say how busy it was.
        result["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        write_result("progress", result)
    finally:
        with psycopg.connect(make_conninfo(server_url(), dbname="postgres"), autocommit=True) as a:
            a.execute(f'drop database if exists "{name}" with (force)')


if __name__ == "__main__":
    main()
