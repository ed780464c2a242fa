"""What a request may contain, checked in one place for the HTTP API and the CLI alike: every
refusal names the field (or option) that is wrong and why, before anything is written.

Limits (also in the OpenAPI description):
- `items`: 1 to 1 000 per enqueue request (one SQL statement, so all or nothing);
- keys: 1 to 1 024 UTF-8 bytes, relative, no NUL or control characters, no `.`/`..` segments;
- group ids: 1 to 200 characters of letters, digits and `_ . : @ / + = -`;
- `etag`: at most 200 characters; `content_type`: `type/subtype[; params]`, at most 255;
- `budget_ms`: 1 000 up to the configured THUMBQ_BUDGET_MS (the platform's timeout is sized on
  it, so a caller may shorten an invocation but never lengthen it);
- `max_items`: 1 up to THUMBQ_BATCH_SIZE.

The HTTP layer answers a `ValidationError` with 400 and its code; the CLI prints its message on
one line and exits 1. `where` names the field as the caller wrote it (`items[0].etag` for the
API, `--budget-ms` for the CLI).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from worker.errors import InvalidKey, validate_key

if TYPE_CHECKING:
    from worker.config import Config

MAX_ITEMS = 1000
MIN_BUDGET_MS = 1000
MAX_ETAG_LENGTH = 200
MAX_CONTENT_TYPE_LENGTH = 255

GROUP_ID_RE = re.compile(r"[A-Za-z0-9_.:@/+=-]{1,200}")
_CONTENT_TYPE_RE = re.compile(r"[A-Za-z0-9!#$&^_.+-]+/[A-Za-z0-9!#$&^_.+-]+(\s*;[ -~]*)?")
_TYPE_NAMES = {str: "a string", int: "an integer", list: "an array", dict: "an object"}


class ValidationError(ValueError):
    """Input the caller can fix: a stable machine `code` and a sentence naming the field."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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
        raise ValidationError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {allowed}")
    missing = [f for f in required if f not in obj]
    if missing:
        raise ValidationError(f"{where}: missing required field(s) {', '.join(missing)}")


def typed(value: Any, kind: type, where: str) -> Any:
    """`value` if it is of `kind` (a bool is not an integer), else refuse it."""
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        got = "null" if value is None else type(value).__name__
        raise ValidationError(f"{where} must be {_TYPE_NAMES.get(kind, kind.__name__)}, got {got}")
    return value


def int_in_range(value: Any, where: str, lo: int, hi: int) -> int:
    """An integer within [lo, hi], else refuse it naming the range."""
    typed(value, int, where)
    if not lo <= value <= hi:
        raise ValidationError(f"{where} must be between {lo} and {hi}, got {value}")
    return int(value)


def group_id(value: Any, where: str = "group_id") -> str:
    """A valid group id, else `invalid_group_id`."""
    if not isinstance(value, str):
        got = "null" if value is None else type(value).__name__
        raise ValidationError(f"{where} must be a string, got {got}", "invalid_group_id")
    if not GROUP_ID_RE.fullmatch(value):
        raise ValidationError(
            f"{where} must be 1 to 200 characters of letters, digits and _ . : @ / + = -",
            "invalid_group_id",
        )
    return value


def object_key(value: Any, where: str) -> str:
    """A safe relative object key, else `invalid_key`."""
    typed(value, str, where)
    try:
        return validate_key(value)
    except InvalidKey as exc:
        raise ValidationError(f"{where}: {exc}", "invalid_key") from None


def key_prefix(value: Any, where: str = "prefix") -> str:
    """A listing prefix: empty (everything) or a safe key, possibly ending in `/`."""
    typed(value, str, where)
    if value:
        object_key(value.rstrip("/") or "/", where)
    return str(value)


def etag(value: Any, where: str) -> str:
    """An object version as storage reports it."""
    text = typed(value, str, where)
    if len(text) > MAX_ETAG_LENGTH or "\x00" in text or not _encodable(text):
        raise ValidationError(
            f"{where} must be at most {MAX_ETAG_LENGTH} characters of valid Unicode without NUL"
        )
    return str(text)


def enqueue_item(item: Any, where: str) -> dict[str, Any]:
    """One item of an enqueue request, in the engine's shape."""
    typed(item, dict, where)
    check_fields(
        item,
        required=("source_key",),
        optional=("etag", "content_type", "group_id"),
        where=where,
    )
    clean: dict[str, Any] = {"source_key": object_key(item["source_key"], f"{where}.source_key")}
    if item.get("etag") is not None:
        clean["etag"] = etag(item["etag"], f"{where}.etag")
    if item.get("content_type") is not None:
        ctype = typed(item["content_type"], str, f"{where}.content_type")
        if len(ctype) > MAX_CONTENT_TYPE_LENGTH or not _CONTENT_TYPE_RE.fullmatch(ctype):
            raise ValidationError(f"{where}.content_type must look like type/subtype")
        clean["content_type"] = ctype
    if item.get("group_id") is not None:
        clean["group_id"] = group_id(item["group_id"], f"{where}.group_id")
    return clean


def enqueue_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The validated items of an enqueue request, in the engine's shape."""
    check_fields(body, required=("items",))
    items = typed(body["items"], list, "items")
    if not items:
        raise ValidationError("items must not be empty")
    if len(items) > MAX_ITEMS:
        raise ValidationError(f"items has {len(items)} entries; at most {MAX_ITEMS} per request")
    return [enqueue_item(item, f"items[{i}]") for i, item in enumerate(items)]


def batch_options(
    config: Config,
    budget_ms: Any = None,
    max_items: Any = None,
    *,
    where: tuple[str, str] = ("budget_ms", "max_items"),
) -> tuple[int | None, int | None]:
    """A batch's own budget and item cap, each optional: a caller may shorten an invocation
    (never beyond THUMBQ_BUDGET_MS, which the platform's timeout is sized on) and cap it."""
    if budget_ms is not None:
        budget_ms = int_in_range(budget_ms, where[0], MIN_BUDGET_MS, config.budget_ms)
    if max_items is not None:
        max_items = int_in_range(max_items, where[1], 1, config.batch_size)
    return budget_ms, max_items
