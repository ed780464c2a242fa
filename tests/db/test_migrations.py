"""The schema as an append-only chain: what shipped stays as it shipped, and every database
that a release set up reaches today's schema, by `supabase db push` and by `thumbq db init`.

Release 0.1.0 is commit 2723964: its sql/001..009 and supabase/migrations/...01..09 are frozen.
They are compared with that commit (git history; CI's clone has it) and with the checksums in
sql/released.json (so a tarball without history is still checked). The upgrade tests apply the
released files to a database, then today's, and compare `pg_dump --schema-only` of schema
thumbq with a fresh install, on the pgmq extension at the versions Supabase ships (and, for
`db init`, on the pgmq package's SQL too, the embedded default's path).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from tests.support.pgtools import (
    PGMQ_EXTENSION_VERSIONS,
    PGMQ_SQL,
    ROOT,
    install_pgmq,
    require,
    schema_dump,
    supabase_push,
    supabase_roles,
)
from worker.cli import main as cli_main
from worker.engine import db
from worker.engine.migrations import PGMQ_EXTENSION, export, migrations

RELEASE = "2723964"  # 0.1.0
# The first `thumbq db export-migration` (before 0.1.0): a project that pushed then has an
# older 001_schema (no jobs_group_errors_idx), which 0.1.0 edited in place.
PRE_RELEASE = "5eac11e"
MIGRATIONS = ROOT / "supabase" / "migrations"


# -- git and the Supabase CLI's bookkeeping -----------------------------------------------------


def _git(*args: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, check=True, timeout=60
    ).stdout


def _require_history(commit: str) -> None:
    ok = (
        shutil.which("git") is not None
        and subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
            capture_output=True,
            timeout=30,
        ).returncode
        == 0
    )
    require(ok, f"git history with commit {commit} (a clone, not a source tarball)")


def _files_at(commit: str, folder: str) -> dict[str, bytes]:
    """The numbered files of `folder` at `commit`, by repository path."""
    _require_history(commit)
    names = _git("ls-tree", "--name-only", f"{commit}:{folder}").decode().split()
    return {
        f"{folder}/{n}": _git("show", f"{commit}:{folder}/{n}")
        for n in names
        if n[:1].isdigit() and n.endswith(".sql")
    }


def _checked_in() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(MIGRATIONS.glob("*.sql"))}


def _released_chain(commit: str) -> dict[str, str]:
    return {
        path.rsplit("/", 1)[1]: text.decode()
        for path, text in _files_at(commit, "supabase/migrations").items()
    }


def _fresh_install(url: str, pgmq: str) -> str:
    """Today's `thumbq db init` on an empty database with the given pgmq: its schema dump."""
    with db.connect(url) as conn:
        supabase_roles(conn)
        install_pgmq(conn, pgmq)
        db.init_schema(conn)
    return schema_dump(url)


# -- 1. frozen files ----------------------------------------------------------------------------


def test_released_files_are_byte_for_byte_those_of_0_1_0() -> None:
    shipped = _files_at(RELEASE, "sql") | _files_at(RELEASE, "supabase/migrations")
    manifest = {p: r.sha256 for p, r in db.released_files().items() if r.commit == RELEASE}
    # The manifest lists exactly what 0.1.0 shipped, with its checksums...
    assert manifest == {p: hashlib.sha256(b).hexdigest() for p, b in shipped.items()}
    # ...and the tree still has every one of those files unchanged.
    changed = [p for p, b in shipped.items() if (ROOT / p).read_bytes() != b]
    assert not changed, f"released files were edited; add a new file instead: {changed}"


def test_released_files_match_the_manifest_without_git() -> None:
    db.check_chain()  # sql/: raises on an edit
    for path, rel in db.released_files().items():
        assert db.file_sha256(ROOT / path) == rel.sha256, f"{path} differs from {rel.version}"


def _sql_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "sql"
    shutil.copytree(db.sql_dir(), copy)
    return copy


