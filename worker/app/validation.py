"""What a request may contain, checked in one place for the HTTP API and the CLI alike: every
refusal names the field (or option) that is wrong and why, before anything is written.

Limits (also in the OpenAPI description):
- `items`: 1 to 1 000 per enqueue request (one SQL statement, so all or nothing);
- keys: 1 to 1 024 UTF-8 bytes, relative, no NUL or control characters, no `.`/`..` segments;
- group ids: 1 to 200 characters of letters, digits and `_ . : @ / + = -`;
- `etag`: at most 200 characters; `content_type`: `type/subtype[; params]`, at most 255;
- `budget_ms`: 1 000 up to the configured THUMBQ_BUDGET_MS (the platform's timeout is sized on
  it, so a caller may shorten an invocation but never lengthen it);
- `max_items`: 1 up to THUMBQ_BATCH_SIZE;
- jobs (`POST /api/jobs`, `thumbq jobs enqueue`): `task` 1 to 200 characters like a group id;
  `payload` any JSON without NUL characters, lone surrogates or non-finite numbers (what
  Postgres's jsonb cannot store), nested at most 100 deep; `priority` 0-9; `ordering_key` and
  `idempotency_key` 1 to 200 characters without control characters; `sequence` 0 to 10^18 - 1,
  only with an `ordering_key`; `max_attempts` 1-100; `wait_ms` 100 up to THUMBQ_BUDGET_MS -
  THUMBQ_BUFFER_MS, for one job only. A `thumbnail` job's payload is `{"source_key", "etag"?,
  "content_type"?}`, checked as an enqueue item; it is idempotent by key and etag, so it takes
  neither keys nor a sequence of its own.

The HTTP layer answers a `ValidationError` with 400 and its code; the CLI prints its message on
one line and exits 1. `where` names the field as the caller wrote it (`items[0].etag` for the
API, `--budget-ms` for the CLI).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from worker.engine.errors import InvalidKey, validate_key

if TYPE_CHECKING:
    from worker.engine.config import Config

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


# -- jobs of any task ---------------------------------------------------------------------------

THUMBNAIL_TASK = "thumbnail"
TASK_NAME_RE = GROUP_ID_RE
MAX_KEY_LENGTH = 200
MAX_SEQUENCE = 10**18 - 1
MAX_PAYLOAD_DEPTH = 100
MIN_WAIT_MS = 100
JOB_FIELDS = (
    "task",
    "payload",
    "group_id",
    "priority",
    "ordering_key",
    "sequence",
    "idempotency_key",
    "max_attempts",
)


def task_name(value: Any, where: str = "task") -> str:
    """A task's name: 1 to 200 letters, digits and _ . : @ / + = -."""
    typed(value, str, where)
    if not TASK_NAME_RE.fullmatch(value):
        raise ValidationError(
            f"{where} must be 1 to 200 characters of letters, digits and _ . : @ / + = -"
        )
    return str(value)


def _text_key(value: Any, where: str) -> str:
    """An ordering or idempotency key: 1 to 200 characters, no control characters."""
    text = typed(value, str, where)
    if (
        not 1 <= len(text) <= MAX_KEY_LENGTH
        or any(ord(c) < 0x20 or ord(c) == 0x7F for c in text)
        or not _encodable(text)
    ):
        raise ValidationError(
            f"{where} must be 1 to {MAX_KEY_LENGTH} characters of valid Unicode without "
            "control characters"
        )
    return str(text)


def payload(value: Any, where: str = "payload") -> Any:
    """A JSON value that Postgres's jsonb can store: no NUL character and no lone surrogate in
    any string (or object key), no infinite number, at most MAX_PAYLOAD_DEPTH deep. Walked
    without recursion, so a hostile nesting cannot exhaust the stack."""
    import math

    todo: list[tuple[Any, int, str]] = [(value, 0, where)]
    while todo:
        item, depth, path = todo.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise ValidationError(f"{where} is nested more than {MAX_PAYLOAD_DEPTH} deep")
        if isinstance(item, str):
            if "\x00" in item or not _encodable(item):
                raise ValidationError(
                    f"{path} holds a string with a NUL character or a lone surrogate, which "
                    "JSON in Postgres cannot store"
                )
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise ValidationError(f"{path} holds a number too large to store")
        elif isinstance(item, dict):
            for k, v in item.items():
                todo.append((k, depth + 1, path))
                todo.append((v, depth + 1, f"{path}.{k}" if len(path) < 200 else path))
        elif isinstance(item, list):
            for i, v in enumerate(item):
                todo.append((v, depth + 1, f"{path}[{i}]" if len(path) < 200 else path))
        elif item is not None and not isinstance(item, bool | int):
            raise ValidationError(f"{path} must be JSON")
    return value


