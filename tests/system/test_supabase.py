"""Supabase integration: Realtime broadcasts and the Netlify/Vercel deploy files, tested as far
as a machine without Supabase allows. The migrations are tested in test_migrations.py, the
pg_cron + pg_net schedule in test_pg_cron.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.support.pgtools import require_tool, supabase_roles
from worker.engine import db
from worker.engine.config import Config

ROOT = Path(__file__).resolve().parents[2]
MIGRATIONS = ROOT / "supabase" / "migrations"


# -- Realtime ---------------------------------------------------------------------------------

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


# -- Netlify and Vercel ---------------------------------------------------------------------

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


def _run_netlify_function(api_url: str, secret: str) -> tuple[int, str]:
    node = require_tool("node", "node is not installed (the Netlify function runs on it)")
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
    from tests.support.liveapp import call, live_app, put_samples
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
