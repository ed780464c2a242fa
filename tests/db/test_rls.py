"""Row level security and grants, through plain SQL as Supabase's roles.

Each check runs the way PostgREST and the API do: inside one transaction, `set local role` and the
JWT's claims in `request.jwt.claims`. Users A and B belong to one group each; what they may read
is decided by the example policies of sql/005_security.sql, what they may call by
sql/008_grants.sql. A write attempt passes when it changed nothing, whatever Postgres answered.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from worker.engine import db

USER_A = {"sub": "user-a", "role": "authenticated"}
USER_B = {"sub": "user-b", "role": "authenticated"}


@pytest.fixture
def two_groups(conn: db.Conn) -> db.Conn:
    """Group a-group (2 jobs, member user-a) and b-group (3 jobs, one failed, member user-b)."""
    conn.execute(
        "insert into thumbq.group_members values ('a-group', 'user-a'), ('b-group', 'user-b')"
    )
    for key, group in [("a1.jpg", "a-group"), ("a2.jpg", "a-group")] + [
        (f"b{i}.pdf", "b-group") for i in range(3)
    ]:
        conn.execute("select * from thumbq.enqueue(%s, 'e1', %s)", [key, group])
    # One of B's jobs fails for good, so that retry_failed would have something to requeue.
    claimed = conn.execute("select thumbq.claim('w1', 5, 60, null) as r").fetchone()
    assert claimed is not None
    job = next(j for j in claimed["r"]["jobs"] if j["group_id"] == "b-group")
    conn.execute(
        "select thumbq.fail('w1', %s, %s, 'corrupt_input', 'broken', true)",
        [job["msg_id"], job["id"]],
    )
    others = [j["id"] for j in claimed["r"]["jobs"] if j["id"] != job["id"]]
    conn.execute("select thumbq.release('w1', %s::bigint[], null)", [others])
    return conn


@contextmanager
def acting_as(conn: db.Conn, role: str, claims: dict[str, Any] | None = None) -> Iterator[db.Conn]:
    """One transaction as `role` with the JWT claims set, as PostgREST and the API do it."""
    with conn.transaction():
        conn.execute(f"set local role {role}")
        if claims is not None:
            conn.execute("select set_config('request.jwt.claims', %s, true)", [json.dumps(claims)])
        yield conn


def _rows(conn: db.Conn, role: str, claims: dict[str, Any] | None, sql: str) -> Any:
    """The rows `sql` returns to the role, or the permission error it raised."""
    try:
        with acting_as(conn, role, claims) as c:
            return c.execute(sql).fetchall()
    except psycopg.errors.InsufficientPrivilege as exc:
        return exc


def _state(conn: db.Conn) -> dict[str, Any]:
    """Everything an attempted write could have changed, read as the owner."""

    def q(sql: str) -> list[dict[str, Any]]:
        return conn.execute(sql).fetchall()

    return {
        "jobs": q(
            "select id, group_id, status, attempts, msg_id, dlq_msg_id, error_code, worker_id,"
            " updated_at from thumbq.jobs order by id"
        ),
        "groups": q("select * from thumbq.groups order by group_id"),
        "members": q("select * from thumbq.group_members order by 1, 2"),
        "rate_limits": q("select * from thumbq.rate_limits order by name"),
        "runs": q("select * from thumbq.batch_runs order by id"),
        "stats": q("select * from thumbq.render_stats order by 1, 2"),
        "queues": q(
            "select queue_name, queue_length, total_messages from pgmq.metrics_all()"
            " where queue_name like 'thumbq%' order by 1"
        ),
        # Hidden messages would show here even when the queue length is unchanged.
        "visible": q("select count(*) as n from thumbq.queue_overview where visible > 0"),
        "msgs": q("select msg_id, read_ct, vt from pgmq.q_thumbq_jobs order by msg_id"),
    }


# -- reading ----------------------------------------------------------------------------------


def test_a_user_sees_only_the_groups_they_belong_to(two_groups: db.Conn) -> None:
    sql = "select group_id, total from thumbq.groups order by 1"
    assert _rows(two_groups, "authenticated", USER_A, sql) == [{"group_id": "a-group", "total": 2}]
    assert _rows(two_groups, "authenticated", USER_B, sql) == [{"group_id": "b-group", "total": 3}]
    # Signed in, but a member of nothing.
    assert _rows(two_groups, "authenticated", {"sub": "user-c"}, sql) == []


def test_a_user_sees_only_the_jobs_of_their_groups(two_groups: db.Conn) -> None:
    sql = "select source_key from thumbq.jobs order by 1"
    a = _rows(two_groups, "authenticated", USER_A, sql)
    b = _rows(two_groups, "authenticated", USER_B, sql)
    assert [r["source_key"] for r in a] == ["a1.jpg", "a2.jpg"]
    assert [r["source_key"] for r in b] == ["b0.pdf", "b1.pdf", "b2.pdf"]
    # Asking for B's jobs by name is no way round the policy.
    named = "select id from thumbq.jobs where group_id = 'b-group' or source_key = 'b0.pdf'"
    assert _rows(two_groups, "authenticated", USER_A, named) == []


def test_progress_of_another_users_group_is_empty(two_groups: db.Conn) -> None:
    mine = _rows(two_groups, "authenticated", USER_A, "select * from thumbq.progress('a-group')")
    theirs = _rows(two_groups, "authenticated", USER_A, "select * from thumbq.progress('b-group')")
    assert [(r["group_id"], r["total"]) for r in mine] == [("a-group", 2)]
    assert theirs == []


def test_a_user_sees_only_their_own_memberships(two_groups: db.Conn) -> None:
    rows = _rows(two_groups, "authenticated", USER_A, "select * from thumbq.group_members")
    assert rows == [{"group_id": "a-group", "user_id": "user-a"}]


def test_a_user_cannot_read_the_operator_views_and_tables(two_groups: db.Conn) -> None:
    for sql in (
        "select * from thumbq.queue_overview",
        "select * from thumbq.recent_failures",
        "select * from thumbq.alerts",
        "select * from thumbq.rate_limits",
        "select * from thumbq.batch_runs",
        "select * from pgmq.q_thumbq_jobs",
        "select * from pgmq.read('thumbq_jobs', 0, 10)",
    ):
        got = _rows(two_groups, "authenticated", USER_A, sql)
        assert isinstance(got, psycopg.errors.InsufficientPrivilege), (sql, got)


def test_anon_sees_nothing(two_groups: db.Conn) -> None:
    for sql in (
        "select * from thumbq.groups",
        "select * from thumbq.jobs",
        "select * from thumbq.group_members",
        "select * from thumbq.progress('a-group')",
        "select * from thumbq.queue_overview",
    ):
        got = _rows(two_groups, "anon", None, sql)
        # An error or no rows: either way nothing is revealed.
        assert isinstance(got, psycopg.errors.InsufficientPrivilege) or got == [], (sql, got)


def test_service_role_sees_everything(two_groups: db.Conn) -> None:
    def count(sql: str) -> int:
        rows = _rows(two_groups, "service_role", None, sql)
        assert not isinstance(rows, Exception), rows
        return int(rows[0]["n"])

    assert count("select count(*) as n from thumbq.groups") == 2
    assert count("select count(*) as n from thumbq.jobs") == 5
    assert count("select count(*) as n from thumbq.group_members") == 2
    assert count("select count(*) as n from thumbq.rate_limits") == 1
    assert count("select count(*) as n from thumbq.progress('b-group')") == 1


# -- writing ----------------------------------------------------------------------------------

USER_WRITES = [
    "insert into thumbq.jobs (group_id, source_key) values ('a-group', 'evil.jpg')",
    "update thumbq.jobs set status = 'cancelled'",
    "update thumbq.jobs set status = 'completed' where group_id = 'a-group'",
    "delete from thumbq.jobs",
    "insert into thumbq.groups (group_id, total) values ('a-group-2', 1)",
    "update thumbq.groups set completed = total, pending = 0",
    "delete from thumbq.groups",
    "insert into thumbq.group_members values ('b-group', 'user-a')",
    "update thumbq.group_members set group_id = 'b-group'",
    "delete from thumbq.group_members",
    "update thumbq.rate_limits set capacity = 1e9, tokens = 1e9",
    "insert into thumbq.rate_limits (name, capacity, refill_per_second, tokens)"
    " values ('mine', 1, 1, 1)",
    "delete from thumbq.rate_limits",
    "insert into thumbq.batch_runs (worker_id, budget_ms, buffer_ms, concurrency)"
    " values ('x', 1, 0, 1)",
    "delete from thumbq.batch_runs",
]

ADMIN_CALLS = [
    "select * from thumbq.enqueue_batch('[{\"source_key\": \"evil.jpg\"}]', 'a-group')",
    "select * from thumbq.enqueue('evil.jpg', 'e', 'a-group')",
    "select thumbq.claim('user-a', 10, 60)",
    "select thumbq.claim('user-a', 10, 60, null)",
    "select thumbq.cancel('a-group')",
    "select thumbq.cancel('b-group')",
    "select thumbq.retry_failed('b-group')",
    "select thumbq.reap_stale()",
    "select thumbq.release('w1', array(select id from thumbq.jobs), null)",
    "select thumbq.complete('w1', '[]')",
    "select * from thumbq.take_tokens('thumbnail_generation', 500)",
    "select thumbq.refund_tokens('thumbnail_generation', 500)",
    "select thumbq.start_run('user-a', 1000, 0, 1)",
    "select thumbq.apply_group_changes("
    "array[row('b-group', 'completed', 100, 0, 0)::thumbq.group_change])",
    "select pgmq.purge_queue('thumbq_jobs')",
    "select pgmq.send('thumbq_jobs', '{\"job_id\": 1}')",
]


@pytest.mark.parametrize("role", ["authenticated", "anon"])
@pytest.mark.parametrize("sql", USER_WRITES + ADMIN_CALLS)
def test_users_cannot_change_jobs_groups_limits_or_run_transitions(
    two_groups: db.Conn, role: str, sql: str
) -> None:
    before = _state(two_groups)
    got = _rows(two_groups, role, USER_A if role == "authenticated" else None, sql)
    assert _state(two_groups) == before, f"{role} changed something with: {sql}"
    # Refused outright, not merely lucky to match no row.
    assert isinstance(got, psycopg.errors.InsufficientPrivilege), (sql, got)


def test_only_progress_and_the_policy_helper_are_callable_by_signed_in_users(
    conn: db.Conn,
) -> None:
    """The regression 008_grants.sql fixes: EXECUTE went to PUBLIC with every new function."""
    rows = conn.execute(
        "select p.oid::regprocedure::text as fn,"
        " has_function_privilege('anon', p.oid, 'execute') as anon,"
        " has_function_privilege('authenticated', p.oid, 'execute') as authenticated,"
        " has_function_privilege('service_role', p.oid, 'execute') as service_role,"
        " coalesce(array_to_string(p.proacl, ','), '') ~ '(^|,)=X' as public,"
        " p.prosecdef and p.prorettype = 'trigger'::regtype as definer_trigger"
        " from pg_proc p where p.pronamespace = 'thumbq'::regnamespace"
    ).fetchall()
    assert len(rows) > 15
    assert [r["fn"] for r in rows if r["public"]] == []
    assert [r["fn"] for r in rows if r["anon"]] == []
    assert sorted(r["fn"] for r in rows if r["authenticated"]) == [
        "thumbq.progress(text)",
        "thumbq.progress_v2(text)",
        "thumbq.request_user_id()",
    ]
    # service_role (Supabase's backend key) still runs every transition; only trigger functions
    # that run as their owner (security definer) are nobody's to call.
    assert [r["fn"] for r in rows if not r["service_role"] and not r["definer_trigger"]] == []


def test_reapplying_the_function_files_keeps_the_grants(conn: db.Conn) -> None:
    """`db init` re-applies a changed function file, or a changed versioned file, every later
    one and every function file; `create or replace` must not reopen anything (nor may a
    function that a later file replaced come back)."""
    files = db.schema_files()
    current = [path for _, path in db.repeatable_files()]
    for name in ("003_functions.sql", "004_views.sql", "006_realtime.sql"):
        start = [p.name for p in files].index(name)
        for path in [*files[start:], *current]:
            conn.execute(path.read_bytes())
    for path in current:
        conn.execute(path.read_bytes())
    row = conn.execute(
        "select bool_or(has_function_privilege('authenticated', p.oid, 'execute'))"
        " filter (where p.proname not in ('progress', 'progress_v2', 'request_user_id')) as users,"
        " bool_and(has_function_privilege('service_role', p.oid, 'execute'))"
        " filter (where not (p.prosecdef and p.prorettype = 'trigger'::regtype)) as service"
        " from pg_proc p where p.pronamespace = 'thumbq'::regnamespace"
    ).fetchone()
    assert row == {"users": False, "service": True}


def test_service_role_runs_the_transitions_on_thumbq_queues_only(two_groups: db.Conn) -> None:
    two_groups.execute("select pgmq.create('someone_elses')")
    with acting_as(two_groups, "service_role") as c:
        added = c.execute("select * from thumbq.enqueue('c.jpg', 'e1', 'a-group')").fetchone()
        claim = c.execute("select thumbq.claim('svc', 10, 60) as r").fetchone()
        requeued = c.execute("select thumbq.retry_failed('b-group') as n").fetchone()
        cancelled = c.execute("select thumbq.cancel('a-group') as n").fetchone()
        depth = c.execute("select queue_length from pgmq.metrics('thumbq_jobs')").fetchone()
    assert added is not None and added["created"]
    assert claim is not None and len(claim["r"]["jobs"]) == 5
    assert requeued == {"n": 1}
    assert cancelled == {"n": 3}
    assert depth == {"queue_length": 3}
    got = _rows(two_groups, "service_role", None, "select * from pgmq.read('someone_elses', 0, 1)")
    assert isinstance(got, psycopg.errors.InsufficientPrivilege)
