"""Everything works through a transaction-mode pooler (Supavisor's mode), proved with pgbouncer.

In transaction mode each transaction may run on a different server connection, so prepared
statements, session settings and LISTEN do not survive between statements. Debian's pgbouncer
1.18 has no prepared-statement support in that mode, so anything that relied on it fails here.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jwt
import psycopg
import pytest

from tests.support import pgbouncer
from tests.support.liveapp import put_samples
from tests.support.pgtools import require
from worker.engine import db, ratelimit
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.task import render_options

SECRET = "pgbouncer-test-secret-0123456789"
JWT_SECRET = "pgbouncer-test-jwt-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def bouncer(pg_server_url: str) -> Iterator[str]:
    reason = pgbouncer.unusable(pg_server_url)
    require(reason is None, str(reason))
    with pgbouncer.pgbouncer(pg_server_url) as url:
        yield url


def _token(sub: str) -> str:
    claims = {"sub": sub, "aud": "authenticated", "role": "authenticated", "exp": time.time() + 600}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


def test_this_pgbouncer_really_is_in_transaction_mode(bouncer: str, db_url: str) -> None:
    """The control: prepared statements, which a session-mode pooler would keep, break here."""
    assert pgbouncer.pool_mode(bouncer) == "transaction"
    url = pgbouncer.via(bouncer, db_url)
    a = psycopg.connect(url, autocommit=True, prepare_threshold=0)
    b = psycopg.connect(url, autocommit=True, prepare_threshold=0)
    try:
        with pytest.raises(
            (psycopg.errors.DuplicatePreparedStatement, psycopg.errors.InvalidSqlStatementName)
        ):
            for i in range(10):
                a.execute("select %s::int", [i]).fetchone()
                b.execute("select %s::int + 1", [i]).fetchone()
    finally:
        a.close()
        b.close()


def test_enqueue_batch_retry_and_progress_work_through_pgbouncer(
    bouncer: str, db_url: str, tmp_path: Path
) -> None:
    url = pgbouncer.via(bouncer, db_url)
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_JWT_SECRET": JWT_SECRET,
            "THUMBQ_BUDGET_MS": "5000",
            "THUMBQ_BUFFER_MS": "500",
            # Small runs: many claims, completions and run records, each a pooled transaction.
            "THUMBQ_BATCH_SIZE": "3",
        }
    )
    storage = open_storage(config)
    items = put_samples(storage, "pgb/", good=8, broken=2)
    from worker.thumbnails.render.process import RenderPool

    with db.connect(url) as conn:
        result = enqueue_keys(conn, storage, config, items, "pgb")
        assert result["enqueued"] == 10
        conn.execute("insert into thumbq.group_members values ('pgb', 'alice')")
        q = Queue(conn)
        with RenderPool(
            render_options(config), config.concurrency, config.render_memory_mb
        ) as pool:
            runs = []
            for _ in range(10):
                runs.append(run_batch(config, conn, storage, pool))
                p = q.progress("pgb")
                assert p is not None
                if p["pending"] + p["processing"] == 0:
                    break
        assert len(runs) >= 4 and all(r.stopped_reason != "time_budget" for r in runs)
        final = q.progress("pgb")
        assert final is not None and (final["completed"], final["failed"]) == (8, 2)

    from api import create_app

    app = create_app(config)
    try:
        client = app.test_client()
        admin = {"Authorization": f"Bearer {SECRET}"}
        path = "/api/thumbnails/progress?group_id=pgb"
        # Many requests on the app's pool: any prepared statement would have broken by now.
        for _ in range(12):
            r = client.get(path, headers=admin)
            assert r.status_code == 200, r.get_json()
        assert r.get_json()["failed"] == 2
        assert (
            client.get(path, headers={**admin, "If-None-Match": r.headers["ETag"]}).status_code
            == 304
        )

        # The JWT path: role and claims are set per transaction, so RLS decides per request and
        # nothing carries over to the next transaction on the same server connection.
        alice = {"Authorization": f"Bearer {_token('alice')}"}
        mallory = {"Authorization": f"Bearer {_token('mallory')}"}
        errors: list[str] = []

        def hammer(headers: dict[str, str], want: int) -> None:
            for _ in range(15):
                got = client.get(path, headers=headers).status_code
                if got != want:
                    errors.append(f"wanted {want}, got {got}")

        threads = [
            threading.Thread(target=hammer, args=(h, want))
            for h, want in ((alice, 200), (mallory, 404), (admin, 200), (mallory, 404))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        r = client.get("/api/thumbnails/failures?group_id=pgb", headers=alice)
        assert r.status_code == 200
        assert {f["error_code"] for f in r.get_json()["failures"]} == {"corrupt_input"}
        assert (
            client.get("/api/thumbnails/failures?group_id=pgb", headers=mallory).status_code == 404
        )

        r = client.post(
            "/api/thumbnails/retry-failed", headers=admin, data=json.dumps({"group_id": "pgb"})
        )
        assert r.status_code == 200 and r.get_json() == {"requeued": 2}
        body = client.get(path, headers=alice).get_json()
        assert (body["pending"], body["failed"], body["completed"]) == (2, 0, 8)
    finally:
        app.extensions["thumbq"].close()


def test_a_bounded_call_is_cut_through_pgbouncer_and_leaves_no_setting_behind(
    bouncer: str, db_url: str
) -> None:
    """The deadline's statement_timeout/lock_timeout travel with each call (set_config(...,
    true) in the call's own message), so a transaction-mode pooler neither refuses them nor
    hands them on to the next client of the same server connection."""
    url = pgbouncer.via(bouncer, db_url)
    with db.connect(url) as a, db.connect(url) as b, db.connect(db_url) as holder:
        with holder.transaction():
            holder.execute(
                "select * from thumbq.rate_limits where name = 'thumbnail_generation' for update"
            )
            started = time.monotonic()
            with pytest.raises(db.DeadlineExceeded):
                ratelimit.take(a, "thumbnail_generation", 1, bound=db.Bound(300))
            waited = time.monotonic() - started
        assert 0.25 <= waited <= 1.5, waited
        seen = set()
        for _ in range(20):
            db.run(a, "ping", bound=db.Bound(1234))
            row = b.execute(
                "select current_setting('statement_timeout') as st,"
                " current_setting('lock_timeout') as lt"
            ).fetchone()
            assert row is not None
            seen.add((row["st"], row["lt"]))
        assert seen == {("0", "0")}, seen