def test_db_init_refuses_an_edited_released_file_and_changes_nothing(
    tmp_path: Path,
    empty_db_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The bug this pins: an index added to 001_schema.sql after it shipped reached no project
    # that had pushed 001 (and `db init` re-ran the edited file silently).
    sql = _sql_copy(tmp_path)
    with (sql / "001_schema.sql").open("a", encoding="utf-8") as f:
        f.write("create index if not exists jobs_new_idx on thumbq.jobs (created_at);\n")
    monkeypatch.setattr(db, "sql_dir", lambda: sql)
    monkeypatch.setenv("DATABASE_URL", empty_db_url)
    assert cli_main(["db", "init"]) == 1
    [message] = capsys.readouterr().err.strip().splitlines()  # one line, no traceback
    assert "sql/001_schema.sql was edited after it shipped in 0.1.0" in message
    assert f"git checkout {RELEASE} -- sql/001_schema.sql" in message
    assert "new file" in message
    with db.connect(empty_db_url) as conn:
        row = conn.execute("select to_regnamespace('thumbq') is null as untouched").fetchone()
    assert row == {"untouched": True}


@pytest.mark.parametrize(
    ("remove", "add", "complaint"),
    [
        ("004_views.sql", None, "sql/004_views.sql was removed after it shipped in 0.1.0"),
        (None, "005_more.sql", "sql/005_more.sql is numbered among the released files"),
        (None, "000_early.sql", "number it 010 or later"),
        (None, "010_other.sql", "share the number 010"),
    ],
    ids=["removed", "numbered-among-released", "before-released", "same-number"],
)
def test_the_chain_refuses_removed_and_misnumbered_files(
    tmp_path: Path, remove: str | None, add: str | None, complaint: str
) -> None:
    sql = _sql_copy(tmp_path)
    db.check_chain(sorted(sql.glob("[0-9][0-9][0-9]_*.sql")))  # as it is: fine
    if remove:
        (sql / remove).unlink()
    if add:
        (sql / add).write_text("select 1;\n")
    with pytest.raises(db.SchemaChainError, match=complaint):
        db.check_chain(sorted(sql.glob("[0-9][0-9][0-9]_*.sql")))


def test_export_writes_the_chain_byte_for_byte_and_new_files_get_new_versions(
    tmp_path: Path,
) -> None:
    out = tmp_path / "migrations"
    assert cli_main(["db", "export-migration", "--out", str(out)]) == 0
    generated = {p.name: p.read_text(encoding="utf-8") for p in sorted(out.glob("*.sql"))}
    assert generated == _checked_in(), "run `thumbq db export-migration` and commit the result"
    released = {p.rsplit("/", 1)[1] for p in db.released_files() if p.startswith("supabase/")}
    new = sorted(set(generated) - released)
    assert new, "expected files added since 0.1.0"
    # Every new file sorts after every released one: `supabase db push` takes it as new.
    assert max(released) < min(new)
    assert sorted(generated) == [m.name for m in migrations()]


def test_export_refuses_to_overwrite_an_edited_shipped_migration(tmp_path: Path) -> None:
    out = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, out)
    edited = out / "20260101000001_thumbq_001_schema.sql"
    edited.write_text(edited.read_text(encoding="utf-8") + "-- edited\n", encoding="utf-8")
    with pytest.raises(db.SchemaChainError, match=r"was edited after it shipped in 0\.1\.0"):
        export(out)
    assert edited.read_text(encoding="utf-8").endswith("-- edited\n")  # left for a person
    # A stale file of a renamed, unreleased schema file would double a version: removed.
    edited.write_bytes((MIGRATIONS / edited.name).read_bytes())
    stale = out / "20260101000012_thumbq_012_old_name.sql"
    stale.write_text("select 1;\n")
    export(out)
    assert not stale.exists()


def test_migrations_use_the_extension_and_run_in_one_transaction() -> None:
    for m in migrations():
        body = [ln for ln in m.text.splitlines() if ln.strip() and not ln.startswith("--")]
        assert body[0] == "begin;" and body[-1] == "commit;", m.name
        assert "install_pgmq" not in m.text and "pgmq.meta" not in m.text, m.name
        if "pgmq." in m.text:
            assert body[1] == PGMQ_EXTENSION, m.name


def test_supabase_config_is_a_cli_project_exposing_thumbq() -> None:
    import re
    import tomllib

    cfg = tomllib.loads((ROOT / "supabase" / "config.toml").read_text(encoding="utf-8"))
    assert re.fullmatch(r"[a-z0-9_-]+", cfg["project_id"])
    assert "thumbq" in cfg["api"]["schemas"]
    assert cfg["db"]["major_version"] == 15


# -- 2. one current source ----------------------------------------------------------------------

