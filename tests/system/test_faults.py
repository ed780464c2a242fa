"""Faults: a worker killed anywhere, concurrent invocations, the database gone, hostile input at
scale. Real Postgres, real file storage (observed through `LoggingStorage`), real render
processes; nothing is mocked. Each test prints its figures as one JSON line (`pytest -s`), which
docs/reliability.md reports.

Budgets are shrunk (3 s with a 1 s buffer) so that the whole file runs in about three minutes on
two cores; the visibility timeout is still the engine's (budget + VT_MARGIN_S = 23 s), so the
recovery figures are the real ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from PIL import Image

from bench.corpus import photo_jpeg, tiny_png, vector_pdf
from bench.harness import (
    REPO_ROOT,
    LoggingStorage,
    Worker,
    driver_command,
    driver_env,
    hostile_run,
    run_lines,
    thumbnails_match,
)
from tests.support.faultkit import overlapping, processes_with, put_counts, read_log, renders
from tests.support.liveapp import call, live_app
from tests.support.pgtools import require
from worker.engine import db
from worker.engine.batch import VT_MARGIN_S, run_batch
from worker.engine.config import Config
from worker.storage.file import TEMP_PREFIX, FileStorage
from worker.thumbnails.files import backfill, enqueue_keys
from worker.thumbnails.render.process import RenderPool

BUDGET_MS = 3000
BUFFER_MS = 1000
# What an invocation may run past budget - buffer: thread joins, the last flush, finish_run
# (the same allowance as tests/db/test_batch.py).
MARGIN_MS = 600
SECRET = "fault-secret"


def report(name: str, figures: dict[str, Any]) -> None:
    """Print a test's figures as one JSON line (seen with `pytest -s`)."""
    print(json.dumps({"fault": name, **figures}, default=str))


def make_config(tmp_path: Path, db_url: str, **env: str) -> Config:
    return Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_BUDGET_MS": str(BUDGET_MS),
            "THUMBQ_BUFFER_MS": str(BUFFER_MS),
            "THUMBQ_CRON_SECRET": SECRET,
            **env,
        }
    )


def status_counts(conn: db.Conn) -> Counter[str]:
    return Counter(
        {
            r["status"]: r["n"]
            for r in conn.execute("select status, count(*) as n from thumbq.jobs group by status")
        }
    )


def temp_files(root: Path) -> int:
    """Temporary files left by puts that were killed before their rename."""
    return sum(1 for _ in root.rglob(f"{TEMP_PREFIX}*"))


def wait_for_ready(log: Path, pid: int, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait until worker `pid` has its render pool up; False if it exited first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if log.exists() and any(e.op == "ready" and e.pid == pid for e in read_log(log)):
            return True
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} not ready within {timeout_s} s")


class LeaseWatch:
    """Polls, from its own connection, how far past its lease any job still shows `processing`."""

    def __init__(self, db_url: str, every_s: float = 0.25) -> None:
        self.db_url = db_url
        self.every_s = every_s
        self.max_overdue_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with db.connect(self.db_url) as conn:
            while not self._stop.is_set():
                row = conn.execute(
                    "select coalesce(max(extract(epoch from clock_timestamp() - lease_expires_at)),"
                    " 0)::float8 as s from thumbq.jobs where status = 'processing'"
                ).fetchone()
                assert row is not None
                self.max_overdue_s = max(self.max_overdue_s, row["s"])
                self._stop.wait(self.every_s)


