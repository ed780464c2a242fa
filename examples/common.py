"""What the examples share: the thumbq configuration a handler runs under, and enqueueing.

A handler gets its job (`ctx`, `payload`) but no connection or storage: it runs in a render
child process or a worker thread, for as long as its invocation. It reaches the database and
the storage the way every thumbq command does, from the environment (DATABASE_URL, else the
embedded Postgres of THUMBQ_HOME; THUMBQ_STORAGE_URL, else THUMBQ_HOME's storage folder), read
once per process and configuration.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import Storage, open_storage


def config() -> Config:
    """The thumbq configuration of this process's environment."""
    return _config(tuple(sorted(os.environ.items())))


@functools.lru_cache(maxsize=8)
def _config(env: tuple[tuple[str, str], ...]) -> Config:
    return Config.from_env(dict(env))


@functools.lru_cache(maxsize=8)
def _database_url(cfg: Config) -> str:
    return db.database_url(cfg)


@functools.lru_cache(maxsize=8)
def _storage(cfg: Config) -> Storage:
    return open_storage(cfg)


def database_url() -> str:
    """DATABASE_URL, or the URL of THUMBQ_HOME's embedded Postgres (as `thumbq up` uses)."""
    return _database_url(config())


def connect() -> db.Conn:
    """A new autocommit connection to thumbq's database (close it when done)."""
    return db.connect(database_url(), application_name="thumbq-example")


def storage() -> Storage:
    """The storage thumbq writes to (one client per process and configuration)."""
    return _storage(config())


def enqueue(
    items: Sequence[Mapping[str, Any]], group_id: str, conn: db.Conn | None = None
) -> list[dict[str, Any]]:
    """Enqueue jobs (`Queue.enqueue_jobs`); on `conn`, or on a connection of its own."""
    if conn is not None:
        return Queue(conn).enqueue_jobs(items, group_id)
    with connect() as own:
        return Queue(own).enqueue_jobs(items, group_id)
