"""Test fixtures: one Postgres server per session, one database per test.

The server is the one in TEST_DATABASE_URL, else an embedded pgserver Postgres, so the suite
passes on a laptop too. The schema is applied once to a template database; each test gets
`CREATE DATABASE ... TEMPLATE`, which is fast and isolates tests completely.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from worker import db
from worker.config import Config

pytest_plugins = ["tests.s3fixtures"]


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


@pytest.fixture(scope="session")
def template_db(pg_server_url: str) -> Iterator[str]:
    """A database with pgmq and the thumbq schema, used as the template of every test's."""
    name = f"thumbq_tpl_{uuid.uuid4().hex[:8]}"
    with _admin(pg_server_url) as admin:
        admin.execute(f'create database "{name}"')
    with db.connect(_with_db(pg_server_url, name)) as conn:
        db.init_schema(conn)
    yield name
    with _admin(pg_server_url) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture
def db_url(pg_server_url: str, template_db: str) -> Iterator[str]:
    """A fresh database with the schema, dropped after the test."""
    name = f"thumbq_t_{uuid.uuid4().hex[:12]}"
    with _admin(pg_server_url) as admin:
        admin.execute(f'create database "{name}" template "{template_db}"')
    yield _with_db(pg_server_url, name)
    with _admin(pg_server_url) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')


@pytest.fixture
def empty_db_url(pg_server_url: str) -> Iterator[str]:
    """A fresh database with nothing in it."""
    name = f"thumbq_e_{uuid.uuid4().hex[:12]}"
    with _admin(pg_server_url) as admin:
        admin.execute(f'create database "{name}"')
    yield _with_db(pg_server_url, name)
    with _admin(pg_server_url) as admin:
        admin.execute(f'drop database if exists "{name}" with (force)')


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
