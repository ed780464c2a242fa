"""Helpers for tests that need a particular pgmq, Postgres binaries or the vendored sources.

pgmq reaches a database two ways: the `pgmq` package's SQL (what the embedded default installs,
`ensure_pgmq`'s fallback) and the pgmq extension, built from the sources Supabase ships
(`.ci/extensions` installs 1.4.4 and 1.5.1 from ../shared/vendor/). Once the extension is
installed on the server, `ensure_pgmq` prefers it for every new database, so tests that care
install the pgmq they mean explicitly with `install_pgmq`.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest

from worker.engine import db

ROOT = Path(__file__).resolve().parents[2]
PG15_BIN = Path("/usr/lib/postgresql/15/bin")
PGMQ_SQL = "sql"  # the pgmq package's SQL, as the embedded default installs it
PGMQ_EXTENSION_VERSIONS = ("1.4.4", "1.5.1")  # what Supabase ships

F = TypeVar("F", bound=Callable[..., Any])
# What a test marked `supabase` needs: a live project with thumbq's migrations pushed. No CI
# machine has one, so these tests are the one exception to `require`: conftest skips them by
# their marker, with this list as the reason, in CI too.
SUPABASE_LIVE_VARS = ("SUPABASE_URL", "SUPABASE_ANON_KEY", "THUMBQ_USER_JWT", "SUPABASE_DB_URL")


def vendor_dir() -> Path:
    """The vendored extension sources: ../shared/vendor/ beside the checkout (CI has it)."""
    return Path(os.environ.get("THUMBQ_VENDOR_DIR") or ROOT.parent / "shared" / "vendor")


def require(condition: bool, missing: str) -> None:
    """Skip the test naming what is missing, or fail in CI, where nothing may be missing.

    Every check of a tool, a library or a vendored source in tests/ goes through here (or
    `requires`), so that a CI machine without one fails instead of dropping tests silently;
    `.ci/run` sets CI."""
    if condition:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide this: {missing}")
    pytest.skip(missing)


def requires(condition: bool, missing: str) -> Callable[[F], F]:
    """`require` as a decorator, in place of `pytest.mark.skipif`: the condition is evaluated
    once, where the decorator is written, and checked when the test runs (not at collection,
    where a failure would stop the whole run)."""

    def decorate(test: F) -> F:
        @functools.wraps(test)
        def checked(*args: Any, **kwargs: Any) -> Any:
            require(condition, missing)
            return test(*args, **kwargs)

        return cast(F, checked)

    return decorate


def require_tool(name: str, missing: str | None = None) -> str:
    """The path of program `name` on PATH; skips (fails in CI) naming it when it is absent."""
    found = shutil.which(name)
    require(found is not None, missing or f"{name} is not installed")
    assert found is not None
    return found


def require_module(name: str, missing: str) -> None:
    """Skips (fails in CI) when Python module `name` cannot be imported."""
    try:
        importlib.import_module(name)
    except ImportError:
        require(False, missing)


def require_vendored(pattern: str) -> Path:
    """The vendored source tarball matching `pattern`; skips (fails in CI) naming it."""
    found = sorted(vendor_dir().glob(pattern))
    require(bool(found), f"{vendor_dir() / pattern} (the vendored source) is missing")
    return found[0]


def pgmq_extension_offered(conn: db.Conn, version: str) -> bool:
    """Whether the server can `create extension pgmq version '<version>'`."""
    row = conn.execute(
        "select exists(select 1 from pg_available_extension_versions"
        " where name = 'pgmq' and version = %s) as ok",
        [version],
    ).fetchone()
    return bool(row and row["ok"])


def require_pgmq_extension(conn: db.Conn, version: str) -> None:
    """Skip (fail in CI) unless the pgmq extension at `version` is installed on the server."""
    if pgmq_extension_offered(conn, version):
        return
    tarball = vendor_dir() / f"pgmq-extension-{version}.tar.gz"
    if not tarball.exists():
        require(False, f"{tarball} (the vendored pgmq source) is missing")
    require(False, f"the pgmq extension {version} is not installed: run .ci/extensions as root")


def install_pgmq(conn: db.Conn, how: str) -> None:
    """Install pgmq in the connection's database: the package's SQL (`PGMQ_SQL`) or the
    extension at a version (`"1.4.4"`)."""
    with conn.transaction():
        if how == PGMQ_SQL:
            from pgmq.install import get_embedded_install_sql, install_pgmq_sql

            install_pgmq_sql(get_embedded_install_sql(), conn=conn)  # type: ignore[arg-type]
        else:
            require_pgmq_extension(conn, how)
            conn.execute(f"create extension pgmq version '{how}'")  # a version we name


def pg_bin(name: str, url: str | None = None) -> str:
    """A Postgres client program of the server's major version (pg_dump refuses a newer
    server): Debian's Postgres 15, the embedded pgserver's own (16), else the one on PATH."""
    candidates = [PG15_BIN / name]
    if url is not None:
        with db.connect(url) as conn:
            row = conn.execute("select current_setting('server_version_num')::int / 10000 as v")
            major = row.fetchone()["v"]  # type: ignore[index]
        if major != 15:
            candidates = []
            try:
                import pgserver

                candidates.append(Path(pgserver.__file__).parent / "pginstall" / "bin" / name)
            except ImportError:
                pass
    for path in candidates:
        if path.exists():
            return str(path)
    found = shutil.which(name)
    require(found is not None, f"{name} is not installed")
    assert found is not None
    return found


def schema_dump(url: str, schema: str = "thumbq") -> str:
    """`pg_dump --schema-only` of one schema, without comments, SET lines and blank lines."""
    proc = subprocess.run(
        [pg_bin("pg_dump", url), "--schema-only", f"--schema={schema}", "--no-owner", "-d", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"pg_dump failed: {proc.stderr.strip()}"
    keep = []
    for line in proc.stdout.splitlines():
        if not line.strip() or line.startswith(
            ("--", "SET ", "SELECT pg_catalog.set_config", "\\")
        ):
            continue
        keep.append(line)
    return "\n".join(keep)


def supabase_roles(conn: db.Conn) -> None:
    """The roles every Supabase database has, created where missing (plain Postgres)."""
    for role in ("anon", "authenticated", "service_role"):
        conn.execute(
            "do $$ begin if not exists (select 1 from pg_roles where rolname = '"
            + role
            + "') then create role "
            + role
            + " nologin; end if; end $$"
        )


def supabase_push(conn: db.Conn, files: dict[str, str]) -> list[str]:
    """What `supabase db push` does with a migrations folder ({file name: text}): every version
    recorded in supabase_migrations.schema_migrations must exist locally; a local version older
    than the newest recorded one is refused (it needs --include-all); the others are applied in
    order, one file per transaction, and recorded. Returns the names applied."""
    conn.execute(
        "create schema if not exists supabase_migrations;"
        "create table if not exists supabase_migrations.schema_migrations"
        " (version text primary key, statements text[], name text)"
    )
    done = {
        r["version"]
        for r in conn.execute("select version from supabase_migrations.schema_migrations")
    }
    local = {name.partition("_")[0]: name for name in files}
    missing = done - set(local)
    assert not missing, f"remote migration versions missing locally: {sorted(missing)}"
    pending = sorted(v for v in local if v not in done)
    late = [local[v] for v in pending if done and v < max(done)]
    assert not late, f"local migrations before the last one applied (need --include-all): {late}"
    for version in pending:
        name = local[version]
        conn.execute(files[name].encode())
        conn.execute(
            "insert into supabase_migrations.schema_migrations (version, name) values (%s, %s)",
            [version, name.partition("_")[2].removesuffix(".sql")],
        )
    return [local[v] for v in pending]


def make_retries_due(conn: db.Conn) -> int:
    """Make the messages of pending jobs visible now, so that retries waiting out thumbq's
    backoff (30 s, then 60 s, ...) are claimed at once; returns how many there were."""
    rows = conn.execute(
        "select pgmq.set_vt(thumbq.band_queue(priority), msg_id, 0) from thumbq.jobs"
        " where status = 'pending' and msg_id is not null"
    ).fetchall()
    return len(rows)
