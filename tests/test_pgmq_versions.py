"""`thumbq db init` on a database whose pgmq is already there, at another version.

thumbq keeps an existing pgmq (the extension Supabase ships, or an earlier SQL install). One that
lacks a function thumbq calls must stop `db init` with a message naming it, before anything of
thumbq is created, instead of failing later inside a claim with a confusing error.
"""

from __future__ import annotations

import json

import pytest

from worker import db
from worker.cli import main as cli_main


def _install_pgmq(url: str, *after: str) -> None:
    """The pgmq package's SQL, then `after` statements that make it another version."""
    with db.connect(url) as conn:
        with conn.transaction():
            db.ensure_pgmq(conn)
        for sql in after:
            conn.execute(sql)


def _thumbq_schema_exists(url: str) -> bool:
    with db.connect(url) as conn:
        row = conn.execute("select to_regnamespace('thumbq') is not null as yes").fetchone()
    return bool(row and row["yes"])


def test_init_refuses_a_pgmq_without_set_vt_and_creates_nothing(
    empty_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pgmq whose set_vt only takes a timestamp: thumbq's retries call set_vt(text, bigint, int).
    _install_pgmq(empty_db_url, "drop function pgmq.set_vt(text, bigint, integer)")
    monkeypatch.setenv("DATABASE_URL", empty_db_url)
    with pytest.raises(RuntimeError) as err:
        cli_main(["db", "init"])
    message = str(err.value)
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


def test_init_accepts_the_pgmq_1_4_4_read_without_the_later_conditional_argument(
    empty_db_url: str,
) -> None:
    # pgmq 1.4.4 (Supabase) has read(text, integer, integer); 1.5+ adds `conditional jsonb
    # default '{}'`. thumbq's call fits both, so both must pass.
    _install_pgmq(
        empty_db_url,
        "drop function pgmq.read(text, integer, integer, jsonb)",
        "create function pgmq.read(queue_name text, vt integer, qty integer)"
        " returns setof pgmq.message_record language sql"
        " as 'select (null::pgmq.message_record).* where false'",
    )
    with db.connect(empty_db_url) as conn:
        result = db.init_schema(conn)
    assert result["pgmq"] == "present" and "001_schema" in result["applied"]
    assert _thumbq_schema_exists(empty_db_url)


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
