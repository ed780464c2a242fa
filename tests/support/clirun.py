"""Running the installed `thumbq` console script as a user does: a subprocess with its own
environment, its stdout and stderr captured."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import psycopg

# Variables of the developer's shell that would point a test's thumbq elsewhere.
_SCRUB = (
    "DATABASE_URL",
    "TEST_DATABASE_URL",
    "THUMBQ_HOME",
    "THUMBQ_STORAGE_URL",
    "THUMBQ_CRON_SECRET",
    "CRON_SECRET",
    "THUMBQ_JWT_SECRET",
    "THUMBQ_API_URL",
    "THUMBQ_DEBUG",
    "SUPABASE_URL",
    "SUPABASE_ANON_KEY",
    "THUMBQ_USER_JWT",
)


def thumbq_exe() -> str:
    """The `thumbq` script installed next to this interpreter (the venv's)."""
    exe = shutil.which("thumbq", path=str(Path(sys.executable).parent))
    if exe is None:
        raise RuntimeError("the thumbq console script is not installed: pip install -e .")
    return exe


def user_env(tmp: Path, **extra: str) -> dict[str, str]:
    """A clean environment for one user: HOME (and XDG data) under `tmp`, nothing of thumbq's
    set but `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB and not k.startswith("XDG_")}
    env["HOME"] = str(tmp / "user-home")
    (tmp / "user-home").mkdir(parents=True, exist_ok=True)
    env.update(extra)
    return env


def thumbq(
    *args: str,
    env: Mapping[str, str],
    cwd: Path | None = None,
    timeout: float = 120,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `thumbq ARGS...` to completion."""
    return subprocess.run(
        [thumbq_exe(), *args],
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
    )


class Running:
    """A started `thumbq` process and what it has printed so far, line by line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.out: list[str] = []
        self.err: list[str] = []

    def printed(self, text: str) -> bool:
        return any(text in line for line in self.out + self.err)


@contextmanager
def thumbq_running(
    *args: str, env: Mapping[str, str], cwd: Path | None = None, ready: str, timeout: float = 60
) -> Iterator[Running]:
    """Start `thumbq ARGS...`, wait until it prints a line containing `ready` (stdout or
    stderr), yield it; Ctrl-C (SIGINT) it afterwards and wait for it to end."""
    import signal
    import threading

    proc = subprocess.Popen(
        [thumbq_exe(), *args],
        env=dict(env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run = Running(proc)

    def read(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line.rstrip("\n"))

    readers = [
        threading.Thread(target=read, args=(proc.stdout, run.out), daemon=True),
        threading.Thread(target=read, args=(proc.stderr, run.err), daemon=True),
    ]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + timeout
        while not run.printed(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise AssertionError(
                    f"thumbq {' '.join(args)} did not get ready:\n" + "\n".join(run.out + run.err)
                )
            time.sleep(0.05)
        yield run
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for t in readers:
            t.join(5)


def one_line_error(proc: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The single line a failed command printed on stderr (asserting that it is one)."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def schemas(url: str) -> set[str]:
    """Which of thumbq's and pgmq's schemas the database at `url` holds."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "select nspname from pg_namespace where nspname in ('thumbq', 'pgmq')"
        ).fetchall()
    return {r[0] for r in rows}
