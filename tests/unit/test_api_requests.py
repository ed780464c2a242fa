"""What the HTTP API answers before it needs the database: a refused request says which field is
wrong (400 with its code), a missing credential gets a Bearer challenge (401), and neither waits
for, nor depends on, Postgres. The app here has a DATABASE_URL that nothing listens on; the
answers that do reach the database are tested in tests/db/test_api.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from api import create_app
from worker.engine.config import Config

SECRET = "unit-admin-secret-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {SECRET}"}
NOWHERE = "postgresql://nobody@127.0.0.1:1/nothing"


@pytest.fixture
def client(tmp_path: Path) -> Iterator[FlaskClient]:
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": NOWHERE,
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        }
    )
    app = create_app(config, db_timeout_s=1.0, pooled=False)
    with app.test_client() as c:
        yield c


def error_of(resp: Any, status: int) -> dict[str, str]:
    assert resp.status_code == status, resp.get_data(as_text=True)
    body = resp.get_json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}
    return dict(body["error"])


def post(client: FlaskClient, path: str, body: Any, headers: dict[str, str] = ADMIN) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, data=data, headers={**headers, "Content-Type": "application/json"})


@pytest.mark.parametrize(
    ("body", "code", "names"),
    [
        (b"{items: [", "invalid_json", ""),
        ({"items": [{"source_key": "a.pdf"}], "priority": 1}, "invalid_request", "priority"),
        ({"items": []}, "invalid_request", "items"),
        ({"items": [{"source_key": f"k{i}"} for i in range(1001)]}, "invalid_request", "1000"),
        ({"items": [{"source_key": "a.pdf", "bytes": 3}]}, "invalid_request", "bytes"),
        ({"items": [{"source_key": 42}]}, "invalid_request", "source_key"),
        (
            {"items": [{"source_key": "a", "content_type": "pdf"}]},
            "invalid_request",
            "content_type",
        ),
        ({"items": [{"source_key": "a/../../etc/passwd"}]}, "invalid_key", ".."),
        ({"items": [{"source_key": "/etc/passwd"}]}, "invalid_key", "relative"),
        ({"items": [{"source_key": "a", "group_id": "a b"}]}, "invalid_group_id", "group_id"),
    ],
)
def test_a_bad_enqueue_is_answered_400_naming_what_is_wrong_without_the_database(
    client: FlaskClient, body: Any, code: str, names: str
) -> None:
    error = error_of(post(client, "/api/thumbnails/enqueue", body), 400)
    assert error["code"] == code
    assert names in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "code", "names"),
    [
        ("/api/thumbnails/batch-generate", {"budget_ms": 999}, "invalid_request", "budget_ms"),
        ("/api/thumbnails/batch-generate", {"budget_ms": "5000"}, "invalid_request", "budget_ms"),
        ("/api/thumbnails/batch-generate", {"max_items": 0}, "invalid_request", "max_items"),
        ("/api/thumbnails/backfill", {"prefix": "../"}, "invalid_key", ".."),
        ("/api/thumbnails/backfill", {}, "invalid_request", "prefix"),
        ("/api/thumbnails/retry-failed", {"group_id": ["g"]}, "invalid_group_id", "group_id"),
        ("/api/thumbnails/cancel", {"group_id": "g", "all": True}, "invalid_request", "all"),
    ],
)
def test_the_admin_routes_refuse_bad_bodies_before_touching_the_database(
    client: FlaskClient, path: str, body: Any, code: str, names: str
) -> None:
    error = error_of(post(client, path, body), 400)
    assert error["code"] == code
    assert names in error["message"]


@pytest.mark.parametrize(
    "path",
    [
        "/api/thumbnails/enqueue",
        "/api/thumbnails/batch-generate",
        "/api/thumbnails/retry-failed",
        "/api/thumbnails/cancel",
    ],
)
@pytest.mark.parametrize("token", [None, "not-the-secret", SECRET + "x"])
def test_admin_routes_without_the_secret_get_a_bearer_challenge(
    client: FlaskClient, path: str, token: str | None
) -> None:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    resp = post(client, path, {"group_id": "g", "items": [{"source_key": "a.pdf"}]}, headers)
    assert error_of(resp, 401)["code"] == "unauthorized"
    assert resp.headers["WWW-Authenticate"].startswith('Bearer realm="thumbq"')


def test_a_wrong_method_answers_405_with_the_methods_allowed(client: FlaskClient) -> None:
    resp = client.get("/api/thumbnails/enqueue", headers=ADMIN)
    assert error_of(resp, 405)["code"] == "method_not_allowed"
    assert "POST" in resp.headers["Allow"]


def test_a_body_over_the_limit_is_answered_413(client: FlaskClient) -> None:
    resp = post(client, "/api/thumbnails/enqueue", b"x" * (3 * 1024 * 1024))
    assert error_of(resp, 413)["code"] == "payload_too_large"
