"""Supabase integration: the pg_cron schedule, Realtime broadcasts, and the Netlify/Vercel
deploy files, tested as far as a machine without Supabase allows. The migrations themselves are
tested in test_migrations.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pgtools import PG15_BIN, PGMQ_SQL, install_pgmq, supabase_push, supabase_roles
from worker import db
from worker.config import Config
from worker.migrations import PGMQ_EXTENSION

ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS = ROOT / "supabase" / "migrations"


def _apply_migrations(conn: db.Conn) -> None:
    """`supabase db push` of supabase/migrations/, on the pgmq the database has."""
    install_pgmq(conn, PGMQ_SQL)
    supabase_push(
        conn,
        {
            p.name: p.read_text(encoding="utf-8").replace(PGMQ_EXTENSION, "")
            for p in sorted(MIGRATIONS.glob("*.sql"))
        },
    )


# -- 2. pg_cron schedule ----------------------------------------------------------------------

PG_CRON_SO = PG15_BIN.parent / "lib" / "pg_cron.so"
CRON_SQL = ROOT / "sql" / "007_cron.sql"
CRON_MIGRATION = MIGRATIONS / "20260101000007_thumbq_007_cron.sql"

# pg_net and Vault are not packaged for Debian: these stand-ins have the real signatures (pg_net
# 0.x `net.http_post`, Vault's `decrypted_secrets` view) and record what they are given.
NET_AND_VAULT_STANDINS = """
create schema net;
create table net.calls (id bigserial primary key, url text, body jsonb, params jsonb,
                        headers jsonb, timeout_milliseconds integer);
create function net.http_post(url text, body jsonb default '{}'::jsonb,
                              params jsonb default '{}'::jsonb,
                              headers jsonb default '{"Content-Type": "application/json"}'::jsonb,
                              timeout_milliseconds integer default 5000)
returns bigint language sql as $$
  insert into net.calls (url, body, params, headers, timeout_milliseconds)
  values (url, body, params, headers, timeout_milliseconds) returning id
$$;
create schema vault;
create table vault.store (name text primary key, secret text not null);
create view vault.decrypted_secrets as select name, secret as decrypted_secret from vault.store;
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres(cmd: str) -> None:
    subprocess.run(["su", "postgres", "-s", "/bin/bash", "-c", cmd], check=True, timeout=60)


@pytest.fixture(scope="module")
def cron_cluster_url() -> Iterator[str]:
    """A throw-away Postgres 15 cluster with pg_cron preloaded, stopped and removed after."""
    import os
    import pwd
    import tempfile

    if not PG_CRON_SO.exists() or not (PG15_BIN / "initdb").exists():
        pytest.skip("postgresql-15-cron is not installed")
    if os.geteuid() != 0:
        pytest.skip("starting a cluster as user postgres needs root")
    pw = pwd.getpwnam("postgres")
    base = Path(tempfile.mkdtemp(prefix="thumbq-cron-"))
    os.chown(base, pw.pw_uid, pw.pw_gid)
    data, port = base / "data", _free_port()
    _as_postgres(f"{PG15_BIN}/initdb -D {data} -U postgres --auth=trust -E UTF8 >/dev/null")
    with (data / "postgresql.conf").open("a") as f:
        f.write(
            "shared_preload_libraries = 'pg_cron'\n"
            "cron.database_name = 'postgres'\n"
            f"port = {port}\nlisten_addresses = ''\nunix_socket_directories = '{base}'\n"
        )
    _as_postgres(f"{PG15_BIN}/pg_ctl -D {data} -l {base}/log -w start >/dev/null")
    try:
        yield f"host={base} port={port} dbname=postgres user=postgres"
    finally:
        _as_postgres(f"{PG15_BIN}/pg_ctl -D {data} -m immediate -w stop >/dev/null")
        shutil.rmtree(base, ignore_errors=True)


def _cron_jobs(conn: db.Conn) -> list[tuple[str, str, str]]:
    rows = conn.execute("select jobname, schedule, command from cron.job order by jobname")
    return [(r["jobname"], r["schedule"], r["command"]) for r in rows]


