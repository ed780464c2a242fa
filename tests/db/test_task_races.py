"""The task engine's promises under races (issue 20), each with several real connections at once
against a real Postgres, on the pgmq package's SQL and on the pgmq extension 1.4.4 and 1.5.1:
an ordering key runs strictly one at a time in order, also while a lower sequence is enqueued
during its head's claim and while a cancelled head is still stopping; a report is never dropped
because a row was briefly locked; every lease that ends is recovered by claims alone, in every
priority queue; a claim takes tokens only from its own jobs' buckets and never holds a bucket
while it waits; crossed mixed enqueues never deadlock; retention never strands a key; ageing
counts only jobs that can be claimed; service_role can use every queue; a key's history does
not slow its next step."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any

import psycopg
import pytest

from tests.db.test_concurrency import run_threads
from tests.db.test_queue import group_rows, items, recount
from worker.engine import db, ratelimit
from worker.engine.queue import ClaimedJob, Queue

pytestmark = pytest.mark.pgmq_versions


def done(q: Queue, worker: str, jobs: list[ClaimedJob]) -> int:
    return q.complete(worker, [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs])


def statuses(conn: db.Conn, key: str) -> list[tuple[int, str]]:
    rows = conn.execute(
        "select sequence, status from thumbq.jobs where ordering_key = %s order by sequence", [key]
    ).fetchall()
    return [(r["sequence"], r["status"]) for r in rows]


def test_a_lower_sequence_enqueued_during_the_heads_claim_never_runs_beside_it(
    db_url: str, conn: db.Conn
) -> None:
    # Regression: enqueue read the head's started_at before the claim committed, then skipped
    # the head (now processing) when it demoted it: seq 3 became a second head and ran beside 5.
    Queue(conn).enqueue_jobs([{"task": "seg", "ordering_key": "k", "sequence": 5}], "g")
    outcome: dict[str, Any] = {}

    def claim_and_hold() -> None:
        with db.connect(db_url) as a, a.transaction():
            outcome["a"] = Queue(a).claim("worker-A", 5, 60).jobs
            time.sleep(1.5)

    def enqueue_lower() -> None:
        time.sleep(0.3)
        with db.connect(db_url) as b:
            try:
                Queue(b).enqueue_jobs([{"task": "seg", "ordering_key": "k", "sequence": 3}], "g")
                outcome["b"] = "created"
            except psycopg.errors.ExclusionViolation as exc:
                outcome["b"] = str(exc)

    assert run_threads([claim_and_hold, enqueue_lower]) == []
    assert [j.sequence for j in outcome["a"]] == [5]
    assert "sequence_conflict" in outcome["b"]
    assert Queue(conn).claim("worker-C", 5, 60).jobs == []
    assert statuses(conn, "k") == [(5, "processing")]


def test_a_lower_sequence_enqueued_before_the_claim_takes_the_heads_place(
    db_url: str, conn: db.Conn
) -> None:
    # The other order of the same race: the enqueue holds the key's rows, the claim finds the
    # head locked and leaves it; once the enqueue commits, the new lower sequence goes first.
    Queue(conn).enqueue_jobs([{"task": "seg", "ordering_key": "k", "sequence": 5}], "g")
    claimed: list[list[int | None]] = []

    def enqueue_and_hold() -> None:
        with db.connect(db_url) as b, b.transaction():
            Queue(b).enqueue_jobs([{"task": "seg", "ordering_key": "k", "sequence": 3}], "g")
            time.sleep(1.0)

    def claim() -> None:
        time.sleep(0.3)
        with db.connect(db_url) as c:
            claimed.append([j.sequence for j in Queue(c).claim("worker-C", 5, 60).jobs])

    assert run_threads([enqueue_and_hold, claim]) == []
    assert claimed == [[]]
    time.sleep(1.1)  # the busy head's message was handed back for a second
    assert [j.sequence for j in Queue(conn).claim("w", 5, 60).jobs] == [3]
    assert statuses(conn, "k") == [(3, "processing"), (5, "pending")]


def test_a_cancelled_head_holds_its_key_until_its_run_reports_or_its_lease_ends(
    conn: db.Conn,
) -> None:
    # Regression: cancelling a running head released the next sequence at once, while the
    # head's handler still ran (a process handler that does not poll runs to its deadline).
    q = Queue(conn)
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k"} for _ in range(3)], "g")
    head = q.claim("w1", 5, 60).jobs
    assert [j.sequence for j in head] == [1]
    assert q.cancel_jobs([head[0].id]) == 1
    assert q.claim("w2", 5, 60).jobs == []
    assert q.claim_job("w2", head[0].id + 1, 60)[0] is None
    # The run stops (it reports, whatever it reports): the next one goes at once.
    assert (
        q.fail("w1", head[0], "render_timeout", "killed at the deadline", False)["owned"] is False
    )
    second = q.claim("w2", 5, 2).jobs  # a short lease: its run will be killed
    assert [j.sequence for j in second] == [2]
    # A run that never reports (killed): its lease ends and the key goes on by claims alone.
    assert q.cancel_jobs([second[0].id]) == 1
    assert q.claim("w3", 5, 60).jobs == []
    time.sleep(2.2)
    assert [j.sequence for j in q.claim("w3", 5, 60).jobs] == [3]
    assert group_rows(conn) == recount(conn)


def test_cancelling_the_next_job_behind_a_cancelled_run_passes_the_key_on_when_the_lease_ends(
    conn: db.Conn,
) -> None:
    # Regression (the soak, in CI): seq 1 was cancelled while it ran and its run was then
    # killed; seq 2, queued to go at the end of that lease, was cancelled as well. The release
    # took the cancelled run as the key's head and gave seq 3 no message: it stayed pending for
    # good once the lease ended, with nothing left to report.
    q = Queue(conn)
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k"} for _ in range(4)], "g")
    head = q.claim("w1", 5, 2).jobs  # a short lease: its run will be killed
    assert [j.sequence for j in head] == [1]
    assert q.cancel_jobs([head[0].id]) == 1
    assert q.cancel_jobs([head[0].id + 1]) == 1  # seq 2, waiting for seq 1's lease
    assert q.claim("w2", 5, 60).jobs == []  # seq 1's run may still go on
    time.sleep(2.2)
    third = q.claim("w2", 5, 60).jobs
    assert [j.sequence for j in third] == [3]
    done(q, "w2", third)
    assert [j.sequence for j in q.claim("w2", 5, 60).jobs] == [4]
    assert statuses(conn, "k") == [
        (1, "cancelled"),
        (2, "cancelled"),
        (3, "completed"),
        (4, "processing"),
    ]
    assert group_rows(conn) == recount(conn)


def test_claim_job_leaves_a_version_queued_again_while_its_cancelled_run_holds_it(
    conn: db.Conn,
) -> None:
    # Regression: a version re-enqueued while the cancelled run still held its lease got a
    # delayed message but no next_attempt_at, and claim_job ran it beside the cancelled run.
    q = Queue(conn)
    q.enqueue_files(items(1), "g")
    job = q.claim("w1", 1, 60).jobs[0]
    assert q.cancel("g") == 1
    again = q.enqueue_files(items(1), "g")
    assert again[0]["job_id"] == job.id and again[0]["status"] == "pending"
    got, why = q.claim_job("w2", job.id, 60)
    assert got is None and why["reason"] in ("busy", "not_waiting")
    row = conn.execute("select next_attempt_at from thumbq.jobs where id = %s", [job.id])
    assert row.fetchone()["next_attempt_at"] is not None


def test_a_killed_claims_priority_jobs_come_back_by_claims_alone(conn: db.Conn) -> None:
    # Regression: claim read only the queues of priorities with pending jobs, so a priority-5
    # job whose invocation died waited for cleanup-stale, not for its lease.
    q = Queue(conn)
    q.enqueue_jobs([{"task": "t", "priority": 5}], "g")
    lost = q.claim("killed", 1, 1).jobs
    assert [j.priority for j in lost] == [5]
    time.sleep(1.3)
    again = q.claim("alive", 1, 60).jobs
    assert [j.id for j in again] == [lost[0].id]
    assert again[0].attempts == 2


def test_an_empty_thumbnail_bucket_does_not_stop_tasks_with_their_own(conn: db.Conn) -> None:
    # Regression: every claim prepaid from THUMBQ_RATE_BUCKET, whatever it then read.
    ratelimit.set_limit(conn, "thumbnail_generation", capacity=1, refill_per_second=0.001)
    ratelimit.take(conn, "thumbnail_generation", 1)
    conn.execute(
        "insert into thumbq.rate_limits (name, capacity, refill_per_second, tokens)"
        " values ('docs', 10, 1, 10)"
    )
    conn.execute("insert into thumbq.tasks (name, bucket) values ('docgen', 'docs')")
    q = Queue(conn)
    q.enqueue_files(items(3), "g")
    q.enqueue_jobs([{"task": "docgen"} for _ in range(2)], "g")
    got = q.claim("w", 10, 60)
    assert sorted(j.task for j in got.jobs) == ["docgen", "docgen"]
    assert got.rate_limited  # the thumbnails wait for their bucket
    tokens = conn.execute("select name, floor(tokens) as t from thumbq.rate_limits order by name")
    assert {r["name"]: r["t"] for r in tokens} == {"docs": 8, "thumbnail_generation": 0}


def test_a_claim_waiting_for_a_group_row_does_not_hold_the_bucket(
    db_url: str, conn: db.Conn
) -> None:
    # Regression: the claim's refund ran before it locked the group rows, so the bucket row
    # stayed locked while the claim waited for an upload transaction's group row: every
    # take_tokens waited with it (1.54 s).
    q = Queue(conn)
    q.enqueue_files(items(2), "g")
    took: list[float] = []

    def hold_group() -> None:
        with db.connect(db_url) as up, up.transaction():
            up.execute("select 1 from thumbq.groups where group_id = 'g' for update")
            time.sleep(1.5)

    def claim() -> None:
        time.sleep(0.2)
        with db.connect(db_url) as c:
            Queue(c).claim("w", 10, 60)  # more than there is: a claim with tokens to spare

    def take() -> None:
        time.sleep(0.5)
        with db.connect(db_url) as c:
            started = time.monotonic()
            ratelimit.take(c, "thumbnail_generation", 1)
            took.append(time.monotonic() - started)

    assert run_threads([hold_group, claim, take]) == []
    assert took and took[0] < 0.3, took


def test_crossed_mixed_enqueues_never_deadlock(db_url: str) -> None:
    # Regression: a mixed POST /api/jobs ran enqueue_batch then enqueue_jobs in one transaction;
    # the first held group rows while the second took key and row locks: crossed requests
    # deadlocked and the error reached the caller.
    def client(n: int) -> None:
        a, b = ("ga", "gb") if n % 2 else ("gb", "ga")
        with db.connect(db_url) as c:
            q = Queue(c)
            for i in range(25):
                q.enqueue_mixed(
                    [{"source_key": f"f/{n}/{i}.png", "etag": "e", "group_id": a}],
                    [
                        {"task": "seg", "ordering_key": f"k{i % 3}", "group_id": b},
                        {"task": "seg", "ordering_key": f"k{(i + 1) % 3}", "group_id": a},
                    ],
                )
                if i % 5 == 0:
                    q.cancel(b)

    errors = run_threads([lambda n=n: client(n) for n in range(4)])
    assert errors == []
    with db.connect(db_url) as c:
        assert group_rows(c) == recount(c)


def test_retention_never_deletes_a_failed_head_that_holds_its_key(conn: db.Conn) -> None:
    # Regression: prune deleted a failed head; the jobs behind it never got a message and
    # counted in `remaining` for ever. An unsupported head could never be retried either.
    q = Queue(conn)
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k"} for _ in range(3)], "g")
    head = q.claim("w", 5, 60).jobs[0]
    q.fail("w", head, "unsupported_task", "no handler here", permanent=True)
    conn.execute("update thumbq.jobs set completed_at = now() - interval '40 days'")
    assert q.prune(30)["jobs"] == 0
    assert statuses(conn, "k") == [(1, "unsupported"), (2, "pending"), (3, "pending")]
    # Retried (its task may be deployed since), it goes first again...
    assert q.retry_failed("g") == 1
    again = q.claim("w", 5, 60).jobs
    assert [j.sequence for j in again] == [1]
    q.fail("w", again[0], "task_failed", "still bad", permanent=True)
    # ...or cancelled, and the key goes on.
    assert q.cancel_jobs([head.id]) == 1
    assert [j.sequence for j in q.claim("w", 5, 60).jobs] == [2]


def test_ageing_counts_only_jobs_that_can_be_claimed(conn: db.Conn) -> None:
    # Regression: one priority-0 job an hour old, held behind its key or waiting out a
    # backoff, put priority 0 ahead of priority 9 for good.
    q = Queue(conn)
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k"} for _ in range(2)], "g")
    q.enqueue_files(items(1), "g")
    first = q.claim("w", 5, 60).jobs
    assert sorted(j.task for j in first) == ["seg", "thumbnail"]
    thumb = next(j for j in first if j.task == "thumbnail")
    q.fail("w", thumb, "storage_error", "flaky", permanent=False)  # waits out a backoff
    conn.execute("update thumbq.jobs set created_at = now() - interval '1 hour'")
    q.enqueue_jobs([{"task": "routine"}, {"task": "urgent", "priority": 9}], "g")
    got = q.claim("w", 1, 60).jobs
    assert [(j.task, j.priority) for j in got] == [("urgent", 9)]


def test_service_role_can_use_every_priority_queue(conn: db.Conn) -> None:
    # Regression: grants covered thumbq_jobs and thumbq_dlq only.
    with conn.transaction():
        conn.execute("set local role service_role")
        q = Queue(conn)
        q.enqueue_jobs([{"task": "t", "priority": p} for p in range(10)], "g")
        q.enqueue_files([{"source_key": "a.png", "etag": "e", "priority": 3}], "g")
        assert len(q.claim("w", 20, 60).jobs) == 11
        assert conn.execute("select * from thumbq.work_metrics()").fetchone() is not None
        conn.execute("select * from thumbq.alerts").fetchall()


def _plans_of(conn: db.Conn, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    """The plans of every statement a call runs, nested ones included (auto_explain)."""
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    conn.execute("load 'auto_explain'")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_analyze = on",
        "auto_explain.log_format = json",
        "client_min_messages = log",
    ):
        conn.execute(f"set {setting}")
    try:
        conn.execute(sql, params)
    finally:
        conn.execute("reset client_min_messages")
    plans = []
    for n in notices:
        if "{" in n:
            plans.append(json.loads(n[n.index("{") :]))
    return plans


def _largest_scan(plan: dict[str, Any]) -> int:
    node = plan.get("Plan", plan)
    here = int(node.get("Actual Rows", 0)) + int(node.get("Rows Removed by Filter", 0))
    return max([here, *(_largest_scan(p) for p in node.get("Plans", []))])


def test_a_keys_history_does_not_slow_its_next_step(conn: db.Conn) -> None:
    # Regression: the head lookup and enqueue_jobs' head check scanned the key from its start,
    # filtering finished rows: with 200 000 completed jobs, complete took 44 ms, not 2.
    conn.execute(
        "insert into thumbq.jobs (group_id, task, ordering_key, sequence, status, completed_at)"
        " select 'g', 'seg', 'k', s, 'completed', now() from generate_series(1, 20000) s"
    )
    conn.execute("analyze thumbq.jobs")
    q = Queue(conn)
    q.enqueue_jobs([{"task": "seg", "ordering_key": "k"} for _ in range(2)], "g")
    head = q.claim("w", 5, 60).jobs
    assert [j.sequence for j in head] == [20001]
    result = json.dumps([{"job_id": head[0].id, "msg_id": head[0].msg_id}])
    plans = _plans_of(conn, "select thumbq.complete(%s, %s::jsonb)", ["w", result])
    assert plans, "auto_explain reported no plan"
    assert max(_largest_scan(p) for p in plans) < 100
    plans = _plans_of(
        conn,
        "select * from thumbq.enqueue_jobs(%s::jsonb, 'g', 3)",
        [json.dumps([{"task": "seg", "ordering_key": "k"}])],
    )
    assert max(_largest_scan(p) for p in plans) < 100
    assert [j.sequence for j in q.claim("w", 5, 60).jobs] == [20002]


def test_ordering_holds_with_three_claimers_cancels_and_lower_enqueues(db_url: str) -> None:
    """Three claimers, random cancels and enqueues of lower and higher sequences for 8 s: no
    two jobs of one key are ever processing at once, and they start in sequence order."""
    stop = time.monotonic() + 8
    starts: list[tuple[str, int, float]] = []
    violations: list[str] = []
    lock = threading.Lock()

    with db.connect(db_url) as c:
        Queue(c).enqueue_jobs(
            [
                {"task": "seg", "ordering_key": f"k{k}", "sequence": s * 10}
                for k in range(4)
                for s in range(1, 6)
            ],
            "g",
        )

    running: dict[str, int] = {}  # key -> job id a claimer runs now

    def claimer(n: int) -> None:
        with db.connect(db_url) as c:
            q = Queue(c)
            while time.monotonic() < stop:
                got = q.claim(f"w{n}", 2, 60).jobs
                with lock:
                    for j in got:
                        key = str(j.ordering_key)
                        if key in running:
                            violations.append(f"{key}: {j.id} started beside {running[key]}")
                        running[key] = j.id
                        starts.append((key, int(j.sequence or 0), time.monotonic()))
                time.sleep(0.05)
                with lock:
                    for j in got:
                        running.pop(str(j.ordering_key), None)
                # Cancelled meanwhile or not, the run reports when it stops.
                done(q, f"w{n}", got)

    def meddler() -> None:
        import random

        rnd = random.Random(7)
        with db.connect(db_url) as c:
            q = Queue(c)
            while time.monotonic() < stop:
                k = rnd.randrange(4)
                with contextlib.suppress(psycopg.errors.ExclusionViolation):
                    q.enqueue_jobs(
                        [{"task": "seg", "ordering_key": f"k{k}", "sequence": rnd.randrange(60)}],
                        "g",
                    )
                if rnd.random() < 0.3:
                    ids = [
                        r["id"]
                        for r in c.execute(
                            "select id from thumbq.jobs where ordering_key = %s and status in"
                            " ('pending', 'processing') order by random() limit 1",
                            [f"k{k}"],
                        )
                    ]
                    q.cancel_jobs(ids)
                time.sleep(0.02)

    assert run_threads([lambda n=n: claimer(n) for n in range(3)] + [meddler]) == []
    assert violations == []
    by_key: dict[str, list[int]] = {}
    for key, seq, _ in sorted(starts, key=lambda s: s[2]):
        by_key.setdefault(key, []).append(seq)
    for key, seqs in by_key.items():
        assert seqs == sorted(seqs), (key, seqs)
