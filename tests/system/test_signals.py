"""Clean stops (docs/cli.md, "Stopping"): a real SIGINT or SIGTERM in the middle of a run.

Regression: Ctrl-C during `thumbq backfill --now` (300 photos, about 20 done) exited 130 at once
and left 223 jobs `processing` until their lease ran out, one charged an attempt with `internal`
("render stopped: the render pool is closing"), and 55 thumbnails on disk for 44 jobs recorded
`completed`. Now each command and server stops claiming, lets renders in flight finish (or stops
them without an attempt), records what finished, hands back the rest and exits within 5 s,
leaving no process behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.clirun import thumbq_exe, user_env
from tests.support.liveapp import call, put_samples, wait_until
from tests.support.s3fixtures import free_port
from worker.engine import db
from worker.engine.config import Config
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys

SECRET = "signals-secret-0123456789abcdef0123456789"
# Enough files that a run is well under way, and far from done, when the signal comes.
FILES = 400
# A signal comes once this many thumbnails are on disk.
STARTED = 20
EXIT_WITHIN_S = 5.0


class Proc:
    """A started `thumbq` command, its output collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.popen = subprocess.Popen(
            [thumbq_exe(), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.stdout: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(s, into), daemon=True)
            for s, into in ((self.popen.stdout, self.stdout), (self.popen.stderr, None))
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream: Any, into: list[str] | None) -> None:
        for line in stream:
            self.lines.append(line.rstrip("\n"))
            if into is not None:
                into.append(line)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def tree(self) -> list[psutil.Process]:
        """This process and every process below it (render zygote and children, granian's
        worker)."""
        me = psutil.Process(self.popen.pid)
        return [me, *me.children(recursive=True)]

    def stop(self, sig: int) -> tuple[float, int]:
        """Send `sig`; seconds until the process exited, and its exit code."""
        tree = self.tree()
        sent = time.monotonic()
        self.popen.send_signal(sig)
        try:
            code = self.popen.wait(EXIT_WITHIN_S + 25)
        except subprocess.TimeoutExpired:
            # The whole tree: a server's worker would outlive its parent.
            for p in tree[::-1]:
                with suppress(psutil.NoSuchProcess):
                    p.kill()
            code = self.popen.wait(10)
        took = time.monotonic() - sent
        print(f"{self.args[0]}: exited {took:.2f} s after signal {sig}")
        for t in self._readers:
            t.join(5)
        return took, code


@contextmanager
def running(args: list[str], env: dict[str, str]) -> Iterator[Proc]:
    proc = Proc(args, env)
    try:
        yield proc
    finally:
        if proc.popen.poll() is None:
            for p in proc.tree()[::-1]:
                with suppress(psutil.NoSuchProcess):
                    p.kill()
            proc.popen.wait(10)


def _env(tmp_path: Path, db_url: str, **extra: str) -> dict[str, str]:
    return user_env(
        tmp_path,
        DATABASE_URL=db_url,
        THUMBQ_STORAGE_URL=(tmp_path / "storage").as_uri(),
        THUMBQ_CONCURRENCY="2",
        PYTHONUNBUFFERED="1",
        **extra,
    )