def test_cron_migration_schedules_batch_and_cleanup_once_even_when_reapplied(
    cron_cluster_url: str,
) -> None:
    expected = [
        ("thumbq-batch", "*/5 * * * *", "select thumbq.call_api('/api/thumbnails/batch-generate')"),
        ("thumbq-cleanup-stale", "*/15 * * * *", "select thumbq.reap_stale()"),
    ]
    with db.connect(cron_cluster_url) as conn:
        conn.execute(NET_AND_VAULT_STANDINS.encode())
        supabase_roles(conn)
        _apply_migrations(conn)
        assert _cron_jobs(conn) == expected
        # Re-running replaces by name: still exactly two jobs.
        conn.execute(CRON_MIGRATION.read_bytes())
        conn.execute(CRON_SQL.read_bytes())
        assert db.init_schema(conn)["applied"] == []
        assert _cron_jobs(conn) == expected
        # The scheduled commands run as written (pg_cron would run the very same text).
        batch_cmd, cleanup_cmd = expected[0][2], expected[1][2]
        assert conn.execute(cleanup_cmd).fetchone() == {"reap_stale": 0}
        with pytest.raises(Exception, match="Vault secret thumbq_api_url is missing"):
            conn.execute(batch_cmd)
        conn.execute("insert into vault.store values ('thumbq_api_url', 'https://api.test/')")
        with pytest.raises(Exception, match="Vault secret thumbq_cron_secret is missing"):
            conn.execute(batch_cmd)


def test_call_api_posts_to_the_vault_url_with_the_bearer_secret(cron_cluster_url: str) -> None:
    with db.connect(cron_cluster_url) as conn:
        if conn.execute("select to_regclass('net.calls') is null as fresh").fetchone()["fresh"]:
            pytest.skip("needs the schedule test's database")
        conn.execute("truncate net.calls; delete from vault.store")
        conn.execute(
            "insert into vault.store values ('thumbq_api_url', 'https://api.test/'),"
            " ('thumbq_cron_secret', 's3cret-value')"
        )
        request_id = conn.execute(
            "select thumbq.call_api('/api/thumbnails/batch-generate') as id"
        ).fetchone()
        call = conn.execute("select * from net.calls").fetchall()
        may_call = conn.execute(
            "select has_function_privilege(r, 'thumbq.call_api(text, integer)', 'execute') as ok"
            " from unnest(array['anon', 'authenticated', 'service_role']) r"
        ).fetchall()
    assert request_id == {"id": call[0]["id"]}
    assert len(call) == 1
    assert call[0]["url"] == "https://api.test/api/thumbnails/batch-generate"
    assert call[0]["headers"] == {
        "Content-Type": "application/json",
        "Authorization": "Bearer s3cret-value",
    }
    assert call[0]["body"] == {} and call[0]["timeout_milliseconds"] >= 15000
    assert not any(r["ok"] for r in may_call), "API roles must not trigger batches or read secrets"


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


# -- 3. Realtime ------------------------------------------------------------------------------

# A stand-in for Supabase's realtime schema: realtime.send with the real signature records each
# call; messages + topic() are enough for the private-topic policy to be created and enforced.
REALTIME_STANDIN = """
create schema realtime;
create table realtime.sent (id bigserial primary key, payload jsonb, event text, topic text,
                            private boolean);
create function realtime.send(payload jsonb, event text, topic text, private boolean default true)
returns void language sql as $$
  insert into realtime.sent (payload, event, topic, private) values (payload, event, topic, private)
$$;
create table realtime.messages (id bigserial primary key, topic text, extension text,
                                payload jsonb);
create function realtime.topic() returns text language sql stable as $$
  select nullif(current_setting('realtime.topic', true), '')
$$;
"""


def _enqueue(conn: db.Conn, key: str, group: str) -> None:
    conn.execute("select * from thumbq.enqueue(%s, 'e1', %s)", [key, group])


