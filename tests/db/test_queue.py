"""The queue's transitions in SQL, against a real Postgres with pgmq."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.pgtools import require
from worker.engine import db, ratelimit
from worker.engine.queue import Queue

# Every test on the pgmq package's SQL and on the pgmq extension 1.4.4 and 1.5.1 (conftest).
pytestmark = pytest.mark.pgmq_versions

ROOT = Path(__file__).resolve().parents[2]
STATUSES = ("pending", "processing", "completed", "failed", "unsupported", "cancelled")
PGMQ_144_API = {
    "create",
    "send",
    "send_batch",
    "read",
    "delete",
    "archive",
    "set_vt",
    "metrics",
    "metrics_all",
    "list_queues",
    "purge_queue",
    "drop_queue",
}


def items(n: int, prefix: str = "f", etag: str = "e1") -> list[dict[str, str]]:
    return [{"source_key": f"{prefix}/{i:05d}.pdf", "etag": etag} for i in range(n)]


def recount(conn: db.Conn) -> dict[str, dict[str, int]]:
    rows = conn.execute(
        "select group_id, status, count(*) as n from thumbq.jobs group by 1, 2"
    ).fetchall()
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        out.setdefault(r["group_id"], dict.fromkeys(STATUSES, 0))[r["status"]] = r["n"]
    return out


def group_rows(conn: db.Conn) -> dict[str, dict[str, int]]:
    rows = conn.execute("select * from thumbq.groups").fetchall()
    return {
        r["group_id"]: {s: r[s] for s in STATUSES}
        for r in rows
        if r["total"] or any(r[s] for s in STATUSES)
    }


def test_only_the_pgmq_1_4_4_api_is_called() -> None:
    calls: Counter[str] = Counter()
    files = [*ROOT.glob("sql/**/*.sql"), *ROOT.glob("worker/**/*.py")]
    for path in files:
        for name in re.findall(r"pgmq\.\"?(\w+)\"?\s*\(", path.read_text()):
            calls[name] += 1
    assert calls, "expected pgmq calls in sql/"
    assert set(calls) <= PGMQ_144_API, f"outside pgmq 1.4.4: {set(calls) - PGMQ_144_API}"


def test_enqueue_is_idempotent_per_object_version(conn: db.Conn) -> None:
    q = Queue(conn)
    first = q.enqueue_files(items(3), "g")
    again = q.enqueue_files(items(3), "g")
    assert all(r["created"] for r in first)
    assert not any(r["created"] for r in again)
    assert sorted(r["job_id"] for r in first) == sorted(r["job_id"] for r in again)
    assert q.overview()["queue_length"] == 3
    assert q.progress("g")["total"] == 3


def test_a_new_etag_supersedes_the_waiting_older_version(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files([{"source_key": "a.pdf", "etag": "v1"}], "g")
    q.enqueue_files([{"source_key": "a.pdf", "etag": "v2"}], "g")
    rows = conn.execute(
        "select source_etag, status, error_code from thumbq.jobs order by id"
    ).fetchall()
    assert [(r["source_etag"], r["status"], r["error_code"]) for r in rows] == [
        ("v1", "cancelled", "superseded"),
        ("v2", "pending", None),
    ]
    # The old version's message is gone: only v2 can be claimed.
    claim = q.claim("w", 10, 30)
    assert [j.source_etag for j in claim.jobs] == ["v2"]


def test_claim_never_returns_a_message_twice_under_concurrency(db_url: str) -> None:
    with db.connect(db_url) as c:
        Queue(c).enqueue_files(items(400), "g")
    seen: list[int] = []
    lock = threading.Lock()

    def claimer(n: int) -> None:
        with db.connect(db_url) as c:
            q = Queue(c)
            while True:
                claim = q.claim(f"w{n}", 7, 60)
                if not claim.jobs:
                    return
                with lock:
                    seen.extend(j.id for j in claim.jobs)

    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 400
    assert len(set(seen)) == 400


def test_a_killed_runs_messages_come_back_after_the_visibility_timeout(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files(items(2), "g")
    lost = q.claim("killed-run", 10, 1).jobs  # this invocation dies without reporting
    assert len(lost) == 2
    assert q.claim("other", 10, 30).jobs == []  # invisible while leased
    time.sleep(1.2)
    assert q.reap_stale() == 2
    back = q.claim("next-run", 10, 30).jobs
    assert sorted(j.id for j in back) == sorted(j.id for j in lost)
    assert all(j.attempts == 2 for j in back)
    done = q.complete("next-run", [{"job_id": j.id, "msg_id": j.msg_id} for j in back])
    assert done == 2
    # The dead run reporting late changes nothing.
    assert q.complete("killed-run", [{"job_id": j.id, "msg_id": j.msg_id} for j in lost]) == 0
    assert q.progress("g")["completed"] == 2
    assert q.overview()["queue_length"] == 0


def test_unstarted_messages_are_released_at_once_without_an_attempt(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files(items(5), "g")
    claimed = q.claim("w1", 5, 300).jobs
    assert q.release("w1", [j.id for j in claimed[2:]]) == 3
    again = q.claim("w2", 5, 300).jobs
    assert sorted(j.id for j in again) == sorted(j.id for j in claimed[2:])
    assert all(j.attempts == 1 for j in again)
    assert q.progress("g")["processing"] == 5


def test_retries_back_off_and_land_in_the_dlq_after_max_attempts(conn: db.Conn) -> None:
    q = Queue(conn, max_attempts=3)
    q.enqueue_files(items(1), "g")
    delays = []
    for attempt in range(1, 4):
        (job,) = q.claim("w", 1, 60).jobs
        assert job.attempts == attempt
        outcome = q.fail("w", job, "storage_error", "storage answered 503", permanent=False)
        if attempt < 3:
            assert outcome["status"] == "pending"
            delays.append(outcome["retry_in_s"])
            assert q.claim("w", 1, 60).jobs == []  # backing off, not visible
            conn.execute("select pgmq.set_vt('thumbq_jobs', %s, 0)", [job.msg_id])
        else:
            assert outcome["status"] == "failed"
    assert 15 <= delays[0] <= 30 and 30 <= delays[1] <= 60
    job_row = conn.execute("select * from thumbq.jobs").fetchone()
    assert job_row["status"] == "failed" and job_row["error_code"] == "storage_error"
    overview = q.overview()
    assert overview["queue_length"] == 0 and overview["dlq_length"] == 1
    assert "dlq_not_empty" in {a["name"] for a in overview["alerts"]}
    # Replay from the DLQ.
    assert q.retry_failed("g") == 1
    assert q.overview()["dlq_length"] == 0
    (job,) = q.claim("w", 1, 60).jobs
    assert job.attempts == 1


def test_permanent_failures_end_at_once_with_their_status(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files([{"source_key": k, "etag": "e"} for k in ("a.svg", "b.pdf", "c.jpg")], "g")
    jobs = {j.source_key: j for j in q.claim("w", 3, 60).jobs}
    q.fail("w", jobs["a.svg"], "unsupported_type", "SVG is not rendered", permanent=True)
    q.fail("w", jobs["b.pdf"], "encrypted_input", "needs a password", permanent=True)
    q.fail("w", jobs["c.jpg"], "source_missing", "object is gone", permanent=True)
    rows = {
        r["source_key"]: (r["status"], r["error_code"])
        for r in conn.execute("select source_key, status, error_code from thumbq.jobs")
    }
    assert rows == {
        "a.svg": ("unsupported", "unsupported_type"),
        "b.pdf": ("failed", "encrypted_input"),
        "c.jpg": ("cancelled", "source_missing"),
    }
    assert q.overview()["dlq_length"] == 0


def test_a_job_whose_lease_is_lost_every_time_is_dead_lettered(conn: db.Conn) -> None:
    q = Queue(conn, max_attempts=2)
    q.enqueue_files(items(1), "g")
    for _ in range(2):
        assert len(q.claim("crashing", 1, 1).jobs) == 1
        time.sleep(1.1)
    assert q.claim("w", 1, 60).jobs == []
    row = conn.execute("select status, error_code from thumbq.jobs").fetchone()
    assert (row["status"], row["error_code"]) == ("failed", "lease_expired")
    assert q.overview()["dlq_length"] == 1


def test_take_tokens_never_over_issues_with_16_concurrent_connections(db_url: str) -> None:
    with db.connect(db_url) as c:
        ratelimit.set_limit(c, "api", capacity=50, refill_per_second=20)
    granted = []
    lock = threading.Lock()
    barrier = threading.Barrier(16)
    started = time.monotonic()

    def taker() -> None:
        with db.connect(db_url) as c:
            barrier.wait()
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                g = ratelimit.take(c, "api", 1)
                assert g is not None
                if g.granted:
                    with lock:
                        granted.append(time.monotonic())

    threads = [threading.Thread(target=taker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    # Capacity plus what refilled while the threads ran: never more.
    assert len(granted) <= 50 + 20 * elapsed + 1
    assert len(granted) >= 50  # and the bucket was really used


def test_claim_respects_the_bucket_and_wastes_no_tokens(conn: db.Conn) -> None:
    ratelimit.set_limit(conn, "thumbnail_generation", capacity=5, refill_per_second=0.5)
    q = Queue(conn)
    q.enqueue_files(items(3), "g")
    assert len(q.claim("w", 10, 60).jobs) == 3
    tokens = conn.execute(
        "select tokens from thumbq.rate_limits where name = 'thumbnail_generation'"
    ).fetchone()["tokens"]
    assert 2 <= tokens < 2.5  # 3 taken for 3 claimed, the rest given back
    q.enqueue_files(items(10, prefix="more"), "g")
    assert len(q.claim("w", 10, 60).jobs) == 2
    limited = q.claim("w", 10, 60)
    assert limited.jobs == [] and limited.rate_limited
    assert limited.retry_after_ms is not None and 0 < limited.retry_after_ms <= 2000


def test_group_counts_equal_a_recount_after_a_random_mix_of_transitions(conn: db.Conn) -> None:
    rnd = random.Random(7)
    q = Queue(conn, max_attempts=2)
    for g in ("a", "b", "c"):
        q.enqueue_files(items(40, prefix=g), g)
    for step in range(60):
        op = rnd.choice(
            [
                "claim",
                "claim",
                "complete",
                "fail",
                "release",
                "enqueue",
                "cancel",
                "retry",
                "supersede",
            ]
        )
        if op == "claim":
            q.claim("w", rnd.randint(1, 8), 60)
        elif op in ("complete", "fail", "release"):
            rows = conn.execute(
                "select id, msg_id, group_id, source_key, source_etag,"
                " source_bytes, content_type, attempts, max_attempts"
                " from thumbq.jobs where status = 'processing'"
            ).fetchall()
            if not rows:
                continue
            from worker.engine.queue import ClaimedJob

            jobs = [ClaimedJob.from_json(r) for r in rnd.sample(rows, min(len(rows), 3))]
            if op == "complete":
                q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs])
            elif op == "fail":
                for j in jobs:
                    q.fail(
                        "w",
                        j,
                        rnd.choice(["corrupt_input", "storage_error"]),
                        "x",
                        permanent=rnd.random() < 0.5,
                    )
            else:
                q.release("w", [j.id for j in jobs])
        elif op == "enqueue":
            g = rnd.choice("abc")
            q.enqueue_files(items(rnd.randint(1, 5), prefix=f"{g}{step}"), g)
        elif op == "cancel":
            q.cancel(rnd.choice("abc"))
        elif op == "retry":
            q.retry_failed(rnd.choice("abc"))
        else:
            g = rnd.choice("abc")
            q.enqueue_files(
                [{"source_key": f"{g}/{rnd.randint(0, 39):05d}.pdf", "etag": f"s{step}"}], g
            )
        if step % 10 == 0:
            conn.execute(
                "select pgmq.set_vt('thumbq_jobs', msg_id, 0) from thumbq.jobs"
                " where status = 'pending' and msg_id is not null"
            )
    assert group_rows(conn) == recount(conn)
    totals = conn.execute("select sum(total) as t from thumbq.groups").fetchone()["t"]
    assert totals == conn.execute("select count(*) as n from thumbq.jobs").fetchone()["n"]


def test_progress_counts_percentage_and_eta(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files(items(10), "g")
    p = q.progress("g")
    assert (p["total"], p["pending"], float(p["progress_percentage"])) == (10, 10, 0.0)
    assert p["estimated_time_remaining_seconds"] is None  # nothing observed yet: unknown
    jobs = q.claim("w", 4, 60).jobs
    time.sleep(0.5)
    q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs[:3]])
    q.fail("w", jobs[3], "corrupt_input", "bad bytes", permanent=True)
    p = q.progress("g")
    assert (p["completed"], p["failed"], p["pending"]) == (3, 1, 6)
    assert float(p["progress_percentage"]) == 40.0
    # 4 finished in ~0.5 s: 6 left take ~0.75 s, rounded up.
    assert p["estimated_time_remaining_seconds"] == 1
    assert 4 <= p["rate_per_second"] <= 9
    version = p["version"]
    assert q.progress("g")["version"] == version  # reading changes nothing
    # A minute later nothing runs and nothing finished (a stopped worker): no made-up ETA.
    conn.execute("update thumbq.groups set last_done_at = now() - interval '61 seconds'")
    assert q.progress("g")["estimated_time_remaining_seconds"] is None
    q.cancel("g")
    p = q.progress("g")
    assert float(p["progress_percentage"]) == 100.0
    assert p["estimated_time_remaining_seconds"] == 0
    assert p["version"] > version
    assert q.progress("nope") is None


Scan = tuple[str, str | None, str | None]


def _plans_of(conn: db.Conn, call: Callable[[], object]) -> list[dict[str, Any]]:
    """The plan of every statement `call` runs on `conn`, those inside the live plpgsql and SQL
    functions included: auto_explain logs each (nested statements on) to the client as a
    notice, in JSON. Returns the plan trees, outermost statement last."""
    try:
        conn.execute("load 'auto_explain'")
    except psycopg.Error:
        conn.rollback()
        require(False, "the auto_explain module of Postgres (contrib) is not installed")
    for setting in (
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_format = json",
        "client_min_messages = log",
    ):
        conn.execute(f"set {setting}")
    logged: list[str] = []

    def keep(diag: psycopg.errors.Diagnostic) -> None:
        if diag.message_primary and "plan:" in diag.message_primary:
            logged.append(diag.message_primary)

    conn.add_notice_handler(keep)
    try:
        call()
    finally:
        conn.remove_notice_handler(keep)
        conn.execute("reset client_min_messages")
        conn.execute("reset auto_explain.log_min_duration")
    return [json.loads(m[m.index("{") :])["Plan"] for m in logged]


def _scans(plan: dict[str, Any]) -> list[Scan]:
    """(node type, relation, index) of every node of a plan tree."""
    out = [(plan["Node Type"], plan.get("Relation Name"), plan.get("Index Name"))]
    for child in plan.get("Plans", []):
        out += _scans(child)
    return out


def _scans_of(
    conn: db.Conn, call: Callable[[], object]
) -> list[tuple[str, str | None, str | None]]:
    plans = _plans_of(conn, call)
    assert plans, "auto_explain logged no plan"
    return [scan for plan in plans for scan in _scans(plan)]


def test_the_live_progress_read_is_one_index_lookup(conn: db.Conn) -> None:
    conn.execute(
        "insert into thumbq.groups (group_id) select 'g' || i from generate_series(1, 5000) i"
    )
    conn.execute("analyze thumbq.groups")
    got: list[dict[str, Any] | None] = []
    # What the API and the CLI call (Queue.progress: thumbq.progress_v2).
    scans = _scans_of(conn, lambda: got.append(Queue(conn).progress("g42")))
    assert got and got[0] is not None and got[0]["group_id"] == "g42"
    on_groups = [s for s in scans if s[1] == "groups"]
    assert on_groups and all(s[2] == "groups_pkey" for s in on_groups), on_groups


def test_the_live_claim_and_complete_find_jobs_by_index_never_by_a_scan(conn: db.Conn) -> None:
    q = Queue(conn)
    q.enqueue_files(items(2000), "g")
    conn.execute("analyze thumbq.jobs")
    claimed: list[Any] = []
    scans = _scans_of(conn, lambda: claimed.extend(q.claim("w", 5, 60).jobs))
    assert len(claimed) == 5
    on_jobs = [s for s in scans if s[1] == "jobs"]
    assert ("Index Scan", "jobs", "jobs_pkey") in on_jobs, on_jobs
    assert not [s for s in on_jobs if s[0] == "Seq Scan"], on_jobs

    done: list[int] = []
    results = [{"job_id": j.id, "msg_id": j.msg_id} for j in claimed]
    scans = _scans_of(conn, lambda: done.append(q.complete("w", results)))
    assert done == [5]
    on_jobs = [s for s in scans if s[1] == "jobs"]
    assert ("Index Scan", "jobs", "jobs_pkey") in on_jobs, on_jobs
    assert not [s for s in on_jobs if s[0] == "Seq Scan"], on_jobs


def test_db_init_is_safe_to_run_again_and_concurrently(empty_db_url: str) -> None:
    results = []

    def init() -> None:
        with db.connect(empty_db_url) as c:
            results.append(db.init_schema(c))

    threads = [threading.Thread(target=init) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3
    assert sum(1 for r in results if r["applied"]) == 1
    assert sorted(r["pgmq"] for r in results).count("present") == 2
    with db.connect(empty_db_url) as c:
        assert db.init_schema(c)["applied"] == []
        queues = {r["queue_name"] for r in c.execute("select * from pgmq.list_queues()")}
        assert {"thumbq_jobs", "thumbq_dlq"} <= queues


def test_named_queries_parse_and_each_name_is_unique() -> None:
    text = (ROOT / "sql" / "queries.sql").read_text()
    qs = db.parse_queries(text)
    assert len(qs) == len(re.findall(r"^-- name:", text, re.M))
    with pytest.raises(ValueError):
        db.parse_queries("-- name: a\nselect 1\n-- name: a\nselect 2\n")


def test_a_groups_recent_failures_come_from_its_own_index(conn: db.Conn) -> None:
    conn.execute(
        "insert into thumbq.jobs (group_id, source_key, status, error_code, last_error)"
        " select 'g' || (i % 200), 'k' || i, 'failed', 'corrupt_input', 'bad'"
        " from generate_series(1, 20000) i"
    )
    conn.execute("analyze thumbq.jobs")
    sql = db.queries()["recent_failures_of_group"]
    plan = conn.execute("explain (format json) " + sql, {"group_id": "g7", "limit": 20}).fetchone()
    assert "jobs_group_errors_idx" in str(plan)


def test_a_changed_schema_file_reapplies_every_later_file_too(conn: db.Conn) -> None:
    # As if 005 had changed since it was applied: its grants run again, and so must 008's
    # revokes after them, or users could call the admin functions; and every function file, as
    # an earlier file run again may bring back what they replaced.
    conn.execute(
        "update thumbq.schema_migrations set checksum = 'old' where version = '005_security'"
    )
    applied = db.init_schema(conn)["applied"]
    later = [p.stem for p in db.schema_files() if p.stem >= "005_security"]
    assert applied == later + [version for version, _ in db.repeatable_files()]
    row = conn.execute(
        "select has_function_privilege('authenticated', 'thumbq.cancel(text)', 'execute') as can"
    ).fetchone()
    assert row["can"] is False
