"""GET /api/openapi.json: the OpenAPI 3.1 description of every route, written by hand.

A module that adds routes (the progress page in `api/pages.py`, the operator page in
`api/operator.py`) may export `openapi_paths`, a dict of OpenAPI path items, which is merged in;
a test checks that every route is described.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
from typing import Any

from flask import Blueprint, Response

from api import validation as v
from api.errors import RETRY_AFTER_S, json_response
from worker.engine.progress import POLL_RUNNING_MS, POLL_SETTLED_MS, POLL_WAITING_MS

bp = Blueprint("openapi", __name__)

ERROR_CODES = [
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
]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str, **extra: Any) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": schema}},
        **extra,
    }


def _err(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/responses/{name}"}


ADMIN: list[dict[str, list[str]]] = [{"adminSecret": []}]
READER: list[dict[str, list[str]]] = [{"adminSecret": []}, {"userJwt": []}]
_ADMIN_ERRORS = {"401": _err("Unauthorized"), "503": _err("Unavailable")}
_BODY_ERRORS = {"400": _err("BadRequest"), "413": _err("TooLarge")}
_COUNTS = ("total", "pending", "processing", "completed", "failed", "unsupported", "cancelled")
# With THUMBQ_SIGNED_URL_TTL_S set, job answers carry these (worker/app/urls.py).
_URL_FIELDS: dict[str, Any] = {
    "thumbnail_url": {
        "type": ["string", "null"],
        "description": "THUMBQ_SIGNED_URL_TTL_S only: a URL that GETs the largest thumbnail with "
        "no credentials until it expires (S3's presigned GET, or /thumbnails/... signed).",
    },
    "thumbnail_urls": {
        "type": ["object", "null"],
        "description": "THUMBQ_SIGNED_URL_TTL_S only: box size -> such a URL, and `pages` "
        "([{page, thumbnails: {size: URL}}]) for a document with several pages.",
    },
}


def _body(schema: dict[str, Any], required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


GROUP_ID_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 200,
    "pattern": "^[A-Za-z0-9_.:@/+=-]{1,200}$",
    "description": "Letters, digits and _ . : @ / + = -",
}
KEY_SCHEMA = {
    "type": "string",
    "minLength": 1,
    "maxLength": 1024,
    "description": "A relative object key: no leading '/', no NUL or control characters, no "
    "'.' or '..' segments, no backslashes; at most 1 024 UTF-8 bytes.",
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "additionalProperties": False,
                "properties": {
                    "code": {"type": "string", "examples": ERROR_CODES},
                    "message": {"type": "string"},
                },
            }
        },
    },
    "Progress": {
        "type": "object",
        "required": [
            *_COUNTS,
            "group_id",
            "progress_percentage",
            "estimated_time_remaining_seconds",
            "updated_at",
            "poll_after_ms",
        ],
        "properties": {
            "group_id": {"type": "string"},
            **{c: {"type": "integer", "minimum": 0} for c in _COUNTS},
            "progress_percentage": {
                "type": "number",
                "minimum": 0,
                "maximum": 100,
                "description": "Share of jobs no longer pending or processing.",
            },
            "estimated_time_remaining_seconds": {
                "type": ["integer", "null"],
                "description": "From the completion rate observed in the current wave of work; "
                "0 when nothing is left, null while no rate has been observed.",
            },
            "rate_per_second": {"type": ["number", "null"]},
            "updated_at": {"type": "string", "format": "date-time"},
            "version": {"type": "integer", "description": "Bumped by every change of the counts."},
            "poll_after_ms": {
                "type": "integer",
                "description": f"{POLL_RUNNING_MS} while jobs are processing, {POLL_WAITING_MS} "
                f"while jobs wait for the next batch, {POLL_SETTLED_MS} when nothing is pending "
                "or processing. Depends on the group's state only, so one ETag is one body.",
            },
            "progress_done": {
                "type": "integer",
                "minimum": 0,
                "description": "The sum of the group's jobs' own progress, as their tasks report "
                "it (ctx.progress(done, total)); 0 for thumbnails.",
            },
            "progress_total": {"type": "integer", "minimum": 0},
        },
    },
    "EnqueueItem": {
        "type": "object",
        "required": ["source_key"],
        "additionalProperties": False,
        "properties": {
            "source_key": KEY_SCHEMA,
            "etag": {
                "type": ["string", "null"],
                "maxLength": v.MAX_ETAG_LENGTH,
                "description": "The object version; asked of storage when left out.",
            },
            "content_type": {"type": ["string", "null"], "maxLength": v.MAX_CONTENT_TYPE_LENGTH},
            "group_id": {**GROUP_ID_SCHEMA, "type": ["string", "null"], "default": "default"},
        },
    },
    "EnqueueRequest": {
        "type": "object",
        "required": ["items"],
        "additionalProperties": False,
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": v.MAX_ITEMS,
                "items": _ref("EnqueueItem"),
            }
        },
    },
    "EnqueueResult": {
        "type": "object",
        "required": ["enqueued", "existing", "missing", "jobs"],
        "properties": {
            "enqueued": {"type": "integer", "description": "New jobs created."},
            "existing": {"type": "integer", "description": "Versions already known (idempotent)."},
            "missing": {
                "type": "integer",
                "description": "Items given without an etag that storage does not have. They "
                "are listed in the group (the next batch ends them `cancelled` with "
                "`source_missing`) and not counted as enqueued.",
            },
            "jobs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["job_id", "source_key", "created", "status", "missing"],
                    "properties": {
                        "job_id": {"type": "integer"},
                        "source_key": {"type": "string"},
                        "created": {"type": "boolean"},
                        "status": _ref("JobStatus"),
                        "missing": {"type": "boolean"},
                    },
                },
            },
        },
    },
    "BackfillRequest": {
        "type": "object",
        "required": ["prefix"],
        "additionalProperties": False,
        "properties": {
            "prefix": {
                "type": "string",
                "maxLength": 1024,
                "description": "Key prefix to list; empty for everything.",
            },
            "group_id": {**GROUP_ID_SCHEMA, "type": ["string", "null"], "default": "default"},
        },
    },
    "BackfillResult": {
        "type": "object",
        "required": ["listed", "have_thumbnail", "enqueued", "existing", "group_id"],
        "properties": {
            "listed": {"type": "integer"},
            "have_thumbnail": {"type": "integer"},
            "enqueued": {"type": "integer"},
            "existing": {"type": "integer"},
            "group_id": {"type": "string"},
        },
    },
    "GroupRequest": {
        "type": "object",
        "required": ["group_id"],
        "additionalProperties": False,
        "properties": {"group_id": GROUP_ID_SCHEMA},
    },
    "BatchRequest": {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "budget_ms": {
                "type": "integer",
                "minimum": v.MIN_BUDGET_MS,
                "description": "Shorter budget for this call; at most THUMBQ_BUDGET_MS "
                "(default and maximum: the configured budget).",
            },
            "max_items": {
                "type": "integer",
                "minimum": 1,
                "description": "At most this many items; at most THUMBQ_BATCH_SIZE.",
            },
        },
    },
    "BatchResult": {
        "type": "object",
        "required": [
            "run_id",
            "processed",
            "succeeded",
            "failed",
            "unsupported",
            "missing",
            "retried",
            "skipped",
            "checkpointed",
            "remaining",
            "stopped_reason",
            "duration_ms",
            "budget_ms",
            "retry_after_ms",
        ],
        "properties": {
            "run_id": {"type": "integer"},
            "processed": {"type": "integer"},
            "succeeded": {"type": "integer"},
            "failed": {
                "type": "integer",
                "description": "Jobs this run ended `failed` (a permanent error, or a "
                "transient one on the last attempt).",
            },
            "unsupported": {
                "type": "integer",
                "description": "Jobs this run ended `unsupported` (no renderer for the type).",
            },
            "missing": {
                "type": "integer",
                "description": "Jobs whose source was missing from storage (ended `cancelled` "
                "with `source_missing`).",
            },
            "retried": {"type": "integer"},
            "skipped": {"type": "integer"},
            "checkpointed": {
                "type": "integer",
                "description": "Jobs whose handler stopped to be resumed by a later invocation "
                "(a task's checkpoint: no attempt used).",
            },
            "remaining": {"type": ["integer", "null"]},
            "stopped_reason": {
                "type": "string",
                "enum": ["drained", "time_budget", "rate_limited", "max_items"],
            },
            "duration_ms": {"type": "integer"},
            "budget_ms": {"type": "integer"},
            "retry_after_ms": {"type": ["integer", "null"]},
        },
    },
    "JobStatus": {
        "type": "string",
        "enum": ["pending", "processing", "completed", "failed", "unsupported", "cancelled"],
    },
    "Job": {
        "type": "object",
        "required": ["id", "group_id", "source_key", "source_etag", "status", "attempts"],
        "properties": {
            "id": {"type": "integer"},
            "group_id": {"type": "string"},
            "source_key": {"type": "string"},
            "source_etag": {"type": "string"},
            "source_bytes": {"type": ["integer", "null"]},
            "content_type": {"type": ["string", "null"]},
            "status": _ref("JobStatus"),
            "attempts": {"type": "integer"},
            "max_attempts": {"type": "integer"},
            "error_code": {"type": ["string", "null"]},
            "last_error": {"type": ["string", "null"]},
            "thumbnail_key": {
                "type": ["string", "null"],
                "description": "The largest size's key (see thumbnails).",
            },
            "thumbnail_content_type": {"type": ["string", "null"]},
            "thumbnails": {
                "type": ["object", "null"],
                "description": "Every size made (THUMBQ_THUMB_SIZES): box size -> storage key "
                "(a document's first page).",
                "additionalProperties": {"type": "string"},
            },
            "pages": {
                "type": "array",
                "description": "Each page shown, in order (THUMBQ_PAGES: pages 1..N of a "
                "document; one entry for anything else), with its box size -> storage key.",
                "items": {
                    "type": "object",
                    "required": ["page", "thumbnails"],
                    "properties": {
                        "page": {"type": "integer"},
                        "thumbnails": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                    },
                },
            },
            "thumbhash": {
                "type": ["string", "null"],
                "description": "ThumbHash of the thumbnail, base64: a blurred placeholder.",
            },
            "dominant_color": {
                "type": ["string", "null"],
                "description": "The thumbnail's dominant colour, #rrggbb.",
            },
            "degraded": {
                "type": ["boolean", "null"],
                "description": "The input could not render in its window at full quality; this "
                "thumbnail is a cheaper one (lower resolution, no anti-aliasing, images skipped).",
            },
            "width": {"type": ["integer", "null"]},
            "height": {"type": ["integer", "null"]},
            "bytes": {"type": ["integer", "null"]},
            "duration_ms": {"type": ["integer", "null"]},
            "msg_id": {"type": ["integer", "null"]},
            "dlq_msg_id": {"type": ["integer", "null"]},
            **_URL_FIELDS,
            "worker_id": {"type": ["string", "null"]},
            **{
                t: {"type": ["string", "null"], "format": "date-time"}
                for t in (
                    "lease_expires_at",
                    "next_attempt_at",
                    "created_at",
                    "updated_at",
                    "started_at",
                    "completed_at",
                )
            },
        },
    },
    "Failure": {
        "allOf": [_ref("Job")],
        "required": ["permanent"],
        "properties": {
            "permanent": {
                "type": "boolean",
                "description": "The error is permanent (the input itself is the problem): no "
                "retry will come, and retrying by hand fails the same way.",
            }
        },
    },
    "GalleryItem": {
        "type": "object",
        "required": ["job_id", "source_key", "url", "width", "height"],
        "properties": {
            "job_id": {"type": "integer"},
            "source_key": {"type": "string"},
            "url": {
                "type": "string",
                "description": "Absolute (presigned S3) or relative to the API (local files).",
            },
            "content_type": {"type": ["string", "null"]},
            "width": {"type": ["integer", "null"]},
            "height": {"type": ["integer", "null"]},
            "completed_at": {"type": ["string", "null"], "format": "date-time"},
            "dominant_color": {
                "type": ["string", "null"],
                "description": "#rrggbb to show while the image loads, where recorded.",
            },
            "thumbhash": {
                "type": ["string", "null"],
                "description": "A ThumbHash (base64) placeholder, where recorded.",
            },
            "pages": {
                "type": "array",
                "description": "A document's pages in order (THUMBQ_PAGES above 1), each at its "
                "smallest size; empty for a single page.",
                "items": {
                    "type": "object",
                    "required": ["page", "url"],
                    "properties": {"page": {"type": "integer"}, "url": {"type": "string"}},
                },
            },
        },
    },
    "QueueOverview": {
        "type": "object",
        "description": "The thumbq.queue_overview view (queue length, visible, in flight, oldest "
        "message age, DLQ length, jobs by status, bucket tokens) plus the open alerts.",
        "required": ["alerts"],
        "properties": {
            "alerts": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "figure": {},
                        "threshold": {},
                        "detail": {},
                    },
                },
            }
        },
        "additionalProperties": True,
    },
    "Health": {
        "type": "object",
        "required": ["status", "database"],
        "properties": {
            "status": {"const": "ok"},
            "database": {"const": "ok"},
            "database_ms": {"type": "number"},
        },
    },
}


_JOB_SCHEMAS: dict[str, Any] = {
    "JobRequest": {
        "type": "object",
        "description": "One job (its fields, and `wait_ms` to run it at once), or `items`: 1 to "
        f"{v.MAX_ITEMS} jobs, all or none. A `thumbnail` job's payload is "
        '`{"source_key", "etag"?, "content_type"?}` (as POST /api/thumbnails/enqueue; storage '
        "is asked for the etag of a file given without one); it is idempotent by key and etag "
        "and takes no ordering_key, sequence, idempotency_key or max_attempts.",
        "anyOf": [_ref("SingleJobRequest"), _ref("JobItemsRequest")],
    },
    "JobItem": {
        "type": "object",
        "required": ["task"],
        "additionalProperties": False,
        "properties": {
            "task": {
                **GROUP_ID_SCHEMA,
                "description": "The task's name: `thumbnail`, or one a THUMBQ_TASKS module "
                "registers (a task no worker knows ends `unsupported` with `unsupported_task`).",
            },
            "payload": {
                "description": "The job's input: any JSON without NUL characters, lone "
                f"surrogates or non-finite numbers, at most {v.MAX_PAYLOAD_DEPTH} deep.",
            },
            "group_id": {**GROUP_ID_SCHEMA, "type": ["string", "null"], "default": "default"},
            "priority": {"type": ["integer", "null"], "minimum": 0, "maximum": 9, "default": 0},
            "ordering_key": {
                "type": ["string", "null"],
                "minLength": 1,
                "maxLength": v.MAX_KEY_LENGTH,
                "description": "Jobs sharing an ordering key run one at a time, in sequence "
                "order, across all invocations; a failed one holds the rest.",
            },
            "sequence": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": v.MAX_SEQUENCE,
                "description": "Needs ordering_key; default: after the key's last job. A "
                "sequence behind one that has started is refused (409 sequence_conflict); one "
                "that exists names that job.",
            },
            "idempotency_key": {
                "type": ["string", "null"],
                "minLength": 1,
                "maxLength": v.MAX_KEY_LENGTH,
                "description": "Unique per task: the same key again returns the existing job "
                "(`created` false).",
            },
            "max_attempts": {"type": ["integer", "null"], "minimum": 1, "maximum": 100},
        },
    },
    "SingleJobRequest": {
        "allOf": [_ref("JobItem")],
        "properties": {
            "wait_ms": {
                "type": ["integer", "null"],
                "minimum": v.MIN_WAIT_MS,
                "description": "Run the job here at once and wait up to this long (at most "
                "THUMBQ_BUDGET_MS - THUMBQ_BUFFER_MS) for it: under the same rate limit, claim "
                "and lease as a batch. 200 when it has ended within the wait, else 202 with "
                "`wait.reason`.",
            },
        },
        "unevaluatedProperties": False,
    },
    "JobItemsRequest": {
        "type": "object",
        "required": ["items"],
        "additionalProperties": False,
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": v.MAX_ITEMS,
                "items": _ref("JobItem"),
            }
        },
    },
    "JobAccepted": {
        "type": "object",
        "required": ["job_id", "task", "created", "status", "ordering_key", "sequence", "missing"],
        "properties": {
            "job_id": {"type": "integer"},
            "task": {"type": "string"},
            "created": {
                "type": "boolean",
                "description": "False: the same thumbnail version, idempotency key or ordering "
                "key and sequence named an existing job (or an earlier item of the call).",
            },
            "status": _ref("JobStatus"),
            "ordering_key": {"type": ["string", "null"]},
            "sequence": {"type": ["integer", "null"]},
            "missing": {
                "type": "boolean",
                "description": "A thumbnail job whose file storage does not have (its run ends "
                "it `cancelled` with `source_missing`).",
            },
        },
    },
    "JobsAccepted": {
        "type": "object",
        "required": ["created", "existing", "jobs"],
        "properties": {
            "created": {"type": "integer"},
            "existing": {"type": "integer"},
            "jobs": {
                "type": "array",
                "items": _ref("JobAccepted"),
                "description": "One per item, in order.",
            },
        },
    },
    "JobWait": {
        "type": "object",
        "required": ["ran", "finished", "reason", "message", "retry_after_ms", "duration_ms"],
        "properties": {
            "ran": {"type": "boolean", "description": "The job ran in this call."},
            "finished": {"type": "boolean", "description": "The job has ended (see job)."},
            "reason": {
                "type": ["string", "null"],
                "enum": [
                    None,
                    "rate_limited",
                    "busy",
                    "not_ready",
                    "too_long",
                    "timeout",
                    "checkpointed",
                    "retrying",
                    "unrecorded",
                    "running",
                ],
                "description": "Why it has not ended: rate_limited (no token; retry_after_ms), "
                "busy (another invocation holds it, or this process runs as many interactive "
                "jobs as it runs at once), not_ready (it waits behind its ordering key "
                "or for its retry), too_long (jobs like it take longer than the wait), timeout "
                "(stopped at the end of the wait and handed back at once, no attempt used), "
                "checkpointed (a later batch resumes it), retrying (it failed; backoff), "
                "unrecorded (the database did not take its outcome; it runs again), running "
                "(a thread handler still running at the end of the wait: it keeps the job until "
                "it ends, and its outcome is recorded then).",
            },
            "message": {"type": "string"},
            "retry_after_ms": {"type": ["integer", "null"]},
            "duration_ms": {"type": "integer"},
        },
    },
    "JobRun": {
        "allOf": [_ref("JobAccepted")],
        "required": ["wait", "job"],
        "properties": {"wait": _ref("JobWait"), "job": _ref("JobView")},
    },
    "JobView": {
        "type": "object",
        "required": [
            "id",
            "task",
            "group_id",
            "status",
            "payload",
            "result",
            "error_code",
            "last_error",
            "attempts",
            "max_attempts",
            "priority",
            "created_at",
        ],
        "properties": {
            "id": {"type": "integer"},
            "task": {"type": "string"},
            "group_id": {"type": "string"},
            "status": _ref("JobStatus"),
            "payload": {
                "description": "The job's input; a thumbnail job's source: "
                '`{"source_key", "etag", "content_type"}`.'
            },
            "result": {
                "description": "What the handler returned (null until it completes); a "
                "completed thumbnail job's thumbnails: thumbnail_key, thumbnails (size -> key), "
                "thumbnail_content_type, width, height, bytes, thumbhash, dominant_color, "
                "degraded."
            },
            "error_code": {"type": ["string", "null"]},
            "last_error": {"type": ["string", "null"]},
            "attempts": {"type": "integer"},
            "max_attempts": {"type": "integer"},
            "priority": {"type": "integer", "minimum": 0, "maximum": 9},
            "ordering_key": {"type": ["string", "null"]},
            "sequence": {"type": ["integer", "null"]},
            "idempotency_key": {"type": ["string", "null"]},
            "progress_done": {"type": ["integer", "null"]},
            "progress_total": {"type": ["integer", "null"]},
            "checkpoints": {
                "type": "integer",
                "description": "How often the handler checkpointed (its state stays inside).",
            },
            "duration_ms": {"type": ["integer", "null"]},
            **_URL_FIELDS,
            **{
                t: {"type": ["string", "null"], "format": "date-time"}
                for t in (
                    "created_at",
                    "updated_at",
                    "started_at",
                    "completed_at",
                    "next_attempt_at",
                )
            },
        },
    },
    "JobCancelled": {
        "type": "object",
        "required": ["job_id", "cancelled", "status", "group_id"],
        "properties": {
            "job_id": {"type": "integer"},
            "cancelled": {
                "type": "boolean",
                "description": "False: the job had already ended (its status says how).",
            },
            "status": _ref("JobStatus"),
            "group_id": {"type": "string"},
        },
    },
}
SCHEMAS.update(_JOB_SCHEMAS)

_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "integer"},
    }
}

RESPONSES: dict[str, Any] = {
    "BadRequest": _json(
        _ref("Error"),
        "Bad JSON or fields: invalid_json, invalid_request (unknown, missing, mistyped or "
        "out-of-range fields, empty or oversized lists), invalid_key, invalid_group_id, "
        "invalid_job_id.",
    ),
    "Unauthorized": _json(
        _ref("Error"),
        "Missing or wrong credentials (code unauthorized).",
        headers={"WWW-Authenticate": {"schema": {"type": "string"}}},
    ),
    "NotFound": _json(
        _ref("Error"), "Unknown route, group (or one the caller may not see) or job."
    ),
    "TooLarge": _json(_ref("Error"), f"Request body over {v.MAX_BODY_BYTES} bytes."),
    "Unavailable": _json(
        _ref("Error"),
        "database_unavailable / storage_unavailable (with Retry-After: "
        f"{RETRY_AFTER_S}), schema_missing, or not_configured (no secret is set, so the "
        "route is disabled: fail closed).",
        headers=_RETRY_AFTER,
    ),
}


def _op(
    summary: str,
    responses: dict[str, Any],
    *,
    security: list[dict[str, list[str]]] | None = None,
    body: dict[str, Any] | None = None,
    parameters: list[dict[str, Any]] | None = None,
    op_id: str,
) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": responses}
    op["security"] = security if security is not None else []
    if body is not None:
        op["requestBody"] = body
    if parameters:
        op["parameters"] = parameters
    return op


def _group_op(op_id: str, summary: str, result_field: str) -> dict[str, Any]:
    return {
        "post": _op(
            summary,
            {
                "200": _json(
                    {
                        "type": "object",
                        "required": [result_field],
                        "properties": {result_field: {"type": "integer"}},
                    },
                    "Done.",
                ),
                **_BODY_ERRORS,
                **_ADMIN_ERRORS,
                "404": _err("NotFound"),
            },
            security=ADMIN,
            body=_body(_ref("GroupRequest")),
            op_id=op_id,
        )
    }


_CRON_GET = " GET is for Vercel Cron, which calls its path with GET and no body."


def _batch_op(method: str) -> dict[str, Any]:
    get = method == "get"
    return _op(
        "Run one time-budgeted batch: claim, render, record, release, report."
        + (_CRON_GET + " budget_ms and max_items come from the query string." if get else ""),
        {
            "200": _json(_ref("BatchResult"), "The report of the invocation."),
            **_BODY_ERRORS,
            **_ADMIN_ERRORS,
            "409": _json(
                _ref("Error"),
                "A batch is already running in this process (batch_in_progress).",
                headers=_RETRY_AFTER,
            ),
        },
        security=ADMIN,
        body=None if get else _body(_ref("BatchRequest"), required=False),
        parameters=[
            {
                "name": name,
                "in": "query",
                "required": False,
                "schema": SCHEMAS["BatchRequest"]["properties"][name],
            }
            for name in ("budget_ms", "max_items")
        ]
        if get
        else None,
        op_id="batchGenerateCron" if get else "batchGenerate",
    )


def _cleanup_op(method: str) -> dict[str, Any]:
    get = method == "get"
    return _op(
        "Reset processing jobs whose lease expired, prune finished jobs, batch runs and"
        " archived messages older than THUMBQ_RETENTION_DAYS (group summaries stay), and remove"
        " the temporary files that writes killed mid-way left in local file storage (those older"
        " than 15 minutes)." + (_CRON_GET if get else ""),
        {
            "200": _json(
                {
                    "type": "object",
                    "required": ["reset_count", "pruned", "temp_files_removed"],
                    "properties": {
                        "reset_count": {"type": "integer"},
                        "temp_files_removed": {"type": "integer"},
                        "pruned": {
                            "type": "object",
                            "required": ["jobs", "batch_runs", "archived"],
                            "properties": {
                                "jobs": {"type": "integer"},
                                "batch_runs": {"type": "integer"},
                                "archived": {"type": "integer"},
                            },
                        },
                    },
                },
                "Done.",
            ),
            **_BODY_ERRORS,
            **_ADMIN_ERRORS,
        },
        security=ADMIN,
        body=None
        if get
        else _body({"type": "object", "additionalProperties": False}, required=False),
        op_id="cleanupStaleCron" if get else "cleanupStale",
    )


PATHS: dict[str, Any] = {
    "/api/thumbnails/batch-generate": {
        "post": _batch_op("post"),
        "get": _batch_op("get"),
    },
    "/api/thumbnails/progress": {
        "get": _op(
            "Progress of a group: counts, percentage, ETA and when to poll again.",
            {
                "200": _json(
                    _ref("Progress"),
                    "The group's progress.",
                    headers={
                        "ETag": {"description": "Strong validator.", "schema": {"type": "string"}},
                        "Cache-Control": {"schema": {"const": "no-cache"}},
                        "X-Poll-After-Ms": {"schema": {"type": "integer"}},
                    },
                ),
                "304": {
                    "description": "Unchanged since the ETag in If-None-Match; no body.",
                    "headers": {
                        "ETag": {"schema": {"type": "string"}},
                        "X-Poll-After-Ms": {"schema": {"type": "integer"}},
                    },
                },
                "400": _err("BadRequest"),
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
            },
            security=READER,
            parameters=[
                {
                    "name": "group_id",
                    "in": "query",
                    "required": True,
                    "schema": GROUP_ID_SCHEMA,
                },
                {
                    "name": "If-None-Match",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                },
            ],
            op_id="getProgress",
        )
    },
    "/api/thumbnails/failures": {
        "get": _op(
            "A group's most recent failed, unsupported and retrying jobs with their errors "
            "(for the progress page).",
            {
                "200": _json(
                    {
                        "type": "object",
                        "required": ["group_id", "failures"],
                        "properties": {
                            "group_id": {"type": "string"},
                            "failures": {"type": "array", "items": _ref("Failure")},
                        },
                    },
                    "The group's files without a thumbnail and why (failed, unsupported, "
                    "missing from storage, or retrying after an error), newest first.",
                ),
                "400": _err("BadRequest"),
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
            },
            security=READER,
            parameters=[
                {"name": "group_id", "in": "query", "required": True, "schema": GROUP_ID_SCHEMA},
                {
                    "name": "limit",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                },
            ],
            op_id="getFailures",
        )
    },
    "/api/thumbnails/gallery": {
        "get": _op(
            "A page of a group's finished thumbnails, newest job first, with URLs an <img> can "
            "load without credentials: presigned by S3, or signed URLs of /api/thumbnails/image "
            "for local files (valid about an hour).",
            {
                "200": _json(
                    {
                        "type": "object",
                        "required": ["group_id", "thumbnails", "next_before"],
                        "properties": {
                            "group_id": {"type": "string"},
                            "thumbnails": {"type": "array", "items": _ref("GalleryItem")},
                            "next_before": {
                                "type": ["integer", "null"],
                                "description": "Pass as `before` for the next page; null at "
                                "the end.",
                            },
                        },
                    },
                    "Finished thumbnails.",
                ),
                "400": _err("BadRequest"),
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
            },
            security=READER,
            parameters=[
                {"name": "group_id", "in": "query", "required": True, "schema": GROUP_ID_SCHEMA},
                {
                    "name": "limit",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 1, "maximum": 200, "default": 48},
                },
                {
                    "name": "before",
                    "in": "query",
                    "required": False,
                    "schema": {"type": "integer", "minimum": 1},
                    "description": "Only jobs with a smaller id (the previous page's next_before).",
                },
            ],
            op_id="getGallery",
        )
    },
    "/api/thumbnails/image": {
        "get": _op(
            "One thumbnail from local storage, for a URL the gallery signed (no other "
            "credentials: an <img> sends none). Only keys under thumbnails/; never outside the "
            "storage root.",
            {
                "200": {
                    "description": "The image.",
                    "content": {
                        t: {"schema": {"type": "string", "contentMediaType": t}}
                        for t in ("image/webp", "image/jpeg", "image/png", "image/avif")
                    },
                },
                "400": _err("BadRequest"),
                "403": _json(
                    _ref("Error"), "A signature that is wrong or expired (code forbidden)."
                ),
                "404": _err("NotFound"),
            },
            parameters=[
                {"name": "key", "in": "query", "required": True, "schema": KEY_SCHEMA},
                {"name": "expires", "in": "query", "required": True, "schema": {"type": "integer"}},
                {"name": "sig", "in": "query", "required": True, "schema": {"type": "string"}},
            ],
            op_id="getThumbnailImage",
        )
    },
    "/api/thumbnails/enqueue": {
        "post": _op(
            "Enqueue object versions (idempotent per key and etag; all or none).",
            {
                "202": _json(_ref("EnqueueResult"), "Accepted: counts and job ids."),
                **_BODY_ERRORS,
                **_ADMIN_ERRORS,
            },
            security=ADMIN,
            body=_body(_ref("EnqueueRequest")),
            op_id="enqueue",
        )
    },
    "/api/thumbnails/backfill": {
        "post": _op(
            "List storage under a prefix and enqueue every file lacking a thumbnail.",
            {
                "202": _json(_ref("BackfillResult"), "Accepted."),
                **_BODY_ERRORS,
                **_ADMIN_ERRORS,
            },
            security=ADMIN,
            body=_body(_ref("BackfillRequest")),
            op_id="backfill",
        )
    },
    "/api/thumbnails/retry-failed": _group_op(
        "retryFailed", "Queue a group's failed jobs again with fresh attempts.", "requeued"
    ),
    "/api/thumbnails/cancel": _group_op(
        "cancel", "Cancel a group's pending and processing jobs.", "cancelled"
    ),
    "/api/thumbnails/cleanup-stale": {
        "post": _cleanup_op("post"),
        "get": _cleanup_op("get"),
    },
    "/api/thumbnails/jobs/{job_id}": {
        "get": _op(
            "One job, every column.",
            {
                "200": _json(_ref("Job"), "The job."),
                "400": _err("BadRequest"),
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
            },
            security=ADMIN,
            parameters=[
                {
                    "name": "job_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1},
                }
            ],
            op_id="getJob",
        )
    },
    "/api/queues": {
        "get": _op(
            "The inspection view as JSON.",
            {"200": _json(_ref("QueueOverview"), "Queue state and alerts."), **_ADMIN_ERRORS},
            security=ADMIN,
            op_id="getQueues",
        )
    },
    "/metrics": {
        "get": _op(
            "Prometheus' text format: jobs, failures, queues, rate limits, durations. The bearer "
            "is the admin secret or THUMBQ_METRICS_TOKEN (read-only).",
            {
                "200": {
                    "description": "Prometheus text exposition 0.0.4.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                },
                **_ADMIN_ERRORS,
            },
            security=ADMIN,
            op_id="getMetrics",
        )
    },
    "/thumbnails/{name}": {
        "get": _op(
            "One thumbnail (thumbnails/<name>) for a signed URL of a job answer, no credentials: "
            "403 signature_invalid or url_expired otherwise.",
            {
                "200": {
                    "description": "The image.",
                    "content": {
                        t: {"schema": {"type": "string", "contentMediaType": t}}
                        for t in ("image/webp", "image/jpeg", "image/png", "image/avif")
                    },
                },
                "400": _err("BadRequest"),
                "403": _json(_ref("Error"), "signature_invalid, or url_expired."),
                "404": _err("NotFound"),
            },
            parameters=[
                {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "expires", "in": "query", "required": True, "schema": {"type": "string"}},
                {
                    "name": "signature",
                    "in": "query",
                    "required": True,
                    "schema": {"type": "string"},
                },
            ],
            op_id="getSignedThumbnail",
        )
    },
    "/api/openapi.json": {
        "get": _op(
            "This description.",
            {"200": _json({"type": "object"}, "The OpenAPI 3.1 document.")},
            op_id="getOpenapi",
        )
    },
    "/healthz": {
        "get": _op(
            "Liveness plus a database round trip.",
            {"200": _json(_ref("Health"), "Alive."), "503": _err("Unavailable")},
            op_id="healthz",
        )
    },
    "/progress": {
        "get": _op(
            "The progress page: polls the progress endpoint, or follows Supabase Realtime.",
            {
                "200": {
                    "description": "An HTML page.",
                    "content": {"text/html": {"schema": {"type": "string"}}},
                },
            },
            parameters=[
                {"name": "group_id", "in": "query", "required": False, "schema": GROUP_ID_SCHEMA}
            ],
            op_id="progressPage",
        )
    },
}


_JOB_ID_PARAM = {
    "name": "job_id",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 1},
}
_SSE = {
    "description": "Server-Sent Events until nothing is pending or processing: a `retry:` "
    "hint, one `progress` event per change of the group (`id` is its ETag, `data` the progress "
    "endpoint's JSON), a `: heartbeat` comment after 15 s without an event, and an `end` event "
    '(`{"group_id", "reason": "done" | "not_found"}`). It also ends after 30 minutes or when '
    "a user's token expires; a client reconnects with Last-Event-ID and gets no event for the "
    "version it has. For servers that hold long responses (`thumbq serve`); serverless "
    "deployments poll or use Realtime.",
    # As OpenAPI 3.2 reads a stream's `itemSchema` (and tools read `schema` before 3.2): each
    # event, with its JSON data described by contentSchema.
    "content": {
        "text/event-stream": {
            "schema": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["event", "id", "data"],
                        "properties": {
                            "event": {"const": "progress"},
                            "id": {"type": "string", "description": "The group's ETag."},
                            "data": {
                                "type": "string",
                                "contentMediaType": "application/json",
                                "contentSchema": _ref("Progress"),
                            },
                        },
                    },
                    {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": {"const": "end"},
                            "data": {
                                "type": "string",
                                "contentMediaType": "application/json",
                                "contentSchema": {
                                    "type": "object",
                                    "required": ["group_id", "reason"],
                                    "properties": {
                                        "group_id": {"type": "string"},
                                        "reason": {"enum": ["done", "not_found"]},
                                    },
                                },
                            },
                        },
                    },
                ]
            }
        }
    },
    "headers": {"Cache-Control": {"schema": {"const": "no-cache"}}},
}
_JOB_PATHS: dict[str, Any] = {
    "/api/jobs": {
        "post": _op(
            "Enqueue a job of any task (or `items`: up to 1 000, all or none). With `wait_ms`, "
            "a single job runs here at once, under the same rate limit, claim and lease as a "
            "batch: 200 once it has ended, 202 while it still waits (`wait.reason`).",
            {
                "200": _json(
                    _ref("JobRun"),
                    "With wait_ms: the job ended within the wait, completed (its result) or "
                    "not (its error); or it had ended before.",
                ),
                "202": _json(
                    {"anyOf": [_ref("JobRun"), _ref("JobAccepted"), _ref("JobsAccepted")]},
                    "Queued: the job (JobAccepted), the items (JobsAccepted), or with wait_ms "
                    "a job that has not ended, and why (JobRun).",
                    headers={
                        "Retry-After": {
                            "description": "With wait.reason rate_limited: seconds until a "
                            "token comes.",
                            "schema": {"type": "integer"},
                        }
                    },
                ),
                **_BODY_ERRORS,
                **_ADMIN_ERRORS,
                "404": _err("NotFound"),
                "409": _json(
                    _ref("Error"),
                    "sequence_conflict: a sequence behind one of its ordering key that has "
                    "already started; nothing was enqueued.",
                ),
            },
            security=ADMIN,
            body=_body(_ref("JobRequest")),
            op_id="enqueueJobs",
        )
    },
    "/api/jobs/{job_id}": {
        "get": _op(
            "One job: status, payload, result or error, attempts, priority, ordering, progress "
            "and times.",
            {
                "200": _json(_ref("JobView"), "The job."),
                "400": _err("BadRequest"),
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
            },
            security=ADMIN,
            parameters=[_JOB_ID_PARAM],
            op_id="showJob",
        )
    },
    "/api/jobs/{job_id}/cancel": {
        "post": _op(
            "Cancel a job that waits or runs (a running handler sees ctx.cancelled() at its "
            "next check; the next job of its ordering key goes).",
            {
                "200": _json(_ref("JobCancelled"), "Done, or it had already ended."),
                **_BODY_ERRORS,
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
            },
            security=ADMIN,
            body=_body({"type": "object", "additionalProperties": False}, required=False),
            parameters=[_JOB_ID_PARAM],
            op_id="cancelJob",
        )
    },
    "/api/thumbnails/progress/stream": {
        "get": _op(
            "A group's progress as Server-Sent Events, one event per change, until it is done.",
            {
                "200": _SSE,
                "400": _err("BadRequest"),
                "404": _err("NotFound"),
                **_ADMIN_ERRORS,
                "503": _json(
                    _ref("Error"),
                    "too_many_streams (this process holds THUMBQ_MAX_STREAMS open; Retry-After), "
                    "streams_disabled, not_configured, or the database is unavailable.",
                    headers=_RETRY_AFTER,
                ),
            },
            security=READER,
            parameters=[
                {"name": "group_id", "in": "query", "required": True, "schema": GROUP_ID_SCHEMA},
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string"},
                },
            ],
            op_id="streamProgress",
        )
    },
}
PATHS.update(_JOB_PATHS)


def spec() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (a fresh copy)."""
    paths = copy.deepcopy(PATHS)
    for module in ("api.pages", "api.operator"):
        if importlib.util.find_spec(module) is not None:
            extra = getattr(importlib.import_module(module), "openapi_paths", None)
            if isinstance(extra, dict):
                paths.update(copy.deepcopy(extra))
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "thumbq",
            "version": "0.1.0",
            "description": "Thumbnails for files in object storage, made by short time-budgeted "
            'batches. Every error is `{"error": {"code", "message"}}`; request bodies are at '
            f"most {v.MAX_BODY_BYTES} bytes (413 beyond); a wrong method answers 405 with Allow; "
            "a database outage answers 503 with Retry-After.",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "responses": copy.deepcopy(RESPONSES),
            "securitySchemes": {
                "adminSecret": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "THUMBQ_CRON_SECRET (or Vercel's CRON_SECRET). Without a "
                    "configured secret, admin routes answer 503 not_configured.",
                },
                "userJwt": {
                    "type": "http",
                    "scheme": "bearer",
                    "bearerFormat": "JWT",
                    "description": "A Supabase user JWT: HS256 with THUMBQ_JWT_SECRET, aud "
                    "'authenticated', exp and sub required. Row level security decides which "
                    "groups it can read; others answer 404.",
                },
            },
        },
    }


@bp.get("/api/openapi.json")
def openapi_json() -> Response:
    """The OpenAPI description."""
    return json_response(spec(), headers={"Cache-Control": "public, max-age=300"})
