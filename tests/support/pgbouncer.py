"""Debian's pgbouncer in transaction mode in front of the test server, for the pooler proof.

pgbouncer refuses to run as root, so under root it runs as `postgres` (via su) with its
config, log and pid files in a temporary folder that user owns. It is stopped by the pid in
its pid file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

RUN_AS = "postgres"


def binary() -> str | None:
    """The pgbouncer executable, or None when it is not installed."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None
    )


def unusable(server_url: str) -> str | None:
    """Why pgbouncer cannot stand before the server of `server_url` here, or None when it can."""
    if binary() is None:
        return "the pgbouncer binary is not installed (apt-get install pgbouncer)"
    host = str(conninfo_to_dict(server_url).get("host") or "")
    if host.startswith("/") and os.geteuid() == 0:
        # pgbouncer refuses to run as root, and the postgres user cannot enter root's private
        # folders, where the embedded fallback server keeps its socket.
        return (
            f"pgbouncer (run as {RUN_AS}) cannot reach the embedded server's socket in "
            f"{host}: set TEST_DATABASE_URL to a server on TCP"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(server: dict[str, str], port: int, folder: Path) -> str:
    host = server.get("host") or "127.0.0.1"
    target = f"host={host} port={server.get('port') or 5432}"
    user = server.get("user") or "postgres"
    return f"""\
[databases]
* = {target}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {folder / "users.txt"}
admin_users = {user}
pool_mode = transaction
max_client_conn = 200
default_pool_size = 10
server_reset_query =
ignore_startup_parameters = extra_float_digits,options
logfile = {folder / "pgbouncer.log"}
pidfile = {folder / "pgbouncer.pid"}
"""


@contextlib.contextmanager
def pgbouncer(server_url: str, timeout_s: float = 10.0) -> Iterator[str]:
    """Run pgbouncer in transaction mode before the server of `server_url`; yield a URL template
    (the same user, dbname to be filled in with `via()`) and stop it afterwards."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError("pgbouncer is not installed")
    server = {k: str(v) for k, v in conninfo_to_dict(server_url).items()}
    user = server.get("user") or "postgres"
    port = free_port()
    # Not pytest's tmp_path: its parents are 0700 root, which the postgres user cannot enter.
    folder = Path(tempfile.mkdtemp(prefix="thumbq-pgbouncer-"))
    (folder / "users.txt").write_text(f'"{user}" ""\n', encoding="utf-8")
    (folder / "pgbouncer.ini").write_text(_config(server, port, folder), encoding="utf-8")
    as_root = os.geteuid() == 0
    if as_root:
        shutil.chown(folder, RUN_AS)
        for f in folder.iterdir():
            shutil.chown(f, RUN_AS)
    cmd = f"{exe} -d {folder / 'pgbouncer.ini'}"
    argv = ["su", RUN_AS, "-s", "/bin/bash", "-c", cmd] if as_root else ["bash", "-c", cmd]
    pid: int | None = None
    try:
        subprocess.run(argv, check=True, capture_output=True, timeout=timeout_s)
        pid = _wait_for(folder / "pgbouncer.pid", port, timeout_s)
        yield make_conninfo(server_url, host="127.0.0.1", port=str(port))
    finally:
        if pid is None:
            pid = _read_pid(folder / "pgbouncer.pid")
        if pid is not None:
            _stop(pid, timeout_s)
        shutil.rmtree(folder, ignore_errors=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _wait_for(pidfile: Path, port: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = _read_pid(pidfile)
        if pid is not None:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
                return pid
        time.sleep(0.05)
    log = pidfile.with_name("pgbouncer.log")
    tail = log.read_text()[-2000:] if log.exists() else "(no log)"
    raise RuntimeError(f"pgbouncer did not start on port {port}:\n{tail}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A daemon that exited stays a zombie until init reaps it, which some containers do late.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _stop(pid: int, timeout_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def via(bouncer_url: str, db_url: str) -> str:
    """`db_url`'s database, reached through the pgbouncer of `bouncer_url`."""
    return make_conninfo(bouncer_url, dbname=conninfo_to_dict(db_url).get("dbname"))


def pool_mode(bouncer_url: str) -> str:
    """The pool mode pgbouncer reports on its admin console (`SHOW CONFIG`)."""
    with psycopg.connect(
        make_conninfo(bouncer_url, dbname="pgbouncer"), autocommit=True, prepare_threshold=None
    ) as admin:
        cur = admin.cursor()
        cur.execute("show config")
        rows = cur.fetchall()
    return next(str(r[1]) for r in rows if r[0] == "pool_mode")