def _config(tmp_path: Path, db_url: str) -> Config:
    return Config.from_env(
        {"DATABASE_URL": db_url, "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri()}
    )


def _put_files(tmp_path: Path, db_url: str, prefix: str) -> list[dict[str, Any]]:
    return put_samples(open_storage(_config(tmp_path, db_url)), prefix, good=FILES)


def _thumbnails(tmp_path: Path, prefix: str) -> int:
    folder = tmp_path / "storage" / "thumbnails" / prefix
    return sum(1 for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _jobs(db_url: str, prefix: str) -> list[dict[str, Any]]:
    with db.connect(db_url) as conn:
        return list(
            conn.execute(
                "select source_key, status, attempts, error_code, last_error"
                " from thumbq.jobs where source_key like %s",
                (prefix + "%",),
            ).fetchall()
        )


def _wait_mid_run(tmp_path: Path, prefix: str, proc: Proc, timeout_s: float = 90) -> None:
    """Until STARTED thumbnails are on disk (the run is under way and far from done)."""

    def started() -> bool:
        assert proc.popen.poll() is None, proc.output
        return _thumbnails(tmp_path, prefix) >= STARTED

    wait_until(started, timeout_s, 0.02)


def _assert_clean(tmp_path: Path, db_url: str, prefix: str, tree: list[psutil.Process]) -> None:
    """What a clean stop leaves: nothing `processing`, no attempt charged for work that never
    ran (no error at all: every file is good), as many thumbnails as completions, no process."""
    jobs = _jobs(db_url, prefix)
    assert len(jobs) == FILES
    by_status: dict[str, int] = {}
    for j in jobs:
        by_status[j["status"]] = by_status.get(j["status"], 0) + 1
    assert by_status.get("processing", 0) == 0, by_status
    charged = [j for j in jobs if j["status"] == "pending" and j["attempts"] > 0]
    assert not charged, charged[:3]
    errors = [j for j in jobs if j["error_code"] is not None]
    assert not errors, errors[:3]
    completed = by_status.get("completed", 0)
    assert completed >= STARTED and by_status.get("pending", 0) > 0, by_status
    # One size is configured: one file per completed job.
    assert _thumbnails(tmp_path, prefix) == completed
    # The render zygote and its children (and a server's worker) went with the command.
    deadline = time.monotonic() + 2
    alive = tree
    while alive and time.monotonic() < deadline:
        alive = [p for p in tree if _alive(p)]
        time.sleep(0.05)
    assert not alive, [(p.pid, p.name()) for p in alive]


def _answers(url: str) -> bool:
    try:
        return call("GET", url, timeout=2)[0] == 200
    except OSError:
        return False


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ctrl_c_during_backfill_now_records_what_finished_and_hands_back_the_rest(
    tmp_path: Path, db_url: str
) -> None:
    _put_files(tmp_path, db_url, "photos/")
    env = _env(tmp_path, db_url)
    with running(["backfill", "--prefix", "photos/", "--group", "g", "--now"], env) as proc:
        _wait_mid_run(tmp_path, "photos/", proc)
        tree = proc.tree()
        took, code = proc.stop(signal.SIGINT)
    _assert_clean(tmp_path, db_url, "photos/", tree)
    assert took < EXIT_WITHIN_S, (took, proc.output)
    assert code == 130, proc.output
    assert "SIGINT: stopped" in proc.output and "Traceback" not in proc.output, proc.output


def test_sigterm_during_run_batch_ends_the_batch_cleanly_with_143(
    tmp_path: Path, db_url: str
) -> None:
    config = _config(tmp_path, db_url)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, open_storage(config), config, _put_files(tmp_path, db_url, "rb/"), "rb")
    env = _env(tmp_path, db_url, THUMBQ_BUDGET_MS="20000", THUMBQ_BUFFER_MS="2000")
    with running(["run-batch"], env) as proc:
        _wait_mid_run(tmp_path, "rb/", proc)
        tree = proc.tree()
        took, code = proc.stop(signal.SIGTERM)
    _assert_clean(tmp_path, db_url, "rb/", tree)
    assert took < EXIT_WITHIN_S, (took, proc.output)
    assert code == 143, proc.output
    answer = json.loads("".join(proc.stdout))
    assert answer["stopped_reason"] == "time_budget" and answer["duration_ms"] < 60000


def test_sigterm_to_thumbq_up_mid_batch_stops_it_cleanly(tmp_path: Path, db_url: str) -> None:
    config = _config(tmp_path, db_url)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, open_storage(config), config, _put_files(tmp_path, db_url, "up/"), "up")
    env = _env(tmp_path, db_url, THUMBQ_HOME=str(tmp_path / "home"))
    with running(["up", "--port", str(free_port())], env) as proc:
        _wait_mid_run(tmp_path, "up/", proc)
        tree = proc.tree()
        took, code = proc.stop(signal.SIGTERM)
    _assert_clean(tmp_path, db_url, "up/", tree)
    assert took < EXIT_WITHIN_S, (took, proc.output)
    assert code == 0, proc.output
    assert "thumbq: stopped" in proc.output and "Traceback" not in proc.output, proc.output


