"""The task engine end to end: handlers in child processes and in threads, results, errors,
checkpoints across invocations (and across a SIGKILL), cancellation of a running job, and
strict order per ordering key under concurrent invocations that get killed."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

import tests.support.tasks_fixture  # noqa: F401  (registers the tasks in this process too)
from worker.engine import db
from worker.engine.batch import BatchResult, run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
TASKS = "tests.support.tasks_fixture"


@pytest.fixture
def tconfig(config: Config) -> Config:
    return config.with_(tasks=(TASKS,))


def batch(config: Config, conn: db.Conn, **kw: object) -> BatchResult:
    return run_batch(config, conn, open_storage(config), **kw)  # type: ignore[arg-type]


def job_rows(conn: db.Conn) -> list[dict]:
    return conn.execute(
        "select id, task, status, error_code, last_error, result, state, attempts, checkpoints,"
        " progress_done, progress_total from thumbq.jobs order by id"
    ).fetchall()


def test_handlers_run_in_a_child_process_or_a_thread_and_their_results_are_stored(
    tconfig: Config, conn: db.Conn
) -> None:
    q = Queue(conn)
    q.enqueue_jobs(
        [
            {"task": "echo", "payload": {"n": 1}},
            {"task": "echo_thread", "payload": {"n": 2}},
            {"task": "nobody_knows_me"},
        ],
        "g",
    )
    result = batch(tconfig, conn)
    assert (result.succeeded, result.unsupported) == (2, 1)
    rows = {r["task"]: r for r in job_rows(conn)}
    assert rows["echo"]["status"] == "completed"
    assert rows["echo"]["result"]["payload"] == {"n": 1}
    assert rows["echo"]["result"]["pid"] != os.getpid()  # the render child ran it
    assert rows["echo_thread"]["result"] == {"payload": {"n": 2}, "pid": os.getpid()}
    unknown = rows["nobody_knows_me"]
    assert (unknown["status"], unknown["error_code"]) == ("unsupported", "unsupported_task")
    assert "THUMBQ_TASKS" in unknown["last_error"]


def test_a_permanent_error_ends_the_job_and_a_transient_one_retries_then_dead_letters(
    tconfig: Config, conn: db.Conn
) -> None:
    Queue(conn).enqueue_jobs([{"task": "refuse"}, {"task": "flaky"}], "g")
    result = batch(tconfig, conn)
    assert (result.failed, result.retried) == (1, 1)
    rows = {r["task"]: r for r in job_rows(conn)}
    assert (rows["refuse"]["status"], rows["refuse"]["error_code"]) == ("failed", "bad_request")
    assert rows["refuse"]["last_error"] == "this request can never succeed"
    assert (rows["flaky"]["status"], rows["flaky"]["error_code"]) == (
        "pending",
        "upstream_unavailable",
    )
    # The task's own max_attempts (2), not THUMBQ_MAX_ATTEMPTS (3): the second failure is last.
    conn.execute("select pgmq.set_vt('thumbq_jobs', msg_id, 0) from thumbq.jobs")
    batch(tconfig, conn)
    flaky = {r["task"]: r for r in job_rows(conn)}["flaky"]
    assert (flaky["status"], flaky["attempts"]) == ("failed", 2)
    assert Queue(conn).overview()["dlq_length"] == 1


@pytest.mark.parametrize("task", ["steps", "steps_thread"])
def test_a_long_job_finishes_across_invocations_from_its_checkpoints(
    tconfig: Config, conn: db.Conn, task: str
) -> None:
    # 4 s of work, 1.5 s windows: at least three invocations, no attempt used by any. Each
    # invocation starts its render process inside its window, as a cold serverless one does
    # (on a slow machine that leaves a handler a third of a second: 12 runs alone, over 20
    # beside the rest of the suite).
    Queue(conn).enqueue_jobs([{"task": task, "payload": {"steps": 40, "step_ms": 100}}], "g")
    config = tconfig.with_(budget_ms=2000, buffer_ms=500)
    runs = []
    for _ in range(60):
        runs.append(batch(config, conn))
        if runs[-1].succeeded:
            break
    # Every run before the last checkpointed, or (its cold render process took the window)
    # handed the job back unstarted: none failed, none used an attempt.
    assert all(r.checkpointed + r.released == 1 for r in runs[:-1]), runs
    assert len(runs) >= 3 and runs[-1].succeeded == 1
    assert all(r.duration_ms <= 1500 + 300 for r in runs)
    row = job_rows(conn)[0]
    assert row["status"] == "completed"
    assert row["result"] == {"sum": sum(range(40)), "steps": 40}
    assert row["attempts"] == 1 and row["checkpoints"] >= 40
    assert (row["progress_done"], row["progress_total"]) == (40, 40)


def test_a_job_killed_between_checkpoints_resumes_from_the_last_one(
    tconfig: Config, conn: db.Conn, db_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "steps.log"
    Queue(conn).enqueue_jobs(
        [{"task": "steps", "payload": {"steps": 30, "step_ms": 100, "log": str(log)}}], "g"
    )
    script = textwrap.dedent(
        f"""
        from worker.engine import db
        from worker.engine.batch import run_batch
        from worker.engine.config import Config
        from worker.storage import open_storage
        config = Config.from_env({{"DATABASE_URL": {db_url!r}, "THUMBQ_TASKS": {TASKS!r},
                                   "THUMBQ_HOME": {str(tmp_path / "home")!r},
                                   "THUMBQ_BUDGET_MS": "60000", "THUMBQ_CONCURRENCY": "1"}})
        with db.connect(config.database_url) as conn:
            run_batch(config, conn, open_storage(config))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
        not log.exists() or len(log.read_text().splitlines()) < 10
    ):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the invocation and its render child, mid-step
    proc.wait()
    saved = job_rows(conn)[0]
    assert saved["status"] == "processing" and saved["state"]["i"] >= 10
    # As if its lease had run out (budget + 20 s), without waiting for it.
    conn.execute("update thumbq.jobs set lease_expires_at = now() - interval '1 second'")
    conn.execute("select pgmq.set_vt('thumbq_jobs', msg_id, 0) from thumbq.jobs")
    for _ in range(6):
        batch(tconfig, conn)
        if job_rows(conn)[0]["status"] == "completed":
            break
    row = job_rows(conn)[0]
    assert row["status"] == "completed"
    assert row["result"] == {"sum": sum(range(30)), "steps": 30}  # as if never killed
    steps = [json.loads(line)["i"] for line in log.read_text().splitlines()]
    # It went on from the last checkpoint: no step was done twice, none was skipped.
    assert steps == list(range(1, 31))


