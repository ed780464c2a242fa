"""Request validation: everything is checked before the first write, and each refusal says which
field is wrong and why.

Limits (also in the OpenAPI description):
- request body: at most 2 MiB (the largest valid enqueue, 1 000 items with 1 024-byte keys, fits);
- `items`: 1 to 1 000 per enqueue (one SQL statement, so all or nothing);
- keys: 1 to 1 024 UTF-8 bytes, relative, no NUL or control characters, no `.`/`..` segments;
- group ids: 1 to 200 characters of letters, digits and `_ . : @ / + = -`;
- `etag`: at most 200 characters; `content_type`: `type/subtype[; params]`, at most 255;
- `budget_ms`: 1 000 up to the configured THUMBQ_BUDGET_MS (the platform's timeout is sized on
  it, so a caller may shorten an invocation but never lengthen it);
- `max_items`: 1 up to THUMBQ_BATCH_SIZE.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from flask import request

from api.errors import ApiError, bad_request
from worker.errors import InvalidKey, validate_key

MAX_BODY_BYTES = 2 * 1024 * 1024
MAX_ITEMS = 1000
MIN_BUDGET_MS = 1000
MAX_ETAG_LENGTH = 200
MAX_CONTENT_TYPE_LENGTH = 255
MAX_JOB_ID = 2**63 - 1

GROUP_ID_RE = re.compile(r"[A-Za-z0-9_.:@/+=-]{1,200}")
_CONTENT_TYPE_RE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+(\s*;[ -~]*)?")
_TYPE_NAMES = {str: "a string", int: "an integer", list: "an array", dict: "an object"}


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


def _encodable(text: str) -> bool:
    # A lone surrogate ("\ud800" in JSON) is a str in Python but cannot be sent to Postgres.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_fields(
    obj: Mapping[str, Any],
    *,
    required: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
    where: str = "body",
) -> None:
    """Refuse unknown and missing fields, naming them."""
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join(required + optional) or "none"
        raise bad_request(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {allowed}")
    missing = [f for f in required if f not in obj]
    if missing:
        raise bad_request(f"{where}: missing required field(s) {', '.join(missing)}")


def typed(value: Any, kind: type, where: str) -> Any:
    """`value` if it is of `kind` (a bool is not an integer), else 400."""
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        got = "null" if value is None else type(value).__name__
        raise bad_request(f"{where} must be {_TYPE_NAMES.get(kind, kind.__name__)}, got {got}")
    return value


def int_in_range(value: Any, where: str, lo: int, hi: int) -> int:
    """An integer within [lo, hi], else 400 naming the range."""
    typed(value, int, where)
    if not lo <= value <= hi:
        raise bad_request(f"{where} must be between {lo} and {hi}, got {value}")
    return int(value)


def group_id(value: Any, where: str = "group_id") -> str:
    """A valid group id, else 400 `invalid_group_id`."""
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise bad_request(f"{where} must be a string, got {got}", "invalid_group_id")
    if not GROUP_ID_RE.fullmatch(value):
        raise bad_request(
            f"{where} must be 1 to 200 characters of letters, digits and _ . : @ / + = -",
            "invalid_group_id",
        )
    return value


def object_key(value: Any, where: str) -> str:
    """A safe relative object key, else 400 `invalid_key`."""
    typed(value, str, where)
    try:
        return validate_key(value)
    except InvalidKey as exc:
        raise bad_request(f"{where}: {exc}", "invalid_key") from None


def key_prefix(value: Any, where: str = "prefix") -> str:
    """A listing prefix: empty (everything) or a safe key, possibly ending in `/`."""
    typed(value, str, where)
    if value:
        object_key(value.rstrip("/") or "/", where)
    return str(value)


def enqueue_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The validated items of an enqueue request, in the engine's shape."""
    check_fields(body, required=("items",))
    items = typed(body["items"], list, "items")
    if not items:
        raise bad_request("items must not be empty")
    if len(items) > MAX_ITEMS:
        raise bad_request(f"items has {len(items)} entries; at most {MAX_ITEMS} per request")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"items[{i}]"
        typed(item, dict, where)
        check_fields(
            item,
            required=("source_key",),
            optional=("etag", "content_type", "group_id"),
            where=where,
        )
        clean: dict[str, Any] = {
            "source_key": object_key(item["source_key"], f"{where}.source_key")
        }
        if item.get("etag") is not None:
            etag = typed(item["etag"], str, f"{where}.etag")
            if len(etag) > MAX_ETAG_LENGTH or "\x00" in etag or not _encodable(etag):
                raise bad_request(
                    f"{where}.etag must be at most {MAX_ETAG_LENGTH} characters of valid "
                    "Unicode without NUL"
                )
            clean["etag"] = etag
        if item.get("content_type") is not None:
            ctype = typed(item["content_type"], str, f"{where}.content_type")
            if len(ctype) > MAX_CONTENT_TYPE_LENGTH or not _CONTENT_TYPE_RE.fullmatch(ctype):
                raise bad_request(f"{where}.content_type must look like type/subtype")
            clean["content_type"] = ctype
        if item.get("group_id") is not None:
            clean["group_id"] = group_id(item["group_id"], f"{where}.group_id")
        out.append(clean)
    return out


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