@pytest.mark.parametrize(
    ("server", "sig"), [("waitress", signal.SIGINT), ("granian", signal.SIGTERM)]
)
def test_a_signal_to_thumbq_serve_ends_the_batch_in_flight_cleanly(
    tmp_path: Path, db_url: str, server: str, sig: int
) -> None:
    config = _config(tmp_path, db_url)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, open_storage(config), config, _put_files(tmp_path, db_url, "sv/"), "sv")
    port = free_port()
    env = _env(
        tmp_path,
        db_url,
        THUMBQ_CRON_SECRET=SECRET,
        THUMBQ_HOME=str(tmp_path / "home"),
        THUMBQ_BUDGET_MS="20000",
    )
    with running(["serve", "--port", str(port), "--server", server], env) as proc:
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 30, 0.1)
        answers: list[Any] = []

        def batch() -> None:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/api/thumbnails/batch-generate",
                data=b"{}",
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"},
                method="POST",
            )
            try:
                with urllib.request.urlopen(req, timeout=90) as resp:
                    answers.append((resp.status, json.loads(resp.read())))
            except OSError as exc:  # the server closed the connection on its way out
                answers.append(exc)

        caller = threading.Thread(target=batch, daemon=True)
        caller.start()
        _wait_mid_run(tmp_path, "sv/", proc)
        tree = proc.tree()
        took, code = proc.stop(sig)
        caller.join(10)
    # Measured before the state is read: that the state is clean is not because the run was
    # left to finish everything.
    assert took < EXIT_WITHIN_S, (took, proc.output)
    _assert_clean(tmp_path, db_url, "sv/", tree)
    # The batch in flight ended early and answered, as a batch out of time does.
    ((status, body),) = answers
    assert status == 200, answers
    assert body["stopped_reason"] == "time_budget" and body["remaining"] > 0, body
    assert code == 0, proc.output
    assert "thumbq: stopped" in proc.output and "Traceback" not in proc.output, proc.output


def test_a_render_stopped_by_the_pools_close_is_not_run_rather_than_internal() -> None:
    # Regression: a render in flight when the pool closed (a stop) failed `internal` ("render
    # stopped: the render pool is closing"), and a batch charged its job an attempt for it.
    from bench import corpus
    from worker.engine.errors import RENDER_TIMEOUT
    from worker.engine.processes import PoolStopped
    from worker.thumbnails.render import RenderOptions
    from worker.thumbnails.render.process import RenderPool

    pool = RenderPool(RenderOptions(), workers=1, memory_limit_mb=768)
    pool.start()
    closer = threading.Timer(0.3, pool.close)
    closer.start()
    try:
        with pytest.raises(PoolStopped) as info:
            pool.render(corpus.slow_pdf(), None, timeout_s=20)
    finally:
        closer.join()
        pool.close()
    assert info.value.code == RENDER_TIMEOUT and "stopping" in info.value.message
    with pytest.raises(PoolStopped):
        pool.render(corpus.small_jpeg(), None, timeout_s=5)