def test_a_handler_whose_process_was_slow_to_start_still_stops_before_the_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's deadline is the invocation's, however long its process took to start (a
    first call starts the zygote and imports the task modules): one that works until
    `remaining_ms()` says stop gets its checkpoint in, rather than being killed."""
    from worker.thumbnails.render import RenderOptions
    from worker.thumbnails.render.process import RenderPool

    (tmp_path / "slow_start_tasks.py").write_text(
        textwrap.dedent(
            """
            import time
            from worker.tasks import task

            time.sleep(0.8)  # a heavy import: a model, a big library

            @task("until_told")
            def until_told(ctx, payload):
                # 150 ms before its deadline, 300 ms before the kill: room for a loaded
                # machine; a deadline counted from the process's start would be 0.8 s late.
                while ctx.remaining_ms() > 150:
                    time.sleep(0.005)
                return ctx.checkpoint({"stopped_with_ms": ctx.remaining_ms()})
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    saves: list[object] = []
    pool = RenderPool(RenderOptions(tasks=("slow_start_tasks",)), 1, 512)  # started on demand
    try:
        started = time.monotonic()
        reply = pool.run_task(
            "until_told",
            {"id": 1, "task": "until_told", "payload": None},
            # A cold zygote (0.3 s quiet, 0.7 s and more beside the suite) and the 0.8 s
            # import come first: 3 s leaves the handler about a second either way.
            timeout_s=3.0,
            on_save=lambda state, done, total: saves.append(state) or True,
            is_cancelled=lambda: False,
        )
        took_s = time.monotonic() - started
    finally:
        pool.close()
    assert reply.checkpoint and saves == [reply.state]
    assert took_s < 3.0


