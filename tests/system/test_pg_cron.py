"""The schedule that works on every Supabase plan: pg_cron calls thumbq.call_api, which posts to
the batch endpoint with pg_net, URL and secret read from Vault (sql/007_cron.sql).

pg_cron is Debian's (postgresql-15-cron); pg_net and pgmq are built from the sources Supabase
ships (.ci/extensions). Both need `shared_preload_libraries`, so the tests run a throw-away
Postgres 15 cluster of their own. Vault is not packaged anywhere outside Supabase: a table and a
`vault.decrypted_secrets` view with Vault's columns stand in for it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.httpstub import HttpStub
from tests.support.liveapp import call, put_samples, wait_listening, wait_until
from tests.support.pgbouncer import free_port
from tests.support.pgtools import (
    PG15_BIN,
    require,
    require_pgmq_extension,
    supabase_push,
    supabase_roles,
    vendor_dir,
)
from worker.engine import db
from worker.engine.config import Config
from worker.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "supabase" / "migrations"
CRON_SQL = ROOT / "sql" / "007_cron.sql"
LIB = PG15_BIN.parent / "lib"

VAULT_STANDIN = """
create schema vault;
create table vault.store (name text primary key, secret text not null);
create view vault.decrypted_secrets as select name, secret as decrypted_secret from vault.store;
"""


def _as_postgres(cmd: str) -> None:
    subprocess.run(["su", "postgres", "-s", "/bin/bash", "-c", cmd], check=True, timeout=60)


@pytest.fixture(scope="module")
def cron_cluster_url() -> Iterator[str]:
    """A throw-away Postgres 15 cluster with pg_cron and pg_net preloaded, the Supabase roles,
    the Vault stand-in and thumbq's migrations pushed (pgmq from the extension, as on
    Supabase); stopped and removed after the module."""
    require((LIB / "pg_cron.so").exists(), "pg_cron is not installed (postgresql-15-cron)")
    if not (LIB / "pg_net.so").exists():
        tarballs = sorted(vendor_dir().glob("pg_net-*.tar.gz"))
        require(bool(tarballs), f"{vendor_dir()}/pg_net-*.tar.gz (the vendored source) is missing")
        require(False, "pg_net is not installed: run .ci/extensions as root")
    require(os.geteuid() == 0, "starting a cluster as user postgres needs root")
    pw = pwd.getpwnam("postgres")
    base = Path(tempfile.mkdtemp(prefix="thumbq-cron-"))
    os.chown(base, pw.pw_uid, pw.pw_gid)
    data, port = base / "data", free_port()
    _as_postgres(f"{PG15_BIN}/initdb -D {data} -U postgres --auth=trust -E UTF8 >/dev/null")
    with (data / "postgresql.conf").open("a") as f:
        f.write(
            "shared_preload_libraries = 'pg_cron,pg_net'\n"
            "cron.database_name = 'postgres'\n"
            # Jobs run in background workers: no connection back over TCP needed.
            "cron.use_background_workers = on\n"
            "max_worker_processes = 16\n"
            f"port = {port}\nlisten_addresses = ''\nunix_socket_directories = '{base}'\n"
        )
    _as_postgres(f"{PG15_BIN}/pg_ctl -D {data} -l {base}/log -w start >/dev/null")
    url = f"host={base} port={port} dbname=postgres user=postgres"
    try:
        with db.connect(url) as conn:
            require_pgmq_extension(conn, "1.5.1")
            conn.execute(VAULT_STANDIN.encode())
            supabase_roles(conn)
            supabase_push(
                conn,
                {p.name: p.read_text(encoding="utf-8") for p in sorted(MIGRATIONS.glob("*.sql"))},
            )
        yield url
    finally:
        _as_postgres(f"{PG15_BIN}/pg_ctl -D {data} -m immediate -w stop >/dev/null")
        shutil.rmtree(base, ignore_errors=True)


def _cron_jobs(conn: db.Conn) -> list[tuple[str, str, str]]:
    rows = conn.execute("select jobname, schedule, command from cron.job order by jobname")
    return [(r["jobname"], r["schedule"], r["command"]) for r in rows]


EXPECTED_JOBS = [
    ("thumbq-batch", "*/5 * * * *", "select thumbq.call_api('/api/thumbnails/batch-generate')"),
    ("thumbq-cleanup-stale", "*/15 * * * *", "select thumbq.reap_stale()"),
]


def _secrets(conn: db.Conn, **secrets: str) -> None:
    conn.execute("delete from vault.store")
    for name, value in secrets.items():
        conn.execute("insert into vault.store values (%s, %s)", [name, value])


def test_the_migrations_schedule_batch_and_cleanup_once_with_the_real_extensions(
    cron_cluster_url: str,
) -> None:
    with db.connect(cron_cluster_url) as conn:
        exts = conn.execute(
            "select extname, extversion from pg_extension"
            " where extname in ('pg_cron', 'pg_net', 'pgmq') order by 1"
        ).fetchall()
        assert [e["extname"] for e in exts] == ["pg_cron", "pg_net", "pgmq"]
        assert _cron_jobs(conn) == EXPECTED_JOBS
        # Re-running replaces by name: still exactly two jobs.
        conn.execute(CRON_SQL.read_bytes())
        assert db.init_schema(conn)["applied"] == []
        assert _cron_jobs(conn) == EXPECTED_JOBS
        assert conn.execute(EXPECTED_JOBS[1][2]).fetchone() == {"reap_stale": 0}
        _secrets(conn)
        with pytest.raises(Exception, match="Vault secret thumbq_api_url is missing"):
            conn.execute(EXPECTED_JOBS[0][2])
        _secrets(conn, thumbq_api_url="http://127.0.0.1:9/")
        with pytest.raises(Exception, match="Vault secret thumbq_cron_secret is missing"):
            conn.execute(EXPECTED_JOBS[0][2])
        may_call = conn.execute(
            "select has_function_privilege(r, 'thumbq.call_api(text, integer)', 'execute') as ok"
            " from unnest(array['anon', 'authenticated', 'service_role']) r"
        ).fetchall()
    assert not any(r["ok"] for r in may_call), "API roles must not trigger batches or read secrets"


def test_set_schedule_false_unschedules_thumbqs_cron_jobs_and_true_brings_them_back(
    cron_cluster_url: str,
) -> None:
    """Supabase with Vercel Cron or Netlify: one documented call turns pg_cron's schedule off
    (docs/deploy.md), it stays off when the schema files run again, and one call turns it on."""
    with db.connect(cron_cluster_url) as conn:
        conn.execute("select cron.schedule('someone-elses', '0 3 * * *', 'select 1')")
        try:
            off = conn.execute("select thumbq.set_schedule(false) as r").fetchone()
            assert off == {"r": {"enabled": False, "jobs": []}}
            assert [j[0] for j in _cron_jobs(conn)] == ["someone-elses"]
            # An upgrade that applies 007 again (and every file after it) keeps it off.
            conn.execute("update thumbq.schema_migrations set checksum = 'x'")
            assert "007_cron" in db.init_schema(conn)["applied"]
            assert [j[0] for j in _cron_jobs(conn)] == ["someone-elses"]
            on = conn.execute("select thumbq.set_schedule(true) as r").fetchone()
            assert on == {"r": {"enabled": True, "jobs": [n for n, _, _ in EXPECTED_JOBS]}}
            assert [j for j in _cron_jobs(conn) if j[0] != "someone-elses"] == EXPECTED_JOBS
            may_call = conn.execute(
                "select has_function_privilege(r, 'thumbq.set_schedule(boolean)', 'execute') as ok"
                " from unnest(array['anon', 'authenticated']) r"
            ).fetchall()
        finally:
            conn.execute("select cron.unschedule('someone-elses')")
            conn.execute("select thumbq.set_schedule(true)")
    assert not any(r["ok"] for r in may_call), "API roles must not change the schedule"


def test_call_api_posts_with_pg_net_to_the_vault_url_with_the_bearer_secret(
    cron_cluster_url: str,
) -> None:
    recorder = HttpStub(lambda _: (200, {"Content-Type": "application/json"}, b'{"ok": true}'))
    try:
        with db.connect(cron_cluster_url) as conn:
            _secrets(conn, thumbq_api_url=recorder.url + "/", thumbq_cron_secret="s3cret-value")
            row = conn.execute("select thumbq.call_api('/api/thumbnails/cleanup-stale') as id")
            request_id = row.fetchone()["id"]  # type: ignore[index]
            # pg_net sends after the commit, from its background worker.
            response = wait_until(
                lambda: conn.execute(
                    "select status_code, content from net._http_response where id = %s",
                    [request_id],
                ).fetchone(),
                30,
            )
    finally:
        recorder.close()
    assert response == {"status_code": 200, "content": '{"ok": true}'}
    [req] = recorder.requests
    assert (req.method, req.path) == ("POST", "/api/thumbnails/cleanup-stale")
    assert req.headers["Authorization"] == "Bearer s3cret-value"
    assert req.headers["Content-Type"] == "application/json"
    assert json.loads(req.body) == {}


def _serve(tmp_path: Path, url: str, secret: str) -> tuple[subprocess.Popen[str], str, Config]:
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "THUMBQ_HOME": str(tmp_path / "home"),
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_CRON_SECRET": secret,
        "THUMBQ_BUDGET_MS": "6000",
        "THUMBQ_BUFFER_MS": "1000",
        "THUMBQ_CONCURRENCY": "2",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_listening(proc, port)
    return proc, f"http://127.0.0.1:{port}", Config.from_env(env)


@pytest.mark.slow
def test_pg_cron_fires_pg_net_posts_to_thumbq_serve_and_the_group_completes(
    cron_cluster_url: str, tmp_path: Path
) -> None:
    secret = "cron-secret-for-the-schedule-test-0123"
    proc, api, config = _serve(tmp_path, cron_cluster_url, secret)
    try:
        items = put_samples(open_storage(config), "cron/", good=3)
        status, body, _ = call("POST", api + "/api/thumbnails/enqueue", secret, {"items": items})
        assert status == 202, body
        with db.connect(cron_cluster_url) as conn:
            # Vault holds where the API is and its secret, as `vault.create_secret` would.
            _secrets(conn, thumbq_api_url=api, thumbq_cron_secret=secret)
            # The migration's schedule, made every minute (pg_cron 1.4's finest: its seconds
            # schedules came in 1.5), so the test waits at most a minute for it to fire.
            conn.execute(
                "select cron.alter_job(jobid, schedule => '* * * * *') from cron.job"
                " where jobname = 'thumbq-batch'"
            )
            started = time.monotonic()

            def completed() -> Any:
                row = conn.execute(
                    "select completed, pending, processing from thumbq.groups"
                    " where group_id = 'default'"
                ).fetchone()
                return row if row and row["completed"] == 3 else None

            assert wait_until(completed, 150, 0.5) == {
                "completed": 3,
                "pending": 0,
                "processing": 0,
            }
            waited = time.monotonic() - started
            # pg_cron's worker records the run's end after the run itself, which under load can
            # come after the batch that pg_net's call started has completed the group.
            run = wait_until(
                lambda: conn.execute(
                    "select d.status, d.return_message from cron.job_run_details d"
                    " join cron.job j using (jobid) where j.jobname = 'thumbq-batch'"
                    " and d.status in ('succeeded', 'failed') order by d.runid limit 1"
                ).fetchone(),
                30,
                0.2,
            )
            # The batch's answer, as pg_net received it (the earlier test's call is there too);
            # pg_net stores it once the whole answer is in, just after the jobs completed.
            response = wait_until(
                lambda: conn.execute(
                    "select status_code, content::jsonb as body from net._http_response"
                    " where content like '%%run_id%%' order by id limit 1"
                ).fetchone(),
                30,
                0.2,
            )
            runs = conn.execute("select processed from thumbq.batch_runs order by id").fetchall()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    print(json.dumps({"cron_fired_and_group_completed_after_s": round(waited, 1)}))
    assert run is not None and run["status"] == "succeeded", run
    assert response is not None and response["status_code"] == 200, response
    assert response["body"]["succeeded"] == 3
    assert runs and runs[0]["processed"] == 3
    assert "Traceback" not in err


def test_cron_migration_on_plain_postgres_does_nothing_and_says_so(conn: db.Conn) -> None:
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute(CRON_SQL.read_bytes())
    row = conn.execute(
        "select to_regprocedure('thumbq.call_api(text, integer)') is null as no_function,"
        " to_regnamespace('cron') is null as no_cron"
    ).fetchone()
    assert row == {"no_function": True, "no_cron": True}
    assert any("pg_cron is not available" in n for n in notices), notices


def test_set_schedule_on_plain_postgres_records_off_and_refuses_on_naming_pg_cron(
    conn: db.Conn,
) -> None:
    assert conn.execute("select thumbq.set_schedule(false) as r").fetchone() == {
        "r": {"enabled": False, "jobs": []}
    }
    with pytest.raises(Exception, match="pg_cron is not installed"):
        conn.execute("select thumbq.set_schedule(true)")
