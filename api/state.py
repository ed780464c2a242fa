"""What one app process keeps between requests: a small connection pool, the storage client and
the render processes, each created on first use so that a cold start pays only for what it uses.

A warm serverless instance reuses all three; nothing here holds session state in Postgres, so a
transaction-mode pooler (Supavisor, pgbouncer) sits happily in front.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from psycopg.rows import dict_row

from api.auth import Authenticator
from api.cache import TimedCache
from worker.engine import db

if TYPE_CHECKING:
    from psycopg_pool import ConnectionPool

    from worker.engine.config import Config
    from worker.storage import Storage
    from worker.thumbnails.render.process import RenderPool

# Poolers and NAT gateways drop idle connections: one idle longer than this is pinged (an empty
# query) before use, so a thawed serverless instance gets a live connection, not a 503.
PING_AFTER_IDLE_S = 30.0
# A progress stream reads its group this often (through the progress cache, so streams and
# pollers of one group share a read), sends a comment after this long without an event (so
# that proxies and clients keep the connection), and ends after this long (the client
# reconnects: its credentials are checked again).
STREAM_POLL_S = 1.0
STREAM_HEARTBEAT_S = 15.0
STREAM_MAX_S = 30 * 60.0


class AppState:
    """Lazily created, process-wide resources of one Flask app."""

    def __init__(
        self, config: Config, *, pool_size: int = 4, db_timeout_s: float = 5.0, pooled: bool = True
    ) -> None:
        self.config = config
        self.pool_size = pool_size
        self.db_timeout_s = db_timeout_s
        self.pooled = pooled
        self.batch_lock = threading.Lock()
        # Interactive runs (POST /api/jobs with wait_ms) at once in this process: one per render
        # process, so that a click waits for its own job, not for a queue of other clicks; and
        # each holds a pooled connection for its wait, so one connection always stays for
        # everything else. Beyond, the job stays queued and the answer says `busy`.
        inline = config.concurrency if not pooled else min(config.concurrency, pool_size - 1)
        self.inline_slots = threading.BoundedSemaphore(max(1, inline))
        # Open progress streams (api/stream.py): each holds a request thread while it is open,
        # and is refused with 503 beyond this. `thumbq serve` gives streams threads of their own.
        self.stream_slots = threading.BoundedSemaphore(max(1, config.max_streams))
        self.streams_enabled = config.max_streams > 0
        # How a stream polls, keeps the connection alive, and how long it lives before the
        # client reconnects (with Last-Event-ID, so nothing is sent twice); tests shorten them.
        self.stream_poll_s = STREAM_POLL_S
        self.stream_heartbeat_s = STREAM_HEARTBEAT_S
        self.stream_max_s = STREAM_MAX_S
        # Who a reader's token is (admin secret, HS256 or JWKS-signed JWT), with its caches.
        self.auth = Authenticator(config)
        # A group's progress answer, for everyone allowed to see it.
        self.progress_cache = TimedCache(config.progress_cache_ms / 1000)
        # Whether a user (by verified claims) may see a group, as RLS decided.
        self.access_cache = TimedCache(config.access_cache_ms / 1000)
        self._lock = threading.Lock()
        self._url: str | None = None
        self._pool: ConnectionPool[Any] | None = None
        self._storage: Storage | None = None
        self._render_pool: RenderPool | None = None
        self._last_used: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._problem: str | None = None
        self._problem_checked = False

    def configuration_problem(self) -> str | None:
        """Why this app cannot work as configured, checked once per process: no DATABASE_URL
        where no embedded Postgres can run (a serverless host), or a THUMBQ_TASKS module that
        does not exist. None when it can; every route answers 503 not_configured otherwise."""
        if self._problem_checked:
            return self._problem
        with self._lock:
            if not self._problem_checked:
                from worker.engine.config import ConfigError, check_task_modules

                problem = None
                if not self.config.database_url:
                    from worker.local.embedded import unavailable_reason

                    problem = unavailable_reason(self.config.home)
                if problem is None:
                    try:
                        check_task_modules(self.config.tasks)
                    except ConfigError as exc:
                        problem = str(exc)
                self._problem, self._problem_checked = problem, True
            return self._problem

    # -- database ---------------------------------------------------------------------------

    def database_url(self) -> str:
        """The database URL (starting the embedded Postgres when none is configured)."""
        with self._lock:
            if self._url is None:
                self._url = db.database_url(self.config)
            return self._url

    def _ping_if_idle(self, conn: db.Conn) -> None:
        last = self._last_used.get(conn)
        if last is not None and time.monotonic() - last > PING_AFTER_IDLE_S:
            conn.execute("")

    def _get_pool(self) -> ConnectionPool[Any]:
        url = self.database_url()
        with self._lock:
            if self._pool is None:
                from psycopg_pool import ConnectionPool

                # The same settings as db.connect: autocommit, no prepared statements.
                self._pool = ConnectionPool(
                    url,
                    min_size=1,
                    max_size=self.pool_size,
                    timeout=self.db_timeout_s,
                    max_idle=300,
                    name="thumbq-api",
                    check=self._ping_if_idle,
                    kwargs={
                        "autocommit": True,
                        "prepare_threshold": None,
                        "row_factory": dict_row,
                        "connect_timeout": max(1, round(self.db_timeout_s)),
                        "application_name": "thumbq-api",
                    },
                    open=False,
                )
                self._pool.open(wait=False)
            return self._pool

    @contextmanager
    def connection(self) -> Iterator[db.Conn]:
        """A connection for one request: from the pool, or a fresh one when pooling is off."""
        if not self.pooled:
            conn = db.connect(
                self.database_url(),
                connect_timeout=max(1, round(self.db_timeout_s)),
                application_name="thumbq-api",
            )
            try:
                yield conn
            finally:
                conn.close()
            return
        pool = self._get_pool()
        with pool.connection() as conn:
            try:
                yield conn
            finally:
                self._last_used[conn] = time.monotonic()

    def dedicated_connection(self) -> db.Conn:
        """A connection of its own for a long call (the batch), so it never starves the pool."""
        return db.connect(
            self.database_url(),
            connect_timeout=max(1, round(self.db_timeout_s)),
            application_name="thumbq-batch",
        )

    # -- storage and rendering ----------------------------------------------------------------

    def storage(self) -> Storage:
        """The configured object storage, opened once per process."""
        with self._lock:
            if self._storage is None:
                from worker.storage import open_storage

                self._storage = open_storage(self.config)
            return self._storage

    def render_pool(self) -> RenderPool:
        """The render processes, started on the first batch and reused by later ones."""
        with self._lock:
            if self._render_pool is None:
                from worker.thumbnails.render.process import RenderPool
                from worker.thumbnails.task import render_options

                self._render_pool = RenderPool(
                    render_options(self.config),
                    self.config.concurrency,
                    self.config.render_memory_mb,
                )
            return self._render_pool

    def close(self) -> None:
        """Close the pool and stop the render processes; safe to call twice (atexit, tests)."""
        with self._lock:
            pool, self._pool = self._pool, None
            render_pool, self._render_pool = self._render_pool, None
        if pool is not None:
            pool.close(timeout=1.0)
        if render_pool is not None:
            render_pool.close()
