"""The HTTP API against a real Postgres: every route, every refusal, auth, RLS, outages, ETag/304,
a real waitress server on loopback, and pgbouncer in transaction mode in front of the database."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
from flask import Flask
from flask.testing import FlaskClient

from api import create_app
from api.auth import secret_matches
from api.contract import spec
from tests.support import pgbouncer
from tests.support.pgtools import require
from tests.support.s3fixtures import free_port
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue

SECRET = "s3cret-admin-token-for-tests"
JWT_SECRET = "jwt-secret-for-tests-" + "x" * 48  # long enough for HS512 too
ADMIN = {"Authorization": f"Bearer {SECRET}"}
ROOT = Path(__file__).resolve().parents[2]


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def api_config(config: Config) -> Config:
    # Most tests here change the database behind the app's back, as another process would, and
    # read the result at once: they run without the progress cache, which has tests of its own.
    return config.with_(
        cron_secret=SECRET, jwt_secret=JWT_SECRET, budget_ms=8000, progress_cache_ms=0
    )


@pytest.fixture
def app(api_config: Config) -> Iterator[Flask]:
    app = create_app(api_config, db_timeout_s=2.0)
    yield app
    app.extensions["thumbq"].close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def user_token(sub: str, *, secret: str = JWT_SECRET, **overrides: Any) -> str:
    claims: dict[str, Any] = {
        "sub": sub,
        "aud": "authenticated",
        "role": "authenticated",
        "exp": int(time.time()) + 600,
    }
    claims.update(overrides)
    claims = {k: v for k, v in claims.items() if v is not None}
    return jwt.encode(claims, secret, algorithm="HS256")


def unsigned_jwt(claims: dict[str, Any]) -> str:
    """A token with `alg: none` and an empty signature, as an attacker would send it."""

    def b64(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(claims)}."


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def enqueue(conn: db.Conn, n: int, group: str, prefix: str = "k") -> None:
    items = [{"source_key": f"{prefix}/{i}.pdf", "etag": f"e{i}"} for i in range(n)]
    Queue(conn).enqueue_files(items, group)


def job_count(conn: db.Conn) -> int:
    row = conn.execute("select count(*) as n from thumbq.jobs").fetchone()
    assert row is not None
    return int(row["n"])


def assert_error(resp: Any, status: int, code: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    body = resp.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    assert body["error"]["code"] == code, body
    assert len(body["error"]["message"]) > 10
    return dict(body["error"])


# -- OpenAPI --------------------------------------------------------------------------------------


def test_openapi_is_valid_3_1_and_describes_every_route(app: Flask, client: FlaskClient) -> None:
    from openapi_spec_validator import validate

    doc = client.get("/api/openapi.json").get_json()
    assert doc["openapi"] == "3.1.0"
    validate(doc)
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.endswith(".static"):
            continue
        path = rule.rule
        for arg in rule.arguments:
            path = path.replace(f"<{arg}>", f"{{{arg}}}")
            for conv in ("int", "path", "string"):
                path = path.replace(f"<{conv}:{arg}>", f"{{{arg}}}")
        assert path in doc["paths"], f"{path} is not described"
        for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}:
            assert method.lower() in doc["paths"][path], f"{method} {path} is not described"


def test_response_bodies_match_their_openapi_schemas(client: FlaskClient, conn: db.Conn) -> None:
    from jsonschema import Draft202012Validator

    doc = spec()

    def check(instance: Any, name: str) -> None:
        schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
        Draft202012Validator(schema).validate(instance)

    enqueued = client.post(
        "/api/thumbnails/enqueue",
        json={"items": [{"source_key": "a.pdf", "etag": "1", "group_id": "g"}]},
        headers=ADMIN,
    )
    check(enqueued.get_json(), "EnqueueResult")
    check(client.get("/api/thumbnails/progress?group_id=g", headers=ADMIN).get_json(), "Progress")
    job_id = enqueued.get_json()["jobs"][0]["job_id"]
    check(client.get(f"/api/thumbnails/jobs/{job_id}", headers=ADMIN).get_json(), "Job")
    check(client.get("/api/queues", headers=ADMIN).get_json(), "QueueOverview")
    check(client.get("/healthz").get_json(), "Health")
    check(client.get("/api/thumbnails/progress?group_id=nope", headers=ADMIN).get_json(), "Error")


# -- happy paths ----------------------------------------------------------------------------------


def test_enqueue_answers_202_with_counts_and_job_ids_and_is_idempotent(
    client: FlaskClient, conn: db.Conn, api_config: Config
) -> None:
    from worker.storage import open_storage

    open_storage(api_config).put("photos/cat.jpg", b"\xff\xd8 not really", "image/jpeg")
    body = {
        "items": [
            {"source_key": "slides/q1.pdf", "etag": "v1", "content_type": "application/pdf"},
            {"source_key": "photos/cat.jpg", "group_id": "event-7"},
        ]
    }
    resp = client.post("/api/thumbnails/enqueue", json=body, headers=ADMIN)
    assert resp.status_code == 202
    out = resp.get_json()
    assert (out["enqueued"], out["existing"]) == (2, 0)
    assert {j["source_key"] for j in out["jobs"]} == {"slides/q1.pdf", "photos/cat.jpg"}
    assert all(isinstance(j["job_id"], int) and j["status"] == "pending" for j in out["jobs"])
    cat = conn.execute(
        "select group_id, source_etag from thumbq.jobs where source_key = 'photos/cat.jpg'"
    ).fetchone()
    assert cat is not None and cat["group_id"] == "event-7" and cat["source_etag"]  # from storage
    again = client.post("/api/thumbnails/enqueue", json=body, headers=ADMIN).get_json()
    assert (again["enqueued"], again["existing"]) == (0, 2)
    assert job_count(conn) == 2


def test_progress_reports_counts_percentage_eta_and_poll_interval(
    client: FlaskClient, conn: db.Conn
) -> None:
    enqueue(conn, 10, "g")
    resp = client.get("/api/thumbnails/progress?group_id=g", headers=ADMIN)
    assert resp.status_code == 200
    assert resp.headers["Cache-Control"] == "no-cache"
    p = resp.get_json()
    assert (p["group_id"], p["total"], p["pending"], p["completed"]) == ("g", 10, 10, 0)
    assert p["progress_percentage"] == 0.0
    assert p["estimated_time_remaining_seconds"] is None  # no rate observed: unknown, not made up
    assert p["poll_after_ms"] == 5_000  # waiting for the next batch
    assert p["updated_at"].startswith("20")

    q = Queue(conn)
    jobs = q.claim("w", 4, 60).jobs
    time.sleep(0.3)
    q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs[:3]])
    p = client.get("/api/thumbnails/progress?group_id=g", headers=ADMIN).get_json()
    assert (p["completed"], p["processing"], p["pending"]) == (3, 1, 6)
    assert p["progress_percentage"] == 30.0
    assert isinstance(p["estimated_time_remaining_seconds"], int)
    assert p["poll_after_ms"] == 1_000  # work is running

    q.cancel("g")
    p = client.get("/api/thumbnails/progress?group_id=g", headers=ADMIN).get_json()
    assert p["progress_percentage"] == 100.0 and p["estimated_time_remaining_seconds"] == 0
    assert p["poll_after_ms"] == 30_000  # settled


def test_progress_etag_answers_304_until_the_group_changes(
    client: FlaskClient, conn: db.Conn
) -> None:
    enqueue(conn, 3, "g")
    first = client.get("/api/thumbnails/progress?group_id=g", headers=ADMIN)
    etag = first.headers["ETag"]
    assert etag.startswith('"') and not etag.startswith("W/")
    again = client.get(
        "/api/thumbnails/progress?group_id=g", headers={**ADMIN, "If-None-Match": etag}
    )
    assert again.status_code == 304 and again.get_data() == b""
    assert again.headers["ETag"] == etag and again.headers["X-Poll-After-Ms"] == "5000"
    # Reading changes nothing; a transition changes the tag.
    assert client.get("/api/thumbnails/progress?group_id=g", headers=ADMIN).headers["ETag"] == etag
    Queue(conn).claim("w", 1, 60)
    changed = client.get(
        "/api/thumbnails/progress?group_id=g", headers={**ADMIN, "If-None-Match": etag}
    )
    assert changed.status_code == 200 and changed.headers["ETag"] != etag
    assert changed.get_json()["processing"] == 1


def test_retry_failed_and_cancel_report_counts_and_404_for_unknown_groups(
    client: FlaskClient, conn: db.Conn
) -> None:
    enqueue(conn, 3, "g")
    q = Queue(conn)
    job = q.claim("w", 1, 60).jobs[0]
    q.fail("w", job, "corrupt_input", "bad", permanent=False)  # retry scheduled
    conn.execute("update thumbq.jobs set status = 'failed' where id = %s", [job.id])
    resp = client.post("/api/thumbnails/retry-failed", json={"group_id": "g"}, headers=ADMIN)
    assert resp.status_code == 200 and resp.get_json() == {"requeued": 1}
    resp = client.post("/api/thumbnails/cancel", json={"group_id": "g"}, headers=ADMIN)
    assert resp.status_code == 200 and resp.get_json() == {"cancelled": 3}
    # A known group with nothing to do answers 0, an unknown one 404.
    resp = client.post("/api/thumbnails/cancel", json={"group_id": "g"}, headers=ADMIN)
    assert resp.get_json() == {"cancelled": 0}
    for path in ("/api/thumbnails/retry-failed", "/api/thumbnails/cancel"):
        resp = client.post(path, json={"group_id": "nope"}, headers=ADMIN)
        assert_error(resp, 404, "group_not_found")


def test_cleanup_stale_resets_expired_leases(client: FlaskClient, conn: db.Conn) -> None:
    enqueue(conn, 2, "g")
    Queue(conn).claim("w", 2, 60)
    conn.execute("update thumbq.jobs set lease_expires_at = now() - interval '1 minute'")
    resp = client.post("/api/thumbnails/cleanup-stale", headers=ADMIN)
    assert resp.status_code == 200 and resp.get_json() == {
        "reset_count": 2,
        "pruned": {"jobs": 0, "batch_runs": 0, "archived": 0},
        "temp_files_removed": 0,
    }
    resp = client.post("/api/thumbnails/cleanup-stale", json={}, headers=ADMIN)
    assert resp.get_json() == {
        "reset_count": 0,
        "pruned": {"jobs": 0, "batch_runs": 0, "archived": 0},
        "temp_files_removed": 0,
    }


def test_job_route_returns_one_job_404_for_unknown_and_400_for_non_ids(
    client: FlaskClient, conn: db.Conn
) -> None:
    enqueue(conn, 1, "g")
    row = conn.execute("select id from thumbq.jobs").fetchone()
    assert row is not None
    job = client.get(f"/api/thumbnails/jobs/{row['id']}", headers=ADMIN).get_json()
    assert job["id"] == row["id"] and job["status"] == "pending" and job["group_id"] == "g"
    assert "T" in job["created_at"]  # ISO 8601
    assert_error(client.get("/api/thumbnails/jobs/999999", headers=ADMIN), 404, "job_not_found")
    for bad in ("abc", "-1", "0", "1.5", "99999999999999999999"):
        assert_error(
            client.get(f"/api/thumbnails/jobs/{bad}", headers=ADMIN), 400, "invalid_job_id"
        )


def test_queues_and_healthz(client: FlaskClient, conn: db.Conn) -> None:
    enqueue(conn, 2, "g")
    overview = client.get("/api/queues", headers=ADMIN).get_json()
    assert isinstance(overview["alerts"], list)
    assert 2 in overview.values() or json.dumps(overview).count("2") > 0
    health = client.get("/healthz")
    assert health.status_code == 200 and health.get_json()["database"] == "ok"


def test_backfill_enqueues_every_file_lacking_a_thumbnail(
    client: FlaskClient, conn: db.Conn, api_config: Config
) -> None:
    from worker.storage import open_storage
    from worker.thumbnails.task import thumbnail_key

    storage = open_storage(api_config)
    for name in ("a.pdf", "b.pdf", "c.pdf"):
        storage.put(f"event/{name}", b"%PDF-1.7 " + name.encode(), "application/pdf")
    done = storage.head("event/a.pdf")
    storage.put(
        thumbnail_key("event/a.pdf", done.etag, api_config.thumb_size, api_config.thumb_ext),
        b"webp",
        "image/webp",
    )
    resp = client.post(
        "/api/thumbnails/backfill", json={"prefix": "event/", "group_id": "ev"}, headers=ADMIN
    )
    assert resp.status_code == 202
    out = resp.get_json()
    assert (out["listed"], out["have_thumbnail"], out["enqueued"]) == (3, 1, 2)
    assert job_count(conn) == 2


def test_batch_generate_renders_a_pdf_and_reports(
    client: FlaskClient, conn: db.Conn, api_config: Config
) -> None:
    from bench.corpus import a4_pdf
    from worker.storage import open_storage

    storage = open_storage(api_config)
    storage.put("docs/a4.pdf", a4_pdf(), "application/pdf")
    client.post(
        "/api/thumbnails/enqueue", json={"items": [{"source_key": "docs/a4.pdf"}]}, headers=ADMIN
    )
    resp = client.post(
        "/api/thumbnails/batch-generate", json={"budget_ms": 6000, "max_items": 5}, headers=ADMIN
    )
    assert resp.status_code == 200, resp.get_data(as_text=True)
    out = resp.get_json()
    assert set(out) == {
        "run_id", "processed", "succeeded", "failed", "unsupported", "missing", "retried",
        "skipped", "checkpointed", "remaining", "stopped_reason", "duration_ms", "budget_ms",
        "retry_after_ms",
    }  # fmt: skip
    assert (out["succeeded"], out["remaining"], out["budget_ms"]) == (1, 0, 6000)
    assert out["stopped_reason"] == "drained" and out["duration_ms"] < 6000
    job = conn.execute("select status, thumbnail_key from thumbq.jobs").fetchone()
    assert job is not None and job["status"] == "completed"
    assert storage.exists(job["thumbnail_key"])
    # The render processes outlive the request: a warm instance reuses them.
    assert app_render_pool_is_kept(client)


def app_render_pool_is_kept(client: FlaskClient) -> bool:
    st = client.application.extensions["thumbq"]
    return st._render_pool is not None


# -- bad input: the right 4xx, a clear message, nothing written ----------------------------------

BAD_ENQUEUES: list[tuple[str, Any, str]] = [
    ("not json", b"{items: [", "invalid_json"),
    ("not utf-8", b'{"items": ["\xff"]}', "invalid_json"),
    ("NaN", b'{"items": NaN}', "invalid_json"),
    ("array body", [], "invalid_json"),
    ("empty body", b"", "invalid_json"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
    ("missing items", {}, "invalid_request"),
    ("unknown top field", {"items": [{"source_key": "a"}], "priority": 1}, "invalid_request"),
    ("items not a list", {"items": {"source_key": "a"}}, "invalid_request"),
    ("empty items", {"items": []}, "invalid_request"),
    (
        "too many items",
        {"items": [{"source_key": f"k{i}"} for i in range(1001)]},
        "invalid_request",
    ),
    ("item not an object", {"items": ["a.pdf"]}, "invalid_request"),
    ("unknown item field", {"items": [{"source_key": "a", "bytes": 3}]}, "invalid_request"),
    ("missing source_key", {"items": [{"etag": "x"}]}, "invalid_request"),
    ("source_key not a string", {"items": [{"source_key": 42}]}, "invalid_request"),
    ("etag not a string", {"items": [{"source_key": "a", "etag": True}]}, "invalid_request"),
    (
        "bad content type",
        {"items": [{"source_key": "a", "content_type": "pdf"}]},
        "invalid_request",
    ),
    ("dot dot", {"items": [{"source_key": "a/../../etc/passwd"}]}, "invalid_key"),
    ("NUL byte", {"items": [{"source_key": "a\u0000b.pdf"}]}, "invalid_key"),
    ("absolute path", {"items": [{"source_key": "/etc/passwd"}]}, "invalid_key"),
    ("windows drive", {"items": [{"source_key": "C:\\x"}]}, "invalid_key"),
    ("empty key", {"items": [{"source_key": ""}]}, "invalid_key"),
    ("key too long", {"items": [{"source_key": "k" * 1025}]}, "invalid_key"),
    ("bad group", {"items": [{"source_key": "a", "group_id": "a b"}]}, "invalid_group_id"),
    ("empty group", {"items": [{"source_key": "a", "group_id": ""}]}, "invalid_group_id"),
    ("long group", {"items": [{"source_key": "a", "group_id": "g" * 201}]}, "invalid_group_id"),
    ("group not a string", {"items": [{"source_key": "a", "group_id": 7}]}, "invalid_group_id"),
]


def test_a_bad_enqueue_is_refused_with_400_and_writes_nothing(
    client: FlaskClient, conn: db.Conn
) -> None:
    wrong = []
    for case, body, code in BAD_ENQUEUES:
        # Valid items come first: a refusal must not have written them.
        items = body.get("items") if isinstance(body, dict) else None
        if isinstance(items, list) and 0 < len(items) < 5:
            body = {**body, "items": [{"source_key": "good/one.pdf", "etag": "1"}, *items]}
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = client.post(
            "/api/thumbnails/enqueue",
            data=data,
            headers={**ADMIN, "Content-Type": "application/json"},
        )
        try:
            assert_error(resp, 400, code)
        except AssertionError as exc:
            wrong.append(f"{case}: {exc}")
    assert not wrong, "\n".join(wrong)
    assert job_count(conn) == 0


BAD_OTHERS: list[tuple[str, str, Any, int, str]] = [
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": -5}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": 999}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": 10**12}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": 8001}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": "5000"}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": True}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget_ms": 5000.5}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"max_items": 0}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"max_items": 10**6}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", {"budget": 5000}, 400, "invalid_request"),
    ("/api/thumbnails/batch-generate", "POST", b"[1,2", 400, "invalid_json"),
    ("/api/thumbnails/backfill", "POST", {"prefix": "../"}, 400, "invalid_key"),
    ("/api/thumbnails/backfill", "POST", {"prefix": "/abs"}, 400, "invalid_key"),
    ("/api/thumbnails/backfill", "POST", {"prefix": 3}, 400, "invalid_request"),
    ("/api/thumbnails/backfill", "POST", {}, 400, "invalid_request"),
    (
        "/api/thumbnails/backfill",
        "POST",
        {"prefix": "", "group_id": "x y"},
        400,
        "invalid_group_id",
    ),
    ("/api/thumbnails/retry-failed", "POST", {}, 400, "invalid_request"),
    ("/api/thumbnails/retry-failed", "POST", {"group_id": ["g"]}, 400, "invalid_group_id"),
    ("/api/thumbnails/cancel", "POST", {"group_id": "g", "all": True}, 400, "invalid_request"),
    ("/api/thumbnails/cancel", "POST", {"group_id": "a\u0000"}, 400, "invalid_group_id"),
    ("/api/thumbnails/cleanup-stale", "POST", {"force": True}, 400, "invalid_request"),
    ("/api/thumbnails/progress", "GET", None, 400, "invalid_group_id"),
    ("/api/thumbnails/progress?group_id=", "GET", None, 400, "invalid_group_id"),
    ("/api/thumbnails/progress?group_id=a&group_id=b", "GET", None, 400, "invalid_group_id"),
    ("/api/thumbnails/progress?group_id=%00", "GET", None, 400, "invalid_group_id"),
    ("/api/thumbnails/progress?group_id=nope", "GET", None, 404, "group_not_found"),
    ("/api/nothing-here", "GET", None, 404, "not_found"),
    ("/api/thumbnails/enqueue", "GET", None, 405, "method_not_allowed"),
    ("/api/thumbnails/progress", "POST", {}, 405, "method_not_allowed"),
    ("/api/thumbnails/enqueue", "POST", b"x" * (3 * 1024 * 1024), 413, "payload_too_large"),
]


def test_bad_requests_get_the_right_4xx_never_a_500(client: FlaskClient, conn: db.Conn) -> None:
    enqueue(conn, 1, "g")
    wrong = []
    for path, method, body, status, code in BAD_OTHERS:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        resp = client.open(path, method=method, data=data, headers=ADMIN)
        try:
            assert_error(resp, status, code)
            assert status != 405 or resp.headers["Allow"]
        except (AssertionError, KeyError) as exc:
            wrong.append(f"{method} {path} {body!r:.60}: {exc}")
    assert not wrong, "\n".join(wrong)
    assert job_count(conn) == 1


def test_a_wrong_method_answers_405_with_allow(client: FlaskClient) -> None:
    resp = client.delete("/api/thumbnails/jobs/1", headers=ADMIN)
    assert_error(resp, 405, "method_not_allowed")
    assert "GET" in resp.headers["Allow"]


def test_a_body_over_the_limit_is_refused_even_without_content_length(app: Flask) -> None:
    port, stop = serve(app)
    try:
        conn = socket.create_connection(("127.0.0.1", port))
        conn.sendall(
            b"POST /api/thumbnails/enqueue HTTP/1.1\r\nHost: x\r\n"
            + f"Authorization: Bearer {SECRET}\r\n".encode()
            + b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n"
        )
        chunk = b"x" * (512 * 1024)
        with_status = b""
        try:
            for _ in range(6):
                conn.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            conn.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server may answer and close before the whole body is sent
        conn.settimeout(5)
        while b"\r\n" not in with_status:
            part = conn.recv(4096)
            if not part:
                break
            with_status += part
        conn.close()
        assert with_status.split(b"\r\n")[0].split(b" ")[1] == b"413"
    finally:
        stop()


# -- auth ------------------------------------------------------------------------------------------

ADMIN_ROUTES = [
    ("POST", "/api/thumbnails/batch-generate"),
    ("POST", "/api/thumbnails/enqueue"),
    ("POST", "/api/thumbnails/backfill"),
    ("POST", "/api/thumbnails/retry-failed"),
    ("POST", "/api/thumbnails/cancel"),
    ("POST", "/api/thumbnails/cleanup-stale"),
    ("GET", "/api/thumbnails/jobs/1"),
    ("GET", "/api/queues"),
    ("GET", "/api/thumbnails/progress?group_id=g"),
]


def test_missing_or_wrong_credentials_get_401_with_a_bearer_challenge(
    client: FlaskClient, conn: db.Conn
) -> None:
    enqueue(conn, 1, "g")
    cases: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {SECRET}x"},
        {"Authorization": f"Bearer {SECRET[:-1]}"},
        {"Authorization": f"Basic {SECRET}"},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer " + "x" * 10_000},
    ]
    for method, path in ADMIN_ROUTES:
        for headers in cases:
            body = {"items": [{"source_key": "a"}]}
            resp = client.open(path, method=method, json=body, headers=headers)
            assert_error(resp, 401, "unauthorized")
            assert resp.headers["WWW-Authenticate"].startswith("Bearer"), (path, headers)
    assert job_count(conn) == 1


def test_admin_routes_fail_closed_without_a_configured_secret(config: Config) -> None:
    app = create_app(config.with_(cron_secret=None, jwt_secret=None))
    client = app.test_client()
    for method, path in ADMIN_ROUTES:
        for headers in ({}, {"Authorization": "Bearer "}, {"Authorization": "Bearer anything"}):
            resp = client.open(path, method=method, json={}, headers=headers)
            assert_error(resp, 503, "not_configured")
    app.extensions["thumbq"].close()


def test_vercel_cron_calls_with_get_and_its_cron_secret(db_url: str, tmp_path: Path) -> None:
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "CRON_SECRET": "from-vercel",
        }
    )
    app = create_app(config)
    client = app.test_client()
    cron = bearer("from-vercel")
    resp = client.get("/api/thumbnails/batch-generate", headers=cron)
    assert resp.status_code == 200 and resp.get_json()["stopped_reason"] == "drained"
    resp = client.get("/api/thumbnails/batch-generate?budget_ms=3000&max_items=2", headers=cron)
    assert resp.status_code == 200 and resp.get_json()["budget_ms"] == 3000
    assert client.get("/api/thumbnails/cleanup-stale", headers=cron).get_json() == {
        "reset_count": 0,
        "pruned": {"jobs": 0, "batch_runs": 0, "archived": 0},
        "temp_files_removed": 0,
    }
    for query, code in (
        ("budget_ms=abc", "invalid_request"),
        ("budget_ms=1", "invalid_request"),
        ("budget_ms=3000&budget_ms=4000", "invalid_request"),
        ("force=1", "invalid_request"),
    ):
        assert_error(client.get(f"/api/thumbnails/batch-generate?{query}", headers=cron), 400, code)
    assert_error(client.get("/api/thumbnails/batch-generate", headers=ADMIN), 401, "unauthorized")
    app.extensions["thumbq"].close()


def test_secret_comparison_handles_any_length_and_content() -> None:
    assert secret_matches("abc", "abc")
    assert not secret_matches("abc", "abcd")
    assert not secret_matches("", "abc")
    assert not secret_matches("\udcff", "abc")  # unpaired surrogates do not raise


def test_bad_jwts_get_401(client: FlaskClient, conn: db.Conn) -> None:
    enqueue(conn, 1, "g")
    conn.execute("insert into thumbq.group_members values ('g', 'alice')")
    url = "/api/thumbnails/progress?group_id=g"
    assert client.get(url, headers=bearer(user_token("alice"))).status_code == 200
    unsigned = unsigned_jwt({"sub": "alice", "aud": "authenticated", "exp": time.time() + 60})
    bad = {
        "another secret": user_token("alice", secret="not-the-secret-not-the-secret-123"),
        "alg none": unsigned,
        "expired": user_token("alice", exp=int(time.time()) - 10),
        "wrong audience": user_token("alice", aud="anon"),
        "no exp": user_token("alice", exp=None),
        # RFC 7519 dates are numbers; PyJWT alone would take these strings.
        "string exp": user_token("alice", exp=str(int(time.time()) + 600)),
        "string nbf": user_token("alice", nbf=str(int(time.time()) - 600)),
        "boolean iat": user_token("alice", iat=True),
        "no sub": user_token(None),  # type: ignore[arg-type]
        "garbage": "a.b.c",
        "HS512": jwt.encode(
            {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60},
            JWT_SECRET,
            "HS512",
        ),
    }
    messages = {}
    for name, token in bad.items():
        resp = client.get(url, headers=bearer(token))
        messages[name] = assert_error(resp, 401, "unauthorized")["message"]
        assert 'error="invalid_token"' in resp.headers["WWW-Authenticate"], name
    assert "expired" in messages["expired"] and "audience" in messages["wrong audience"]
    assert "`exp`" in messages["string exp"] and "`nbf`" in messages["string nbf"]
    # A user token is never an admin token.
    assert_error(
        client.post("/api/thumbnails/cleanup-stale", headers=bearer(user_token("alice"))),
        401,
        "unauthorized",
    )


def test_rls_lets_a_user_read_only_the_groups_they_belong_to(
    client: FlaskClient, conn: db.Conn
) -> None:
    enqueue(conn, 2, "alices-group", "a")
    enqueue(conn, 3, "bobs-group", "b")
    conn.execute(
        "insert into thumbq.group_members values ('alices-group', 'alice'), ('bobs-group', 'bob')"
    )
    alice, bob = bearer(user_token("alice")), bearer(user_token("bob"))
    url = "/api/thumbnails/progress?group_id="
    mine = client.get(url + "alices-group", headers=alice)
    assert mine.status_code == 200 and mine.get_json()["total"] == 2
    assert client.get(url + "bobs-group", headers=bob).get_json()["total"] == 3
    # The other's group looks exactly like one that does not exist.
    hidden = client.get(url + "bobs-group", headers=alice)
    missing = client.get(url + "no-such-group", headers=alice)
    assert_error(hidden, 404, "group_not_found")
    assert hidden.get_json()["error"]["message"].replace("bobs-group", "X") == missing.get_json()[
        "error"
    ]["message"].replace("no-such-group", "X")
    assert_error(client.get(url + "alices-group", headers=bob), 404, "group_not_found")
    # The role and claims were local to the request's transaction: the pooled connection is clean.
    assert client.get(url + "bobs-group", headers=ADMIN).status_code == 200
    st = client.application.extensions["thumbq"]
    with st.connection() as c:
        row = c.execute(
            "select current_user as u, current_setting('request.jwt.claims', true) as claims"
        ).fetchone()
    assert row is not None and row["u"] != "authenticated" and not row["claims"]


# -- the progress cache ---------------------------------------------------------------------------


def alices_group(conn: db.Conn) -> None:
    """Two jobs in group `alices-group`, of which user `alice` is a member."""
    enqueue(conn, 2, "alices-group", "a")
    conn.execute("insert into thumbq.group_members values ('alices-group', 'alice')")


def cached_client(api_config: Config, ttl_ms: int) -> tuple[Flask, FlaskClient]:
    app = create_app(api_config.with_(progress_cache_ms=ttl_ms), db_timeout_s=2.0)
    return app, app.test_client()


def test_pollers_of_one_group_share_a_read_that_is_never_older_than_the_cache_interval(
    api_config: Config, conn: db.Conn
) -> None:
    enqueue(conn, 4, "g")
    app, client = cached_client(api_config, 1_000)
    try:
        url = "/api/thumbnails/progress?group_id=g"
        first = client.get(url, headers=ADMIN)
        assert first.get_json()["completed"] == 0
        # Another process (a batch elsewhere) completes two jobs.
        q = Queue(conn)
        jobs = q.claim("w", 2, 60).jobs
        q.complete("w", [{"job_id": j.id, "msg_id": j.msg_id} for j in jobs])
        # Inside the interval pollers get the shared answer...
        soon = client.get(url, headers={**ADMIN, "If-None-Match": first.headers["ETag"]})
        assert soon.status_code == 304
        # ...and once it is over, the change.
        time.sleep(1.05)
        later = client.get(url, headers={**ADMIN, "If-None-Match": first.headers["ETag"]})
        assert later.status_code == 200 and later.get_json()["completed"] == 2
        assert later.headers["ETag"] != first.headers["ETag"]
    finally:
        app.extensions["thumbq"].close()


def test_a_change_made_through_the_app_shows_at_once_despite_the_cache(
    api_config: Config, conn: db.Conn
) -> None:
    enqueue(conn, 3, "g")
    app, client = cached_client(api_config, 60_000)
    try:
        url = "/api/thumbnails/progress?group_id=g"
        assert client.get(url, headers=ADMIN).get_json()["pending"] == 3
        cancel = client.post("/api/thumbnails/cancel", json={"group_id": "g"}, headers=ADMIN)
        assert cancel.status_code == 200
        assert client.get(url, headers=ADMIN).get_json()["cancelled"] == 3
        assert client.get(url.replace("=g", "=new"), headers=ADMIN).status_code == 404
        items = [{"source_key": "n/1.pdf", "etag": "1", "group_id": "new"}]
        added = client.post("/api/thumbnails/enqueue", json={"items": items}, headers=ADMIN)
        assert added.status_code == 202
        assert client.get(url.replace("=g", "=new"), headers=ADMIN).get_json()["total"] == 1
    finally:
        app.extensions["thumbq"].close()


def test_the_cache_never_shows_one_users_group_to_another(
    api_config: Config, conn: db.Conn
) -> None:
    alices_group(conn)
    app, client = cached_client(api_config, 60_000)
    try:
        url = "/api/thumbnails/progress?group_id=alices-group"
        alice = bearer(user_token("alice"))
        assert client.get(url, headers=alice).get_json()["total"] == 2
        # Same group, moments later, from a cache that holds Alice's answer:
        assert_error(client.get(url, headers=bearer(user_token("bob"))), 404, "group_not_found")
        forged = bearer(user_token("alice", secret="x" * 64))
        assert_error(client.get(url, headers=forged), 401, "unauthorized")
        assert client.get(url, headers=ADMIN).get_json()["total"] == 2
    finally:
        app.extensions["thumbq"].close()


def test_polls_answered_from_memory_are_the_routes_answers_byte_for_byte(
    api_config: Config, conn: db.Conn
) -> None:
    enqueue(conn, 5, "g")
    url = "/api/thumbnails/progress?group_id=g"
    plain, plain_client = cached_client(api_config, 0)
    app, client = cached_client(api_config, 60_000)
    reached_flask: list[str] = []
    app.before_request(lambda: reached_flask.append(request_path()))
    try:
        want = plain_client.get(url, headers=ADMIN)
        want_304 = plain_client.get(url, headers={**ADMIN, "If-None-Match": want.headers["ETag"]})
        assert want.status_code == 200 and want_304.status_code == 304
        for _ in range(3):
            got = client.get(url, headers=ADMIN)
            assert (got.status, list(got.headers), got.data) == (
                want.status,
                list(want.headers),
                want.data,
            )
            weak = {**ADMIN, "If-None-Match": "W/" + want.headers["ETag"] + ', "other"'}
            got_304 = client.get(url, headers=weak)
            assert (got_304.status, list(got_304.headers), got_304.data) == (
                want_304.status,
                list(want_304.headers),
                b"",
            )
        # Only the first poll reached Flask (and the database); the rest came from memory.
        assert reached_flask == ["/api/thumbnails/progress"]
        # Whatever the fast path does not handle goes to the route, which answers as ever.
        assert_error(client.get(url, headers=bearer("wrong")), 401, "unauthorized")
        assert_error(client.get(url + "&group_id=h", headers=ADMIN), 400, "invalid_group_id")
        assert client.get(url.replace("=g", "=%67"), headers=ADMIN).get_json()["total"] == 5
        assert client.head(url, headers=ADMIN).status_code == 200
    finally:
        plain.extensions["thumbq"].close()
        app.extensions["thumbq"].close()


def request_path() -> str:
    from flask import request

    return request.path


def test_a_users_polls_come_from_memory_until_the_token_expires(
    api_config: Config, conn: db.Conn
) -> None:
    alices_group(conn)
    app, client = cached_client(api_config, 60_000)
    reached_flask: list[str] = []
    app.before_request(lambda: reached_flask.append(request_path()))
    try:
        url = "/api/thumbnails/progress?group_id=alices-group"
        token = user_token("alice", exp=int(time.time()) + 2)
        first = client.get(url, headers=bearer(token))
        assert first.status_code == 200 and first.get_json()["total"] == 2
        again = {**bearer(token), "If-None-Match": first.headers["ETag"]}
        for _ in range(3):
            assert client.get(url, headers=again).status_code == 304
        assert len(reached_flask) == 1  # verified once, read once, then answered from memory
        # Alice's answer is still cached, but her token is not valid any more.
        time.sleep(
            max(0.0, jwt.decode(token, options={"verify_signature": False})["exp"] - time.time())
            + 0.1
        )
        expired = client.get(url, headers=again)
        assert "expired" in assert_error(expired, 401, "unauthorized")["message"]
        # A new token for her reads through RLS once, then comes from memory again.
        fresh = bearer(user_token("alice"))
        assert client.get(url, headers=fresh).get_json()["total"] == 2
        assert client.get(url, headers=fresh).get_json()["total"] == 2
        assert len(reached_flask) == 3
    finally:
        app.extensions["thumbq"].close()


def test_access_decided_by_rls_is_trusted_for_the_access_interval_only(
    api_config: Config, conn: db.Conn
) -> None:
    enqueue(conn, 2, "team", "t")
    conn.execute("insert into thumbq.group_members values ('team', 'alice')")
    config = api_config.with_(progress_cache_ms=300, access_cache_ms=1_000)
    app = create_app(config, db_timeout_s=2.0)
    client = app.test_client()
    try:
        url = "/api/thumbnails/progress?group_id=team"
        alice, bob = bearer(user_token("alice")), bearer(user_token("bob"))
        assert client.get(url, headers=alice).status_code == 200
        assert_error(client.get(url, headers=bob), 404, "group_not_found")
        conn.execute("delete from thumbq.group_members where user_id = 'alice'")
        conn.execute("insert into thumbq.group_members values ('team', 'bob')")
        started = time.monotonic()
        # Within the access interval Alice still sees the counts RLS let her see a moment ago.
        assert client.get(url, headers=alice).status_code == 200
        assert time.monotonic() - started < 0.3
        # A "may not" lasts no longer than an answer: Bob, just added, sees the group soon...
        time.sleep(0.35)
        assert client.get(url, headers=bob).get_json()["total"] == 2
        # ...and once the access interval is over, RLS is asked again and Alice is out.
        time.sleep(max(0.0, 1.05 - (time.monotonic() - started)))
        assert_error(client.get(url, headers=alice), 404, "group_not_found")
    finally:
        app.extensions["thumbq"].close()


def test_a_burst_of_pollers_missing_the_cache_sends_one_query() -> None:
    from api.cache import TimedCache

    cache = TimedCache(ttl_s=5.0)
    loads: list[float] = []
    start = threading.Barrier(20)

    def load() -> dict[str, Any]:
        loads.append(time.monotonic())
        time.sleep(0.1)  # a slow query: every other poller arrives while it runs
        return {"total": 1}

    def poll() -> None:
        start.wait()
        assert cache.get(("g", None), load) == {"total": 1}

    threads = [threading.Thread(target=poll) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(loads) == 1

    def broken() -> dict[str, Any]:
        raise OSError("database gone")

    with pytest.raises(OSError):
        cache.get(("h", None), broken)
    # A failed read is not remembered: the next poller asks again (and gets the answer).
    assert cache.get(("h", None), lambda: {"total": 2}) == {"total": 2}


# -- outages --------------------------------------------------------------------------------------


def test_an_unreachable_database_answers_503_with_retry_after(tmp_path: Path) -> None:
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path),
            "DATABASE_URL": f"postgresql://postgres@127.0.0.1:{free_port()}/postgres",
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CRON_SECRET": SECRET,
        }
    )
    for pooled in (True, False):
        app = create_app(config, db_timeout_s=0.5, pooled=pooled)
        client = app.test_client()
        requests = [
            ("GET", "/api/thumbnails/progress?group_id=g", None),
            ("POST", "/api/thumbnails/enqueue", {"items": [{"source_key": "a", "etag": "1"}]}),
            ("POST", "/api/thumbnails/batch-generate", {"budget_ms": 2000}),
            ("POST", "/api/thumbnails/cancel", {"group_id": "g"}),
            ("GET", "/api/queues", None),
            ("GET", "/healthz", None),
        ]
        for method, path, body in requests:
            started = time.monotonic()
            resp = client.open(path, method=method, json=body, headers=ADMIN)
            assert_error(resp, 503, "database_unavailable")
            assert resp.headers["Retry-After"] == "5"
            assert time.monotonic() - started < 3
        app.extensions["thumbq"].close()


def test_a_database_without_the_schema_answers_503_schema_missing(
    empty_db_url: str, tmp_path: Path
) -> None:
    config = Config.from_env(
        {"THUMBQ_HOME": str(tmp_path), "DATABASE_URL": empty_db_url, "THUMBQ_CRON_SECRET": SECRET}
    )
    app = create_app(config)
    resp = app.test_client().get("/api/thumbnails/progress?group_id=g", headers=ADMIN)
    assert_error(resp, 503, "schema_missing")
    app.extensions["thumbq"].close()


# -- real HTTP ------------------------------------------------------------------------------------


def serve(app: Flask) -> tuple[int, Any]:
    """Serve `app` with waitress on a free loopback port; returns (port, stop)."""
    from waitress.server import create_server

    server: Any = create_server(app, host="127.0.0.1", port=0, threads=4)
    port = int(server.effective_port)
    stopped = threading.Event()

    def loop() -> None:
        # waitress's run() has no stop; a loop of short polls ends cleanly when asked.
        while not stopped.is_set():
            server.asyncore.loop(timeout=0.05, map=server._map, count=1)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join(5)
        server.task_dispatcher.shutdown()
        server.close()

    return port, stop


def http(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def test_the_api_over_real_http_with_waitress(app: Flask, conn: db.Conn) -> None:
    port, stop = serve(app)
    try:
        status, _, body = http(
            port,
            "POST",
            "/api/thumbnails/enqueue",
            {
                "items": [
                    {"source_key": f"x/{i}.pdf", "etag": "1", "group_id": "web"} for i in range(5)
                ]
            },
            ADMIN,
        )
        assert status == 202 and json.loads(body)["enqueued"] == 5
        status, headers, body = http(
            port, "GET", "/api/thumbnails/progress?group_id=web", headers=ADMIN
        )
        assert status == 200 and json.loads(body)["total"] == 5
        etag = headers["ETag"]
        status, headers, body = http(
            port,
            "GET",
            "/api/thumbnails/progress?group_id=web",
            headers={**ADMIN, "If-None-Match": etag},
        )
        assert status == 304 and body == b"" and headers["ETag"] == etag
        status, headers, body = http(port, "GET", "/api/queues")
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert json.loads(body)["error"]["code"] == "unauthorized"
        status, headers, body = http(port, "PUT", "/healthz")
        assert status == 405 and "GET" in headers["Allow"]
        status, _, body = http(port, "GET", "/api/openapi.json")
        assert status == 200 and json.loads(body)["openapi"] == "3.1.0"
    finally:
        stop()


def test_the_progress_path_imports_neither_pymupdf_nor_boto3(db_url: str, tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "from api.index import app\n"
        "r = app.test_client().get('/api/thumbnails/progress?group_id=g',"
        " headers={'Authorization': 'Bearer t'})\n"
        "print(json.dumps({'status': r.status_code,"
        " 'heavy': sorted(m for m in ('pymupdf', 'fitz', 'boto3', 'botocore', 'PIL')"
        " if m in sys.modules)}))\n"
    )
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "THUMBQ_HOME": str(tmp_path),
        "THUMBQ_CRON_SECRET": "t",
        "THUMBQ_STORAGE_URL": "s3://bucket/prefix",
    }
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"status": 404, "heavy": []}


def _responses(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Read `n` HTTP/1.1 responses (with Content-Length or none) from `sock`."""
    buf = b""
    out = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"the server closed the connection after {len(out)}")
            buf += chunk
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        while len(buf) < length:
            buf += sock.recv(65536)
        out.append((int(lines[0].split()[1]), headers, buf[:length]))
        buf = buf[length:]
    return out