# -- 1. crash anywhere ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_worker_killed_anywhere_loses_nothing_and_no_file_is_rendered_twice_at_once(
    tmp_path: Path, db_url: str
) -> None:
    """Two worker processes run batches over 200 files; 20 times (seeded), one of them is
    SIGKILLed a random moment after it is up, and restarted."""
    n_files, n_kills, rng = 200, 20, random.Random(20261125)
    root, log = tmp_path / "storage", tmp_path / "storage.log"
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    marker.mkdir()
    storage = FileStorage(root)
    items = []
    for i in range(n_files):
        if i % 2:
            key, data, ctype = f"in/{i:03d}.pdf", vector_pdf(i, draws=120), "application/pdf"
        else:
            key, data, ctype = f"in/{i:03d}.jpg", photo_jpeg(i, (2400, 1800)), "image/jpeg"
        storage.put(key, data, ctype)
        items.append({"source_key": key, "content_type": ctype})
    config = make_config(tmp_path, db_url)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "crash")

    env = driver_env(
        db_url, marker, budget_ms=BUDGET_MS, buffer_ms=BUFFER_MS, batch_size=12, concurrency=1
    )
    argv = driver_command(root, log, until_drained=True)
    spawned = 0

    def spawn() -> Worker:
        nonlocal spawned
        spawned += 1
        return Worker(argv, env, tmp_path / f"worker-{spawned}.out")

    deaths: dict[int, float] = {}
    kills: list[dict[str, Any]] = []
    workers = [spawn(), spawn()]
    seen_alive = 0
    started = time.time()
    try:
        with LeaseWatch(db_url) as watch:
            for _ in range(n_kills):
                i = rng.randrange(len(workers))
                w = workers[i]
                if not wait_for_ready(log, w.pid, w.proc, 30):
                    break  # it finished: everything is done, nothing left to kill
                time.sleep(rng.uniform(0.05, 1.0))
                if w.proc.poll() is not None:
                    break
                # The leftover check below finds processes by this marker: prove that it can.
                seen_alive = max(seen_alive, len(processes_with(marker.name)))
                deaths[w.pid] = w.kill()
                kills.append({"pid": w.pid, "t": deaths[w.pid]})
                workers[i] = spawn()
            last_kill = time.time()
            exits = [w.proc.wait(180) for w in workers]
            drained = time.time()
        overdue = watch.max_overdue_s
    finally:
        for w in workers:
            w.stop()

    events = read_log(log)
    attempts = renders(events, deaths)
    by_key = Counter(r.key for r in attempts)
    puts = put_counts(events)
    in_flight_at_kill = sum(
        1 for k in kills if any(r.pid == k["pid"] and r.end == k["t"] for r in attempts)
    )
    with db.connect(db_url) as conn:
        statuses = status_counts(conn)
        failed = conn.execute(
            "select error_code, count(*) as n from thumbq.jobs where status = 'failed' group by 1"
        ).fetchall()
        checked = thumbnails_match(conn, storage)
        runs = conn.execute("select count(*) as n from thumbq.batch_runs").fetchone()
    time.sleep(0.3)  # the kernel delivers PDEATHSIG to render children asynchronously
    leftovers = processes_with(marker.name)
    figures = {
        "files": n_files,
        "kills": len(kills),
        "kills_with_a_render_in_flight": in_flight_at_kill,
        "statuses": dict(statuses),
        "failed_by_code": {r["error_code"]: r["n"] for r in failed},
        "render_attempts": len(attempts),
        "files_rendered_more_than_once": sum(1 for n in by_key.values() if n > 1),
        "thumbnails_written_more_than_once": sum(1 for n in puts.values() if n > 1),
        "kill_phase_s": round(last_kill - started, 1),
        "recovery_after_last_kill_s": round(drained - last_kill, 1),
        "total_s": round(drained - started, 1),
        "lease_s": BUDGET_MS // 1000 + VT_MARGIN_S,
        "max_processing_past_lease_s": round(overdue, 1),
        "batch_runs_started": runs["n"] if runs else None,
        "temp_files_left": temp_files(root),
        "processes_per_live_worker_tree_seen": seen_alive,
        "leftover_processes": len(leftovers),
    }
    report("crash_anywhere", figures)

    assert exits == [0, 0], [w.out.read_text()[-2000:] for w in workers]
    assert len(kills) == n_kills, "the work ran out before every kill landed"
    # Every job completes once the killed runs' leases come back (docs/reliability.md): a lost
    # lease comes back after 23 s and the kills end within about 30 s, so a job loses at most
    # two, fewer than max_attempts (3). None may end failed (lease_expired) or anything else.
    assert statuses == {"completed": n_files}, (dict(statuses), figures["failed_by_code"])
    assert checked == n_files
    assert overlapping(attempts) == []
    # Past its lease, a job is picked up by the next claim: within one run (+ polling slack).
    assert overdue <= BUDGET_MS / 1000 + 2
    assert seen_alive >= 3  # a worker, its zygote, a render child
    assert leftovers == []