def test_plain_postgres_has_no_broadcast_trigger_and_groups_still_update(conn: db.Conn) -> None:
    row = conn.execute(
        "select to_regprocedure('thumbq.groups_broadcast()') is null as no_function,"
        " not exists (select 1 from pg_trigger where tgname = 'groups_broadcast') as no_trigger"
    ).fetchone()
    assert row == {"no_function": True, "no_trigger": True}
    _enqueue(conn, "a.jpg", "g1")
    _enqueue(conn, "b.jpg", "g1")
    group = conn.execute("select total, pending from thumbq.groups where group_id = 'g1'")
    assert group.fetchone() == {"total": 2, "pending": 2}


def test_group_changes_broadcast_to_the_private_group_topic(empty_db_url: str) -> None:
    with db.connect(empty_db_url) as conn:
        conn.execute(REALTIME_STANDIN.encode())
        db.init_schema(conn)
        _enqueue(conn, "a.jpg", "g1")
        _enqueue(conn, "b.jpg", "g2")
        conn.execute("select thumbq.cancel('g1')")
        sent = conn.execute("select payload, event, topic, private from realtime.sent order by id")
        calls = sent.fetchall()
    assert [(c["topic"], c["event"], c["private"]) for c in calls] == [
        ("thumbq:group:g1", "progress", True),
        ("thumbq:group:g2", "progress", True),
        ("thumbq:group:g1", "progress", True),
    ]
    assert calls[0]["payload"]["operation"] == "INSERT"
    last = calls[2]["payload"]
    assert last["operation"] == "UPDATE"
    assert last["record"]["group_id"] == "g1"
    assert (last["record"]["pending"], last["record"]["cancelled"]) == (0, 1)


def test_only_group_members_receive_a_private_group_topic(empty_db_url: str) -> None:
    with db.connect(empty_db_url) as conn:
        conn.execute(REALTIME_STANDIN.encode())
        supabase_roles(conn)
        db.init_schema(conn)
        conn.execute(
            "insert into thumbq.group_members values ('g1', 'alice');"
            "insert into realtime.messages (topic, extension)"
            " values ('thumbq:group:g1', 'broadcast');"
            "alter table realtime.messages enable row level security;"
            "grant usage on schema realtime to authenticated;"
            "grant select on realtime.messages to authenticated;"
            "grant execute on function realtime.topic() to authenticated"
        )

        def visible(user: str, topic: str) -> int:
            with conn.transaction():
                conn.execute("set local role authenticated")
                conn.execute("select set_config('realtime.topic', %s, true)", [topic])
                conn.execute(
                    "select set_config('request.jwt.claims', %s, true)", [f'{{"sub": "{user}"}}']
                )
                row = conn.execute("select count(*) as n from realtime.messages").fetchone()
            assert row is not None
            return int(row["n"])

        assert visible("alice", "thumbq:group:g1") == 1
        assert visible("bob", "thumbq:group:g1") == 0
        assert visible("alice", "thumbq:group:g2") == 0


def test_jobs_and_groups_join_an_existing_supabase_realtime_publication(empty_db_url: str) -> None:
    with db.connect(empty_db_url) as conn:
        conn.execute("create publication supabase_realtime")
        db.init_schema(conn)
        db.init_schema(conn)  # again: no duplicate membership error
        conn.execute((ROOT / "sql" / "005_security.sql").read_bytes())
        tables = conn.execute(
            "select schemaname || '.' || tablename as t from pg_publication_tables"
            " where pubname = 'supabase_realtime' order by 1"
        ).fetchall()
        identity = conn.execute(
            "select relname, relreplident from pg_class"
            " where oid in ('thumbq.jobs'::regclass, 'thumbq.groups'::regclass) order by relname"
        ).fetchall()
    assert [r["t"] for r in tables] == ["thumbq.groups", "thumbq.jobs"]
    # groups: full old rows in UPDATE/DELETE events; jobs: primary key only (wider, churns more).
    assert [(r["relname"], r["relreplident"]) for r in identity] == [
        ("groups", "f"),
        ("jobs", "d"),
    ]


