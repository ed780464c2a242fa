"""Postgres fixtures: one server per session, one database per test.

Imported by the conftest.py of tests/db and tests/system; tests/unit never sees them.

The server is the one in TEST_DATABASE_URL, else an embedded pgserver Postgres, so the suite
passes on a laptop too. The schema is applied once to a template database; each test gets
`CREATE DATABASE ... TEMPLATE`, which is fast and isolates tests completely.

Which pgmq a test's database has is chosen, never left to the server: by default the `pgmq`
package's SQL (the embedded default's path), whether or not the server also offers the pgmq
extension. A module marked `pytest.mark.pgmq_versions` runs each test that takes a database
three times: on that SQL install and on the pgmq extension at 1.4.4 and 1.5.1 (Supabase's), one
template each, made on first use. A test may also take `pgmq_install` to ask for one.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from tests.support.pgtools import PGMQ_EXTENSION_VERSIONS, PGMQ_SQL, install_pgmq
from worker.engine import db
from worker.engine.config import Config


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pgmq_install" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "pgmq_versions"
    ):
        installs = [PGMQ_SQL, *PGMQ_EXTENSION_VERSIONS]
        metafunc.parametrize("pgmq_install", installs, ids=[f"pgmq-{i}" for i in installs])


def _with_db(url: str, name: str) -> str:
    return make_conninfo(url, dbname=name)


@pytest.fixture(scope="session")
def pg_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of the session's Postgres server (its maintenance database)."""
    url = os.environ.get("TEST_DATABASE_URL")
    if url:
        yield url
        return
    import pgserver

    server = pgserver.get_server(tmp_path_factory.mktemp("pg") / "pgdata", cleanup_mode="stop")
    yield str(server.get_uri())
    server.cleanup()


def _admin(url: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(_with_db(url, "postgres"), autocommit=True)


class Templates:
    """Template databases with the thumbq schema, one per pgmq install, made on first use."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.names: dict[str, str] = {}

    def get(self, pgmq: str) -> str:
        if pgmq not in self.names:
            name = f"thumbq_tpl_{uuid.uuid4().hex[:8]}"
            with _admin(self.server_url) as admin:
                admin.execute(f'create database "{name}"')
            try:
                with db.connect(_with_db(self.server_url, name)) as conn:
                    install_pgmq(conn, pgmq)
                    db.init_schema(conn)
            except BaseException:
                drop_database(self.server_url, name)
                raise
            self.names[pgmq] = name
        return self.names[pgmq]

    def close(self) -> None:
        for name in self.names.values():
            drop_database(self.server_url, name)


@pytest.fixture(scope="session")
def templates(pg_server_url: str) -> Iterator[Templates]:
    """The session's template databases, by pgmq install."""
    made = Templates(pg_server_url)
    yield made
    made.close()


@pytest.fixture(scope="session")
def template_db(templates: Templates) -> str:
    """The default template: pgmq from the package's SQL and the thumbq schema."""
    return templates.get(PGMQ_SQL)


@pytest.fixture
def pgmq_install() -> str:
    """Which pgmq the test's database has (parametrized in `pgmq_versions` modules)."""
    return PGMQ_SQL


def drop_database(server_url: str, name: str) -> None:
    with _admin(server_url) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')


class Dropper:
    """Drops the tests' databases on a thread of its own: a DROP DATABASE waits on the disk
    (0.1 s idle, seconds on a busy machine) and the next test need not wait with it. Each
    database has a name of its own, so nothing a test sees depends on when a drop ends."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self.names: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="drop-test-databases", daemon=True)
        self.thread.start()

    def drop(self, name: str) -> None:
        self.names.put(name)

    def _run(self) -> None:
        while (name := self.names.get()) is not None:
            try:
                drop_database(self.server_url, name)
            except Exception as exc:  # reported at the end of the session, never lost
                self.errors.append(f"{name}: {exc}")

    def close(self) -> None:
        self.names.put(None)
        self.thread.join()
        assert not self.errors, f"test databases left behind: {self.errors}"


@pytest.fixture(scope="session")
def dropper(pg_server_url: str) -> Iterator[Dropper]:
    """Drops the session's test databases in the background; all are gone when it ends."""
    made = Dropper(pg_server_url)
    yield made
    made.close()


@pytest.fixture
def db_url(
    pg_server_url: str, templates: Templates, pgmq_install: str, dropper: Dropper
) -> Iterator[str]:
    """A fresh database with pgmq and the schema, dropped after the test."""
    template = templates.get(pgmq_install)
    name = f"thumbq_t_{uuid.uuid4().hex[:12]}"
    with _admin(pg_server_url) as admin:
        admin.execute(f'create database "{name}" template "{template}"')
    yield _with_db(pg_server_url, name)
    dropper.drop(name)


@pytest.fixture
def new_db(pg_server_url: str, dropper: Dropper) -> Iterator[Callable[[], str]]:
    """Makes empty databases (as many as the test asks for), dropped after the test."""
    made: list[str] = []

    def make() -> str:
        name = f"thumbq_e_{uuid.uuid4().hex[:12]}"
        with _admin(pg_server_url) as admin:
            admin.execute(f'create database "{name}"')
        made.append(name)
        return _with_db(pg_server_url, name)

    yield make
    for name in made:
        dropper.drop(name)


@pytest.fixture
def empty_db_url(new_db: Callable[[], str]) -> str:
    """A fresh database with nothing in it."""
    return new_db()


@pytest.fixture
def conn(db_url: str) -> Iterator[db.Conn]:
    with db.connect(db_url) as c:
        yield c


@pytest.fixture
def config(tmp_path: Path, db_url: str) -> Config:
    """A configuration on the test's database and a local storage folder."""
    return Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "2",
        }
    )
