"""Tasks in SQL: idempotency keys, ordering keys, priorities with ageing, checkpoints and
cancellation of running jobs, against a real Postgres with pgmq and several connections."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import psycopg
import pytest

from tests.db.test_concurrency import run_threads
from tests.db.test_queue import group_rows, recount
from worker.engine import db
from worker.engine.queue import ClaimedJob, Queue


def done(q: Queue, worker: str, jobs: list[ClaimedJob], result: object = None) -> int:
    return q.complete(
        worker, [{"job_id": j.id, "msg_id": j.msg_id, "result": result} for j in jobs]
    )


def test_an_idempotency_key_collapses_repeated_requests(conn: db.Conn) -> None:
    q = Queue(conn)
    first = q.enqueue_jobs(
        [
            {"task": "docgen", "payload": {"n": 1}, "idempotency_key": "req-a"},
            {"task": "docgen", "payload": {"n": 2}, "idempotency_key": "req-b"},
            {"task": "docgen", "payload": {"n": 1}, "idempotency_key": "req-a"},
        ],
        "g",
    )
    assert [r["created"] for r in first] == [True, True, False]
    assert first[0]["job_id"] == first[2]["job_id"] != first[1]["job_id"]
    again = q.enqueue_jobs([{"task": "docgen", "idempotency_key": "req-b"}], "g")
    assert again[0]["job_id"] == first[1]["job_id"] and not again[0]["created"]
    # Per task: another task may use the same key.
    other = q.enqueue_jobs([{"task": "export", "idempotency_key": "req-a"}], "g")
    assert other[0]["created"]
    assert q.progress("g")["total"] == 3


def test_concurrent_requests_with_one_idempotency_key_make_one_job(db_url: str) -> None:
    ids: list[int] = []
    start = threading.Barrier(6)

    def request() -> None:
        with db.connect(db_url) as c:
            start.wait()
            row = Queue(c).enqueue_jobs([{"task": "docgen", "idempotency_key": "same"}], "g")
            ids.append(row[0]["job_id"])

    assert run_threads([request] * 6) == []
    assert len(set(ids)) == 1
    with db.connect(db_url) as c:
        n = c.execute("select count(*) as n from pgmq.q_thumbq_jobs").fetchone()["n"]
        assert n == 1


def test_an_ordering_key_runs_in_sequence_one_at_a_time(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_jobs(
        [{"task": "seg", "ordering_key": "video-1", "payload": {"i": i}} for i in range(3)], "g"
    )
    q.enqueue_jobs([{"task": "seg", "ordering_key": "video-2", "sequence": 10}], "g")
    claim = q.claim("w", 10, 60).jobs
    assert sorted((j.ordering_key, j.sequence) for j in claim) == [("video-1", 1), ("video-2", 10)]
    assert q.claim("w", 10, 60).jobs == []  # the rest wait behind their heads
    assert done(q, "w", [j for j in claim if j.ordering_key == "video-1"]) == 1
    nxt = q.claim("w", 10, 60).jobs
    assert [(j.ordering_key, j.sequence) for j in nxt] == [("video-1", 2)]
    # A failure holds the rest of the key...
    q.fail("w", nxt[0], "task_failed", "bad segment", permanent=True)
    assert q.claim("w", 10, 60).jobs == []
    # ...until it is retried (and then it goes first again) or cancelled.
    assert q.retry_failed("g") == 1
    again = q.claim("w", 10, 60).jobs
    assert [(j.ordering_key, j.sequence) for j in again] == [("video-1", 2)]
    assert q.cancel_jobs([again[0].id]) == 1
    # The cancelled run may still be going: the next job waits until its run reports (or
    # its lease ends), never beside it.
    assert q.claim("w", 10, 60).jobs == []
    assert done(q, "w", again) == 0
    last = q.claim("w", 10, 60).jobs
    assert [(j.ordering_key, j.sequence) for j in last] == [("video-1", 3)]
    assert group_rows(conn) == recount(conn)


def test_a_sequence_behind_one_that_started_is_refused(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k", "sequence": 5}], "g")
    j = q.claim("w", 1, 60).jobs[0]
    with pytest.raises(psycopg.errors.ExclusionViolation, match=r"sequence_conflict.*behind"):
        q.enqueue_jobs([{"task": "seg", "ordering_key": "k", "sequence": 3}], "g")
    done(q, "w", [j])
    # One that has not started yet is simply overtaken: the new head goes first.
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k2", "sequence": 5}], "g")
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k2", "sequence": 2}], "g")
    order = []
    for _ in range(3):
        got = q.claim("w", 5, 60).jobs
        order += [(x.ordering_key, x.sequence) for x in got]
        done(q, "w", got)
    assert order == [("k2", 2), ("k2", 5)]


def test_higher_priorities_go_first_and_waiting_ages_into_priority(conn: db.Conn) -> None:
    q = Queue(conn, ageing_s=3600)
    q.enqueue_jobs([{"task": "t", "payload": {"n": i}} for i in range(3)], "low")
    q.enqueue_jobs([{"task": "t", "priority": 9, "payload": {"n": i}} for i in range(3)], "high")
    q.enqueue_jobs([{"task": "t", "priority": 4}], "mid")
    got = q.claim("w", 4, 60).jobs
    assert [j.priority for j in got] == [9, 9, 9, 4]
    # Low jobs that have waited long enough count as more urgent than new high ones.
    q.enqueue_jobs([{"task": "t", "priority": 9}], "high")
    conn.execute(
        "update thumbq.jobs set created_at = now() - interval '11 hours' where group_id = 'low'"
    )
    got = q.claim("w", 3, 60).jobs
    assert [j.group_id for j in got] == ["low", "low", "low"]


def test_thumbnails_take_a_priority_too(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files([{"source_key": f"bulk/{i}.jpg", "etag": "e"} for i in range(5)], "backfill")
    q.enqueue_files([{"source_key": "upload/new.jpg", "etag": "e", "priority": 9}], "uploads")
    assert [j.source_key for j in q.claim("w", 1, 60).jobs] == ["upload/new.jpg"]


def test_a_checkpoint_hands_the_job_back_without_using_an_attempt(conn: db.Conn) -> None:
    q = Queue(conn, max_attempts=2)
    q.enqueue_jobs([{"task": "export"}], "g")
    for step in range(4):
        j = q.claim("w", 1, 60).jobs[0]
        assert j.attempts == 1 and j.checkpoints == step
        assert j.state == (None if step == 0 else {"offset": step * 100})
        r = q.checkpoint("w", j, {"offset": (step + 1) * 100}, (step + 1) * 100, 1000, requeue=True)
        assert r == {"owned": True, "status": "pending"}
    j = q.claim("w", 1, 60).jobs[0]
    assert done(q, "w", [j], {"rows": 1000}) == 1
    row = conn.execute(
        "select status, result, state, attempts, progress_done from thumbq.jobs"
    ).fetchone()
    assert row == {
        "status": "completed",
        "result": {"rows": 1000},
        "state": {"offset": 400},
        "attempts": 1,
        "progress_done": 1000,
    }


def test_progress_sums_into_the_group_row(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_jobs([{"task": "export"}, {"task": "export"}], "g")
    a, b = q.claim("w", 2, 60).jobs
    q.checkpoint("w", a, None, 30, 100, requeue=False)
    q.checkpoint("w", b, None, 5, 50, requeue=False)
    g = conn.execute(
        "select progress_done, progress_total from thumbq.groups where group_id = 'g'"
    ).fetchone()
    assert g == {"progress_done": 35, "progress_total": 150}
    p = q.progress("g")
    assert (p["progress_done"], p["progress_total"]) == (35, 150)
    done(q, "w", [a])
    g = conn.execute(
        "select progress_done, progress_total from thumbq.groups where group_id = 'g'"
    ).fetchone()
    assert g == {"progress_done": 105, "progress_total": 150}


def test_a_cancelled_running_job_is_seen_as_not_held_and_its_reports_change_nothing(
    conn: db.Conn,
) -> None:
    q = Queue(conn)
    q.enqueue_jobs([{"task": "export"}, {"task": "export"}], "g")
    a, b = q.claim("w", 2, 60).jobs
    assert q.not_held("w", [a.id, b.id]) == set()
    assert q.cancel_jobs([a.id]) == 1
    assert q.not_held("w", [a.id, b.id]) == {a.id}
    assert q.checkpoint("w", a, {"x": 1}, 1, 2, requeue=True)["owned"] is False
    assert done(q, "w", [a]) == 0
    assert conn.execute("select status from thumbq.jobs where id = %s", [a.id]).fetchone() == {
        "status": "cancelled"
    }


def test_claim_job_runs_one_given_job_under_the_same_lease(conn: db.Conn) -> None:
    q = Queue(conn)
    rows = q.enqueue_jobs([{"task": "t"}, {"task": "t"}], "g")
    job, why = q.claim_job("api", rows[1]["job_id"], 30)
    assert job is not None and job.id == rows[1]["job_id"] and job.attempts == 1
    # A batch claims only the other one meanwhile; a second interactive call finds it taken.
    assert [j.id for j in q.claim("batch", 5, 60).jobs] == [rows[0]["job_id"]]
    again, why = q.claim_job("api2", rows[1]["job_id"], 30)
    assert again is None and why["reason"] == "not_waiting"
    assert done(q, "api", [job]) == 1


@pytest.mark.slow
def test_ordering_holds_with_four_concurrent_claimers(db_url: str) -> None:
    keys, per_key = 40, 6
    with db.connect(db_url) as c:
        Queue(c).enqueue_jobs(
            [{"task": "seg", "ordering_key": f"k{k}"} for k in range(keys) for _ in range(per_key)],
            "g",
        )
    finished: dict[str, list[int]] = defaultdict(list)
    running: dict[str, int] = {}
    violations: list[str] = []
    lock = threading.Lock()

    def claimer(n: int) -> None:
        with db.connect(db_url) as c:
            q = Queue(c)
            idle_since = time.monotonic()
            while time.monotonic() - idle_since < 2.0:
                jobs = q.claim(f"w{n}", 5, 60).jobs
                if not jobs:
                    time.sleep(0.01)
                    continue
                idle_since = time.monotonic()
                with lock:
                    for j in jobs:
                        assert j.ordering_key is not None and j.sequence is not None
                        if j.ordering_key in running:
                            violations.append(
                                f"{j.ordering_key} {j.sequence} beside {running[j.ordering_key]}"
                            )
                        running[j.ordering_key] = j.sequence
                time.sleep(0.002)
                with lock:
                    for j in jobs:
                        assert j.ordering_key is not None and j.sequence is not None
                        running.pop(j.ordering_key, None)
                        finished[j.ordering_key].append(j.sequence)
                done(q, f"w{n}", jobs)

    assert run_threads([lambda i=i: claimer(i) for i in range(4)]) == []
    assert violations == []
    assert len(finished) == keys
    assert all(seqs == list(range(1, per_key + 1)) for seqs in finished.values()), finished


def test_an_item_without_a_sequence_goes_after_the_earlier_items_of_its_call(
    conn: db.Conn,
) -> None:
    # Regression: the second item got sequence 1 too and collapsed into the first.
    q = Queue(conn)
    rows = q.enqueue_jobs(
        [
            {"task": "seg", "ordering_key": "v", "sequence": 1},
            {"task": "seg", "ordering_key": "v"},
            {"task": "seg", "ordering_key": "v", "sequence": 7},
            {"task": "seg", "ordering_key": "v"},
        ],
        "g",
    )
    assert [(r["created"], r["sequence"]) for r in rows] == [
        (True, 1),
        (True, 2),
        (True, 7),
        (True, 8),
    ]
    assert len({r["job_id"] for r in rows}) == 4


def test_released_jobs_give_their_tokens_back_to_their_own_bucket(conn: db.Conn) -> None:
    # Regression: release refunded the thumbnail bucket for every job, whatever its task took.
    from worker.engine import ratelimit

    ratelimit.set_limit(conn, "api_quota", capacity=10, refill_per_second=0)
    conn.execute(
        "insert into thumbq.tasks (name, bucket) values ('docgen', 'api_quota')"
        " on conflict (name) do update set bucket = excluded.bucket"
    )
    ratelimit.set_limit(conn, "thumbnail_generation", capacity=10, refill_per_second=0)
    q = Queue(conn)
    q.enqueue_jobs([{"task": "docgen"} for _ in range(3)], "g")
    jobs = q.claim("w", 3, 60).jobs
    assert len(jobs) == 3
    tokens = {
        r["name"]: r["tokens"] for r in conn.execute("select name, tokens from thumbq.rate_limits")
    }
    assert (tokens["api_quota"], tokens["thumbnail_generation"]) == (7, 10)
    assert q.release("w", [j.id for j in jobs]) == 3
    tokens = {
        r["name"]: r["tokens"] for r in conn.execute("select name, tokens from thumbq.rate_limits")
    }
    assert (tokens["api_quota"], tokens["thumbnail_generation"]) == (10, 10)