# -- 4. Netlify and Vercel --------------------------------------------------------------------

NETLIFY_FN = ROOT / "netlify" / "functions" / "thumbq-batch.mjs"


def _netlify() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "netlify.toml").read_text(encoding="utf-8"))


def test_netlify_toml_publishes_the_page_proxies_the_api_and_schedules_the_batch() -> None:
    cfg = _netlify()
    publish = ROOT / cfg["build"]["publish"]
    assert (publish / "progress.html").is_file() and (publish / "progress.js").is_file()
    redirects = {r["from"]: r for r in cfg["redirects"]}
    api = redirects["/api/*"]
    assert api["status"] == 200 and api["to"].endswith("/api/:splat")
    assert "THUMBQ_API_URL" in api["to"]
    assert redirects["/progress/static/*"]["to"] == "/:splat"
    fn_dir = ROOT / cfg["functions"]["directory"]
    assert cfg["functions"]["thumbq-batch"]["schedule"] == "*/5 * * * *"
    assert (fn_dir / "thumbq-batch.mjs").is_file()


def test_netlify_build_command_writes_the_api_url_into_the_proxy(tmp_path: Path) -> None:
    import tomllib

    shutil.copy(ROOT / "netlify.toml", tmp_path / "netlify.toml")
    subprocess.run(
        ["bash", "-c", _netlify()["build"]["command"]],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "THUMBQ_API_URL": "https://api.example.org/"},
        check=True,
        timeout=10,
    )
    cfg = tomllib.loads((tmp_path / "netlify.toml").read_text(encoding="utf-8"))
    api = next(r for r in cfg["redirects"] if r["from"] == "/api/*")
    assert api["to"] == "https://api.example.org/api/:splat"


def test_vercel_json_crons_the_batch_every_5_minutes_into_the_flask_app() -> None:
    cfg = json.loads((ROOT / "vercel.json").read_text(encoding="utf-8"))
    crons = {c["path"]: c["schedule"] for c in cfg["crons"]}
    assert crons["/api/thumbnails/batch-generate"] == "*/5 * * * *"
    assert crons["/api/thumbnails/cleanup-stale"] == "*/15 * * * *"
    assert "api/index.py" in cfg["functions"]
    assert (ROOT / "api" / "index.py").is_file()


def _run_netlify_function(api_url: str, secret: str) -> tuple[int, str]:
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not installed")
    script = (
        "const m = await import(process.env.FN_URL);"
        "const r = await m.default(new Request('https://site.example/.netlify/functions/x'));"
        "process.stdout.write(JSON.stringify({status: r.status, body: await r.text()}));"
    )
    proc = subprocess.run(
        [node, "--input-type=module", "-e", script],
        env={
            "PATH": "/usr/bin:/bin",
            "FN_URL": NETLIFY_FN.as_uri(),
            "THUMBQ_API_URL": api_url + "/",
            "THUMBQ_CRON_SECRET": secret,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return int(out["status"]), str(out["body"])


def test_netlify_function_runs_a_batch_on_the_real_app(config: Config, conn: db.Conn) -> None:
    from tests.liveapp import call, live_app, put_samples
    from worker.storage import open_storage

    secret = "netlify-test-secret-0123456789"
    config = config.with_(cron_secret=secret)
    items = put_samples(open_storage(config), "netlify/", good=2)
    with live_app(config) as server:
        status, body, _ = call(
            "POST", server.url + "/api/thumbnails/enqueue", secret, {"items": items}
        )
        assert status == 202, body
        refused, _ = _run_netlify_function(server.url, "wrong-secret-wrong-secret")
        assert refused == 401
        status, text = _run_netlify_function(server.url, secret)
    assert status == 200, text
    report = json.loads(text)
    runs = conn.execute("select id, processed from thumbq.batch_runs").fetchall()
    assert runs == [{"id": report["run_id"], "processed": 2}]
    assert report["succeeded"] == 2
