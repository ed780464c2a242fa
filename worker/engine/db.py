"""Connections, the named queries of sql/queries.sql, and schema set-up (`thumbq db init`).

Every connection works through a transaction-mode pooler (Supavisor on port 6543, pgbouncer):
no prepared statements, no session state, no LISTEN; each call is its own transaction.

A bounded call (`run(..., bound=Bound(timeout_ms))`) is cut by the server: the query goes out as
one simple-protocol message of two statements, `select set_config('statement_timeout', ...,
true), set_config('lock_timeout', ..., true); <the query>`. A message of several statements is
one implicit transaction, so the settings hold for the query and end with it: no session state
for a pooler to leak, and no extra round trip (measured: about 20 us a call on loopback,
bench/deadlines.py). The parameters are then bound by psycopg on the client (ClientCursor),
still never formatted in by hand.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row

if TYPE_CHECKING:
    from worker.engine.config import Config

Conn = psycopg.Connection[dict[str, Any]]

# pg_advisory_xact_lock key for schema set-up: concurrent `db init`s wait for each other.
_INIT_LOCK = 0x7468756D6271
_NAME_RE = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def sql_dir() -> Path:
    """The folder holding the schema files: inside the wheel, or sql/ of a source checkout."""
    packaged = resources.files("worker").joinpath("sql")
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "sql"


def schema_files() -> list[Path]:
    """The versioned schema files (`NNN_name.sql`: DDL and data moves), in order."""
    return sorted(p for p in sql_dir().glob("[0-9][0-9][0-9]_*.sql"))


def repeatable_files() -> list[tuple[str, Path]]:
    """The current definitions, as (version recorded, path), in the order they are applied:
    `retired.sql` (drops what no current file defines), then every function file of
    `functions/` (functions, triggers, views; one file per transition family) by name.
    Each is applied again whenever its checksum changes (docs/migrations.md)."""
    base = sql_dir()
    files = [("retired", base / "retired.sql")]
    files += [(f"functions/{p.stem}", p) for p in sorted((base / "functions").glob("*.sql"))]
    return files


class SchemaChainError(RuntimeError):
    """The schema files break the append-only rule: a released file was edited, removed or
    numbered over. Raised before anything touches a database."""


@dataclass(frozen=True)
class ReleasedFile:
    """A file as a release shipped it: its path in the repository, checksum and release."""

    path: str
    sha256: str
    version: str
    commit: str


@cache
def released_files() -> dict[str, ReleasedFile]:
    """Every schema file and Supabase migration that a release shipped, by repository path
    (`sql/released.json`): frozen, because users have applied them."""
    manifest = json.loads((sql_dir() / "released.json").read_text(encoding="utf-8"))
    return {
        path: ReleasedFile(path, sha, release["version"], release["commit"])
        for release in manifest["releases"]
        for path, sha in release["files"].items()
    }


def file_sha256(path: Path) -> str:
    """The checksum thumbq records for a schema file: of its text with newlines as \\n (what
    git stores), so that a checkout that writes CRLF line ends still matches."""
    return hashlib.sha256(path.read_text(encoding="utf-8").encode()).hexdigest()


def check_chain(files: list[Path] | None = None) -> None:
    """Refuse schema files that break the append-only chain: every released file is present
    and unchanged, and every newer file has a number of its own after the released ones.

    A released file is never edited because an existing database (or Supabase project, which
    records migrations by version) would never receive the edit."""
    files = schema_files() if files is None else files
    by_name = {p.name: p for p in files}
    released = {
        r.path.removeprefix("sql/"): r
        for r in released_files().values()
        if r.path.startswith("sql/")
    }
    for name, rel in sorted(released.items()):
        path = by_name.get(name)
        how = "was removed" if path is None else "was edited"
        if path is None or file_sha256(path) != rel.sha256:
            raise SchemaChainError(
                f"thumbq: sql/{name} {how} after it shipped in {rel.version} (commit "
                f"{rel.commit}); released schema files are frozen, because databases and "
                f"Supabase projects that applied it never apply it again. Restore it "
                f"(git checkout {rel.commit} -- sql/{name}) and put the change in a new file "
                "sql/NNN_name.sql (DDL) or in sql/functions/ (functions, triggers, views; "
                "docs/migrations.md)."
            )
    last_released = max((int(n[:3]) for n in released), default=0)
    numbers: dict[int, str] = {}
    for name in sorted(by_name):
        number = int(name[:3])
        if number in numbers:
            raise SchemaChainError(
                f"thumbq: sql/{numbers[number]} and sql/{name} share the number {number:03d}; "
                "each schema file needs a number of its own (it is its migration version)."
            )
        numbers[number] = name
        if name not in released and number <= last_released:
            raise SchemaChainError(
                f"thumbq: sql/{name} is numbered among the released files (up to "
                f"{last_released:03d}): a new file runs after them, so number it "
                f"{last_released + 1:03d} or later."
            )


def parse_queries(text: str) -> dict[str, str]:
    """Split a `-- name: x` annotated file into {name: sql}."""
    parts = _NAME_RE.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} is defined twice")
        queries[name] = body.strip()
    return queries


@cache
def queries() -> dict[str, str]:
    """The named queries, read once per process."""
    return parse_queries((sql_dir() / "queries.sql").read_text(encoding="utf-8"))


def database_url(config: Config) -> str:
    """`DATABASE_URL`, or the embedded Postgres under `THUMBQ_HOME` (started on demand)."""
    if config.database_url:
        return config.database_url
    from worker.local.embedded import embedded_database_url

    return embedded_database_url(config.home)


def connect(url: str, *, connect_timeout: int = 5, application_name: str = "thumbq") -> Conn:
    """One autocommit connection without prepared statements (pooler-safe)."""
    return psycopg.connect(
        url,
        autocommit=True,
        prepare_threshold=None,
        row_factory=dict_row,
        connect_timeout=connect_timeout,
        application_name=application_name,
    )


class DeadlineExceeded(psycopg.OperationalError):
    """A bounded call did not finish in its time: cancelled by the server's statement_timeout
    or lock_timeout, or never sent because no time was left."""


@dataclass(frozen=True)
class Bound:
    """How long a call may take: the server cancels it (lock waits included) after `timeout_ms`.

    `durable=False` also lets its commit return before the WAL reaches the disk
    (synchronous_commit off, for that transaction only). Only the calls that close an invocation
    after its deadline use it: under a loaded disk a commit waits 10-200 ms for the flush, and a
    server crash in the next fraction of a second loses no consistency, only that transition (its
    job comes back when its lease ends and is done again).
    """

    timeout_ms: float
    durable: bool = True


# What bounds a call, sent in the same message as the call (module docstring).
_BOUND = (
    "select set_config('statement_timeout', %(_thumbq_timeout)s, true),"
    " set_config('lock_timeout', %(_thumbq_timeout)s, true); "
)
_BOUND_NOT_DURABLE = (
    "select set_config('statement_timeout', %(_thumbq_timeout)s, true),"
    " set_config('lock_timeout', %(_thumbq_timeout)s, true),"
    " set_config('synchronous_commit', 'off', true); "
)


def run(
    conn: Conn,
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    bound: Bound | None = None,
) -> list[dict[str, Any]]:
    """Run the named query and return its rows; with `bound`, the server cancels it (and any
    lock wait in it) after `bound.timeout_ms`, raising `DeadlineExceeded`."""
    if bound is None:
        with conn.cursor() as cur:
            cur.execute(queries()[name], params or {})
            return cur.fetchall() if cur.description else []
    ms = math.floor(bound.timeout_ms)
    if ms < 1:  # 0 would mean no timeout at all
        raise DeadlineExceeded(f"{name}: no time was left to run it")
    prefix = _BOUND if bound.durable else _BOUND_NOT_DURABLE
    with psycopg.ClientCursor(conn) as cur:
        try:
            cur.execute(prefix + queries()[name], {**(params or {}), "_thumbq_timeout": str(ms)})
        except (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable) as exc:
            raise DeadlineExceeded(f"{name}: cut after {ms} ms ({exc})".strip()) from exc
        cur.nextset()
        return cur.fetchall() if cur.description else []


def one(
    conn: Conn,
    name: str,
    params: Mapping[str, Any] | None = None,
    *,
    bound: Bound | None = None,
) -> dict[str, Any] | None:
    """Run the named query and return its first row, or None (`bound` as in `run`)."""
    rows = run(conn, name, params, bound=bound)
    return rows[0] if rows else None


def ensure_pgmq(conn: Conn) -> str:
    """Make pgmq available: already there, the extension where offered, else the package's SQL.

    Returns how: "present", "extension" or "sql". Call inside a transaction: when the pgmq found
    (or installed) lacks a function thumbq calls, raises RuntimeError naming it, and the caller's
    rollback leaves nothing half-applied.
    """
    row = conn.execute(
        "select exists(select 1 from pg_namespace where nspname = 'pgmq') as has_schema,"
        " exists(select 1 from pg_available_extensions where name = 'pgmq') as offered"
    ).fetchone()
    assert row is not None
    if row["has_schema"]:
        how = "present"
    elif row["offered"]:
        # The server's default version may be older than the API thumbq needs: checked below.
        conn.execute("create extension if not exists pgmq")
        how = "extension"
    else:
        # The SQL-only install cannot run twice (its types would exist): guarded by the check
        # above.
        from pgmq.install import get_embedded_install_sql, install_pgmq_sql

        install_pgmq_sql(get_embedded_install_sql(), conn=conn)  # type: ignore[arg-type]
        how = "sql"

    # Every pgmq call in sql/, as (name, argument types, result columns used). A function is
    # callable when its leading arguments are exactly these and the rest have defaults: pgmq
    # 1.5+ added `conditional jsonb default '{}'` to read(), so an exact 1.4.4 signature test
    # (to_regprocedure) would turn away newer installs that run thumbq's calls unchanged.
    wanted = [
        ("list_queues", [], ["queue_name"]),
        ("create", ["text"], []),
        ("send", ["text", "jsonb"], []),
        ("read", ["text", "integer", "integer"], ["msg_id", "message"]),
        ("delete", ["text", "bigint"], []),
        ("delete", ["text", "bigint[]"], []),
        ("set_vt", ["text", "bigint", "integer"], []),
        ("metrics", ["text"], ["queue_length", "newest_msg_age_sec", "oldest_msg_age_sec"]),
    ]
    found = conn.execute(
        "select p.proname as name, p.pronargs - p.pronargdefaults as required,"
        " array(select format_type(t, null) from unnest(p.proargtypes) with ordinality a(t, i)"
        "       order by i) as args,"
        " coalesce((select array_agg(n) from unnest(p.proallargtypes, p.proargmodes, p.proargnames)"
        "           as o(t, m, n) where m in ('o', 't', 'b')),"
        "          (select array_agg(a.attname::text) from pg_type r join pg_attribute a"
        "             on a.attrelid = r.typrelid and a.attnum > 0 and not a.attisdropped"
        "            where r.oid = p.prorettype), '{}') as columns"
        " from pg_proc p where p.pronamespace = 'pgmq'::regnamespace and p.proname = any(%s)",
        [sorted({w[0] for w in wanted})],
    ).fetchall()
    missing = []
    for name, args, columns in wanted:
        ok = any(
            f["name"] == name
            and f["required"] <= len(args)
            and f["args"][: len(args)] == args
            and set(columns) <= set(f["columns"])
            for f in found
        )
        if not ok:
            missing.append(
                f"pgmq.{name}({', '.join(args)})"
                + (f" returning {', '.join(columns)}" if columns else "")
            )
    if missing:
        ext = conn.execute("select extversion from pg_extension where extname = 'pgmq'").fetchone()
        version = (
            f"the pgmq extension, version {ext['extversion']}"
            if ext
            else "a pgmq installed without the extension (version unknown)"
        )
        raise RuntimeError(
            f"thumbq: this database has {version}, which lacks what thumbq calls: "
            f"{'; '.join(missing)}. thumbq needs the pgmq 1.4.4 API or newer (Supabase ships "
            "1.4.4 and 1.5.x). Upgrade pgmq (`alter extension pgmq update;` where it is the "
            "extension; a SQL-only install must be replaced) and run `thumbq db init` "
            "again. Nothing was changed."
        )
    return how


def init_schema(conn: Conn) -> dict[str, Any]:
    """Install pgmq, apply every versioned schema file not yet applied, then every repeatable
    file (retired drops, function files) whose checksum differs from the one recorded.

    All in one transaction under an advisory lock: concurrent callers wait, and a failure
    leaves nothing half-applied. Safe to run again and again. Refuses (SchemaChainError) to
    run files whose released ones were edited: see check_chain.
    """
    files = schema_files()
    check_chain(files)
    applied: list[str] = []
    with conn.transaction():
        conn.execute("select pg_advisory_xact_lock(%s)", [_INIT_LOCK])
        pgmq_how = ensure_pgmq(conn)
        conn.execute("create schema if not exists thumbq")
        conn.execute(
            "create table if not exists thumbq.schema_migrations ("
            " version text primary key, checksum text not null,"
            " applied_at timestamptz not null default clock_timestamp())"
        )
        done = {
            r["version"]: r["checksum"]
            for r in conn.execute("select version, checksum from thumbq.schema_migrations")
        }

        def apply(version: str, text: str, checksum: str) -> None:
            conn.execute(text.encode())  # several statements: simple query protocol
            conn.execute(
                "insert into thumbq.schema_migrations (version, checksum) values (%s, %s)"
                " on conflict (version) do update set checksum = excluded.checksum,"
                " applied_at = clock_timestamp()",
                [version, checksum],
            )
            applied.append(version)

        rerun = False
        for path in files:
            text = path.read_text(encoding="utf-8")
            checksum = hashlib.sha256(text.encode()).hexdigest()  # as file_sha256
            # A recorded checksum differs only on a database set up before the file was
            # released (released files are frozen), or by an unreleased file during
            # development. Once one file changed, every later one runs again too: later files
            # may undo or refine what an earlier one does (008's revokes after 005's grants).
            if not applied and done.get(path.stem) == checksum:
                continue
            rerun = rerun or path.stem in done
            apply(path.stem, text, checksum)
        for version, path in repeatable_files():
            text = path.read_text(encoding="utf-8")
            checksum = hashlib.sha256(text.encode()).hexdigest()
            # A versioned file run again (002 and 003 define the functions of 0.1.0) brings
            # back what the current definitions replaced: then every one runs again.
            if not rerun and done.get(version) == checksum:
                continue
            apply(version, text, checksum)
    return {"pgmq": pgmq_how, "applied": applied}