@pytest.mark.parametrize("task", ["until_cancelled", "until_cancelled_thread"])
def test_cancelling_a_running_job_stops_it_within_one_check_and_its_output_is_removed(
    tconfig: Config, conn: db.Conn, db_url: str, tmp_path: Path, task: str
) -> None:
    partial, seen = tmp_path / "partial.csv", tmp_path / "seen"
    rows = Queue(conn).enqueue_jobs(
        [{"task": task, "payload": {"partial": str(partial), "seen": str(seen)}}], "g"
    )
    results: list[BatchResult] = []
    runner = threading.Thread(
        target=lambda: results.append(batch(tconfig.with_(budget_ms=8000), conn))
    )
    runner.start()
    while not partial.exists():
        time.sleep(0.01)
    with db.connect(db_url) as other:
        cancelled_at = time.monotonic()
        assert Queue(other).cancel_jobs([rows[0]["job_id"]]) == 1
    while not seen.exists() and time.monotonic() - cancelled_at < 5:
        time.sleep(0.01)
    stopped_after = time.monotonic() - cancelled_at
    runner.join(15)
    assert seen.exists() and stopped_after < 1.0  # one poll (0.25 s) and one check
    assert not partial.exists()
    assert results[0].duration_ms < 4000  # it did not run on to the deadline
    row = job_rows(conn)[0]
    assert (row["status"], row["error_code"]) == ("cancelled", "cancelled")
    assert row["state"] is None  # the cancelled job's report changed nothing


@pytest.mark.slow
def test_order_holds_under_four_concurrent_invocations_with_sigkills(
    db_url: str, tmp_path: Path
) -> None:
    """For every ordering key, the completion order equals the sequence order, and no two jobs
    of one key ever run at once, while invocations are SIGKILLed and replaced."""
    keys, per_key = 12, 8
    log = tmp_path / "segments.log"
    with db.connect(db_url) as c:
        Queue(c).enqueue_jobs(
            [
                {
                    "task": "segment",
                    "ordering_key": f"video-{k}",
                    "payload": {"key": f"video-{k}", "seq": s, "log": str(log), "sleep_ms": 100},
                }
                for k in range(keys)
                for s in range(1, per_key + 1)
            ],
            "videos",
        )
    script = textwrap.dedent(
        f"""
        import time
        from worker.engine import db
        from worker.engine.batch import run_batch
        from worker.engine.config import Config
        from worker.storage import open_storage
        config = Config.from_env({{"DATABASE_URL": {db_url!r}, "THUMBQ_TASKS": {TASKS!r},
                                   "THUMBQ_HOME": {str(tmp_path / "home")!r},
                                   "THUMBQ_BUDGET_MS": "3000", "THUMBQ_BUFFER_MS": "1000",
                                   "THUMBQ_CONCURRENCY": "1"}})
        with db.connect(config.database_url) as conn:
            while True:
                r = run_batch(config, conn, open_storage(config))
                if r.stopped_reason == "drained" and not r.processed:
                    time.sleep(0.2)
        """
    )

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-c", script],
            cwd=ROOT,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    procs = [start() for _ in range(4)]
    kills = 0
    deadline = time.monotonic() + 150
    try:
        with db.connect(db_url) as c:
            while time.monotonic() < deadline:
                time.sleep(0.5)
                if kills < 4:
                    victim = procs.pop(kills % len(procs))
                    os.killpg(victim.pid, signal.SIGKILL)
                    victim.wait()
                    kills += 1
                    # Its leases run out as if 20 s had passed: the replacement takes over.
                    c.execute(
                        "update thumbq.jobs set lease_expires_at = now() - interval '1 second'"
                        " where status = 'processing' and worker_id like %s",
                        [f"%:{victim.pid}:%"],
                    )
                    procs.append(start())
                left = c.execute(
                    "select count(*) as n from thumbq.jobs where status <> 'completed'"
                ).fetchone()["n"]
                if left == 0:
                    break
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert left == 0 and kills == 4

    events = [json.loads(line) for line in log.read_text().splitlines()]
    starts: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        starts[e["key"]].append(e)
    with db.connect(db_url) as c:
        completed = c.execute(
            "select ordering_key, sequence from thumbq.jobs order by completed_at, id"
        ).fetchall()
    by_key: dict[str, list[int]] = defaultdict(list)
    for r in completed:
        by_key[r["ordering_key"]].append(r["sequence"])
    assert all(seqs == list(range(1, per_key + 1)) for seqs in by_key.values()), by_key
    # No two segments of one key ever ran at once (a killed run's segment has no end: it
    # counts as running until the next segment of its key started, which it never overlaps).
    for key, evs in starts.items():
        open_seq = None
        for e in sorted(evs, key=lambda e: (e["t"], e["at"] == "start")):
            if e["at"] == "start":
                assert open_seq is None or open_seq == e["seq"], (key, open_seq, e)
                open_seq = e["seq"]
            elif e["seq"] == open_seq:
                open_seq = None