# Loaded by the worker processes of the next test (sitecustomize in their marker folder, first on
# their sys.path): a disk whose fsync of a temporary file hangs until the test says go, so that an
# invocation can be SIGKILLed in the middle of a thumbnail's write, every time.
_SLOW_FSYNC = """
import os, time

_fsync = os.fsync
_here = os.path.dirname(os.path.abspath(__file__))

def fsync(fd):
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = ""
    if os.path.basename(name).startswith(".thumbq-tmp-"):
        with open(os.path.join(_here, "fsyncs.log"), "a") as log:
            log.write(f"{os.getpid()} {name}\\n")
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(_here, "go")) and time.monotonic() < deadline:
            time.sleep(0.02)
    return _fsync(fd)

os.fsync = fsync
"""


@pytest.mark.slow
def test_writes_killed_mid_way_leave_no_temporary_file_after_cleanup_stale(
    tmp_path: Path, db_url: str
) -> None:
    """Regression (issue 9): SIGKILLing invocations mid-write left `.thumbq-tmp-*` files in the
    thumbnail folders for ever. They are never listed; cleanup-stale removes them once they are
    older than any live write, and a live write keeps its own."""
    root, log = tmp_path / "storage", tmp_path / "storage.log"
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    marker.mkdir()
    (marker / "sitecustomize.py").write_text(_SLOW_FSYNC)
    fsyncs = marker / "fsyncs.log"
    storage = FileStorage(root)
    items = []
    for i in range(12):
        storage.put(f"pics/{i:02d}.png", tiny_png(i, (320, 240)), "image/png")
        items.append({"source_key": f"pics/{i:02d}.png", "content_type": "image/png"})
    config = make_config(tmp_path, db_url, THUMBQ_BUDGET_MS="8000", THUMBQ_BUFFER_MS="2000")
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "killed-writes")
    # Two items an invocation, so that each new one finds work while the killed ones' leases run.
    env = driver_env(db_url, marker, budget_ms=8000, buffer_ms=2000, concurrency=2, batch_size=2)
    argv = driver_command(root, log, until_drained=True)

    def writes_started() -> list[tuple[int, Path]]:
        """(pid, temporary file) of every thumbnail write that reached its fsync."""
        lines = fsyncs.read_text().splitlines() if fsyncs.exists() else []
        return [(int(pid), Path(name)) for pid, name in (ln.split(" ", 1) for ln in lines)]

    def wait_for_writes(n: int) -> None:
        deadline = time.monotonic() + 30
        while len(writes_started()) < n:
            assert time.monotonic() < deadline, "no thumbnail write started"
            time.sleep(0.02)

    # Three invocations, each SIGKILLed while it writes a thumbnail.
    killed: list[int] = []
    for k in range(3):
        w = Worker(argv, env, tmp_path / f"killed-{k}.out")
        wait_for_writes(len(writes_started()) + 1)
        time.sleep(0.1)  # its other worker thread may be writing too
        w.kill()
        killed.append(w.pid)
    left = sorted(root.rglob(f"{TEMP_PREFIX}*"))
    assert len(left) >= 3, left
    # Never an object: not listed, not backfilled, and no thumbnail is partial.
    listed = [o.key for o in storage.list("")]
    assert not [k for k in listed if TEMP_PREFIX in k]
    with db.connect(db_url) as conn:
        filled = backfill(conn, storage, config, "")
    assert filled["listed"] == 12, filled
    for o in storage.list("thumbnails/"):
        with Image.open(root / o.key) as img:
            img.load()

    # A fourth invocation is writing right now: its temporary file is young and must survive.
    live = Worker(argv, env, tmp_path / "live.out")
    try:
        wait_for_writes(len(writes_started()) + 1)
        live_tmp = [n for p, n in writes_started() if p == live.pid]
        assert live_tmp and live_tmp[0].exists()
        # The leftovers are too young to be sure they are no live write's.
        assert _cleanup_stale_cli(env, root)["temp_files_removed"] == 0
        # Sixteen minutes later (as far as the files can tell):
        old = time.time() - 16 * 60
        for path in left:
            os.utime(path, (old, old))
        swept = _cleanup_stale_cli(env, root)
        assert swept["temp_files_removed"] == len(left), (swept, left)
        assert live_tmp[0].exists()  # the live write kept its file
        (marker / "go").touch()  # its disk answers again: the write completes
        deadline = time.monotonic() + 30
        while live_tmp[0].exists():
            assert time.monotonic() < deadline, "the live write never completed"
            time.sleep(0.05)
        written = [
            o.key
            for o in storage.list("thumbnails/")
            if o.key.startswith(str(live_tmp[0].parent.relative_to(root)))
        ]
        assert written, "the live write's thumbnail is not in place"
    finally:
        live.stop()

    # Everything the killed invocations held comes back when their leases end: end them now.
    with db.connect(db_url) as conn:
        conn.execute(
            "update thumbq.jobs set lease_expires_at = now() - interval '1 s'"
            " where status = 'processing'"
        )
        conn.execute(
            "select pgmq.set_vt('thumbq_jobs', msg_id, 0) from thumbq.jobs"
            " where status in ('processing', 'pending')"
        ).fetchall()
        final = Worker(argv, env, tmp_path / "final.out")
        assert final.proc.wait(120) == 0, final.out.read_text()[-2000:]
        statuses = status_counts(conn)
        checked = thumbnails_match(conn, storage)
    report(
        "killed_writes",
        {"killed": killed, "temp_files_left_by_kills": len(left), "swept": swept},
    )
    assert statuses == {"completed": 12}, statuses
    assert checked == 12
    assert temp_files(root) == 0