def test_thumbq_serve_keeps_a_polling_client_on_one_connection(
    tmp_path: Path, db_url: str, conn: db.Conn
) -> None:
    enqueue(conn, 3, "web")
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "THUMBQ_HOME": str(tmp_path / "home"),
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_CRON_SECRET": SECRET,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.1)
        with sock:
            get = (
                f"GET /api/thumbnails/progress?group_id=web HTTP/1.1\r\nHost: x\r\n"
                f"Authorization: Bearer {SECRET}\r\n"
            )
            sock.sendall(get.encode() + b"\r\n")
            [(status, headers, body)] = _responses(sock, 1)
            assert status == 200 and json.loads(body)["total"] == 3
            etag = headers["etag"]
            # A browser's polls: each 304 leaves the connection open for the next one.
            for _ in range(5):
                sock.sendall(get.encode() + f"If-None-Match: {etag}\r\n\r\n".encode())
                [(status, headers, body)] = _responses(sock, 1)
                assert status == 304 and body == b"" and headers["etag"] == etag
                assert headers.get("connection", "").lower() != "close"
            sock.sendall(get.replace("web", "nope").encode() + b"\r\n")
            [(status, _, body)] = _responses(sock, 1)
            assert status == 404 and json.loads(body)["error"]["code"] == "group_not_found"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "granian" in err and "Traceback" not in err


