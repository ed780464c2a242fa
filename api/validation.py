"""Request validation for the HTTP layer: the body as JSON, the query string and path ids.

What a field may contain is decided in `worker.app.validation`, shared with the CLI (so that
`thumbq run-batch --budget-ms -5` is refused as the API refuses `{"budget_ms": -5}`); its
`ValidationError` is answered with 400 and its code (api/errors.py). The request body is at most
2 MiB (the largest valid enqueue, 1 000 items with 1 024-byte keys, fits).
"""

from __future__ import annotations

import json
from typing import Any

from flask import request

from api.errors import ApiError, bad_request
from worker.app.validation import (
    GROUP_ID_RE,
    MAX_CONTENT_TYPE_LENGTH,
    MAX_ETAG_LENGTH,
    MAX_ITEMS,
    MAX_KEY_LENGTH,
    MAX_PAYLOAD_DEPTH,
    MAX_SEQUENCE,
    MIN_BUDGET_MS,
    MIN_WAIT_MS,
    ValidationError,
    batch_options,
    check_fields,
    enqueue_items,
    group_id,
    int_in_range,
    job_request,
    key_prefix,
    object_key,
    typed,
)

__all__ = [
    "GROUP_ID_RE",
    "MAX_BODY_BYTES",
    "MAX_CONTENT_TYPE_LENGTH",
    "MAX_ETAG_LENGTH",
    "MAX_ITEMS",
    "MAX_JOB_ID",
    "MAX_KEY_LENGTH",
    "MAX_PAYLOAD_DEPTH",
    "MAX_SEQUENCE",
    "MIN_BUDGET_MS",
    "MIN_WAIT_MS",
    "ValidationError",
    "batch_options",
    "check_fields",
    "enqueue_items",
    "group_id",
    "int_in_range",
    "job_id",
    "job_request",
    "json_body",
    "key_prefix",
    "object_key",
    "query_group_id",
    "query_ints",
    "typed",
]

MAX_BODY_BYTES = 2 * 1024 * 1024
MAX_JOB_ID = 2**63 - 1


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def json_body(*, optional: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; an empty body is `{}` when `optional`."""
    raw = request.get_data(cache=True)  # werkzeug raises 413 past MAX_CONTENT_LENGTH
    if not raw.strip():
        if optional:
            return {}
        raise bad_request("the request body must be a JSON object", "invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad_request("the request body is not UTF-8", "invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", "invalid_json")
    return body


def query_ints() -> dict[str, Any]:
    """The query string as {name: int}; each parameter given once, as a decimal integer."""
    out: dict[str, Any] = {}
    for name in request.args:
        values = request.args.getlist(name)
        if len(values) > 1:
            raise bad_request(f"give the {name} query parameter once")
        raw = values[0]
        if not raw.isascii() or not raw.lstrip("-").isdigit() or len(raw) > 20:
            raise bad_request(f"{name} must be an integer, got {raw[:40]!r}")
        out[name] = int(raw)
    return out


def query_group_id() -> str:
    """The `group_id` query parameter, given exactly once."""
    values = request.args.getlist("group_id")
    if not values:
        raise bad_request("the group_id query parameter is required", "invalid_group_id")
    if len(values) > 1:
        raise bad_request("give the group_id query parameter once", "invalid_group_id")
    return group_id(values[0])


def job_id(raw: str) -> int:
    """A job id from the path: a positive 64-bit integer."""
    if not raw.isascii() or not raw.isdigit() or len(raw) > 19 or not 1 <= int(raw) <= MAX_JOB_ID:
        raise ApiError(400, "invalid_job_id", "a job id is a positive integer")
    return int(raw)