def test_a_thread_handler_that_ignores_its_deadline_never_runs_twice_at_once(
    tconfig: Config, conn: db.Conn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (issue 20, item 2): a thread cannot be killed, and one left behind at the
    deadline lost its job when its lease ended: the next claim ran it a second time alongside.
    Now it keeps its job (the lease renewed) until it ends, and its result is recorded then."""
    import worker.engine.batch

    # Leases end 1 s after a batch's budget (20 s in production), so that batches run past
    # the first lease within the test.
    monkeypatch.setattr(worker.engine.batch, "VT_MARGIN_S", 1)
    log = tmp_path / "overrun.log"
    payload = {"log": str(log), "sleep_s": 6}
    (job,) = Queue(conn).enqueue_jobs([{"task": "overrun_thread", "payload": payload}], "g")
    config = tconfig.with_(budget_ms=1500, buffer_ms=500)  # a lease of 2 s + 1 s
    started = time.monotonic()
    runs = []
    while time.monotonic() - started < 12:
        runs.append(batch(config, conn))
        if Queue(conn).job(job["job_id"])["status"] == "completed":
            break
        time.sleep(0.1)
    took = time.monotonic() - started
    starts = [json.loads(line)["at"] for line in log.read_text().splitlines()]
    assert starts.count("start") == 1, starts
    assert len(runs) >= 4 and took >= 6  # batches went on well past the first lease
    assert all(r.duration_ms <= 1000 + 300 for r in runs)  # none waited for the thread
    row = Queue(conn).job(job["job_id"])
    assert (row["status"], row["attempts"], row["result"]) == ("completed", 1, {"slept_s": 6})


def test_a_checkpointing_handler_killed_at_its_deadline_uses_no_attempt(
    tconfig: Config, conn: db.Conn
) -> None:
    """Regression (issue 20, item 14): a handler that saved a checkpoint and was then killed
    at the deadline was charged an attempt and waited a 30-60 s backoff. It made progress: it
    is handed back like a checkpoint, and the next invocation resumes it at once."""
    (job,) = Queue(conn).enqueue_jobs([{"task": "checkpoint_then_overrun"}], "g")
    config = tconfig.with_(budget_ms=3000, buffer_ms=1000)
    first = batch(config, conn)
    row = Queue(conn).job(job["job_id"])
    assert (row["status"], row["attempts"], row["error_code"]) == ("pending", 0, None), row
    assert row["state"] == {"step": 1} and row["next_attempt_at"] is None
    assert first.checkpointed == 1 and first.duration_ms <= 2000 + 300
    second = batch(config, conn)  # no backoff to wait out
    row = Queue(conn).job(job["job_id"])
    assert second.succeeded == 1
    assert (row["status"], row["attempts"]) == ("completed", 1)
    assert row["result"] == {"resumed_from": {"step": 1}}


@pytest.mark.parametrize("task", ["unsaved_checkpoint", "unsaved_checkpoint_thread"])
def test_a_checkpoint_that_postgres_refuses_raises_in_the_handler(
    tconfig: Config, conn: db.Conn, task: str
) -> None:
    """Regression (issue 20, item 13): a failed checkpoint write was reported as saved, so a
    handler went on believing a crash would resume from it. Postgres refuses this state (a NUL
    character in jsonb): the handler's ctx.checkpoint raises CheckpointNotSaved."""
    (job,) = Queue(conn).enqueue_jobs([{"task": task}], "g")
    assert batch(tconfig, conn).succeeded == 1
    row = Queue(conn).job(job["job_id"])
    assert row["result"] == {"raised": "CheckpointNotSaved", "code": "checkpoint_not_saved"}
    assert row["state"] is None and row["checkpoints"] == 0


def test_progress_is_written_at_most_every_half_second_and_the_last_value_with_the_outcome(
    tconfig: Config, conn: db.Conn
) -> None:
    """A handler reports progress every 10 ms: the job row (and its group's, which Realtime
    follows) is written at most every 0.5 s while it runs, and the last value reported, never
    written while it ran, is the one the finished job shows."""
    conn.execute(
        "create table progress_writes (at timestamptz not null default clock_timestamp(),"
        " done bigint, status text)"
    )
    conn.execute(
        "create function log_progress() returns trigger language plpgsql as $$ begin"
        " insert into progress_writes (done, status) values (new.progress_done, new.status);"
        " return new; end $$"
    )
    conn.execute(
        "create trigger progress_writes after update on thumbq.jobs for each row"
        " when (old.progress_done is distinct from new.progress_done)"
        " execute function log_progress()"
    )
    payload = {"burst_s": 1.6, "last": 100_000}
    (job,) = Queue(conn).enqueue_jobs([{"task": "progress_burst", "payload": payload}], "g")
    assert batch(tconfig, conn).succeeded == 1
    writes = conn.execute("select at, done, status from progress_writes order by at").fetchall()
    # While it reported (the last value goes with the outcome, below): 1.6 s of reports are
    # written at 0, 0.5, 1.0 and 1.5 s at most.
    running = [w for w in writes if w["done"] != payload["last"]]
    assert 2 <= len(running) <= 4 and writes[-1]["done"] == payload["last"], writes
    gaps = [(b["at"] - a["at"]).total_seconds() for a, b in itertools.pairwise(running)]
    assert all(gap >= 0.45 for gap in gaps), gaps
    row = Queue(conn).job(job["job_id"])
    assert (row["status"], row["progress_done"]) == ("completed", 100_000)


def test_a_progress_write_on_a_locked_row_does_not_hold_the_handler_and_is_tried_again(
    tconfig: Config, conn: db.Conn, db_url: str, tmp_path: Path
) -> None:
    """Regression (issue 20, item 13): a progress write waited for a row held elsewhere for as
    long as the invocation had left, holding up the handler, and a report that was not written
    counted as written for the throttle. Now it gives up after a moment, the handler goes on,
    and its next report is written."""
    (job,) = Queue(conn).enqueue_jobs(
        [{"task": "progress_under_lock", "payload": {"dir": str(tmp_path)}}], "g"
    )
    results: list[BatchResult] = []
    runner = threading.Thread(target=lambda: results.append(batch(tconfig, conn)))
    runner.start()

    def wait_for(name: str, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not (tmp_path / name).exists() and time.monotonic() < end:
            time.sleep(0.01)
        return (tmp_path / name).exists()

    assert wait_for("ready", 30)
    with db.connect(db_url) as other:
        with other.transaction():  # an operator's statement holds the job's row
            other.execute("select id from thumbq.jobs where id = %s for update", [job["job_id"]])
            (tmp_path / "locked").touch()
            wait_for("tried", 3)
        (tmp_path / "unlocked").touch()
    assert wait_for("reported", 10)
    shown = Queue(conn).job(job["job_id"])["progress_done"]
    (tmp_path / "checked").touch()
    runner.join(30)
    held_ms = float((tmp_path / "tried").read_text())
    assert held_ms < 600, held_ms  # the progress write's bound (250 ms), not the lock's hold
    assert shown == 3  # the report after the failed one was written at once
    assert results[0].succeeded == 1
