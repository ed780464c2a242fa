"""Supabase integration: generated migrations, the pg_cron schedule, Realtime broadcasts, and
the Netlify/Vercel deploy files, tested as far as a machine without Supabase allows.

pgmq comes from the `pgmq` package's SQL here (no extension is offered), so the migrations'
`create extension if not exists pgmq;` line is the one thing the tests leave out when applying.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from worker import db
from worker.cli import main as cli_main
from worker.migrations import PGMQ_EXTENSION, migrations

ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS = ROOT / "supabase" / "migrations"
PG15_BIN = Path("/usr/lib/postgresql/15/bin")


def _pg_bin(name: str) -> str:
    path = PG15_BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed")
    return found


def _supabase_roles(conn: db.Conn) -> None:
    for role in ("anon", "authenticated", "service_role"):
        conn.execute(
            "do $$ begin if not exists (select 1 from pg_roles where rolname = '"
            + role
            + "') then create role "
            + role
            + " nologin; end if; end $$"
        )


def _apply_migrations(conn: db.Conn) -> None:
    """Apply supabase/migrations/ in order, with the package's pgmq standing in."""
    with conn.transaction():
        db.ensure_pgmq(conn)
    for path in sorted(MIGRATIONS.glob("*.sql")):
        text = path.read_text(encoding="utf-8")
        conn.execute(text.replace(PGMQ_EXTENSION, "-- pgmq: the package's SQL stands in").encode())


def _schema_dump(url: str) -> str:
    """`pg_dump --schema-only` of schema thumbq, without comments, SET lines and blank lines."""
    proc = subprocess.run(
        [_pg_bin("pg_dump"), "--schema-only", "--schema=thumbq", "--no-owner", "-d", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        pytest.skip(f"pg_dump cannot dump this server: {proc.stderr.strip()}")
    keep = []
    for line in proc.stdout.splitlines():
        if not line.strip() or line.startswith(
            ("--", "SET ", "SELECT pg_catalog.set_config", "\\")
        ):
            continue
        keep.append(line)
    return "\n".join(keep)


# -- 1. migrations ----------------------------------------------------------------------------


def test_export_migration_regenerates_the_checked_in_files_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "migrations"
    assert cli_main(["db", "export-migration", "--out", str(out)]) == 0
    generated = {p.name: p.read_bytes() for p in out.glob("*.sql")}
    checked_in = {p.name: p.read_bytes() for p in MIGRATIONS.glob("*_thumbq_*.sql")}
    assert generated, "nothing was generated"
    assert generated == checked_in, "run `thumbq db export-migration` and commit the result"
    # Timestamps follow the file order, so a regeneration never renames a file.
    assert sorted(generated) == [m.name for m in migrations()]
    assert "20260101000001_thumbq_001_schema.sql" in generated


def test_migrations_use_the_extension_and_run_in_one_transaction() -> None:
    for m in migrations():
        body = [ln for ln in m.text.splitlines() if ln.strip() and not ln.startswith("--")]
        assert body[0] == "begin;" and body[-1] == "commit;", m.name
        assert "install_pgmq" not in m.text and "pgmq.meta" not in m.text, m.name
        if "pgmq." in m.text:
            assert body[1] == PGMQ_EXTENSION, m.name


def test_migrations_build_the_same_schema_as_db_init_and_reapply_as_a_no_op(
    db_url: str, empty_db_url: str
) -> None:
    with db.connect(empty_db_url) as conn:
        _supabase_roles(conn)
        _apply_migrations(conn)
    migrated = _schema_dump(empty_db_url)
    assert "CREATE TABLE thumbq.jobs" in migrated and "CREATE POLICY" in migrated
    assert migrated == _schema_dump(db_url)

    with db.connect(empty_db_url) as conn:
        _apply_migrations(conn)
        # The migrations recorded themselves, so `thumbq db init` finds nothing to do.
        assert db.init_schema(conn)["applied"] == []
        queues = {
            r["queue_name"] for r in conn.execute("select queue_name from pgmq.list_queues()")
        }
    assert queues == {"thumbq_jobs", "thumbq_dlq"}
    assert _schema_dump(empty_db_url) == migrated


def test_a_failing_migration_leaves_nothing_behind(empty_db_url: str) -> None:
    broken = migrations()[0].text.replace("commit;", "select 1/0;\ncommit;")
    with db.connect(empty_db_url) as conn:
        with conn.transaction():
            db.ensure_pgmq(conn)
        with pytest.raises(Exception, match="division by zero"):
            conn.execute(broken.replace(PGMQ_EXTENSION, "").encode())
        conn.rollback()
        row = conn.execute("select to_regclass('thumbq.jobs') as t").fetchone()
    assert row is not None and row["t"] is None


def test_supabase_config_is_a_cli_project_exposing_thumbq() -> None:
    import tomllib

    cfg = tomllib.loads((ROOT / "supabase" / "config.toml").read_text(encoding="utf-8"))
    assert re.fullmatch(r"[a-z0-9_-]+", cfg["project_id"])
    assert "thumbq" in cfg["api"]["schemas"]
    assert cfg["db"]["major_version"] == 15