# Functions defined only where their platform exists (sql/functions/95_platform.sql: Realtime's
# realtime.send, pg_cron), as 006 and 007 create them.
ON_SUPABASE_ONLY = {"thumbq.call_api", "thumbq.groups_broadcast"}


def _defined(kind: str) -> Counter[str]:
    """How many times the function files define each object of `kind` (function, view,
    trigger), by name."""
    pattern = {
        "function": r"^\s*create or replace function (thumbq\.\w+)\(",
        "view": r"^create or replace view (thumbq\.\w+)",
        "trigger": r"^\s*create trigger (\w+)",
    }[kind]
    found: Counter[str] = Counter()
    for path in sorted((db.sql_dir() / "functions").glob("*.sql")):
        found.update(re.findall(pattern, path.read_text(encoding="utf-8"), re.MULTILINE))
    return found


def test_every_function_view_and_trigger_is_defined_once_in_a_function_file(
    conn: db.Conn,
) -> None:
    functions = Counter(
        r["name"]
        for r in conn.execute(
            "select 'thumbq.' || proname as name from pg_proc"
            " where pronamespace = 'thumbq'::regnamespace"
        )
    )
    defined = _defined("function")
    assert all(n == 1 for n in defined.values()), "a function defined twice in sql/functions/"
    # Nothing else: no dead function of an earlier file (a fresh database runs 002 and 003).
    assert functions == Counter(
        {n: c for n, c in defined.items() if n not in ON_SUPABASE_ONLY or n in functions}
    )
    assert set(defined) >= ON_SUPABASE_ONLY
    views = {
        r["name"]
        for r in conn.execute(
            "select 'thumbq.' || viewname as name from pg_views where schemaname = 'thumbq'"
        )
    }
    assert views == set(_defined("view"))
    triggers = {
        r["tgname"]
        for r in conn.execute(
            "select tgname from pg_trigger t join pg_class c on c.oid = t.tgrelid"
            " where c.relnamespace = 'thumbq'::regnamespace and not t.tgisinternal"
        )
    }
    # The storage triggers live on storage.objects (Supabase), created by watch_storage.
    assert triggers <= set(_defined("trigger"))
    assert {"jobs_groups_insert", "groups_completed_event"} <= triggers


def test_nothing_the_retired_list_drops_exists_after_db_init(conn: db.Conn) -> None:
    text = (db.sql_dir() / "retired.sql").read_text(encoding="utf-8")
    functions = re.findall(r"^drop function if exists (thumbq\.\w+\([^;]*\));$", text, re.M)
    types = re.findall(r"^drop type if exists (thumbq\.\w+);$", text, re.M)
    assert functions and types
    for fn in functions:
        # A retired signature that a function file still defines would exist here.
        try:
            row = conn.execute("select to_regprocedure(%s) is null as gone", [fn]).fetchone()
        except psycopg.errors.UndefinedObject:  # an argument's type is retired too
            row = {"gone": True}
        assert row == {"gone": True}, f"{fn} is retired but defined"
    for t in types:
        assert conn.execute("select to_regtype(%s) is null as gone", [t]).fetchone() == {
            "gone": True
        }


def test_no_sql_file_outside_the_0_1_0_chain_is_over_600_lines() -> None:
    frozen = {p for p, r in db.released_files().items() if r.version == "0.1.0"}
    sizes = {
        p.relative_to(ROOT).as_posix(): len(p.read_text(encoding="utf-8").splitlines())
        for p in sorted((ROOT / "sql").rglob("*.sql"))
    }
    assert len(sizes) > len([p for p in frozen if p.startswith("sql/")])
    big = {p: n for p, n in sizes.items() if p not in frozen and n > 600}
    assert not big, f"split these by concern: {big}"


def _release(sql: Path, out: Path, version: str) -> None:
    """Record the pending migration and the new versioned files as released (what a release
    does to sql/released.json, docs/migrations.md)."""
    manifest = json.loads((sql / "released.json").read_text(encoding="utf-8"))
    known = set(db.released_files())
    files = {
        f"sql/{p.name}": db.file_sha256(p)
        for p in sorted(sql.glob("[0-9][0-9][0-9]_*.sql"))
        if f"sql/{p.name}" not in known
    }
    files |= {
        f"supabase/migrations/{p.name}": db.file_sha256(p)
        for p in sorted(out.glob("*.sql"))
        if f"supabase/migrations/{p.name}" not in known
    }
    manifest["releases"].append({"version": version, "commit": "0000000", "files": files})
    (sql / "released.json").write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    db.released_files.cache_clear()


