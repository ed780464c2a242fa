"""`thumbq db init` on a database whose pgmq is already there, at another version.

thumbq keeps an existing pgmq (the extension Supabase ships, or an earlier SQL install). The
extension at the versions Supabase ships (1.4.4, 1.5.1: built from their sources by
.ci/extensions) must be accepted as it is. A pgmq that lacks a function thumbq calls (older than
any source kept here, so emulated by dropping functions from the package's SQL install) must
stop `db init` with a message naming it, before anything of thumbq is created, instead of
failing later inside a claim with a confusing error.
"""

from __future__ import annotations

import json

import pytest

from tests.support.pgtools import (
    PGMQ_EXTENSION_VERSIONS,
    PGMQ_SQL,
    install_pgmq,
    require_pgmq_extension,
)
from worker.cli import main as cli_main
from worker.engine import db
from worker.engine.queue import Queue


def _install_pgmq(url: str, *after: str) -> None:
    """The pgmq package's SQL, then `after` statements that make it an older pgmq."""
    with db.connect(url) as conn:
        install_pgmq(conn, PGMQ_SQL)
        for sql in after:
            conn.execute(sql)


def _thumbq_schema_exists(url: str) -> bool:
    with db.connect(url) as conn:
        row = conn.execute("select to_regnamespace('thumbq') is not null as yes").fetchone()
    return bool(row and row["yes"])


def test_init_refuses_a_pgmq_without_set_vt_and_creates_nothing(
    empty_db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A pgmq whose set_vt only takes a timestamp: thumbq's retries call set_vt(text, bigint, int).
    _install_pgmq(empty_db_url, "drop function pgmq.set_vt(text, bigint, integer)")
    monkeypatch.setenv("DATABASE_URL", empty_db_url)
    assert cli_main(["db", "init"]) == 1
    [message] = capsys.readouterr().err.strip().splitlines()  # one line, no traceback
    assert "lacks what thumbq calls: pgmq.set_vt(text, bigint, integer)." in message
    assert "installed without the extension (version unknown)" in message
    assert "alter extension pgmq update" in message and "Nothing was changed" in message
    assert not _thumbq_schema_exists(empty_db_url)
    # The existing pgmq is left as it was: not reinstalled, not half-upgraded.
    with db.connect(empty_db_url) as conn:
        row = conn.execute(
            "select to_regprocedure('pgmq.set_vt(text, bigint, integer)') is null as still_gone,"
            " (select count(*) from pgmq.list_queues()) as queues"
        ).fetchone()
    assert row == {"still_gone": True, "queues": 0}


def test_init_names_everything_an_old_pgmq_lacks(empty_db_url: str) -> None:
    # An early pgmq: single delete only, no read of the shape thumbq calls, no metrics.
    _install_pgmq(
        empty_db_url,
        "drop function pgmq.delete(text, bigint[])",
        "drop function pgmq.metrics(text)",
        "drop function pgmq.read(text, integer, integer, jsonb)",
    )
    with db.connect(empty_db_url) as conn, pytest.raises(RuntimeError) as err:
        db.init_schema(conn)
    message = str(err.value)
    for missing in (
        "pgmq.read(text, integer, integer) returning msg_id, message",
        "pgmq.delete(text, bigint[])",
        "pgmq.metrics(text) returning queue_length, newest_msg_age_sec, oldest_msg_age_sec",
    ):
        assert missing in message
    # What is there is not listed.
    assert "pgmq.send(" not in message and "set_vt" not in message
    assert not _thumbq_schema_exists(empty_db_url)


@pytest.mark.parametrize("version", PGMQ_EXTENSION_VERSIONS)
def test_init_keeps_the_pgmq_extension_supabase_ships(empty_db_url: str, version: str) -> None:
    # 1.4.4 has read(text, integer, integer); 1.5 adds `conditional jsonb default '{}'`.
    # thumbq's calls fit both, so both must pass, and the extension stays at its version.
    with db.connect(empty_db_url) as conn:
        install_pgmq(conn, version)
        result = db.init_schema(conn)
        read_args = conn.execute(
            "select pg_get_function_identity_arguments(p.oid) as args from pg_proc p"
            " where p.pronamespace = 'pgmq'::regnamespace and p.proname = 'read'"
        ).fetchall()
        ext = conn.execute("select extversion from pg_extension where extname = 'pgmq'")
        assert ext.fetchone() == {"extversion": version}
    assert result["pgmq"] == "present" and "001_schema" in result["applied"]
    expected = "queue_name text, vt integer, qty integer"
    if version != "1.4.4":
        expected += ", conditional jsonb"
    assert [r["args"] for r in read_args] == [expected]


def test_init_creates_the_offered_extension_rather_than_the_sql_install(
    empty_db_url: str,
) -> None:
    # Where the server offers pgmq (Supabase), db init creates the extension (the server's
    # default version), not the package's SQL copy.
    with db.connect(empty_db_url) as conn:
        require_pgmq_extension(conn, PGMQ_EXTENSION_VERSIONS[-1])
        assert db.init_schema(conn)["pgmq"] == "extension"
        row = conn.execute(
            "select e.extversion, v.default_version from pg_extension e"
            " join pg_available_extensions v on v.name = e.extname where e.extname = 'pgmq'"
        ).fetchone()
    assert row is not None and row["extversion"] == row["default_version"]


def test_queued_work_survives_alter_extension_pgmq_update_from_1_4_4(empty_db_url: str) -> None:
    # A Supabase project that upgrades pgmq in place keeps its queue and thumbq keeps working.
    # Regression: 0.1.0's queue_overview called pgmq.metrics directly, and the upgrade, which
    # re-creates it, failed with "cannot drop function metrics(text)".
    with db.connect(empty_db_url) as conn:
        install_pgmq(conn, "1.4.4")
        require_pgmq_extension(conn, "1.5.1")
        db.init_schema(conn)
        queue = Queue(conn)
        queue.enqueue_files([{"source_key": "a.pdf", "etag": "e1"}, {"source_key": "b.pdf"}], "g1")
        conn.execute("alter extension pgmq update to '1.5.1'")
        assert db.init_schema(conn) == {"pgmq": "present", "applied": []}
        claimed = queue.claim("w1", 10, vt_seconds=60).jobs
        assert sorted(c.source_key for c in claimed) == ["a.pdf", "b.pdf"]
        queue.complete("w1", [{"job_id": c.id, "msg_id": c.msg_id} for c in claimed])
        group = conn.execute("select completed, pending from thumbq.groups where group_id = 'g1'")
        assert group.fetchone() == {"completed": 2, "pending": 0}
        overview = conn.execute("select queue_length, jobs_completed from thumbq.queue_overview")
        assert overview.fetchone() == {"queue_length": 0, "jobs_completed": 2}


def test_a_second_db_init_on_a_good_database_is_a_no_op(
    db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with db.connect(db_url) as conn:
        before = conn.execute("select * from thumbq.schema_migrations order by 1").fetchall()
    monkeypatch.setenv("DATABASE_URL", db_url)
    assert cli_main(["db", "init"]) == 0
    assert json.loads(capsys.readouterr().out) == {"pgmq": "present", "applied": []}
    with db.connect(db_url) as conn:
        after = conn.execute("select * from thumbq.schema_migrations order by 1").fetchall()
    assert after == before