# -- a transaction-mode pooler in front ----------------------------------------------------------


@pytest.fixture
def pgbouncer_url(db_url: str, pg_server_url: str) -> Iterator[str]:
    """Debian's pgbouncer in transaction mode in front of the test database."""
    reason = pgbouncer.unusable(pg_server_url)
    require(reason is None, str(reason))
    with pgbouncer.pgbouncer(pg_server_url) as bouncer:
        yield pgbouncer.via(bouncer, db_url)


def test_batch_and_progress_work_through_pgbouncer_in_transaction_mode(
    pgbouncer_url: str, api_config: Config, conn: db.Conn
) -> None:
    from bench.corpus import small_png
    from worker.storage import open_storage

    config = api_config.with_(database_url=pgbouncer_url)
    storage = open_storage(config)
    for i in range(3):
        storage.put(f"pgb/{i}.png", small_png(), "image/png")
    app = create_app(config, pool_size=3)
    client = app.test_client()
    try:
        body = {"items": [{"source_key": f"pgb/{i}.png", "group_id": "pgb"} for i in range(3)]}
        assert client.post("/api/thumbnails/enqueue", json=body, headers=ADMIN).status_code == 202
        alice = bearer(user_token("alice"))
        conn.execute("insert into thumbq.group_members values ('pgb', 'alice')")
        # Many requests on few server connections: prepared statements or session state would
        # break here (psycopg's would collide after a few executions).
        for _ in range(20):
            assert (
                client.get("/api/thumbnails/progress?group_id=pgb", headers=ADMIN).status_code
                == 200
            )
            resp = client.get("/api/thumbnails/progress?group_id=pgb", headers=alice)
            assert resp.status_code == 200 and resp.get_json()["total"] == 3
        resp = client.post(
            "/api/thumbnails/batch-generate", json={"budget_ms": 6000}, headers=ADMIN
        )
        assert resp.status_code == 200, resp.get_data(as_text=True)
        assert resp.get_json()["succeeded"] == 3
        p = client.get("/api/thumbnails/progress?group_id=pgb", headers=alice).get_json()
        assert p["completed"] == 3 and p["progress_percentage"] == 100.0
    finally:
        app.extensions["thumbq"].close()