def test_renders_still_running_at_a_stop_are_stopped_and_handed_back_without_an_attempt(
    tmp_path: Path, db_url: str
) -> None:
    # Two pages that take minutes each: the stop cannot wait for them.
    from bench import corpus

    storage = open_storage(_config(tmp_path, db_url))
    for name in ("a", "b"):
        storage.put(f"slow/{name}.pdf", corpus.slow_pdf(), "application/pdf")
    # The stop must come before the batch's own deadline, or the deadline, not the stop, ends
    # the renders: a 60 s budget against at most 45 s of waiting for both to run (the stop
    # kills them at once, so they do not keep the cores for the rest of the budget).
    env = _env(tmp_path, db_url, THUMBQ_BUDGET_MS="60000", THUMBQ_BUFFER_MS="2000")
    with running(["backfill", "--prefix", "slow/", "--group", "slow", "--now"], env) as proc:

        def rendering() -> bool:
            assert proc.popen.poll() is None, proc.output
            jobs = _jobs(db_url, "slow/")
            return len(jobs) == 2 and all(j["status"] == "processing" for j in jobs)

        try:
            wait_until(rendering, 45, 0.05)
        except AssertionError as exc:
            # Say where the run was: which jobs exist in which state, and what it printed.
            states = [(j["status"], j["attempts"], j["error_code"]) for j in _jobs(db_url, "slow/")]
            raise AssertionError(f"{exc}: jobs {states}; output: {proc.output}") from None
        time.sleep(1.0)  # both renders are well under way
        tree = proc.tree()
        took, code = proc.stop(signal.SIGINT)
    jobs = _jobs(db_url, "slow/")
    assert [(j["status"], j["attempts"], j["error_code"]) for j in jobs] == [
        ("pending", 0, None)
    ] * 2
    assert took < EXIT_WITHIN_S, (took, proc.output)
    assert code == 130, proc.output
    assert _thumbnails(tmp_path, "slow/") == 0
    deadline = time.monotonic() + 2
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p.pid for p in tree if _alive(p)]


def test_sigterm_to_thumbq_scheduler_mid_call_exits_without_waiting_for_the_batch(
    tmp_path: Path, db_url: str
) -> None:
    # The scheduler's call is a 20 s batch of two slow pages on a separate server (a longer one
    # only keeps both cores busy longer for the other tests when a stop is slow): the
    # scheduler stops at once (the server records the batch whatever the caller does), and the
    # server's own stop then hands the pages back.
    from bench import corpus

    config = _config(tmp_path, db_url)
    storage = open_storage(config)
    items = []
    for name in ("a", "b"):
        info = storage.put(f"sch/{name}.pdf", corpus.slow_pdf(), "application/pdf")
        items.append({"source_key": f"sch/{name}.pdf", "etag": info.etag})
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "sch")
    port = free_port()
    env = _env(
        tmp_path,
        db_url,
        THUMBQ_CRON_SECRET=SECRET,
        THUMBQ_HOME=str(tmp_path / "home"),
        THUMBQ_BUDGET_MS="20000",
        THUMBQ_API_URL=f"http://127.0.0.1:{port}",
        THUMBQ_SCHEDULE="* * * * * *",
    )
    with running(["serve", "--port", str(port), "--server", "waitress"], env) as server:
        wait_until(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 30, 0.1)
        with running(["scheduler"], env) as sched:

            def rendering() -> bool:
                assert sched.popen.poll() is None, sched.output
                return all(j["status"] == "processing" for j in _jobs(db_url, "sch/"))

            wait_until(rendering, 60, 0.05)
            took, code = sched.stop(signal.SIGTERM)
        assert took < EXIT_WITHIN_S, (took, sched.output)
        assert code == 0 and "Traceback" not in sched.output, sched.output
        tree = server.tree()
        took, code = server.stop(signal.SIGTERM)
    assert took < EXIT_WITHIN_S, (took, server.output)
    jobs = _jobs(db_url, "sch/")
    assert [(j["status"], j["attempts"], j["error_code"]) for j in jobs] == [
        ("pending", 0, None)
    ] * 2
    deadline = time.monotonic() + 2
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p.pid for p in tree if _alive(p)]