def test_the_next_migration_holds_only_what_changed_since_the_last_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_db: Callable[[], str]
) -> None:
    sql = _sql_copy(tmp_path)
    out = tmp_path / "migrations"
    shutil.copytree(MIGRATIONS, out)
    monkeypatch.setattr(db, "sql_dir", lambda: sql)
    monkeypatch.setattr(db, "released_files", functools.cache(db.released_files.__wrapped__))
    _release(sql, out, "0.2.0")
    shipped = {p.name: p.read_bytes() for p in out.glob("*.sql")}
    assert [p.name for p in export(out)] == sorted(shipped)  # nothing changed: nothing new

    # One function changes, one column is added, one function is retired.
    claim = sql / "functions" / "40_claim.sql"
    claim.write_text(
        claim.read_text(encoding="utf-8").replace("returns jsonb", "returns jsonb\n-- changed", 1),
        encoding="utf-8",
    )
    (sql / "011_note.sql").write_text(
        "alter table thumbq.batch_runs add column if not exists note text;\n", encoding="utf-8"
    )
    with (sql / "retired.sql").open("a", encoding="utf-8") as f:
        f.write("drop function if exists thumbq.no_longer_there(text);\n")
    paths = export(out)
    assert {p.name: p.read_bytes() for p in paths if p.name in shipped} == shipped
    [new] = [p for p in paths if p.name not in shipped]
    assert new.name == f"{int(max(shipped).partition('_')[0]) + 1}_thumbq_011_note.sql"
    recorded = re.findall(r"^values \('([^']+)'", new.read_text(encoding="utf-8"), re.M)
    assert recorded == ["011_note", "retired", "functions/40_claim"]

    # Pushed on a project at the last release, the chain gives what `db init` gives.
    fresh = new_db()
    with db.connect(fresh) as conn:
        supabase_roles(conn)
        install_pgmq(conn, PGMQ_EXTENSION_VERSIONS[0])
        db.init_schema(conn)
    url = new_db()
    with db.connect(url) as conn:
        supabase_roles(conn)
        install_pgmq(conn, PGMQ_EXTENSION_VERSIONS[0])
        chain = {p.name: p.read_text(encoding="utf-8") for p in sorted(out.glob("*.sql"))}
        supabase_push(conn, {n: t for n, t in chain.items() if n in shipped})
        assert supabase_push(conn, chain) == [new.name]
        assert db.init_schema(conn)["applied"] == []
    assert schema_dump(url) == schema_dump(fresh)


# -- 3. upgrades on the real pgmq extension -----------------------------------------------------


@pytest.mark.parametrize("pgmq", PGMQ_EXTENSION_VERSIONS)
def test_the_whole_chain_pushed_to_a_new_project_is_a_fresh_install(
    pgmq: str, new_db: Callable[[], str]
) -> None:
    fresh = _fresh_install(new_db(), pgmq)
    url = new_db()
    with db.connect(url) as conn:
        supabase_roles(conn)
        install_pgmq(conn, pgmq)  # the project's pgmq; the migrations keep it
        applied = supabase_push(conn, _checked_in())
        assert applied == sorted(_checked_in())
        # The migrations recorded themselves: `thumbq db init` and a second push do nothing.
        assert db.init_schema(conn)["applied"] == []
        assert supabase_push(conn, _checked_in()) == []
        queues = {r["queue_name"] for r in conn.execute("select * from pgmq.list_queues()")}
        ext = conn.execute("select extversion from pg_extension where extname = 'pgmq'")
        assert ext.fetchone() == {"extversion": pgmq}
    # The work queue of each priority (0 is thumbq_jobs) and the dead letters.
    assert queues == {"thumbq_jobs", "thumbq_dlq"} | {f"thumbq_jobs_p{p}" for p in range(1, 10)}
    dump = schema_dump(url)
    assert "CREATE TABLE thumbq.jobs" in dump and "CREATE POLICY" in dump
    assert dump == fresh


