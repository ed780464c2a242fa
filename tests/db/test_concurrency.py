"""Every transition with several connections at once: no deadlock, no double lease, no second
message, claims that do not wait on each other, and a soak of all of them together."""

from __future__ import annotations

import io
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from PIL import Image

from tests.db.test_queue import group_rows, items, recount
from worker.engine import db, ratelimit
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import ClaimedJob, Queue
from worker.storage import open_storage
from worker.thumbnails.task import thumbnail_key


def run_threads(targets: list[Callable[[], None]], timeout_s: float = 120) -> list[BaseException]:
    """Run each target in its own thread; return the exceptions they raised."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                with lock:
                    errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        assert not t.is_alive(), "a thread hung"
    return errors


def messages_per_job(conn: db.Conn) -> Counter[int]:
    rows = conn.execute(
        "select (message->>'job_id')::bigint as job_id from pgmq.q_thumbq_jobs"
    ).fetchall()
    return Counter(r["job_id"] for r in rows)


def test_cancel_of_a_large_group_while_three_invocations_claim_never_deadlocks(
    db_url: str,
) -> None:
    # Regression: cancel locked job rows then messages, claim messages then job rows, and most
    # rounds ended in DeadlockDetected (answered 503 database_unavailable by the API).
    for round_ in range(4):
        group = f"big{round_}"
        with db.connect(db_url) as c:
            Queue(c).enqueue_files(items(1000, prefix=group), group)
        start = threading.Barrier(4)
        cancelled: list[int] = []

        def claimer(n: int, group: str = group, start: threading.Barrier = start) -> None:
            with db.connect(db_url) as c:
                q = Queue(c)
                start.wait()
                for _ in range(40):
                    claim = q.claim(f"w{n}", 25, 60)
                    if claim.jobs:
                        q.complete(
                            f"w{n}", [{"job_id": j.id, "msg_id": j.msg_id} for j in claim.jobs[:10]]
                        )
                        q.release(f"w{n}", [j.id for j in claim.jobs[10:]])

        def canceller(
            group: str = group,
            start: threading.Barrier = start,
            cancelled: list[int] = cancelled,
        ) -> None:
            with db.connect(db_url) as c:
                start.wait()
                time.sleep(0.02)
                cancelled.append(Queue(c).cancel(group))

        errors = run_threads([lambda i=i: claimer(i) for i in range(3)] + [canceller])
        assert errors == [], f"round {round_}: {errors!r}"
        with db.connect(db_url) as c:
            p = Queue(c).progress(group)
            assert p is not None
            assert p["pending"] + p["processing"] == 0
            assert p["cancelled"] == cancelled[0] and p["completed"] + p["cancelled"] == 1000
            assert sum(messages_per_job(c).values()) == 0


def test_concurrent_enqueues_of_a_cancelled_version_queue_it_once(db_url: str) -> None:
    # Regression: each enqueue sent a message in the UPDATE's SET before waiting for the row
    # lock, so a cancelled version enqueued twice at once had two messages and was rendered
    # twice at the same time.
    with db.connect(db_url) as c:
        q = Queue(c)
        job_id = q.enqueue_files([{"source_key": "a.pdf", "etag": "v1"}], "g")[0]["job_id"]
    for _ in range(15):
        with db.connect(db_url) as c:
            Queue(c).cancel("g")
        start = threading.Barrier(4)

        def enqueuer(start: threading.Barrier = start) -> None:
            with db.connect(db_url) as c:
                start.wait()
                Queue(c).enqueue_files([{"source_key": "a.pdf", "etag": "v1"}], "g")

        assert run_threads([enqueuer] * 4) == []
        with db.connect(db_url) as c:
            assert messages_per_job(c) == {job_id: 1}
            row = c.execute("select status, msg_id from thumbq.jobs").fetchone()
            assert row["status"] == "pending"
            assert (
                c.execute("select msg_id from pgmq.q_thumbq_jobs").fetchone()["msg_id"]
                == row["msg_id"]
            )


def test_claim_never_takes_a_job_whose_lease_is_live(conn: db.Conn) -> None:
    # Regression: claim updated `status in ('pending', 'processing')` with no lease check, so a
    # visible message made a second worker take a job the first was still rendering.
    q = Queue(conn)
    q.enqueue_files(items(1), "g")
    first = q.claim("first", 5, 60).jobs
    assert len(first) == 1
    conn.execute("select pgmq.set_vt('thumbq_jobs', %s, 0)", [first[0].msg_id])
    assert q.claim("second", 5, 60).jobs == []
    row = conn.execute("select worker_id, status from thumbq.jobs").fetchone()
    assert (row["worker_id"], row["status"]) == ("first", "processing")
    # The message waits for the lease instead of being read again at once.
    assert q.claim("third", 5, 60).jobs == []
    assert q.complete("first", [{"job_id": first[0].id, "msg_id": first[0].msg_id}]) == 1


def test_only_the_lease_holder_reports(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files(items(1), "g")
    job = q.claim("holder", 1, 60).jobs[0]
    stranger = ClaimedJob(**{**job.__dict__})
    assert q.fail("stranger", stranger, "storage_error", "x", permanent=False)["owned"] is False
    assert q.complete("stranger", [{"job_id": job.id, "msg_id": job.msg_id}]) == 0
    assert q.release("stranger", [job.id]) == 0
    assert q.complete("holder", [{"job_id": job.id, "msg_id": job.msg_id}]) == 1


def test_a_slow_claim_does_not_hold_the_bucket_for_other_claims(db_url: str) -> None:
    # Regression: claim took its tokens in its own transaction, so the bucket row stayed locked
    # until the claim committed and every concurrent claim queued behind it.
    with db.connect(db_url) as c:
        Queue(c).enqueue_files(items(5, prefix="x"), "x")
        Queue(c).enqueue_files(items(5, prefix="y"), "y")
    blocker = db.connect(db_url)
    blocker.execute("begin")
    # Something else holds group x's summary row (a long cancel, an operator): A's claim of x's
    # jobs waits for it.
    blocker.execute("select * from thumbq.groups where group_id = 'x' for update")
    a_done = threading.Event()
    a_jobs: list[ClaimedJob] = []

    def claim_a() -> None:
        with db.connect(db_url) as c:
            a_jobs.extend(Queue(c).claim("a", 5, 60).jobs)
        a_done.set()

    a = threading.Thread(target=claim_a)
    a.start()
    try:
        time.sleep(0.5)
        assert not a_done.is_set(), "A should be waiting for group x's row"
        with db.connect(db_url) as c:
            c.execute("set lock_timeout = '2s'")
            started = time.monotonic()
            b_jobs = Queue(c).claim("b", 5, 60).jobs
            waited = time.monotonic() - started
        assert waited < 1.0
        assert sorted(j.group_id for j in b_jobs) == ["y"] * 5
    finally:
        blocker.execute("rollback")
        blocker.close()
        a.join(10)
    assert sorted(j.group_id for j in a_jobs) == ["x"] * 5


def test_claims_never_take_more_tokens_than_the_bucket_holds(db_url: str) -> None:
    with db.connect(db_url) as c:
        Queue(c).enqueue_files(items(600), "g")
        ratelimit.set_limit(c, "thumbnail_generation", capacity=40, refill_per_second=50)
    claimed: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(6)
    t0 = time.monotonic()

    def claimer(n: int) -> None:
        with db.connect(db_url) as c:
            q = Queue(c)
            start.wait()
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                jobs = q.claim(f"w{n}", 7, 60).jobs
                with lock:
                    claimed.extend(j.id for j in jobs)

    assert run_threads([lambda i=i: claimer(i) for i in range(6)]) == []
    elapsed = time.monotonic() - t0
    assert len(claimed) == len(set(claimed))
    assert len(claimed) <= 40 + 50 * elapsed + 1
    assert len(claimed) >= 40 + 50 * 1.5  # the bucket was really used, not starved


def test_a_key_enqueued_through_sql_that_storage_refuses_fails_permanently_at_once(
    config: Config, conn: db.Conn
) -> None:
    # Regression: keys that skip the API's checks (SQL, PostgREST RPC) failed `internal` three
    # times, with backoff, before the DLQ.
    conn.execute("select * from thumbq.enqueue('../etc/passwd', 'e1', 'g')")
    conn.execute("select * from thumbq.enqueue('/abs/file.pdf', 'e1', 'g')")
    result = run_batch(config, conn, open_storage(config))
    assert result.failed == 2 and result.retried == 0
    rows = conn.execute(
        "select status, error_code, attempts, last_error from thumbq.jobs"
    ).fetchall()
    assert {(r["status"], r["error_code"], r["attempts"]) for r in rows} == {
        ("failed", "invalid_key", 1)
    }
    assert all("source key" in r["last_error"] for r in rows)
    assert Queue(conn).overview()["dlq_length"] == 0


# -- the soak --------------------------------------------------------------------------------


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), ((seed * 37) % 256, (seed * 91) % 256, 120)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_soak_of_every_transition_at_once_keeps_every_invariant(
    tmp_path: Path, db_url: str, config: Config
) -> None:
    """Eight connections for about 60 s doing random enqueues (same and new etags), cancels,
    retries, claims, completes, fails, releases, reaps and abandoned claims; then a drain."""
    storage = open_storage(config)
    keys = [f"soak/{g}/{i:03d}.png" for g in "abc" for i in range(40)]
    for n, key in enumerate(keys):
        storage.put(key, _png(n), "image/png")
    with db.connect(db_url) as c:
        ratelimit.set_limit(c, "thumbnail_generation", capacity=1e9, refill_per_second=1e9)

    duration_s = 55.0
    deadline = time.monotonic() + duration_s
    held: dict[int, str] = {}  # job id -> worker holding its live lease
    completions: Counter[int] = Counter()
    violations: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        rnd = random.Random(n)
        worker = f"w{n}"
        mine: list[ClaimedJob] = []
        with db.connect(db_url) as c:
            q = Queue(c, max_attempts=3)
            while time.monotonic() < deadline:
                op = rnd.choices(
                    [
                        "enqueue",
                        "supersede",
                        "cancel",
                        "retry",
                        "claim",
                        "complete",
                        "fail",
                        "release",
                        "reap",
                        "abandon",
                    ],
                    weights=[6, 2, 1, 1, 8, 6, 3, 2, 1, 1],
                )[0]
                g = rnd.choice("abc")
                if op == "enqueue":
                    picked = rnd.sample(range(40), rnd.randint(1, 6))
                    q.enqueue_files(
                        [{"source_key": f"soak/{g}/{i:03d}.png", "etag": "v1"} for i in picked], g
                    )
                elif op == "supersede":
                    i = rnd.randrange(40)
                    q.enqueue_files(
                        [{"source_key": f"soak/{g}/{i:03d}.png", "etag": f"s{rnd.randint(1, 3)}"}],
                        g,
                    )
                elif op == "cancel":
                    q.cancel(g)
                elif op == "retry":
                    q.retry_failed(g)
                elif op == "reap":
                    q.reap_stale()
                elif op == "abandon":
                    # An invocation that dies holding its claims: short lease, never reports.
                    q.claim(f"dead{n}", rnd.randint(1, 3), 1)
                elif op == "claim":
                    got = q.claim(worker, rnd.randint(1, 6), 60).jobs
                    with lock:
                        for j in got:
                            if j.id in held:
                                violations.append(
                                    f"job {j.id} taken by {worker} while {held[j.id]} held it"
                                )
                            held[j.id] = worker
                    mine.extend(got)
                elif mine:
                    rnd.shuffle(mine)
                    k = rnd.randint(1, 3)
                    batch, mine = mine[:k], mine[k:]
                    with lock:
                        for j in batch:
                            held.pop(j.id, None)
                    if op == "complete":
                        for j in batch:
                            key = thumbnail_key(j.source_key, j.source_etag, 512, "webp")
                            storage.put(key, b"thumbnail", "image/webp")
                            result = {"job_id": j.id, "msg_id": j.msg_id, "thumbnail_key": key}
                            # One call per job: a count of 1 says this worker completed it.
                            if q.complete(worker, [result]) == 1:
                                with lock:
                                    completions[j.id] += 1
                    elif op == "fail":
                        for j in batch:
                            q.fail(
                                worker,
                                j,
                                rnd.choice(["corrupt_input", "storage_error"]),
                                "x",
                                permanent=rnd.random() < 0.3,
                            )
                    else:
                        q.release(worker, [j.id for j in batch])
            # Leave nothing leased by a live worker.
            with lock:
                for j in mine:
                    held.pop(j.id, None)
            q.release(worker, [j.id for j in mine])

    errors = run_threads([lambda i=i: client(i) for i in range(8)], timeout_s=duration_s + 60)
    assert [e for e in errors if isinstance(e, psycopg.errors.TransactionRollback)] == []
    assert errors == []
    assert violations == []
    assert [j for j, n in completions.items() if n > 1] == []

    with db.connect(db_url) as c:
        assert group_rows(c) == recount(c)
        per_job = messages_per_job(c)
        assert [j for j, n in per_job.items() if n > 1] == []
        # Every waiting or running job has exactly its one message; nothing else has one.
        waiting = c.execute(
            "select j.id, j.msg_id, q.msg_id as queued from thumbq.jobs j"
            " left join pgmq.q_thumbq_jobs q on (q.message->>'job_id')::bigint = j.id"
            " where j.status in ('pending', 'processing')"
        ).fetchall()
        assert [r for r in waiting if r["queued"] is None or r["queued"] != r["msg_id"]] == []
        assert sum(per_job.values()) == len(waiting)
        bad_leases = c.execute(
            "select id from thumbq.jobs where status = 'processing'"
            " and (lease_expires_at is null or worker_id is null)"
        ).fetchall()
        assert bad_leases == []

        # Drain with the real engine: every job that was not cancelled ends terminal, and
        # every completed one has its thumbnail.
        c.execute("select pgmq.set_vt('thumbq_jobs', msg_id, 0) from pgmq.q_thumbq_jobs")
        # Every client has stopped: their leases may end now (a version cancelled while a
        # client held it, and queued again, waits for that lease before it runs again).
        c.execute(
            "update thumbq.jobs set lease_expires_at = clock_timestamp()"
            " where lease_expires_at > clock_timestamp()"
        )
        time.sleep(1.1)  # abandoned leases (1 s) expire
        q = Queue(c)
        for _ in range(30):
            q.reap_stale()
            c.execute("select pgmq.set_vt('thumbq_jobs', msg_id, 0) from pgmq.q_thumbq_jobs")
            run_batch(config.with_(max_attempts=3), c, storage)
            left = c.execute(
                "select count(*) as n from thumbq.jobs where status in ('pending', 'processing')"
            ).fetchone()["n"]
            if left == 0:
                break
        assert left == 0
        assert group_rows(c) == recount(c)
        done = c.execute(
            "select source_key, thumbnail_key from thumbq.jobs where status = 'completed'"
        ).fetchall()
        assert done, "the drain completed nothing"
        assert [r for r in done if not storage.exists(r["thumbnail_key"])] == []


# -- growth ----------------------------------------------------------------------------------


def test_retention_prunes_old_history_in_chunks_and_keeps_every_answer(
    config: Config, conn: db.Conn
) -> None:
    from worker.thumbnails.files import cleanup_stale

    q = Queue(conn)
    q.enqueue_files(items(30, prefix="old"), "g")
    q.enqueue_files(items(5, prefix="new"), "g")
    jobs = q.claim("w", 35, 60).jobs
    old = [j for j in jobs if j.source_key.startswith("old/")]
    q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs[:-1]])
    q.fail("w", jobs[-1], "storage_error", "x", permanent=False)
    q.enqueue_files(items(3, prefix="waiting"), "g")
    for _ in range(3):
        run = db.one(
            conn,
            "start_run",
            {"worker_id": "w", "budget_ms": 1000, "buffer_ms": 100, "concurrency": 1},
        )
        assert run is not None
    # Forty days ago: the old files finished and the runs happened.
    conn.execute(
        "update thumbq.jobs set completed_at = now() - interval '40 days'"
        " where source_key like 'old/%%'"
    )
    conn.execute("update thumbq.batch_runs set started_at = now() - interval '40 days'")
    before = q.progress("g")
    assert before is not None

    chunks = []
    while True:
        chunk = q.prune(30, limit=7)
        chunks.append(chunk)
        if chunk["jobs"] == 0 and chunk["batch_runs"] == 0:
            break
    assert [c["jobs"] for c in chunks] == [7, 7, 7, 7, 2, 0]
    assert sum(c["batch_runs"] for c in chunks) == 3
    left = {
        r["source_key"].split("/")[0] for r in conn.execute("select source_key from thumbq.jobs")
    }
    assert left == {"new", "waiting"}
    after = q.progress("g")
    assert after is not None
    assert {k: after[k] for k in ("total", "pending", "completed", "failed")} == {
        k: before[k] for k in ("total", "pending", "completed", "failed")
    }
    assert after["total"] == 38 and len(old) == 30

    # cleanup-stale prunes with THUMBQ_RETENTION_DAYS; 0 keeps everything.
    conn.execute(
        "update thumbq.jobs set completed_at = now() - interval '40 days'"
        " where source_key like 'new/%%' and status = 'completed'"
    )
    assert cleanup_stale(conn, config.with_(retention_days=0))["pruned"]["jobs"] == 0
    result = cleanup_stale(conn, config.with_(retention_days=30))
    assert result["pruned"]["jobs"] == 4
    assert q.progress("g")["completed"] == before["completed"]


def test_a_completion_batch_is_not_held_up_by_one_locked_job_and_records_it_too(
    db_url: str, conn: db.Conn
) -> None:
    # Regressions: complete() waited for every job row of its batch, so one row held by another
    # session (a long cancel, an operator) held up the whole batch; then it skipped that row
    # and the completion was dropped for good (the job ran again after its lease, and used a
    # second attempt). Now the rest is recorded at once and the held one as soon as it is free.
    q = Queue(conn)
    q.enqueue_files(items(3), "g")
    jobs = q.claim("w", 3, 60).jobs
    with db.connect(db_url) as other, db.connect(db_url) as watcher:
        other.execute("begin")
        other.execute("select 1 from thumbq.jobs where id = %s for update", [jobs[0].id])
        seen: list[list[str]] = []

        def watch_then_release() -> None:
            time.sleep(0.8)
            seen.append(
                [r["status"] for r in watcher.execute("select status from thumbq.jobs order by id")]
            )
            time.sleep(0.7)
            other.execute("rollback")

        t = threading.Thread(target=watch_then_release)
        t.start()
        started = time.monotonic()
        done = q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs])
        waited = time.monotonic() - started
        t.join()
    assert seen == [["processing", "completed", "completed"]]  # the rest did not wait
    assert done == 3 and 1.3 < waited < 5
    rows = conn.execute("select status, attempts from thumbq.jobs order by id").fetchall()
    assert [(r["status"], r["attempts"]) for r in rows] == [("completed", 1)] * 3
