"""The embedded default: a Postgres from the `pgserver` wheel under `THUMBQ_HOME`.

Shared by the commands of one home: the first command that needs it starts it, later ones join
it, and it stops when the last command using it ends (or on `thumbq down`). So `thumbq status`
in a second terminal reads the database `thumbq up` runs on, and neither starts a second
server nor stops the other's. Who uses it is kept in the home's registry (worker/local/home.py).

pgserver ships wheels for Linux x86_64 (glibc) and macOS only, so the `local` extra installs it
only there (an environment marker in pyproject.toml); elsewhere, and in a serverless function's
lean install, thumbq needs `DATABASE_URL`.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

from worker.local import home as registry

PGDATA = "pgdata"
STOP_TIMEOUT_S = 15.0
# How long a start that pgserver gave up on may still take to become ready.
START_GRACE_S = 30.0


class EmbeddedUnavailable(RuntimeError):
    """No embedded Postgres on this machine (pgserver is not installed): set DATABASE_URL."""


class EmbeddedError(RuntimeError):
    """The embedded Postgres could not be started, found or stopped; the message says why."""


def _pgserver() -> Any:
    import warnings

    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its fallback is fine.
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            where = f"{sys.platform} {platform.machine()}"
            raise EmbeddedUnavailable(
                f"DATABASE_URL is not set and the embedded Postgres (pgserver, installed by "
                f"pip install 'thumbq[local]' on Linux x86_64 and macOS) is not installed here "
                f"({where}): set DATABASE_URL to a Postgres connection string, e.g. "
                "postgresql://user@host/db"
            ) from None
    # pgserver logs a failed start with the server's whole log: thumbq says it in one line.
    logging.getLogger("pgserver").propagate = False
    logging.getLogger("pgserver").addHandler(logging.NullHandler())
    return pgserver


def check_home(home: Path) -> None:
    """Raise EmbeddedUnavailable, naming DATABASE_URL, when the embedded Postgres cannot live
    in `home` (a read-only file system, as on a serverless host): without this check the first
    write in it failed with a bare "No such file or directory"."""
    try:
        home.mkdir(parents=True, exist_ok=True)
        probe = home / f".thumbq-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise EmbeddedUnavailable(
            f"DATABASE_URL is not set, and the embedded Postgres cannot run here: its folder "
            f"{home} (THUMBQ_HOME) cannot be written ({exc.strerror or exc}): set DATABASE_URL "
            "to a Postgres connection string, e.g. postgresql://user@host/db (or THUMBQ_HOME "
            "to a writable folder)"
        ) from None


def unavailable_reason(home: Path) -> str | None:
    """Why the embedded Postgres cannot run for `home` (pgserver missing, home not writable),
    or None when it can: what an app without DATABASE_URL answers on every route."""
    try:
        _pgserver()
        check_home(home)
    except EmbeddedUnavailable as exc:
        return str(exc)
    return None


class EmbeddedPostgres:
    """The embedded Postgres of one home: its data folder and its server process."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.pgdata = home / PGDATA

    def exists(self) -> bool:
        """Whether a database cluster was ever created here."""
        return (self.pgdata / "PG_VERSION").exists()

    def pid(self) -> int | None:
        """The server's process id while it runs, else None."""
        try:
            first = (self.pgdata / "postmaster.pid").read_text().split("\n", 1)[0]
            pid = int(first)
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # it runs as another user (pgserver runs it as `pgserver` under root)
        return pid

    def start(self) -> tuple[str, bool]:
        """Start the server, or find it running; its URL and whether it was started now.
        Call under `registry.locked(home)`."""
        pgserver = _pgserver()
        was_running = self.pid() is not None
        self.home.mkdir(parents=True, exist_ok=True)
        try:
            server = pgserver.get_server(self.pgdata, cleanup_mode=None)
            url = str(server.get_uri())
        except Exception as exc:
            # pgserver gives pg_ctl 10 s; on a busy machine the server it started may still be
            # on its way up: wait for it before calling it a failure.
            ready = self._ready_url(timeout_s=START_GRACE_S)
            if ready is None:
                raise EmbeddedError(
                    f"cannot start the embedded Postgres in {self.pgdata} "
                    f"({type(exc).__name__}: {exc}); its log is {self.pgdata / 'log'}"
                ) from exc
            url = ready
        return url, not was_running

    def _ready_url(self, timeout_s: float) -> str | None:
        """The URL of a server that is up and ready (from its postmaster.pid), waiting up to
        `timeout_s` for it; None when none comes."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
            except OSError:
                lines = []
            if len(lines) >= 8 and lines[7].strip() == "ready" and self.pid() is not None:
                socket_dir = lines[4].strip()
                return f"postgresql://postgres:@/postgres?host={socket_dir}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop the server (fast shutdown: sessions are ended, nothing is lost); False when it
        was not running."""
        pid = self.pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGINT)
        if not _wait_gone(pid, timeout_s):
            os.kill(pid, signal.SIGQUIT)
            if not _wait_gone(pid, 5.0):
                raise EmbeddedError(f"the embedded Postgres (pid {pid}) did not stop")
        return True


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        time.sleep(0.05)
    return False


class EmbeddedLease:
    """One command's use of its home's embedded Postgres: joined (or started) by `acquire`,
    given back by `release`, which stops the server unless another command still uses it."""

    def __init__(self, home: Path, command: str, **registration: Any) -> None:
        self.server = EmbeddedPostgres(home)
        self.home = home
        self.command = command
        self.registration = registration
        self.started = False
        self.url: str | None = None

    def acquire(self, *, create: bool = True) -> str:
        """The database URL. Without `create`, a home that has no database yet is refused
        (read-only commands never create one)."""
        _pgserver()  # says what to do where pgserver is not installed
        check_home(self.home)
        if not create and not self.server.exists():
            raise EmbeddedError(
                f"there is no embedded database in {self.home} yet: create it with "
                "`thumbq up` (or `thumbq db init`), or set DATABASE_URL"
            )
        with registry.locked(self.home):
            self.url, self.started = self.server.start()
            registry.register(
                self.home,
                command=self.command,
                embedded=True,
                database=registry.database_fingerprint(self.url),
                **self.registration,
            )
        return self.url

    def update(self, **fields: Any) -> None:
        """Add to this command's registration (its schedule and API once it serves)."""
        self.registration.update(fields)
        if self.url is None:
            return
        with registry.locked(self.home):
            registry.register(
                self.home,
                command=self.command,
                embedded=True,
                database=registry.database_fingerprint(self.url),
                **self.registration,
            )

    def release(self) -> str:
        """Give the server back; a sentence saying whether it was stopped, or left running
        although this command started it (another joined meanwhile). Joining a server another
        command runs and leaving it to that one is the normal case, and says nothing."""
        if self.url is None:
            return ""
        with registry.locked(self.home):
            registry.unregister(self.home)
            users = [r for r in registry.running(self.home) if r.embedded]
            if users:
                self.url = None
                if not self.started:
                    return ""
                names = ", ".join(r.name for r in users)
                return f"left the embedded Postgres running: {names} still uses it"
            stopped = self.server.stop()
        self.url = None
        return "stopped the embedded Postgres" if stopped else ""


def embedded_database_url(home: Path) -> str:
    """Start (or find) the embedded Postgres for `home` and return its URL, for a process that
    is not a thumbq command (the WSGI app run by another server): the server is left running,
    and `thumbq down` stops it."""
    _pgserver()
    check_home(home)
    with registry.locked(home):
        url, _started = EmbeddedPostgres(home).start()
    return url