def _cleanup_stale_cli(env: dict[str, str], root: Path) -> dict[str, int]:
    """`thumbq cleanup-stale`, as an operator (or its schedule) runs it."""
    clean_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    clean_env["THUMBQ_STORAGE_URL"] = root.as_uri()
    proc = subprocess.run(
        [sys.executable, "-m", "worker.cli", "cleanup-stale"],
        env=clean_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


# -- 2. concurrent invocations ----------------------------------------------------------------


@pytest.mark.slow
def test_four_concurrent_invocations_render_each_file_exactly_once(
    tmp_path: Path, db_url: str
) -> None:
    """Four worker processes run small batches at the same time, again and again, until 1 000
    tiny images are done."""
    n_files, n_workers = 1000, 4
    root, log = tmp_path / "storage", tmp_path / "storage.log"
    marker = tmp_path / f"marker-{uuid.uuid4().hex}"
    marker.mkdir()
    storage = FileStorage(root, fsync=False)
    items = []
    for i in range(n_files):
        storage.put(f"tiny/{i:04d}.png", tiny_png(i), "image/png")
        items.append({"source_key": f"tiny/{i:04d}.png", "content_type": "image/png"})
    config = make_config(tmp_path, db_url)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items[: n_files // 2], "left")
        enqueue_keys(conn, storage, config, items[n_files // 2 :], "right")
    env = driver_env(db_url, marker, budget_ms=2000, buffer_ms=500, batch_size=25, concurrency=1)
    argv = driver_command(root, log, until_drained=True, fsync=False)
    started = time.time()
    workers = [Worker(argv, env, tmp_path / f"worker-{i}.out") for i in range(n_workers)]
    try:
        for w in workers:
            assert w.proc.wait(150) == 0, w.out.read_text()[-2000:]
    finally:
        for w in workers:
            w.stop()
    wall_s = time.time() - started

    events = read_log(log)
    puts = put_counts(events)
    gets = Counter(e.key for e in events if e.op == "get")
    runs = [r for w in workers for r in run_lines(w.out.read_text())]
    with db.connect(db_url) as conn:
        statuses = status_counts(conn)
        mismatched = conn.execute(
            """
            select g.group_id from thumbq.groups g
              left join (select group_id, count(*) as total,
                                count(*) filter (where status = 'pending') as pending,
                                count(*) filter (where status = 'processing') as processing,
                                count(*) filter (where status = 'completed') as completed,
                                count(*) filter (where status = 'failed') as failed,
                                count(*) filter (where status = 'unsupported') as unsupported,
                                count(*) filter (where status = 'cancelled') as cancelled
                           from thumbq.jobs group by group_id) j using (group_id)
             where (g.total, g.pending, g.processing, g.completed, g.failed, g.unsupported,
                    g.cancelled)
                   is distinct from (j.total, j.pending, j.processing, j.completed, j.failed,
                                     j.unsupported, j.cancelled)
            """
        ).fetchall()
        groups = {
            r["group_id"]: r["completed"]
            for r in conn.execute("select group_id, completed from thumbq.groups")
        }
        checked = thumbnails_match(conn, storage)
    report(
        "concurrent_invocations",
        {
            "files": n_files,
            "workers": n_workers,
            "runs": len(runs),
            "rate_limited_runs": sum(1 for r in runs if r["stopped_reason"] == "rate_limited"),
            "max_run_ms": max(r["duration_ms"] for r in runs),
            "wall_s": round(wall_s, 1),
            "thumbnail_puts": sum(puts.values()),
            "keys_written_twice": sum(1 for n in puts.values() if n > 1),
            "sources_read_twice": sum(1 for n in gets.values() if n > 1),
            "statuses": dict(statuses),
            "groups": groups,
        },
    )
    assert statuses == Counter({"completed": n_files})
    assert len(puts) == n_files and set(puts.values()) == {1}
    assert len(gets) == n_files and set(gets.values()) == {1}
    assert checked == n_files
    assert mismatched == []
    assert groups == {"left": n_files // 2, "right": n_files // 2}
    assert sum(r["succeeded"] for r in runs) == n_files


# -- 3. database gone -------------------------------------------------------------------------


def local_backend(conn: db.Conn, pid: int | None = None) -> bool:
    """Whether `pid` (default: `conn`'s backend) is a process on this machine that we may signal:
    its title names `conn`'s database (a server in a container or elsewhere has other pids)."""
    pid, dbname = pid or conn.info.backend_pid, conn.info.dbname
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if b"postgres" not in title or dbname.encode() not in title:
        return False
    try:
        os.kill(pid, 0)  # may we signal it?
    except OSError:
        return False
    return True


def invocation_with_fault(
    config: Config, db_url: str, storage: LoggingStorage, pool: RenderPool, fault: str
) -> dict[str, Any]:
    """Run one invocation in a thread on its own connection; once three more renders have
    started, hit its backend with `fault` ("terminate": pg_terminate_backend from another
    connection; "stall": SIGSTOP, a server that stops answering, resumed after the invocation
    ended). Returns how it ended and how long it took."""
    log = Path(storage.log_path)
    outcome: dict[str, Any] = {}
    conn = db.connect(db_url)
    gets_before = sum(1 for e in read_log(log) if e.op == "get")

    def invocation() -> None:
        try:
            outcome["result"] = run_batch(config, conn, storage, pool)
        except Exception as exc:
            outcome["error"] = exc

    t = threading.Thread(target=invocation)
    started = time.monotonic()
    t.start()
    deadline = time.monotonic() + 10
    while sum(1 for e in read_log(log) if e.op == "get") < gets_before + 3:
        assert time.monotonic() < deadline, "no render started"
        time.sleep(0.01)
    backend = conn.info.backend_pid
    try:
        if fault == "terminate":
            with db.connect(db_url) as admin:
                admin.execute("select pg_terminate_backend(%s)", [backend])
        else:
            assert local_backend(conn), "refusing to signal a process that is not our backend"
            os.kill(backend, signal.SIGSTOP)
        t.join(BUDGET_MS / 1000 + 10)
        ended_s = time.monotonic() - started
    finally:
        if fault == "stall":
            os.kill(backend, signal.SIGCONT)
    t.join(30)
    conn.close()
    assert not t.is_alive(), f"the invocation hangs after a {fault} of its backend"
    return {
        "fault": fault,
        "outcome": repr(outcome["error"]) if "error" in outcome else "returned",
        "error": outcome.get("error"),
        "wall_s": round(ended_s, 2),
    }


@pytest.fixture
def own_db_url() -> Iterator[str]:
    """A database on a Postgres server of the test's own, with pgmq and the schema: a test that
    SIGSTOPs a backend must not stall the session's shared server (a stopped backend can hold
    a lock every other backend of its server then waits for, and the other worker's tests time
    out)."""
    from tests.support.pgtools import PGMQ_SQL, install_pgmq

    with throwaway_server() as (server, _folder):
        url = str(server.get_uri())
        with db.connect(url) as conn:
            install_pgmq(conn, PGMQ_SQL)
            db.init_schema(conn)
        yield url


@pytest.mark.slow
def test_a_terminated_or_stalled_backend_ends_the_invocation_in_time_and_nothing_is_lost(
    tmp_path: Path, own_db_url: str
) -> None:
    """Two invocations while renders are in flight: one's backend is terminated, the next one's
    stops answering (SIGSTOP). Both end within their budget; following runs finish the work.

    Regression: a stalled backend held the invocation (and, in a long-lived server, the batch
    lock) until the database answered again, however far past the budget."""
    n_files = 30
    log = tmp_path / "storage.log"
    db_url = own_db_url
    config = make_config(tmp_path, db_url, THUMBQ_CONCURRENCY="2")
    storage = LoggingStorage(tmp_path / "storage", log)
    items = []
    for i in range(n_files):
        storage.put(f"deck/{i:02d}.pdf", vector_pdf(i, draws=150), "application/pdf")
        items.append({"source_key": f"deck/{i:02d}.pdf", "content_type": "application/pdf"})
    from worker.thumbnails.task import render_options

    with (
        db.connect(db_url) as admin,
        RenderPool(render_options(config), 2, config.render_memory_mb) as pool,
    ):
        enqueue_keys(admin, storage, config, items, "deck")
        faults = [invocation_with_fault(config, db_url, storage, pool, "terminate")]
        # Stopping a backend needs the server on this machine (and the right to signal it).
        if local_backend(admin):
            faults.append(invocation_with_fault(config, db_url, storage, pool, "stall"))
        last_fault = time.monotonic()

        # Following runs, each on a fresh connection, until everything is done.
        runs = []
        while True:
            with db.connect(db_url) as c:
                runs.append(run_batch(config, c, storage, pool))
                left = status_counts(c)
            if left["pending"] + left["processing"] == 0:
                break
            assert time.monotonic() - last_fault < BUDGET_MS / 1000 + VT_MARGIN_S + 30, left
            time.sleep(0.5)
        recovered_s = time.monotonic() - last_fault
        statuses = status_counts(admin)
        checked = thumbnails_match(admin, storage)
    attempts = renders(read_log(log), {})
    by_key = Counter(r.key for r in attempts)
    report(
        "terminate_and_stall_backend",
        {
            "files": n_files,
            "invocations": [{k: v for k, v in f.items() if k != "error"} for f in faults],
            "stall_tried": len(faults) == 2,
            "recovered_after_last_fault_s": round(recovered_s, 1),
            "following_runs": len(runs),
            "files_rendered_more_than_once": sum(1 for n in by_key.values() if n > 1),
            "statuses": dict(statuses),
        },
    )
    for f in faults:
        # The stalled call is cut SEVER_AFTER_DEADLINE_MS after the deadline, at the earliest
        # at the end of the budget.
        assert f["wall_s"] <= BUDGET_MS / 1000 + 1, f
        assert f["error"] is None or isinstance(f["error"], psycopg.OperationalError), f
    assert statuses == Counter({"completed": n_files})
    assert checked == n_files
    assert overlapping(attempts) == []


@pytest.mark.slow
def test_a_stalled_database_answers_503_within_the_budget_and_frees_the_batch_lock(
    tmp_path: Path, own_db_url: str
) -> None:
    """The HTTP endpoint, its batch connection's backend stopped (SIGSTOP) mid-run.

    Regression: the request waited as long as the database did, holding the process's batch
    lock, so every later batch-generate would have answered 409 batch_in_progress."""
    db_url = own_db_url
    config = make_config(tmp_path, db_url, THUMBQ_CONCURRENCY="2")
    storage = FileStorage(tmp_path / "storage")
    items = []
    for i in range(20):
        storage.put(f"deck/{i:02d}.pdf", vector_pdf(i, draws=150), "application/pdf")
        items.append({"source_key": f"deck/{i:02d}.pdf"})
    with db.connect(db_url) as admin:
        require(local_backend(admin), "the database server is not a local process we may signal")
        enqueue_keys(admin, storage, config, items, "http")
        with live_app(config, db_timeout_s=1.0) as srv:
            url = f"{srv.url}/api/thumbnails/batch-generate"
            answer: dict[str, Any] = {}

            def post() -> None:
                t = time.monotonic()
                answer["status"], answer["body"], answer["headers"] = call("POST", url, SECRET, {})
                answer["s"] = time.monotonic() - t

            thread = threading.Thread(target=post)
            thread.start()
            deadline = time.monotonic() + 10
            backend = None
            while backend is None:
                assert time.monotonic() < deadline, "the batch never claimed anything"
                row = admin.execute(
                    "select a.pid from pg_stat_activity a"
                    " where a.datname = current_database() and a.application_name = 'thumbq-batch'"
                    " and exists (select 1 from thumbq.jobs where status = 'processing')"
                ).fetchone()
                backend = row["pid"] if row else None
                time.sleep(0.02)
            assert local_backend(admin, backend)
            os.kill(backend, signal.SIGSTOP)
            try:
                thread.join(BUDGET_MS / 1000 + 10)
            finally:
                os.kill(backend, signal.SIGCONT)
            thread.join(30)
            again, body, _ = call("POST", url, SECRET, {})
    report(
        "stalled_database_http",
        {"status": answer["status"], "seconds": round(answer["s"], 2), "next_call": again},
    )
    assert answer["status"] == 503, answer
    assert answer["headers"].get("Retry-After", "").isdigit()
    assert answer["body"]["error"]["code"] == "database_unavailable"
    assert answer["s"] <= BUDGET_MS / 1000 + 1
    assert again == 200, body  # not 409: the batch lock was released


@contextlib.contextmanager
def throwaway_server() -> Iterator[tuple[Any, Path]]:
    """An embedded Postgres (pgserver) in a fresh folder, stopped and removed afterwards."""
    import pgserver

    folder = Path(tempfile.mkdtemp(prefix="thumbq-pg-"))
    server = pgserver.get_server(folder / "pgdata", cleanup_mode="stop")
    try:
        yield server, folder
    finally:
        with contextlib.suppress(Exception):
            pgserver.get_server(folder / "pgdata", cleanup_mode="stop").cleanup()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_with_the_database_stopped_the_endpoints_answer_503_and_the_work_waits(
    tmp_path: Path,
) -> None:
    """A throw-away Postgres is stopped between runs and started again."""
    import pgserver

    with throwaway_server() as (server, folder):
        url = str(server.get_uri())
        with db.connect(url) as conn:
            db.init_schema(conn)
        config = make_config(tmp_path, url, THUMBQ_CONCURRENCY="2")
        storage = FileStorage(tmp_path / "storage")
        items = []
        for i in range(12):
            storage.put(f"p/{i}.png", tiny_png(i, (400, 300)), "image/png")
            items.append({"source_key": f"p/{i}.png"})
        with db.connect(url) as conn:
            enqueue_keys(conn, storage, config, items, "outage")

        with live_app(config, db_timeout_s=1.0) as srv:
            base = f"{srv.url}/api/thumbnails"
            status, body, _ = call("POST", f"{base}/batch-generate", SECRET, {"max_items": 4})
            assert status == 200 and body is not None and body["succeeded"] == 4, body
            assert call("GET", f"{base}/progress?group_id=outage", SECRET)[0] == 200

            server.cleanup()  # stopped
            down: list[dict[str, Any]] = []
            calls: list[tuple[str, str, dict[str, Any] | None]] = [
                ("POST", "/batch-generate", {}),
                ("GET", "/progress?group_id=outage", None),
                ("POST", "/batch-generate", {}),
                ("GET", "/progress?group_id=outage", None),
            ]
            for method, path, payload in calls:
                t = time.monotonic()
                status, body, headers = call(method, base + path, SECRET, payload)
                down.append(
                    {
                        "call": f"{method} {path.split('?')[0]}",
                        "status": status,
                        "retry_after": headers.get("Retry-After"),
                        "code": (body or {}).get("error", {}).get("code"),
                        "ms": round((time.monotonic() - t) * 1000),
                    }
                )
                assert status == 503, (path, status, body)
                assert headers.get("Retry-After", "").isdigit()
                assert body is not None and set(body) == {"error"}
                assert body["error"]["code"] == "database_unavailable"
                assert body["error"]["message"]

            server = pgserver.get_server(folder / "pgdata", cleanup_mode="stop")  # started again
            restarted = time.monotonic()
            after: list[int] = []
            for _ in range(10):
                status, body, _ = call("POST", f"{base}/batch-generate", SECRET, {})
                after.append(status)
                if status == 200 and body is not None and body["remaining"] == 0:
                    break
            progress_statuses = []
            for _ in range(5):
                status, pbody, _ = call("GET", f"{base}/progress?group_id=outage", SECRET)
                progress_statuses.append(status)
                if status == 200:
                    break
            recovered_s = time.monotonic() - restarted
        with db.connect(url) as conn:
            statuses = status_counts(conn)
            checked = thumbnails_match(conn, storage)
    report(
        "database_stopped",
        {
            "while_down": down,
            "batch_statuses_after_restart": after,
            "progress_statuses_after_restart": progress_statuses,
            "recovered_s": round(recovered_s, 2),
            "statuses": dict(statuses),
        },
    )
    assert all(d["ms"] < 5000 for d in down)
    assert after[-1] == 200 and progress_statuses[-1] == 200
    assert pbody is not None and pbody["completed"] == 12
    assert statuses == Counter({"completed": 12}) and checked == 12


# -- 5. hostile input at scale ----------------------------------------------------------------


@pytest.mark.slow
def test_hostile_input_at_scale_never_overruns_nor_exceeds_memory(
    tmp_path: Path, db_url: str
) -> None:
    """300 files (a third from the corpus), plus 4 legal PNGs that need about 530 MB each to
    render. Regression: with 768 MB per render process, two of those at once took the worker
    and its render processes to 1152 MB, over a 1 GiB function. The full 1 000 files run in
    bench/hostile.py (the same code), which keeps this suite within CI's time on a busy machine."""
    figures = hostile_run(tmp_path, db_url, 300, budget_ms=BUDGET_MS, buffer_ms=BUFFER_MS, hogs=4)
    report("hostile_input", figures)
    assert figures["wrong_outcomes"] == []
    assert figures["thumbnails_checked"] == figures["statuses"]["completed"]
    assert figures["max_duration_ms"] <= BUDGET_MS - BUFFER_MS + MARGIN_MS, figures
    assert figures["peak_rss_tree_mb"] < 1024, figures
