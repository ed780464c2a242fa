"""/api/jobs against the real app and database: jobs of any task enqueued one by one or many at
once (validation, idempotency, ordering conflicts, thumbnails through the thumbnail enqueue),
shown and cancelled; and interactive runs (`wait_ms`): the job's result within the wait, under
the same rate limit, claim and lease as a batch, or a 202 that says why it still waits."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient

# Both register their tasks in this process too (thread tasks run here).
import tests.support.jobs_fixture
import tests.support.tasks_fixture  # noqa: F401
from api import create_app
from api.contract import spec
from tests.db.test_api import ADMIN, JWT_SECRET, SECRET, assert_error, bearer, job_count, user_token
from tests.support.liveapp import call, jpeg, live_app, wait_until
from worker.app.signing import page_token
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage

TASKS = ("tests.support.tasks_fixture", "tests.support.jobs_fixture")


@pytest.fixture
def jconfig(config: Config) -> Config:
    # An 8 s budget with a 2 s buffer: a caller may wait up to 6 s.
    return config.with_(
        cron_secret=SECRET,
        jwt_secret=JWT_SECRET,
        budget_ms=8000,
        buffer_ms=2000,
        progress_cache_ms=0,
        tasks=TASKS,
    )


@pytest.fixture
def app(jconfig: Config) -> Iterator[Flask]:
    app = create_app(jconfig, db_timeout_s=2.0)
    yield app
    app.extensions["thumbq"].close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def post(client: FlaskClient, body: Any) -> Any:
    return client.post("/api/jobs", json=body, headers=ADMIN)


def check_schema(instance: Any, name: str) -> None:
    """`instance` is what the OpenAPI description says `name` is."""
    from jsonschema import Draft202012Validator

    schema = {"$ref": f"#/components/schemas/{name}", "components": spec()["components"]}
    Draft202012Validator(schema).validate(instance)


def job_row(conn: db.Conn, job_id: int) -> dict[str, Any]:
    row = conn.execute("select * from thumbq.jobs where id = %s", [job_id]).fetchone()
    assert row is not None
    return row


# -- enqueue, show, cancel -------------------------------------------------------------------


def test_a_job_is_enqueued_with_202_and_shown_by_its_id(client: FlaskClient) -> None:
    r = post(client, {"task": "echo", "payload": {"n": 1}, "group_id": "g", "priority": 5})
    assert r.status_code == 202, r.get_json()
    accepted = r.get_json()
    check_schema(accepted, "JobAccepted")
    assert (accepted["task"], accepted["created"], accepted["status"]) == ("echo", True, "pending")

    shown = client.get(f"/api/jobs/{accepted['job_id']}", headers=ADMIN)
    assert shown.status_code == 200
    job = shown.get_json()
    check_schema(job, "JobView")
    assert job["id"] == accepted["job_id"]
    assert (job["task"], job["group_id"], job["priority"]) == ("echo", "g", 5)
    assert (job["payload"], job["result"], job["attempts"]) == ({"n": 1}, None, 0)
    assert "state" not in job  # the handler's checkpoint stays inside


def test_items_are_enqueued_in_order_and_thumbnails_go_through_the_thumbnail_enqueue(
    client: FlaskClient, conn: db.Conn, jconfig: Config
) -> None:
    storage = open_storage(jconfig)
    info = storage.put("uploads/cat.jpg", jpeg(1), "image/jpeg")
    r = post(
        client,
        {
            "items": [
                {"task": "echo", "payload": [1, 2]},
                {"task": "thumbnail", "payload": {"source_key": "uploads/cat.jpg"}},
                {"task": "thumbnail", "payload": {"source_key": "uploads/gone.jpg"}},
                {"task": "segment", "ordering_key": "video-1"},
                {"task": "segment", "ordering_key": "video-1"},
            ]
        },
    )
    assert r.status_code == 202, r.get_json()
    body = r.get_json()
    check_schema(body, "JobsAccepted")
    assert (body["created"], body["existing"]) == (5, 0)
    jobs = body["jobs"]
    assert [j["task"] for j in jobs] == ["echo", "thumbnail", "thumbnail", "segment", "segment"]
    assert [j["missing"] for j in jobs] == [False, False, True, False, False]
    assert [j["sequence"] for j in jobs[3:]] == [1, 2]
    # Storage was asked for the version, as POST /api/thumbnails/enqueue asks it.
    cat = job_row(conn, jobs[1]["job_id"])
    assert (cat["source_etag"], cat["content_type"]) == (info.etag, "image/jpeg")
    # The same version again is the same job, through either route.
    again = client.post(
        "/api/thumbnails/enqueue",
        json={"items": [{"source_key": "uploads/cat.jpg"}]},
        headers=ADMIN,
    ).get_json()
    assert again["jobs"][0]["job_id"] == jobs[1]["job_id"] and not again["jobs"][0]["created"]
    # Only the head of an ordering key waits with a message.
    assert job_row(conn, jobs[3]["job_id"])["msg_id"] is not None
    assert job_row(conn, jobs[4]["job_id"])["msg_id"] is None


def test_the_same_idempotency_key_returns_the_same_job_through_http(client: FlaskClient) -> None:
    first = post(client, {"task": "echo", "idempotency_key": "req-7f3a", "payload": 1}).get_json()
    again = post(client, {"task": "echo", "idempotency_key": "req-7f3a", "payload": 2}).get_json()
    assert first["created"] and not again["created"]
    assert again["job_id"] == first["job_id"]
    # Within one call too, and per task: another task's same key is another job.
    body = post(
        client,
        {
            "items": [
                {"task": "echo", "idempotency_key": "req-9"},
                {"task": "echo", "idempotency_key": "req-9"},
                {"task": "echo_thread", "idempotency_key": "req-9"},
            ]
        },
    ).get_json()
    ids = [j["job_id"] for j in body["jobs"]]
    assert ids[0] == ids[1] != ids[2]
    assert [j["created"] for j in body["jobs"]] == [True, False, True]
    assert (body["created"], body["existing"]) == (2, 1)
    shown = client.get(f"/api/jobs/{first['job_id']}", headers=ADMIN).get_json()
    assert shown["payload"] == 1 and shown["idempotency_key"] == "req-7f3a"


def test_a_sequence_behind_a_started_one_is_409_and_nothing_of_the_call_is_written(
    client: FlaskClient, conn: db.Conn, jconfig: Config
) -> None:
    post(client, {"task": "segment", "ordering_key": "video-2", "sequence": 5})
    # A batch takes the head: sequence 5 has started.
    claim = Queue(conn).claim("someone", 10, 60)
    assert [j.sequence for j in claim.jobs] == [5]
    before = job_count(conn)
    r = post(client, {"task": "segment", "ordering_key": "video-2", "sequence": 3})
    err = assert_error(r, 409, "sequence_conflict")
    assert "video-2" in err["message"] and "sequence 3" in err["message"]
    # A call that mixes a thumbnail with the conflicting job writes neither (one transaction).
    open_storage(jconfig).put("uploads/dog.jpg", jpeg(2), "image/jpeg")
    r = post(
        client,
        {
            "items": [
                {"task": "thumbnail", "payload": {"source_key": "uploads/dog.jpg"}},
                {"task": "segment", "ordering_key": "video-2", "sequence": 4},
            ]
        },
    )
    assert_error(r, 409, "sequence_conflict")
    assert job_count(conn) == before


BAD_REQUESTS: list[tuple[Any, str, str]] = [
    ({}, "invalid_request", "missing required field(s) task"),
    ({"task": ""}, "invalid_request", "task must be 1 to 200"),
    ({"task": "no spaces"}, "invalid_request", "task must be 1 to 200"),
    ({"task": 7}, "invalid_request", "task must be a string"),
    ({"task": "echo", "colour": "red"}, "invalid_request", "unknown field(s) colour"),
    ({"task": "echo", "priority": 10}, "invalid_request", "priority must be between 0 and 9"),
    ({"task": "echo", "priority": True}, "invalid_request", "priority must be an integer"),
    ({"task": "echo", "group_id": "a b"}, "invalid_group_id", "group_id must be"),
    ({"task": "echo", "sequence": 1}, "invalid_request", "sequence needs an ordering_key"),
    (
        {"task": "echo", "ordering_key": "k", "sequence": -1},
        "invalid_request",
        "sequence must be between 0",
    ),
    ({"task": "echo", "ordering_key": ""}, "invalid_request", "ordering_key must be 1 to 200"),
    ({"task": "echo", "ordering_key": "a\nb"}, "invalid_request", "ordering_key must be"),
    ({"task": "echo", "idempotency_key": "k" * 201}, "invalid_request", "idempotency_key must"),
    ({"task": "echo", "max_attempts": 0}, "invalid_request", "max_attempts must be between 1"),
    ({"task": "echo", "payload": {"a": "x\x00y"}}, "invalid_request", "payload.a holds a string"),
    ({"task": "echo", "payload": ["\ud800"]}, "invalid_request", "payload[0] holds a string"),
    ({"task": "echo", "payload": {"\x00": 1}}, "invalid_request", "NUL character"),
    ({"task": "echo", "payload": [[[[]]]] * 2}, None, ""),  # fine: shallow enough
    ({"task": "echo", "wait_ms": 50}, "invalid_request", "wait_ms must be between 100 and 6000"),
    ({"task": "echo", "wait_ms": 6001}, "invalid_request", "wait_ms must be between 100 and 6000"),
    ({"task": "echo", "wait_ms": "1000"}, "invalid_request", "wait_ms must be an integer"),
    ({"items": []}, "invalid_request", "items must not be empty"),
    ({"items": "echo"}, "invalid_request", "items must be an array"),
    ({"items": [{"task": "echo"}], "task": "echo"}, "invalid_request", "unknown field(s) task"),
    (
        {"items": [{"task": "echo"}, {"task": "echo", "wait_ms": 100}]},
        "invalid_request",
        "items[1].wait_ms: only a single job",
    ),
    ({"items": [{"task": "echo"}] * 1001}, "invalid_request", "at most 1000 per request"),
    (
        {"items": [{"task": "echo"}, {"task": "echo", "priority": -1}]},
        "invalid_request",
        "items[1].priority must be between 0 and 9",
    ),
    ({"task": "thumbnail"}, "invalid_request", "payload is required for a thumbnail job"),
    ({"task": "thumbnail", "payload": "a.jpg"}, "invalid_request", "payload must be an object"),
    (
        {"task": "thumbnail", "payload": {"source_key": "../etc/passwd"}},
        "invalid_key",
        "payload.source_key",
    ),
    (
        {"task": "thumbnail", "payload": {"source_key": "a.jpg", "group_id": "g"}},
        "invalid_request",
        "payload: unknown field(s) group_id",
    ),
    (
        {"task": "thumbnail", "payload": {"source_key": "a.jpg"}, "idempotency_key": "k"},
        "invalid_request",
        "a thumbnail job takes no idempotency_key",
    ),
]


def test_bad_job_requests_are_refused_with_400_naming_the_field_and_write_nothing(
    client: FlaskClient, conn: db.Conn
) -> None:
    for body, code, fragment in BAD_REQUESTS:
        r = post(client, body)
        if code is None:
            assert r.status_code == 202, (body, r.get_json())
            continue
        err = assert_error(r, 400, code)
        assert fragment in err["message"], (body, err)
    assert job_count(conn) == 1  # the one valid request
    # Numbers JSON can write but Postgres cannot store, and nesting past the limit.
    for raw in (
        b'{"task": "echo", "payload": {"x": 1e999}}',
        b'{"task": "echo", "payload": ' + b"[" * 120 + b"]" * 120 + b"}",
    ):
        r = client.post(
            "/api/jobs", data=raw, headers={**ADMIN, "Content-Type": "application/json"}
        )
        assert_error(r, 400, "invalid_request")
    assert job_count(conn) == 1


def test_job_routes_are_admin_only_and_fail_closed(config: Config, client: FlaskClient) -> None:
    routes = [
        ("post", "/api/jobs", {"task": "echo"}),
        ("get", "/api/jobs/1", None),
        ("post", "/api/jobs/1/cancel", None),
    ]
    refused = [
        {},
        bearer("not-the-secret"),
        bearer(user_token("alice")),  # a user's token reads progress, never jobs
        bearer(page_token(SECRET)),  # the progress page's read-only link neither
    ]
    for method, path, body in routes:
        for headers in refused:
            r = getattr(client, method)(path, json=body, headers=headers)
            assert_error(r, 401, "unauthorized")
    open_app = create_app(config.with_(cron_secret=None), db_timeout_s=2.0)
    try:
        for method, path, body in routes:
            r = getattr(open_app.test_client(), method)(path, json=body, headers=ADMIN)
            assert_error(r, 503, "not_configured")
    finally:
        open_app.extensions["thumbq"].close()


def test_show_and_cancel_answer_404_for_unknown_jobs_and_400_for_non_ids(
    client: FlaskClient,
) -> None:
    assert_error(client.get("/api/jobs/999", headers=ADMIN), 404, "job_not_found")
    assert_error(client.post("/api/jobs/999/cancel", headers=ADMIN), 404, "job_not_found")
    for bad in ("abc", "0", "-1", "99999999999999999999"):
        assert_error(client.get(f"/api/jobs/{bad}", headers=ADMIN), 400, "invalid_job_id")
        assert_error(client.post(f"/api/jobs/{bad}/cancel", headers=ADMIN), 400, "invalid_job_id")
    job = post(client, {"task": "echo"}).get_json()
    r = client.post(f"/api/jobs/{job['job_id']}/cancel", json={"why": 1}, headers=ADMIN)
    assert_error(r, 400, "invalid_request")


def test_cancelling_a_waiting_job_lets_the_next_of_its_ordering_key_go(
    client: FlaskClient, conn: db.Conn
) -> None:
    first = post(client, {"task": "segment", "ordering_key": "video-3"}).get_json()
    second = post(client, {"task": "segment", "ordering_key": "video-3"}).get_json()
    assert job_row(conn, second["job_id"])["msg_id"] is None
    r = client.post(f"/api/jobs/{first['job_id']}/cancel", headers=ADMIN)
    assert r.status_code == 200
    check_schema(r.get_json(), "JobCancelled")
    assert r.get_json() == {
        "job_id": first["job_id"],
        "cancelled": True,
        "status": "cancelled",
        "group_id": "default",
    }
    assert job_row(conn, second["job_id"])["msg_id"] is not None  # now the head
    # Cancelling again changes nothing and says so.
    again = client.post(f"/api/jobs/{first['job_id']}/cancel", headers=ADMIN).get_json()
    assert (again["cancelled"], again["status"]) == (False, "cancelled")


# -- interactive runs ---------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["echo", "echo_thread"])
def test_wait_ms_runs_the_job_at_once_and_answers_200_with_its_result(
    client: FlaskClient, conn: db.Conn, task: str
) -> None:
    r = post(client, {"task": task, "payload": {"n": 3}, "wait_ms": 5000})
    assert r.status_code == 200, r.get_json()
    body = r.get_json()
    check_schema(body, "JobRun")
    assert body["status"] == "completed" and body["wait"]["ran"] and body["wait"]["finished"]
    job = body["job"]
    assert (job["status"], job["attempts"]) == ("completed", 1)
    assert job["result"]["payload"] == {"n": 3}
    # A thread task runs in the app's process, a process task in the app's render pool.
    if task == "echo_thread":
        assert job["result"]["pid"] == os.getpid()
    else:
        assert job["result"]["pid"] != os.getpid()
    # The same lease and message as a batch: the message is gone once the job completed.
    assert job_row(conn, body["job_id"])["msg_id"] is None
    assert Queue(conn).overview()["queue_length"] == 0


def test_a_failure_within_the_wait_answers_200_with_the_error_and_a_transient_one_202(
    client: FlaskClient,
) -> None:
    r = post(client, {"task": "refuse", "wait_ms": 5000})
    assert r.status_code == 200
    job = r.get_json()["job"]
    assert (job["status"], job["error_code"]) == ("failed", "bad_request")
    assert job["last_error"] == "this request can never succeed"

    r = post(client, {"task": "flaky", "wait_ms": 5000})
    assert r.status_code == 202
    body = r.get_json()
    check_schema(body, "JobRun")
    assert (body["status"], body["wait"]["reason"]) == ("pending", "retrying")
    assert body["job"]["error_code"] == "upstream_unavailable"
    assert body["job"]["next_attempt_at"] is not None  # its backoff


def test_a_thumbnail_for_a_just_uploaded_photo_comes_back_well_under_a_second(
    jconfig: Config, conn: db.Conn
) -> None:
    storage = open_storage(jconfig)
    photos = [
        storage.put(f"uploads/photo-{i}.jpg", jpeg(i, (4032, 3024)), "image/jpeg") for i in range(3)
    ]
    with live_app(jconfig) as server:
        timings = []
        for i, _info in enumerate(photos):
            started = time.monotonic()
            status, body, _ = call(
                "POST",
                f"{server.url}/api/jobs",
                SECRET,
                {
                    "task": "thumbnail",
                    "payload": {"source_key": f"uploads/photo-{i}.jpg"},
                    "wait_ms": 5000,
                },
            )
            timings.append(time.monotonic() - started)
            assert status == 200 and body is not None, body
            result = body["job"]["result"]
            assert body["status"] == "completed"
            assert (result["width"], result["height"]) == (512, 384)
            assert storage.head(result["thumbnail_key"]).size == result["bytes"]
    # The first call starts the render process; the app keeps it for the next ones. A 12 MP
    # photo takes about 0.1-0.2 s warm here (bench/interactive.py); 1 s leaves room for a
    # loaded machine and still means "at once" to a person who clicked.
    assert max(timings[1:]) < 1.0, timings


def test_a_rate_limited_run_answers_202_with_retry_after_and_the_job_stays_queued(
    client: FlaskClient, conn: db.Conn, jconfig: Config
) -> None:
    storage = open_storage(jconfig)
    storage.put("uploads/bird.jpg", jpeg(3), "image/jpeg")
    conn.execute(
        "update thumbq.rate_limits set tokens = 0, refill_per_second = 0.5,"
        " refilled_at = clock_timestamp() where name = 'thumbnail_generation'"
    )
    r = post(
        client,
        {"task": "thumbnail", "payload": {"source_key": "uploads/bird.jpg"}, "wait_ms": 3000},
    )
    assert r.status_code == 202, r.get_json()
    body = r.get_json()
    check_schema(body, "JobRun")
    assert (body["wait"]["ran"], body["wait"]["reason"]) == (False, "rate_limited")
    assert 1000 <= body["wait"]["retry_after_ms"] <= 2100
    assert r.headers["Retry-After"] == "2"
    row = job_row(conn, body["job_id"])
    assert (row["status"], row["attempts"]) == ("pending", 0)
    # It waits for a batch, which runs it once the bucket has tokens.
    conn.execute("update thumbq.rate_limits set tokens = 10 where name = 'thumbnail_generation'")
    run_batch(jconfig, conn, storage)
    assert job_row(conn, body["job_id"])["status"] == "completed"


def test_a_task_with_its_own_bucket_is_limited_by_that_bucket_only(
    client: FlaskClient, conn: db.Conn
) -> None:
    assert post(client, {"task": "limited", "wait_ms": 3000}).status_code == 200
    # The thumbnail bucket empty: the task's own bucket decides, and it has tokens.
    conn.execute(
        "update thumbq.rate_limits set tokens = 0, refill_per_second = 0.001,"
        " refilled_at = clock_timestamp()"
    )
    conn.execute("update thumbq.rate_limits set tokens = 5 where name = 'jobs_test_quota'")
    r = post(client, {"task": "limited", "payload": 2, "wait_ms": 3000})
    assert r.status_code == 200, r.get_json()
    # Its own bucket empty: refused, whatever the thumbnail bucket holds.
    conn.execute("update thumbq.rate_limits set tokens = 1000 where name <> 'jobs_test_quota'")
    conn.execute("update thumbq.rate_limits set tokens = 0 where name = 'jobs_test_quota'")
    r = post(client, {"task": "limited", "payload": 3, "wait_ms": 3000})
    assert (r.status_code, r.get_json()["wait"]["reason"]) == (202, "rate_limited")


def test_a_job_cut_at_the_end_of_the_wait_is_handed_back_at_once_without_an_attempt(
    client: FlaskClient, conn: db.Conn
) -> None:
    started = time.monotonic()
    r = post(client, {"task": "spin", "payload": {"ms": 4000}, "wait_ms": 600})
    took = time.monotonic() - started
    assert r.status_code == 202, r.get_json()
    body = r.get_json()
    assert (body["wait"]["ran"], body["wait"]["reason"]) == (True, "timeout")
    # Within the wait and the recording reserve (0.3 s), with room for a loaded machine.
    assert took < 0.6 + 0.3 + 0.7, took
    row = job_row(conn, body["job_id"])
    assert (row["status"], row["attempts"], row["error_code"]) == ("pending", 0, None)
    # Its message is visible at once: the next claim takes it, no backoff, no lease to wait.
    claim = Queue(conn).claim("next-batch", 5, 60)
    assert [j.id for j in claim.jobs] == [body["job_id"]]


def test_wait_ms_bounds_the_answer_of_a_thread_handler_that_runs_on_and_it_runs_once(
    client: FlaskClient, conn: db.Conn, jconfig: Config, tmp_path: Path
) -> None:
    """Regression (issue 20, item 2): a thread handler ran in the request's thread with no
    bound, so `wait_ms` did not bound the answer. The answer now comes within the wait; the
    handler, which cannot be stopped, keeps its job until it ends (a batch meanwhile does not
    run it again), and its result is recorded then."""
    log = tmp_path / "overrun.log"
    payload = {"log": str(log), "sleep_s": 3}
    started = time.monotonic()
    r = post(client, {"task": "overrun_thread", "payload": payload, "wait_ms": 500})
    took = time.monotonic() - started
    body = r.get_json()
    assert (r.status_code, body["wait"]["ran"], body["wait"]["reason"]) == (202, True, "running")
    check_schema(body, "JobRun")
    # Within the wait and the recording reserve (0.3 s), with room for a loaded machine.
    assert took < 0.5 + 0.3 + 0.7, took
    assert job_row(conn, body["job_id"])["status"] == "processing"
    while (
        job_row(conn, body["job_id"])["status"] == "processing" and time.monotonic() < started + 15
    ):
        run_batch(jconfig.with_(budget_ms=1000, buffer_ms=300), conn, open_storage(jconfig))
        time.sleep(0.1)
    row = job_row(conn, body["job_id"])
    assert (row["status"], row["attempts"], row["result"]) == ("completed", 1, {"slept_s": 3})
    starts = [json.loads(line)["at"] for line in log.read_text().splitlines()]
    assert starts == ["start", "end"]


def test_a_job_predicted_too_long_for_the_wait_is_not_started(
    client: FlaskClient, conn: db.Conn
) -> None:
    conn.execute(
        "insert into thumbq.render_stats (kind, size_class, samples, ewma_ms, max_ms)"
        " values ('task:spin', 0, 20, 5000, 6000)"
    )
    started = time.monotonic()
    r = post(client, {"task": "spin", "payload": {"ms": 5000}, "wait_ms": 1000})
    assert time.monotonic() - started < 1.0  # it did not spin
    body = r.get_json()
    assert (r.status_code, body["wait"]["reason"], body["wait"]["ran"]) == (202, "too_long", False)
    assert "5000 ms" in body["wait"]["message"]
    row = job_row(conn, body["job_id"])
    assert (row["status"], row["attempts"], row["result"]) == ("pending", 0, None)
    # Its token went back to the bucket too.
    tokens = conn.execute(
        "select tokens from thumbq.rate_limits where name = 'thumbnail_generation'"
    ).fetchone()
    assert tokens is not None and tokens["tokens"] >= 999


def test_a_handler_that_checkpoints_within_the_wait_answers_202_checkpointed(
    client: FlaskClient, conn: db.Conn
) -> None:
    # The wait includes starting the render process (the app's first task); the handler stops
    # with 500 ms to spare.
    r = post(client, {"task": "steps", "payload": {"steps": 40, "step_ms": 50}, "wait_ms": 2000})
    body = r.get_json()
    assert (r.status_code, body["wait"]["reason"]) == (202, "checkpointed"), body
    row = job_row(conn, body["job_id"])
    assert row["status"] == "pending" and row["attempts"] == 0
    assert row["state"]["i"] >= 5 and row["progress_done"] == row["state"]["i"]
    assert body["job"]["progress_total"] == 40


def test_jobs_held_elsewhere_or_behind_their_ordering_key_wait_and_an_ended_one_answers(
    client: FlaskClient, conn: db.Conn
) -> None:
    # Held by a batch: busy.
    held = post(client, {"task": "echo", "idempotency_key": "held"}).get_json()
    Queue(conn).claim("a-batch", 10, 60)
    r = post(client, {"task": "echo", "idempotency_key": "held", "wait_ms": 1000})
    body = r.get_json()
    assert body["job_id"] == held["job_id"]
    assert (r.status_code, body["wait"]["reason"], body["status"]) == (202, "busy", "processing")
    # Behind the head of its ordering key: not ready.
    post(client, {"task": "segment", "ordering_key": "video-4"})
    r = post(client, {"task": "segment", "ordering_key": "video-4", "wait_ms": 1000})
    body = r.get_json()
    assert (r.status_code, body["wait"]["reason"]) == (202, "not_ready")
    assert "video-4" in body["wait"]["message"]
    # Asked again once it has ended: its result at once, nothing run twice.
    done = post(client, {"task": "echo", "idempotency_key": "once", "wait_ms": 3000}).get_json()
    r = post(client, {"task": "echo", "idempotency_key": "once", "wait_ms": 3000})
    body = r.get_json()
    assert r.status_code == 200 and not body["created"] and not body["wait"]["ran"]
    assert body["job"]["result"] == done["job"]["result"] and body["job"]["attempts"] == 1


def start_clicks(
    url: str, n: int, answers: list[tuple[int, dict[str, Any]]]
) -> list[threading.Thread]:
    """`n` users clicking at once: each a POST /api/jobs of a 1.5 s `spin` task that waits for
    it (5 s); each answer lands in `answers`."""

    def click(i: int) -> None:
        status, body, _ = call(
            "POST",
            f"{url}/api/jobs",
            SECRET,
            {"task": "spin", "payload": {"ms": 1500 + i}, "wait_ms": 5000},
        )
        assert body is not None
        answers.append((status, body))

    clicks = [threading.Thread(target=click, args=(i,)) for i in range(n)]
    for t in clicks:
        t.start()
    return clicks


def test_more_interactive_runs_than_render_processes_leave_the_rest_queued(
    jconfig: Config, conn: db.Conn
) -> None:
    # Two render processes: a third click at the same moment is told `busy` at once.
    answers: list[tuple[int, dict[str, Any]]] = []
    with live_app(jconfig) as server:
        clicks = start_clicks(server.url, 3, answers)
        for t in clicks:
            t.join(30)
    statuses = sorted(s for s, _ in answers)
    assert statuses == [200, 200, 202], answers
    busy = next(b for s, b in answers if s == 202)
    assert (busy["wait"]["reason"], busy["wait"]["ran"], busy["status"]) == (
        "busy",
        False,
        "pending",
    )


def test_interactive_runs_leave_a_pooled_connection_for_everything_else(
    jconfig: Config, conn: db.Conn
) -> None:
    # Each run holds a connection of the pool for its wait: with two, one click runs and the
    # other is told `busy`, and polls still find a connection meanwhile.
    Queue(conn).enqueue_jobs([{"task": "echo"}], "polled")
    answers: list[tuple[int, dict[str, Any]]] = []
    with live_app(jconfig, pool_size=2) as server:
        clicks = start_clicks(server.url, 2, answers)
        time.sleep(0.5)
        started = time.monotonic()
        status, _, _ = call("GET", f"{server.url}/api/thumbnails/progress?group_id=polled", SECRET)
        assert status == 200 and time.monotonic() - started < 1.0
        for t in clicks:
            t.join(30)
    assert sorted(s for s, _ in answers) == [200, 202], answers
    assert next(b for s, b in answers if s == 202)["wait"]["reason"] == "busy"


@pytest.mark.parametrize("task", ["until_cancelled", "until_cancelled_thread"])
def test_cancelling_a_running_job_through_http_stops_its_handler(
    jconfig: Config, conn: db.Conn, tmp_path: Path, task: str
) -> None:
    partial, seen = tmp_path / "partial.csv", tmp_path / "seen"
    answers: list[tuple[int, Any]] = []
    with live_app(jconfig) as server:
        runner = threading.Thread(
            target=lambda: answers.append(
                call(
                    "POST",
                    f"{server.url}/api/jobs",
                    SECRET,
                    {
                        "task": task,
                        "payload": {"partial": str(partial), "seen": str(seen)},
                        "wait_ms": 6000,
                    },
                )[:2]
            )
        )
        runner.start()
        wait_until(partial.exists, 10, 0.01)
        row = conn.execute("select id from thumbq.jobs where task = %s", [task]).fetchone()
        assert row is not None
        cancelled_at = time.monotonic()
        status, body, _ = call("POST", f"{server.url}/api/jobs/{row['id']}/cancel", SECRET)
        assert status == 200 and body == {
            "job_id": row["id"],
            "cancelled": True,
            "status": "cancelled",
            "group_id": "default",
        }
        wait_until(seen.exists, 5, 0.01)
        stopped_after = time.monotonic() - cancelled_at
        runner.join(15)
    assert stopped_after < 1.0  # one cancellation poll (0.25 s) and one check
    assert not partial.exists()  # the handler cleaned up
    [(status, body)] = answers
    # The run answers with the job as it ended: cancelled, its late checkpoint ignored.
    assert status == 200 and body["status"] == "cancelled", body
    assert body["wait"]["ran"] and body["wait"]["duration_ms"] < 4000
    assert job_row(conn, row["id"])["state"] is None


def test_an_interactive_run_writes_no_batch_run_row(client: FlaskClient, conn: db.Conn) -> None:
    # Decision: batch_runs (and its alerts on budget use and rate limiting) describe scheduled
    # invocations; a click's short wait would read there as a run that used its whole budget.
    assert post(client, {"task": "echo", "wait_ms": 3000}).status_code == 200
    row = conn.execute("select count(*) as n from thumbq.batch_runs").fetchone()
    assert row is not None and row["n"] == 0


def test_progress_carries_the_jobs_own_progress(client: FlaskClient, conn: db.Conn) -> None:
    post(
        client,
        {
            "task": "steps",
            "group_id": "export",
            # 5 s of work in a 3 s wait: the handler stops with 500 ms left, after the render
            # process's start (0.3 s on a quiet machine, 0.7 s and more on a busy one).
            "payload": {"steps": 100, "step_ms": 50},
            "wait_ms": 3000,
        },
    )
    p = client.get("/api/thumbnails/progress?group_id=export", headers=ADMIN).get_json()
    check_schema(p, "Progress")
    assert p["progress_total"] == 100 and 5 <= p["progress_done"] < 100
    assert json.loads(json.dumps(p))["pending"] == 1


def test_a_failed_job_of_another_task_is_listed_among_the_failures_as_described(
    client: FlaskClient, jconfig: Config, conn: db.Conn
) -> None:
    # Regression (issue 21's fuzzing of the generated document): a task's job has no source
    # key, and the failures page answered null where the description promised a string.
    answer = post(client, {"task": "refuse", "group_id": "mixed", "payload": {}})
    assert answer.status_code == 202, answer.get_json()
    run_batch(jconfig, conn, open_storage(jconfig))
    reply = client.get("/api/thumbnails/failures?group_id=mixed", headers=ADMIN)
    status, body = reply.status_code, reply.get_json()
    assert status == 200, body
    [failure] = body["failures"]
    assert (failure["source_key"], failure["error_code"]) == (None, "bad_request")
    check_schema(failure, "Failure")
