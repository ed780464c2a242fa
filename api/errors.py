"""Every error the API answers, as `{"error": {"code", "message"}}` with the right status.

Database outages become 503 with `Retry-After`, never 500: a scheduler or a frontend then waits
and tries again instead of alerting on a bug.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import psycopg
from flask import Response
from werkzeug.exceptions import HTTPException

from worker.app.validation import ValidationError
from worker.engine import jsonfmt
from worker.engine.errors import InvalidKey
from worker.engine.log import log_event
from worker.storage import StorageError

if TYPE_CHECKING:
    from flask import Flask

# Seconds a client should wait before trying again after a 503 caused by an outage.
RETRY_AFTER_S = 5

# The machine codes an answer's `error.code` may hold (the OpenAPI document lists them).
CODES = (
    "invalid_json",
    "invalid_request",
    "invalid_key",
    "invalid_group_id",
    "invalid_job_id",
    "unauthorized",
    "forbidden",
    "not_found",
    "group_not_found",
    "job_not_found",
    "method_not_allowed",
    "batch_in_progress",
    "sequence_conflict",
    "too_many_streams",
    "streams_disabled",
    "payload_too_large",
    "internal",
    "not_configured",
    "database_unavailable",
    "schema_missing",
    "storage_unavailable",
)

# Machine codes of werkzeug's own HTTP errors (routing, body size).
_HTTP_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
    415: "unsupported_media_type",
}


class ApiError(Exception):
    """An error answered as JSON: status, stable machine code, a sentence for a person."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.headers = dict(headers or {})


def bad_request(message: str, code: str = "invalid_request") -> ApiError:
    """A 400 for input the caller can fix."""
    return ApiError(400, code, message)


def unavailable(code: str, message: str) -> ApiError:
    """A 503 that tells the caller when to try again."""
    return ApiError(503, code, message, {"Retry-After": str(RETRY_AFTER_S)})


def json_response(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON response; datetimes as ISO 8601, numerics as numbers."""
    return Response(
        json_body(body), status=status, headers=dict(headers or {}), mimetype="application/json"
    )


def json_body(body: Any) -> bytes:
    """`body` as compact JSON bytes, as every response of the API writes it."""
    return jsonfmt.dumps(body).encode()


def error_response(err: ApiError) -> Response:
    """The JSON body and headers of `err`."""
    return json_response(
        {"error": {"code": err.code, "message": err.message}}, err.status, err.headers
    )


def _from_http(exc: HTTPException) -> Response:
    status = exc.code or 500
    headers = {
        k: v for k, v in exc.get_headers() if k.lower() not in ("content-type", "content-length")
    }
    message = exc.description or exc.name
    if status == 405:
        allowed = headers.get("Allow", "")
        message = f"method not allowed here; allowed: {allowed}" if allowed else message
    elif status == 413:
        message = "request body is too large"
    elif status == 404:
        message = "no such route"
    code = _HTTP_CODES.get(status, "http_error")
    return error_response(ApiError(status, code, message, headers))


_SCHEMA_MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.InvalidSchemaName,
)


def _database_error(exc: Exception) -> Response:
    if isinstance(exc, _SCHEMA_MISSING):
        log_event("api_error", code="schema_missing", error=str(exc).splitlines()[0])
        return error_response(
            ApiError(
                503, "schema_missing", "the database has no thumbq schema; run `thumbq db init`"
            )
        )
    # OperationalError covers refused connections, pool timeouts, admin shutdowns,
    # serialization failures: all pass if the caller tries again later.
    log_event("api_error", code="database_unavailable", error=str(exc).splitlines()[0][:300])
    return error_response(unavailable("database_unavailable", "the database is unreachable"))


def _storage_error(exc: Exception) -> Response:
    log_event("api_error", code="storage_unavailable", error=str(exc)[:300])
    return error_response(unavailable("storage_unavailable", "object storage is unreachable"))


def _invalid(exc: Exception) -> Response:
    assert isinstance(exc, ValidationError)
    return error_response(bad_request(exc.message, exc.code))


def _invalid_key(exc: Exception) -> Response:
    return error_response(bad_request(str(exc), "invalid_key"))


def _unexpected(exc: Exception) -> Response:
    log_event("api_error", code="internal", error=f"{type(exc).__name__}: {exc}"[:500])
    return error_response(ApiError(500, "internal", "internal error; see the server log"))


def register_error_handlers(app: Flask) -> None:
    """Answer every error of `app` in the one JSON shape."""
    app.register_error_handler(ApiError, error_response)
    app.register_error_handler(HTTPException, _from_http)
    app.register_error_handler(psycopg.OperationalError, _database_error)
    app.register_error_handler(psycopg.InterfaceError, _database_error)
    for missing in _SCHEMA_MISSING:
        app.register_error_handler(missing, _database_error)
    app.register_error_handler(StorageError, _storage_error)
    app.register_error_handler(InvalidKey, _invalid_key)
    app.register_error_handler(ValidationError, _invalid)
    app.register_error_handler(Exception, _unexpected)