def job_item(
    item: Any, where: str, *, name_of: Callable[[str], str] | None = None
) -> dict[str, Any]:
    """One job to enqueue, in the engine's shape: for `thumbnail`, an enqueue item of
    `Queue.enqueue_files` (with `task`); for any other task, an item of `Queue.enqueue_jobs`.
    `where` names the item (`items[3]`, or "" for a job posted alone); `name_of` names a field
    the way the caller wrote it (the CLI's `--ordering-key`)."""
    typed(item, dict, where or "body")

    def at(field: str) -> str:
        if name_of is not None:
            return name_of(field)
        return f"{where}.{field}" if where else field

    check_fields(item, required=("task",), optional=JOB_FIELDS[1:], where=where or "body")
    name = task_name(item["task"], at("task"))
    clean: dict[str, Any] = {"task": name}
    if item.get("group_id") is not None:
        clean["group_id"] = group_id(item["group_id"], at("group_id"))
    if item.get("priority") is not None:
        clean["priority"] = int_in_range(item["priority"], at("priority"), 0, 9)
    if name == THUMBNAIL_TASK:
        given = sorted(
            f
            for f in ("ordering_key", "sequence", "idempotency_key", "max_attempts")
            if item.get(f) is not None
        )
        if given:
            raise ValidationError(
                f"{where + ': ' if where else ''}a thumbnail job takes no "
                f"{', '.join(at(f) for f in given)} (it is idempotent by its source_key and etag, "
                "and its attempts are THUMBQ_MAX_ATTEMPTS)"
            )
        if "payload" not in item:
            raise ValidationError(f"{at('payload')} is required for a thumbnail job")
        source = typed(item["payload"], dict, at("payload"))
        # The payload is an enqueue item of POST /api/thumbnails/enqueue, less its group.
        check_fields(
            source,
            required=("source_key",),
            optional=("etag", "content_type"),
            where=at("payload"),
        )
        clean.update(enqueue_item(source, at("payload")))
        return clean
    if item.get("payload") is not None:
        clean["payload"] = payload(item["payload"], at("payload"))
    if item.get("ordering_key") is not None:
        clean["ordering_key"] = _text_key(item["ordering_key"], at("ordering_key"))
    if item.get("sequence") is not None:
        if "ordering_key" not in clean:
            raise ValidationError(f"{at('sequence')} needs an ordering_key")
        clean["sequence"] = int_in_range(item["sequence"], at("sequence"), 0, MAX_SEQUENCE)
    if item.get("idempotency_key") is not None:
        clean["idempotency_key"] = _text_key(item["idempotency_key"], at("idempotency_key"))
    if item.get("max_attempts") is not None:
        clean["max_attempts"] = int_in_range(item["max_attempts"], at("max_attempts"), 1, 100)
    return clean


def wait_ms(config: Config, value: Any, where: str = "wait_ms") -> int:
    """How long an interactive call may wait for its job: MIN_WAIT_MS up to the work window of
    an invocation (THUMBQ_BUDGET_MS - THUMBQ_BUFFER_MS), so that the answer, recording
    included, still comes within the budget the platform's timeout is sized on."""
    return int_in_range(value, where, MIN_WAIT_MS, max(MIN_WAIT_MS, config.deadline_ms))


def job_request(config: Config, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
    """The jobs of a `POST /api/jobs` body and its `wait_ms`: one job (its fields, and
    `wait_ms` optionally), or `{"items": [...]}` (1 to MAX_ITEMS jobs, no wait)."""
    if "items" in body:
        check_fields(body, required=("items",))
        items = typed(body["items"], list, "items")
        if not items:
            raise ValidationError("items must not be empty")
        if len(items) > MAX_ITEMS:
            raise ValidationError(
                f"items has {len(items)} entries; at most {MAX_ITEMS} per request"
            )
        for i, item in enumerate(items):
            if isinstance(item, dict) and "wait_ms" in item:
                raise ValidationError(
                    f"items[{i}].wait_ms: only a single job (posted without items) can be "
                    "waited for"
                )
        return [job_item(item, f"items[{i}]") for i, item in enumerate(items)], None
    single = {k: v for k, v in body.items() if k != "wait_ms"}
    wait = None if body.get("wait_ms") is None else wait_ms(config, body["wait_ms"])
    return [job_item(single, "")], wait
