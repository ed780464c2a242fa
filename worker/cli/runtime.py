"""What one command holds while it runs (its configuration, its database, its entry in the
home's registry) and how it reaches its database, storage and queue."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from worker.cli.errors import CliError, say
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue

if TYPE_CHECKING:
    from worker.local.embedded import EmbeddedLease
    from worker.storage import Storage


class Runtime:
    """What one command holds while it runs: its configuration, the database (the home's
    embedded Postgres is joined or started on first use and given back at the end, stopped
    unless another command still uses it) and its entry in the home's registry."""

    def __init__(self, config: Config, command: str) -> None:
        self.config = config
        self.command = command
        self.embedded = not config.database_url
        self.lease: EmbeddedLease | None = None
        self.registered = False

    @property
    def where(self) -> str:
        """The database, in words."""
        if self.embedded:
            return f"the embedded Postgres in {self.config.home}"
        return f"the database {url_summary(self.config.database_url or '')} (DATABASE_URL)"

    def database_url(self, *, create: bool = True) -> str:
        """DATABASE_URL, or the home's embedded Postgres (started if needed; never created
        when `create` is false)."""
        if self.config.database_url:
            return self.config.database_url
        from worker.local.embedded import EmbeddedLease

        if self.lease is None:
            self.lease = EmbeddedLease(self.config.home, self.command)
        url = self.lease.acquire(create=create)
        if self.lease.started:
            say(
                f"started the embedded Postgres in {self.config.home}; it stops when the last "
                "thumbq command using it ends"
            )
        return url

    def announce(self, **fields: Any) -> None:
        """Tell the home's other commands what this one does (its schedule, its API)."""
        from worker.local import home

        if self.lease is not None and self.lease.url is not None:
            self.lease.update(**fields)
            return
        with home.locked(self.config.home):
            home.register(
                self.config.home,
                command=self.command,
                embedded=False,
                database=home.database_fingerprint(self.database_url()),
                **fields,
            )
        self.registered = True

    def close(self) -> None:
        """Give the embedded Postgres back (saying whether it stopped) and unregister."""
        if self.lease is not None:
            lease, self.lease = self.lease, None
            say(lease.release())
        if self.registered:
            from worker.local import home

            with home.locked(self.config.home):
                home.unregister(self.config.home)
            self.registered = False


def url_summary(url: str) -> str:
    """host:port/dbname of a connection string, never its password."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    host = info.get("host") or "localhost"
    port = f":{info['port']}" if info.get("port") else ""
    return f"{host}{port}/{info.get('dbname') or info.get('user') or ''}"


def connect(rt: Runtime, *, readonly: bool = False) -> db.Conn:
    """A connection to the command's database. A database without thumbq's schema gets it,
    unless the command only reads: then it is an error that says how to create it."""
    import psycopg

    url = rt.database_url(create=not readonly)
    try:
        conn = db.connect(url)
    except psycopg.OperationalError as exc:
        raise CliError(connect_error(exc, rt, url)) from None
    row = conn.execute("select to_regclass('thumbq.jobs') is not null as ready").fetchone()
    if not (row and row["ready"]):
        if readonly:
            conn.close()
            raise CliError(
                f"{rt.where} has no thumbq schema yet; create it with `thumbq db init` "
                "(or `thumbq up`, which does)"
            )
        result = db.init_schema(conn)
        say(f"created the thumbq schema in {rt.where} ({', '.join(result['applied'])})")
    return conn


@contextmanager
def read_only(conn: db.Conn) -> Iterator[None]:
    """A read-only transaction: whatever a read runs, Postgres refuses to write."""
    with conn.transaction():
        conn.execute("set transaction read only")
        yield


def connect_error(exc: Exception, rt: Runtime, url: str) -> str:
    """Why `url` could not be reached, in one line that says what to do."""
    from psycopg.conninfo import conninfo_to_dict

    text = " ".join(str(exc).split())
    info = conninfo_to_dict(url)
    where = rt.where
    low = text.lower()
    if "does not exist" in low and "database" in low:
        name = info.get("dbname") or info.get("user") or ""
        return (
            f'{where}: database "{name}" does not exist; create it (createdb {name}) '
            "or set DATABASE_URL to an existing database"
        )
    if "password authentication failed" in low or "no password supplied" in low:
        return (
            f"{where} refused the login of user {info.get('user') or '?'}: check the user and "
            "password in DATABASE_URL"
        )
    for clue, why in (
        ("connection refused", "connection refused"),
        ("timeout expired", "no answer within 5 s"),
        ("could not translate host name", "unknown host"),
        ("name or service not known", "unknown host"),
        ("no such file or directory", "no server at that socket"),
    ):
        if clue in low:
            return f"cannot reach {where} ({why}): start Postgres there or fix DATABASE_URL"
    return f"cannot connect to {where}: {text}; check DATABASE_URL"


def storage_of(rt: Runtime) -> Storage:
    """The storage the configuration names."""
    from worker.storage import open_storage

    return open_storage(rt.config)


def queue_of(rt: Runtime, conn: db.Conn) -> Queue:
    """The queue over `conn`, with the configured rate bucket and attempts."""
    return Queue(conn, bucket=rt.config.rate_bucket, max_attempts=rt.config.max_attempts)