@pytest.mark.parametrize("pgmq", PGMQ_EXTENSION_VERSIONS)
@pytest.mark.parametrize("pushed_at", [RELEASE, PRE_RELEASE], ids=["0.1.0", "pre-0.1.0"])
def test_db_push_on_a_project_pushed_at_an_earlier_release_applies_only_new_files(
    pgmq: str, pushed_at: str, new_db: Callable[[], str]
) -> None:
    fresh = _fresh_install(new_db(), pgmq)
    url = new_db()
    with db.connect(url) as conn:
        supabase_roles(conn)
        install_pgmq(conn, pgmq)
        earlier = _released_chain(pushed_at)
        assert supabase_push(conn, earlier) == sorted(earlier)
        # Work the project queued meanwhile survives the upgrade.
        conn.execute("select * from thumbq.enqueue('old.pdf', 'e1', 'g-old')")
        applied = supabase_push(conn, _checked_in())
    # Exactly the files the project lacks; none it already has is applied again.
    assert applied == sorted(set(_checked_in()) - set(earlier))
    assert schema_dump(url) == fresh
    with db.connect(url) as conn:
        group = conn.execute("select total, pending from thumbq.groups where group_id = 'g-old'")
        assert group.fetchone() == {"total": 1, "pending": 1}


def _old_db_init(commit: str, url: str, tmp_path: Path) -> dict[str, object]:
    """`thumbq db init` as the release at `commit` ran it: its worker/ and sql/ (git archive)
    imported in a subprocess of their own."""
    _require_history(commit)
    tree = tmp_path / f"thumbq-{commit}"
    with tarfile.open(fileobj=io.BytesIO(_git("archive", commit, "worker", "sql"))) as tar:
        tar.extractall(tree, filter="data")
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from worker import db;"
        "assert db.__file__.startswith(sys.argv[1]), db.__file__;"
        "print(json.dumps(db.init_schema(db.connect(sys.argv[2]))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tree), url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def _repeatables() -> list[str]:
    return [version for version, _ in db.repeatable_files()]


def _new_files_since(commit: str) -> list[str]:
    """The versioned files `commit` lacks, then every repeatable one (0.1.0 had none)."""
    old = {p.rsplit("/", 1)[1].removesuffix(".sql") for p in _files_at(commit, "sql")}
    return [p.stem for p in db.schema_files() if p.stem not in old] + _repeatables()


@pytest.mark.parametrize("pgmq", [PGMQ_SQL, *PGMQ_EXTENSION_VERSIONS])
def test_db_init_on_a_database_set_up_by_0_1_0_applies_only_new_files(
    pgmq: str, new_db: Callable[[], str], tmp_path: Path
) -> None:
    fresh_url = new_db()
    fresh = _fresh_install(fresh_url, pgmq)
    url = new_db()
    with db.connect(url) as conn:
        supabase_roles(conn)
        install_pgmq(conn, pgmq)
    assert _old_db_init(RELEASE, url, tmp_path)["pgmq"] == "present"
    with db.connect(url) as conn:
        result = db.init_schema(conn)
        assert result["applied"] == _new_files_since(RELEASE)
        assert db.init_schema(conn)["applied"] == []
    assert schema_dump(url) == fresh
    # And what thumbq owns in pgmq's schema: its queues (one per priority) and their grants.
    assert schema_dump(url, "pgmq") == schema_dump(fresh_url, "pgmq")


def test_db_init_on_a_database_set_up_before_0_1_0_reapplies_the_edited_file(
    new_db: Callable[[], str], tmp_path: Path
) -> None:
    # Before 0.1.0, 001_schema.sql was edited in place: such a database records another
    # checksum for it, so db init runs it again, and every file after it; 002 and 003 then
    # bring back 0.1.0's functions, so every repeatable file runs again too.
    fresh = _fresh_install(new_db(), PGMQ_SQL)
    url = new_db()
    with db.connect(url) as conn:
        supabase_roles(conn)
        install_pgmq(conn, PGMQ_SQL)
    _old_db_init(PRE_RELEASE, url, tmp_path)
    with db.connect(url) as conn:
        applied = db.init_schema(conn)["applied"]
        assert applied == [p.stem for p in db.schema_files()] + _repeatables()
    assert schema_dump(url) == fresh


def test_a_failing_migration_leaves_nothing_behind(empty_db_url: str) -> None:
    broken = migrations()[0].text.replace("commit;", "select 1/0;\ncommit;")
    with db.connect(empty_db_url) as conn:
        install_pgmq(conn, PGMQ_EXTENSION_VERSIONS[0])
        with pytest.raises(Exception, match="division by zero"):
            conn.execute(broken.encode())
        conn.rollback()
        row = conn.execute("select to_regclass('thumbq.jobs') as t").fetchone()
    assert row is not None and row["t"] is None
