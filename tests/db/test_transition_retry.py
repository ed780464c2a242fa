"""A real deadlock inside a transition is retried there, and its caller never sees it.

Every transition takes job rows before group rows (the lock order written in
sql/functions/10_helpers.sql); an operator's own transaction that locks a group row and then one
of its job rows closes a cycle with it. The scene, on three connections: the operator locks the
group row; the transition takes the job row and waits for the group row; the operator then asks
for the job row. The transition started waiting first, so its deadlock check (deadlock_timeout,
1 s) fires first and it is the one Postgres aborts (the operator's check is set to 30 s): the
transition must catch `deadlock_detected`, roll back its attempt, wait for the operator to
finish and succeed.

A caught error is not written to the server's log, so the test counts the deadlock where
Postgres counts every one it detects, `pg_stat_database.deadlocks` of the test's database: it
must have gone up, or the scene did not happen and the test proves nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from tests.db.test_queue import items
from worker.engine import db
from worker.engine.queue import ClaimedJob, Queue

pytestmark = pytest.mark.pgmq_versions

GROUP = "deadlocked"
WORKER = "w1"


@dataclass(frozen=True)
class Scene:
    """A job in a state (`setup`), the transition that changes it (`act`), and what the
    transition must have returned and left (`expect`: result, job row)."""

    setup: Callable[[Queue], tuple[int, ClaimedJob | None]]
    act: Callable[[Queue, int, ClaimedJob | None], Any]
    expect: Callable[[Any, dict[str, Any], db.Conn], None]


def _pending(q: Queue) -> tuple[int, ClaimedJob | None]:
    (row,) = q.enqueue_files(items(1, prefix="dl"), GROUP)
    return int(row["job_id"]), None


def _running(q: Queue) -> tuple[int, ClaimedJob | None]:
    job_id, _ = _pending(q)
    claim = q.claim(WORKER, 1, 120)
    assert [j.id for j in claim.jobs] == [job_id]
    return job_id, claim.jobs[0]


def _failed(q: Queue) -> tuple[int, ClaimedJob | None]:
    job_id, job = _running(q)
    assert job is not None
    assert q.fail(WORKER, job, "corrupt_input", "not a PDF", True)["status"] == "failed"
    return job_id, None


def _status(want: str, result: Any) -> Callable[[Any, dict[str, Any], db.Conn], None]:
    def check(got: Any, row: dict[str, Any], conn: db.Conn) -> None:
        assert got == result and row["status"] == want, (got, row["status"])

    return check


def _superseded(got: Any, row: dict[str, Any], conn: db.Conn) -> None:
    assert [r["created"] for r in got] == [True], got
    assert row["status"] == "cancelled", row["status"]
    new = conn.execute("select status from thumbq.jobs where id = %s", [got[0]["job_id"]])
    assert new.fetchone() == {"status": "pending"}


def _failed_now(got: Any, row: dict[str, Any], conn: db.Conn) -> None:
    assert got["owned"] and got["status"] == "failed", got
    assert row["status"] == "failed" and row["error_code"] == "corrupt_input"


def _head(q: Queue) -> tuple[int, ClaimedJob | None]:
    (row,) = q.enqueue_jobs([{"task": "echo", "ordering_key": "k", "sequence": 5}], GROUP)
    return int(row["job_id"]), None


def _demoted(got: Any, row: dict[str, Any], conn: db.Conn) -> None:
    assert [r["created"] for r in got] == [True], got
    # Sequence 3 is the key's head now, with the only message; 5 waits behind it.
    assert row["status"] == "pending" and row["msg_id"] is None, row
    new = conn.execute("select status, msg_id from thumbq.jobs where id = %s", [got[0]["job_id"]])
    first = new.fetchone()
    assert first is not None and first["status"] == "pending" and first["msg_id"] is not None


def _superseded_mixed(got: Any, row: dict[str, Any], conn: db.Conn) -> None:
    files, jobs = got
    _superseded(files, row, conn)
    assert [j["created"] for j in jobs] == [True], jobs


SCENES = {
    "complete": Scene(
        _running,
        lambda q, i, j: q.complete(WORKER, [{"job_id": i, "msg_id": j.msg_id}]),  # type: ignore[union-attr]
        _status("completed", 1),
    ),
    "fail": Scene(
        _running,
        lambda q, i, j: q.fail(WORKER, j, "corrupt_input", "not a PDF", True),  # type: ignore[arg-type]
        _failed_now,
    ),
    "release": Scene(_running, lambda q, i, j: q.release(WORKER, [i]), _status("pending", 1)),
    "cancel_jobs": Scene(_pending, lambda q, i, j: q.cancel_jobs([i]), _status("cancelled", 1)),
    "retry_failed": Scene(_failed, lambda q, i, j: q.retry_failed(GROUP), _status("pending", 1)),
    # A new version of the file supersedes (cancels) the job of the old one.
    "enqueue_batch": Scene(
        _pending,
        lambda q, i, j: q.enqueue_files(items(1, prefix="dl", etag="e2"), GROUP),
        _superseded,
    ),
    # A lower sequence enqueued before the head started: the head gives up its message.
    "enqueue_jobs": Scene(
        _head,
        lambda q, i, j: q.enqueue_jobs(
            [{"task": "echo", "ordering_key": "k", "sequence": 3}], GROUP
        ),
        _demoted,
    ),
    # A new version of the file and a task job in one request (POST /api/jobs, mixed).
    "enqueue_mixed": Scene(
        _pending,
        lambda q, i, j: q.enqueue_mixed(
            items(1, prefix="dl", etag="e2"), [{"task": "echo", "group_id": GROUP}], GROUP
        ),
        _superseded_mixed,
    ),
}


def deadlocks(conn: db.Conn) -> int:
    conn.execute("select pg_stat_clear_snapshot()")
    row = conn.execute(
        "select deadlocks from pg_stat_database where datname = current_database()"
    ).fetchone()
    assert row is not None
    return int(row["deadlocks"])


def wait_until_waiting_for_a_lock(watch: db.Conn, pid: int, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = watch.execute(
            "select wait_event_type from pg_stat_activity where pid = %s", [pid]
        ).fetchone()
        if row and row["wait_event_type"] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError("the transition never waited for the operator's group row")


@pytest.mark.parametrize("name", list(SCENES))
def test_a_transition_deadlocked_by_an_operators_transaction_retries_and_succeeds(
    db_url: str, name: str
) -> None:
    scene = SCENES[name]
    with db.connect(db_url) as setup:
        job_id, job = scene.setup(Queue(setup))
    watch = db.connect(db_url)
    before = deadlocks(watch)
    outcome: dict[str, Any] = {}

    def transition(conn: db.Conn) -> None:
        try:
            outcome["result"] = scene.act(Queue(conn), job_id, job)
        except BaseException as exc:  # what the caller would see
            outcome["error"] = exc

    with db.connect(db_url) as tconn, psycopg.connect(db_url) as operator:
        pid = tconn.execute("select pg_backend_pid() as pid").fetchone()["pid"]  # type: ignore[index]
        tconn.execute("set deadlock_timeout = '1s'")
        # The operator's check comes long after the transition's: the transition is the victim.
        operator.execute("set deadlock_timeout = '30s'")
        operator.execute("set lock_timeout = '20s'")
        operator.execute("select 1 from thumbq.groups where group_id = %s for update", [GROUP])
        thread = threading.Thread(target=transition, args=(tconn,))
        thread.start()
        try:
            wait_until_waiting_for_a_lock(watch, pid)
            # Closes the cycle; granted once Postgres aborts the transition's attempt.
            operator.execute("select 1 from thumbq.jobs where id = %s for update", [job_id])
            time.sleep(0.3)  # the transition's retry now waits for the operator
        finally:
            operator.commit()
            thread.join(30)
        assert not thread.is_alive(), "the transition hung"
    # The transition's backend has ended and flushed its statistics; the watcher reads them.
    deadline = time.monotonic() + 5
    while deadlocks(watch) == before and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = deadlocks(watch) - before
    row = watch.execute("select * from thumbq.jobs where id = %s", [job_id]).fetchone()
    assert row is not None
    error = outcome.get("error")
    assert error is None, f"the caller saw: {type(error).__name__}: {error}"
    assert seen >= 1, "no deadlock happened: the scene did not test the retry"
    scene.expect(outcome["result"], row, watch)
    watch.close()
