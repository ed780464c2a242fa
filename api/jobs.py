"""The /api/jobs routes: jobs of any task (worker.tasks), the built-in `thumbnail` included.

`POST /api/jobs` enqueues one job or `{"items": [...]}`; with `wait_ms`, one job runs here at once
when it can (worker.engine.interactive) and the answer is 200 with how it ended, or 202 with why it
still waits. `GET /api/jobs/<id>` shows one; `POST /api/jobs/<id>/cancel` cancels one that waits or
runs. Admin only, like the other routes that write or show single jobs.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Annotated, Any, Literal

import msgspec
from flask import Blueprint, Response
from msgspec import UNSET, Meta, Struct

from api import validation as v
from api.auth import require_admin
from api.contract import (
    ADMIN,
    ADMIN_ERRORS,
    BAD_REQUEST,
    Absent,
    Answer,
    Empty,
    Error,
    GroupId,
    JobPath,
    Op,
    Timestamp,
    describe,
    read_body,
)
from api.errors import ApiError, json_response
from api.signed import signer
from api.thumbnails import SignedUrl, SignedUrls, state
from worker.app.jobs import SequenceConflict, view
from worker.engine import db
from worker.engine.states import JobStatus

bp = Blueprint("jobs", __name__)

# -- requests and answers ---------------------------------------------------------------------

TextKey = Annotated[str, Meta(min_length=1, max_length=v.MAX_KEY_LENGTH)] | None


class JobItem(Struct, kw_only=True, forbid_unknown_fields=True):
    task: Annotated[
        GroupId,
        Meta(
            description="The task's name: `thumbnail`, or one a THUMBQ_TASKS module registers (a "
            "task no worker knows ends `unsupported` with `unsupported_task`)."
        ),
    ]
    payload: (
        Annotated[
            Any,
            Meta(
                description="The job's input: any JSON without NUL characters, lone surrogates "
                f"or non-finite numbers, at most {v.MAX_PAYLOAD_DEPTH} deep."
            ),
        ]
        | Absent
    ) = UNSET
    group_id: Annotated[GroupId | None, Meta(extra_json_schema={"default": "default"})] | Absent = (
        UNSET
    )
    priority: Annotated[int, Meta(ge=0, le=9)] | Absent | None = UNSET
    ordering_key: (
        Annotated[
            TextKey,
            Meta(
                description="Jobs sharing an ordering key run one at a time, in sequence order, "
                "across all invocations; a failed one holds the rest."
            ),
        ]
        | Absent
    ) = UNSET
    sequence: (
        Annotated[
            Annotated[int, Meta(ge=0, le=v.MAX_SEQUENCE)] | None,
            Meta(
                description="Needs ordering_key; default: after the key's last job. A sequence "
                "behind one that has started is refused (409 sequence_conflict); one that exists "
                "names that job.",
            ),
        ]
        | Absent
    ) = UNSET
    idempotency_key: (
        Annotated[
            TextKey,
            Meta(
                description="Unique per task: the same key again returns the existing job "
                "(`created` false)."
            ),
        ]
        | Absent
    ) = UNSET
    max_attempts: Annotated[int, Meta(ge=1, le=100)] | Absent | None = UNSET


class SingleJobRequest(JobItem, kw_only=True, forbid_unknown_fields=True):
    wait_ms: (
        Annotated[
            Annotated[int, Meta(ge=v.MIN_WAIT_MS)] | None,
            Meta(
                description="Run the job here at once and wait up to this long (at most "
                "THUMBQ_BUDGET_MS - THUMBQ_BUFFER_MS) for it: under the same rate limit, claim "
                "and lease as a batch. 200 when it has ended within the wait, else 202 with "
                "`wait.reason`.",
            ),
        ]
        | Absent
    ) = UNSET


class JobItemsRequest(Struct, forbid_unknown_fields=True):
    items: Annotated[list[JobItem], Meta(min_length=1, max_length=v.MAX_ITEMS)]


JOB_REQUEST = {
    "description": "One job (its fields, and `wait_ms` to run it at once), or `items`: 1 to "
    f"{v.MAX_ITEMS} jobs, all or none. A `thumbnail` job's payload is "
    '`{"source_key", "etag"?, "content_type"?}` (as POST /api/thumbnails/enqueue; storage is '
    "asked for the etag of a file given without one); it is idempotent by key and etag and "
    "takes no ordering_key, sequence, idempotency_key or max_attempts.",
    "anyOf": [{"$ref": SingleJobRequest}, {"$ref": JobItemsRequest}],
}


class JobAccepted(Struct, kw_only=True):
    job_id: int
    task: str
    created: Annotated[
        bool,
        Meta(
            description="False: the same thumbnail version, idempotency key or ordering key and "
            "sequence named an existing job (or an earlier item of the call)."
        ),
    ]
    status: JobStatus
    ordering_key: str | None
    sequence: int | None
    missing: Annotated[
        bool,
        Meta(
            description="A thumbnail job whose file storage does not have (its run ends it "
            "`cancelled` with `source_missing`)."
        ),
    ]


class JobsAccepted(Struct):
    created: int
    existing: int
    jobs: Annotated[list[JobAccepted], Meta(description="One per item, in order.")]


class JobView(Struct, kw_only=True):
    id: int
    task: str
    group_id: str
    status: JobStatus
    payload: Annotated[
        Any,
        Meta(
            description="The job's input; a thumbnail job's source: "
            '`{"source_key", "etag", "content_type"}`.'
        ),
    ]
    result: Annotated[
        Any,
        Meta(
            description="What the handler returned (null until it completes); a completed "
            "thumbnail job's thumbnails: thumbnail_key, thumbnails (size -> key), "
            "thumbnail_content_type, width, height, bytes, thumbhash, dominant_color, degraded."
        ),
    ]
    error_code: str | None
    last_error: str | None
    attempts: int
    max_attempts: int
    priority: Annotated[int, Meta(ge=0, le=9)]
    created_at: Timestamp
    ordering_key: str | Absent | None = UNSET
    sequence: int | Absent | None = UNSET
    idempotency_key: str | Absent | None = UNSET
    progress_done: int | Absent | None = UNSET
    progress_total: int | Absent | None = UNSET
    checkpoints: (
        Annotated[
            int,
            Meta(description="How often the handler checkpointed (its state stays inside)."),
        ]
        | Absent
    ) = UNSET
    duration_ms: int | Absent | None = UNSET
    thumbnail_url: SignedUrl | Absent = UNSET
    thumbnail_urls: SignedUrls | Absent = UNSET
    updated_at: Timestamp | Absent = UNSET
    started_at: Timestamp | Absent = UNSET
    completed_at: Timestamp | Absent = UNSET
    next_attempt_at: Timestamp | Absent = UNSET


_REASONS_DOC = (
    "Why it has not ended: rate_limited (no token; retry_after_ms), busy (another invocation "
    "holds it, or this process runs as many interactive jobs as it runs at once), not_ready (it "
    "waits behind its ordering key or for its retry), too_long (jobs like it take longer than "
    "the wait), timeout (stopped at the end of the wait and handed back at once, no attempt "
    "used), checkpointed (a later batch resumes it), retrying (it failed; backoff), unrecorded "
    "(the database did not take its outcome; it runs again), running (a thread handler still "
    "running at the end of the wait: it keeps the job until it ends, and its outcome is "
    "recorded then)."
)


@cache
def job_run() -> type:
    """A job that ran (or could not) within `wait_ms`: its reasons as the engine names them
    (built on first use: the engine is not imported to serve other requests)."""
    from worker.engine.interactive import REASONS

    wait = msgspec.defstruct(
        "JobWait",
        [
            ("ran", Annotated[bool, Meta(description="The job ran in this call.")]),
            ("finished", Annotated[bool, Meta(description="The job has ended (see job).")]),
            ("reason", Annotated[Literal[REASONS] | None, Meta(description=_REASONS_DOC)]),
            ("message", str),
            ("retry_after_ms", int | None),
            ("duration_ms", int),
        ],
    )
    return msgspec.defstruct("JobRun", [("wait", wait), ("job", JobView)], bases=(JobAccepted,))


class JobCancelled(Struct):
    job_id: int
    cancelled: Annotated[
        bool, Meta(description="False: the job had already ended (its status says how).")
    ]
    status: JobStatus
    group_id: str


def _accepted() -> dict[str, Any]:
    return {"anyOf": [{"$ref": job_run}, {"$ref": JobAccepted}, {"$ref": JobsAccepted}]}


@bp.post("/api/jobs")
@describe(
    Op(
        "enqueueJobs",
        "Enqueue a job of any task (or `items`: up to 1 000, all or none). With `wait_ms`, a "
        "single job runs here at once, under the same rate limit, claim and lease as a batch: "
        "200 once it has ended, 202 while it still waits (`wait.reason`).",
        {
            200: Answer(
                "With wait_ms: the job ended within the wait, completed (its result) or not (its "
                "error); or it had ended before.",
                job_run,
            ),
            202: Answer(
                "Queued: the job (JobAccepted), the items (JobsAccepted), or with wait_ms a job "
                "that has not ended, and why (JobRun).",
                _accepted,
                headers={
                    "Retry-After": {
                        "description": "With wait.reason rate_limited: seconds until a token "
                        "comes.",
                        "schema": {"type": "integer"},
                    }
                },
            ),
            **BAD_REQUEST,
            **ADMIN_ERRORS,
            404: "NotFound",
            409: Answer(
                "sequence_conflict: a sequence behind one of its ordering key that has already "
                "started; nothing was enqueued.",
                Error,
            ),
        },
        security=ADMIN,
        body=JOB_REQUEST,
    )
)
def enqueue() -> Response:
    """Enqueue one job or many (all or none); with `wait_ms`, run one here at once."""
    st = state()
    require_admin(st.config)
    body = v.json_body()
    items, wait_ms = v.job_request(st.config, body)
    from worker.app.jobs import submit

    try:
        with st.connection() as conn:
            rows = submit(conn, st.storage(), st.config, items)
    except SequenceConflict as exc:
        raise ApiError(409, exc.code, exc.message) from None
    finally:
        st.progress_cache.forget()  # items may name several groups
    if "items" in body:
        created = sum(1 for r in rows if r["created"])
        return json_response(
            {"created": created, "existing": len(rows) - created, "jobs": rows}, 202
        )
    if wait_ms is None:
        return json_response(rows[0], 202)
    return _run_now(rows[0], wait_ms)


def _run_now(accepted: dict[str, Any], wait_ms: int) -> Response:
    """Run the job just enqueued within `wait_ms`: 200 once it has ended (its result, or its
    failure), 202 while it still waits, with why (`wait.reason`)."""
    st = state()
    job_id = int(accepted["job_id"])
    if not st.inline_slots.acquire(blocking=False):
        with st.connection() as conn:
            row = _row(conn, job_id)
        wait = {
            "ran": False,
            "finished": False,
            "reason": "busy",
            "message": "this process is already running as many interactive jobs as it runs at "
            "once (one per render process, one less than its connection pool): the job stays "
            "queued",
            "retry_after_ms": None,
            "duration_ms": 0,
        }
        return json_response({**accepted, "wait": wait, "job": view(row, signer())}, 202)
    try:
        from worker.engine.interactive import run_job

        with st.connection() as conn:
            run = run_job(
                st.config,
                conn,
                st.storage(),
                st.render_pool(),
                job_id,
                wait_ms,
                task=str(accepted["task"]),
            )
    finally:
        st.inline_slots.release()
        st.progress_cache.forget()
    if run.row is None:  # deleted meanwhile (retention, an operator)
        raise ApiError(404, "job_not_found", f"there is no job {job_id}")
    headers = {}
    if run.retry_after_ms is not None:
        headers["Retry-After"] = str(max(1, math.ceil(run.retry_after_ms / 1000)))
    body = {
        **accepted,
        "status": run.row["status"],
        "wait": run.summary(),
        "job": view(run.row, signer()),
    }
    return json_response(body, 200 if run.finished else 202, headers)


def _row(conn: db.Conn, job_id: int) -> dict[str, Any]:
    from worker.engine.queue import Queue

    row = Queue(conn).job(job_id)
    if row is None:
        raise ApiError(404, "job_not_found", f"there is no job {job_id}")
    return row


@bp.get("/api/jobs/<job_id>")
@describe(
    Op(
        "showJob",
        "One job: status, payload, result or error, attempts, priority, ordering, progress and "
        "times.",
        {200: Answer("The job.", JobView), 400: "BadRequest", 404: "NotFound", **ADMIN_ERRORS},
        security=ADMIN,
        path=JobPath,
    )
)
def show(job_id: str) -> Response:
    """One job: status, payload, result or error, attempts, ordering, progress, times."""
    st = state()
    require_admin(st.config)
    jid = v.job_id(job_id)
    with st.connection() as conn:
        row = _row(conn, jid)
    return json_response(view(row, signer()))


@bp.post("/api/jobs/<job_id>/cancel")
@describe(
    Op(
        "cancelJob",
        "Cancel a job that waits or runs (a running handler sees ctx.cancelled() at its next "
        "check; the next job of its ordering key goes).",
        {
            200: Answer("Done, or it had already ended.", JobCancelled),
            **BAD_REQUEST,
            404: "NotFound",
            **ADMIN_ERRORS,
        },
        security=ADMIN,
        path=JobPath,
        body=Empty,
        body_required=False,
    )
)
def cancel(job_id: str) -> Response:
    """Cancel a job that waits or runs; a running handler sees `ctx.cancelled()`."""
    st = state()
    require_admin(st.config)
    jid = v.job_id(job_id)
    read_body(Empty, optional=True)
    from worker.app.jobs import cancel as cancel_job

    with st.connection() as conn:
        result = cancel_job(conn, jid)
    if result is None:
        raise ApiError(404, "job_not_found", f"there is no job {jid}")
    st.progress_cache.forget(result["group_id"])
    return json_response(result)
