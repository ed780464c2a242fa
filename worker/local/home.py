"""Which thumbq commands are running in one THUMBQ_HOME, so that they can share it.

Each command that uses the home's embedded Postgres, or schedules batches, registers itself in
`$THUMBQ_HOME/run/<pid>.json` while it runs (what it is, whether it uses the embedded Postgres,
its schedule and API for `up`/`scheduler`). Another command reads the registry to know whether
the embedded Postgres is still in use before stopping it, and when the next batch is due.
A process that died without unregistering (SIGKILL) is recognised by its pid no longer running
with the same start time, and its entry is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RUN_DIR = "run"


@dataclass(frozen=True)
class Registration:
    """One running thumbq command of a home."""

    pid: int
    started: float  # the process's start time, as the OS reports it (guards against pid reuse)
    command: str  # "up", "status", ...
    embedded: bool  # uses the home's embedded Postgres
    database: str | None = None  # a fingerprint of the database it uses (never a password)
    schedule: str | None = None  # the cron schedule of its batch calls (`up`, `scheduler`)
    api_url: str | None = None  # where it serves or calls the API

    @property
    def name(self) -> str:
        return f"thumbq {self.command} (pid {self.pid})"


def _process_start(pid: int) -> float | None:
    """When process `pid` started, or None when there is no such process."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _alive(reg: Registration) -> bool:
    started = _process_start(reg.pid)
    return started is not None and abs(started - reg.started) < 1.0


@contextlib.contextmanager
def locked(home: Path) -> Iterator[None]:
    """Hold the home's lock: one command at a time registers, starts or stops the embedded
    Postgres, so that two commands never start two servers or stop one in use."""
    run = home / RUN_DIR
    run.mkdir(parents=True, exist_ok=True)
    with open(run / ".lock", "a+b") as f:
        if sys.platform == "win32":  # pragma: no cover - no embedded Postgres there
            yield
            return
        import fcntl

        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def register(home: Path, **fields: Any) -> Registration:
    """Register this process (call under `locked`)."""
    pid = os.getpid()
    reg = Registration(pid=pid, started=_process_start(pid) or 0.0, **fields)
    path = home / RUN_DIR / f"{pid}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(reg)), encoding="utf-8")
    tmp.replace(path)
    return reg


def unregister(home: Path, pid: int | None = None) -> None:
    """Remove this process's registration (call under `locked`)."""
    (home / RUN_DIR / f"{pid or os.getpid()}.json").unlink(missing_ok=True)


def running(home: Path, *, exclude_self: bool = True) -> list[Registration]:
    """The live registrations of `home`; entries of dead processes are removed."""
    out: list[Registration] = []
    run = home / RUN_DIR
    if not run.is_dir():
        return out
    for path in sorted(run.glob("*.json")):
        try:
            reg = Registration(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            path.unlink(missing_ok=True)
            continue
        if not _alive(reg):
            path.unlink(missing_ok=True)
            continue
        if exclude_self and reg.pid == os.getpid():
            continue
        out.append(reg)
    return out


def database_fingerprint(url: str) -> str:
    """Which database a URL names (host, port, name, user), without its password: two
    commands compare fingerprints to know whether they work on the same database."""
    import hashlib

    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    key = "|".join(str(info.get(k) or "") for k in ("host", "port", "dbname", "user"))
    return hashlib.sha256(key.encode()).hexdigest()[:16]
