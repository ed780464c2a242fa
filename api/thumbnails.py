"""The /api/thumbnails routes: translate requests into engine calls and results into JSON."""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Annotated, Any

import msgspec
from flask import Blueprint, Response, current_app, request
from msgspec import UNSET, Meta, Struct
from werkzeug.http import parse_etags

from api import validation as v
from api.auth import Principal, require_admin, require_reader
from api.contract import (
    ADMIN,
    ADMIN_ERRORS,
    BAD_REQUEST,
    READER,
    RETRY_AFTER,
    Absent,
    Answer,
    Empty,
    Error,
    GroupId,
    GroupQuery,
    JobPath,
    Key,
    Op,
    Timestamp,
    check_body,
    describe,
    read_body,
)
from api.errors import ApiError, json_body, json_response
from api.state import AppState
from worker.engine import db
from worker.engine.progress import (
    POLL_RUNNING_MS,
    POLL_SETTLED_MS,
    POLL_WAITING_MS,
    poll_after_ms,
    progress_body,
)
from worker.engine.queue import Queue
from worker.engine.states import JobStatus, StopReason

bp = Blueprint("thumbnails", __name__, url_prefix="/api/thumbnails")

BATCH_BUSY_RETRY_S = 10

# -- requests and answers ---------------------------------------------------------------------

Count = Annotated[int, Meta(ge=0)]
MaybeGroupId = Annotated[GroupId | None, Meta(extra_json_schema={"default": "default"})]

Progress = msgspec.defstruct(
    "Progress",
    [
        ("group_id", str),
        *((name, Count) for name in ("total", *(s.value for s in JobStatus))),
        (
            "progress_percentage",
            Annotated[
                float,
                Meta(ge=0, le=100, description="Share of jobs no longer pending or processing."),
            ],
        ),
        (
            "estimated_time_remaining_seconds",
            Annotated[
                int | None,
                Meta(
                    description="From the completion rate observed in the current wave of work; "
                    "0 when nothing is left, null while no rate has been observed."
                ),
            ],
        ),
        ("updated_at", datetime),
        (
            "poll_after_ms",
            Annotated[
                int,
                Meta(
                    description=f"{POLL_RUNNING_MS} while jobs are processing, {POLL_WAITING_MS} "
                    f"while jobs wait for the next batch, {POLL_SETTLED_MS} when nothing is "
                    "pending or processing. Depends on the group's state only, so one ETag is "
                    "one body."
                ),
            ],
        ),
        ("rate_per_second", float | None | Absent, UNSET),
        (
            "version",
            Annotated[int, Meta(description="Bumped by every change of the counts.")] | Absent,
            UNSET,
        ),
        (
            "progress_done",
            Annotated[
                int,
                Meta(
                    ge=0,
                    description="The sum of the group's jobs' own progress, as their tasks "
                    "report it (ctx.progress(done, total)); 0 for thumbnails.",
                ),
            ]
            | Absent,
            UNSET,
        ),
        ("progress_total", Count | Absent, UNSET),
    ],
    kw_only=True,
)


class EnqueueItem(Struct, kw_only=True, forbid_unknown_fields=True):
    source_key: Key
    etag: (
        Annotated[
            Annotated[str, Meta(max_length=v.MAX_ETAG_LENGTH)] | None,
            Meta(
                description="The object version; asked of storage when left out.",
            ),
        ]
        | Absent
    ) = UNSET
    content_type: Annotated[str, Meta(max_length=v.MAX_CONTENT_TYPE_LENGTH)] | Absent | None = UNSET
    group_id: MaybeGroupId | Absent = UNSET


class EnqueueRequest(Struct, forbid_unknown_fields=True):
    items: Annotated[list[EnqueueItem], Meta(min_length=1, max_length=v.MAX_ITEMS)]


class EnqueuedJob(Struct):
    job_id: int
    source_key: str
    created: bool
    status: JobStatus
    missing: bool


class EnqueueResult(Struct):
    enqueued: Annotated[int, Meta(description="New jobs created.")]
    existing: Annotated[int, Meta(description="Versions already known (idempotent).")]
    missing: Annotated[
        int,
        Meta(
            description="Items given without an etag that storage does not have. They are "
            "listed in the group (the next batch ends them `cancelled` with `source_missing`) "
            "and not counted as enqueued."
        ),
    ]
    jobs: list[EnqueuedJob]


class BackfillRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    prefix: Annotated[
        str, Meta(max_length=1024, description="Key prefix to list; empty for everything.")
    ]
    group_id: MaybeGroupId | Absent = UNSET


class BackfillResult(Struct):
    listed: int
    have_thumbnail: int
    enqueued: int
    existing: int
    group_id: str


class GroupRequest(Struct, forbid_unknown_fields=True):
    group_id: GroupId


class BatchRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    budget_ms: (
        Annotated[
            int,
            Meta(
                ge=v.MIN_BUDGET_MS,
                description="Shorter budget for this call; at most THUMBQ_BUDGET_MS (default "
                "and maximum: the configured budget).",
            ),
        ]
        | Absent
    ) = UNSET
    max_items: (
        Annotated[
            int, Meta(ge=1, description="At most this many items; at most THUMBQ_BATCH_SIZE.")
        ]
        | Absent
    ) = UNSET


_BATCH_COUNTS = {
    "failed": "Jobs this run ended `failed` (a permanent error, or a transient one on the last "
    "attempt).",
    "unsupported": "Jobs this run ended `unsupported` (no renderer for the type).",
    "missing": "Jobs whose source was missing from storage (ended `cancelled` with "
    "`source_missing`).",
    "checkpointed": "Jobs whose handler stopped to be resumed by a later invocation (a task's "
    "checkpoint: no attempt used).",
}


@cache
def batch_result() -> type:
    """The report of a batch, its counts as the engine keeps them (built on first use: the
    engine's modules are not imported to serve a progress request)."""
    from worker.engine.recording import COUNTS

    return msgspec.defstruct(
        "BatchResult",
        [
            ("run_id", int),
            *(
                (str(name), Annotated[int, Meta(description=_BATCH_COUNTS[name])])
                if name in _BATCH_COUNTS
                else (str(name), int)
                for name in COUNTS
            ),
            ("remaining", int | None),
            ("stopped_reason", StopReason),
            ("duration_ms", int),
            ("budget_ms", int),
            ("retry_after_ms", int | None),
        ],
    )


PageKeys = dict[str, str]


class PageThumbnails(Struct):
    page: int
    thumbnails: PageKeys


_URL_FIELDS_DOC = {
    "thumbnail_url": "THUMBQ_SIGNED_URL_TTL_S only: a URL that GETs the largest thumbnail with "
    "no credentials until it expires (S3's presigned GET, or /thumbnails/... signed).",
    "thumbnail_urls": "THUMBQ_SIGNED_URL_TTL_S only: box size -> such a URL, and `pages` "
    "([{page, thumbnails: {size: URL}}]) for a document with several pages.",
}
SignedUrl = Annotated[str | None, Meta(description=_URL_FIELDS_DOC["thumbnail_url"])]
SignedUrls = Annotated[dict[str, Any] | None, Meta(description=_URL_FIELDS_DOC["thumbnail_urls"])]


class Job(Struct, kw_only=True):
    id: int
    group_id: str
    source_key: Annotated[str | None, Meta(description="null for a job of another task.")]
    source_etag: str
    status: JobStatus
    attempts: int
    source_bytes: int | Absent | None = UNSET
    content_type: str | Absent | None = UNSET
    max_attempts: int | Absent = UNSET
    error_code: str | Absent | None = UNSET
    last_error: str | Absent | None = UNSET
    thumbnail_key: (
        Annotated[str | None, Meta(description="The largest size's key (see thumbnails).")] | Absent
    ) = UNSET
    thumbnail_content_type: str | Absent | None = UNSET
    thumbnails: (
        Annotated[
            PageKeys | None,
            Meta(
                description="Every size made (THUMBQ_THUMB_SIZES): box size -> storage key (a "
                "document's first page)."
            ),
        ]
        | Absent
    ) = UNSET
    pages: (
        Annotated[
            list[PageThumbnails],
            Meta(
                description="Each page shown, in order (THUMBQ_PAGES: pages 1..N of a document; "
                "one entry for anything else), with its box size -> storage key."
            ),
        ]
        | Absent
    ) = UNSET
    thumbhash: (
        Annotated[
            str | None,
            Meta(description="ThumbHash of the thumbnail, base64: a blurred placeholder."),
        ]
        | Absent
    ) = UNSET
    dominant_color: (
        Annotated[str | None, Meta(description="The thumbnail's dominant colour, #rrggbb.")]
        | Absent
    ) = UNSET
    degraded: (
        Annotated[
            bool | None,
            Meta(
                description="The input could not render in its window at full quality; this "
                "thumbnail is a cheaper one (lower resolution, no anti-aliasing, images "
                "skipped)."
            ),
        ]
        | Absent
    ) = UNSET
    width: int | Absent | None = UNSET
    height: int | Absent | None = UNSET
    bytes: int | Absent | None = UNSET
    duration_ms: int | Absent | None = UNSET
    msg_id: int | Absent | None = UNSET
    dlq_msg_id: int | Absent | None = UNSET
    thumbnail_url: SignedUrl | Absent = UNSET
    thumbnail_urls: SignedUrls | Absent = UNSET
    worker_id: str | Absent | None = UNSET
    lease_expires_at: Timestamp | Absent = UNSET
    next_attempt_at: Timestamp | Absent = UNSET
    created_at: Timestamp | Absent = UNSET
    updated_at: Timestamp | Absent = UNSET
    started_at: Timestamp | Absent = UNSET
    completed_at: Timestamp | Absent = UNSET


def _group_answer(field: str) -> type:
    return msgspec.defstruct(f"{field.capitalize()}Count", [(field, int)])


Requeued = _group_answer("requeued")
Cancelled = _group_answer("cancelled")


class Pruned(Struct):
    jobs: int
    batch_runs: int
    archived: int


class CleanupResult(Struct):
    reset_count: int
    pruned: Pruned
    temp_files_removed: int


class ProgressHeaders(Struct):
    if_none_match: str | Absent = msgspec.field(default=UNSET, name="If-None-Match")


_CRON_GET = " GET is for Vercel Cron, which calls its path with GET and no body."
_BATCH = "Run one time-budgeted batch: claim, render, record, release, report."
_CLEANUP = (
    "Reset processing jobs whose lease expired, prune finished jobs, batch runs and archived "
    "messages older than THUMBQ_RETENTION_DAYS (group summaries stay), and remove the temporary "
    "files that writes killed mid-way left in local file storage (those older than 15 minutes)."
)
_BATCH_ANSWERS: dict[int, Answer | str] = {
    200: Answer("The report of the invocation.", batch_result),
    **BAD_REQUEST,
    **ADMIN_ERRORS,
    409: Answer(
        "A batch is already running in this process (batch_in_progress).",
        Error,
        headers=RETRY_AFTER,
    ),
}
_CLEANUP_ANSWERS: dict[int, Answer | str] = {
    200: Answer("Done.", CleanupResult),
    **BAD_REQUEST,
    **ADMIN_ERRORS,
}


def state() -> AppState:
    """The process-wide resources of the current app."""
    st: AppState = current_app.extensions["thumbq"]
    return st


def _queue(conn: db.Conn) -> Queue:
    config = state().config
    return Queue(conn, bucket=config.rate_bucket, max_attempts=config.max_attempts)


def progress_etag(row: dict[str, Any]) -> str:
    """A strong validator: the group's version, bumped by every change of its counts, plus a hash
    of its id and last change (so a re-created group cannot repeat an old tag)."""
    digest = hashlib.sha256(
        f"{row['group_id']}\x00{row['updated_at'].isoformat()}".encode()
    ).hexdigest()[:16]
    return f"{row['version']}-{digest}"


def group_not_found(group_id: str) -> ApiError:
    # Also the answer for a group the caller may not see: its existence is not revealed.
    return ApiError(404, "group_not_found", f"no group {group_id!r}")


@dataclass(frozen=True)
class ProgressAnswer:
    """One version of a group's progress, ready to send: its ETag, headers and JSON body, and
    whether the group is settled (nothing pending or processing)."""

    tag: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    settled: bool = False

    @classmethod
    def of(cls, row: dict[str, Any]) -> ProgressAnswer:
        tag = progress_etag(row)
        headers = (
            ("ETag", f'"{tag}"'),
            ("Cache-Control", "no-cache"),
            ("Vary", "Authorization"),
            ("X-Poll-After-Ms", str(poll_after_ms(row))),
        )
        settled = row["pending"] + row["processing"] == 0
        return cls(tag, headers, json_body(progress_body(row)), settled)

    def matches(self, if_none_match: str | None) -> bool:
        """Whether an `If-None-Match` header names this version (weak comparison, RFC 9110)."""
        return bool(if_none_match) and parse_etags(if_none_match).contains_weak(self.tag)


def read_progress(st: AppState, group_id: str, who: Principal) -> ProgressAnswer | None:
    """A group's progress as `who` may see it: the operator sees every group; a user sees one
    only if RLS lets them (asked as the user, in one statement, and trusted for the access
    cache's interval). None for a missing group and for one the caller may not see. Both the
    answer and the access decision come from the process's caches when fresh; a connection is
    taken for each read and given back at once."""
    claims = who.claims_json

    def load() -> ProgressAnswer | None:
        with st.connection() as conn:
            row = db.one(conn, "progress", {"group_id": group_id})
        return None if row is None else ProgressAnswer.of(row)

    def may_see() -> bool:
        # As the user, through RLS, in one statement: RLS filters rows, so a user who gets the
        # row sees exactly what the operator sees.
        with st.connection() as conn:
            row = db.one(conn, "progress_as_user", {"claims": claims, "group_id": group_id})
        return row is not None

    def access_ttl(ok: bool) -> float:
        # A "may not" is kept no longer than an answer, so a user just added sees the group soon.
        # A "may" lasts 75-100% of the interval, so that pages opened together (a shared link,
        # a deploy) do not all ask RLS again in the same moment.
        if not ok:
            return st.progress_cache.ttl_s
        return st.access_cache.ttl_s * (0.75 + 0.25 * random.random())

    if claims is not None and not st.access_cache.get((group_id, claims), may_see, access_ttl):
        return None
    answer: ProgressAnswer | None = st.progress_cache.get((group_id, None), load)
    return answer


@bp.get("/progress")
@describe(
    Op(
        "getProgress",
        "Progress of a group: counts, percentage, ETA and when to poll again.",
        {
            200: Answer(
                "The group's progress.",
                Progress,
                headers={
                    "ETag": {"description": "Strong validator.", "schema": {"type": "string"}},
                    "Cache-Control": {"schema": {"const": "no-cache"}},
                    "X-Poll-After-Ms": {"schema": {"type": "integer"}},
                },
            ),
            304: Answer(
                "Unchanged since the ETag in If-None-Match; no body.",
                headers={
                    "ETag": {"schema": {"type": "string"}},
                    "X-Poll-After-Ms": {"schema": {"type": "integer"}},
                },
            ),
            400: "BadRequest",
            404: "NotFound",
            **ADMIN_ERRORS,
        },
        security=READER,
        query=GroupQuery,
        headers=ProgressHeaders,
    )
)
def progress() -> Response:
    """Counts, percentage, ETA and when to poll again; 304 while nothing changed."""
    st = state()
    who = require_reader(st.auth)
    group_id = v.query_group_id()
    answer = read_progress(st, group_id, who)
    if answer is None:
        raise group_not_found(group_id)
    if answer.matches(request.headers.get("If-None-Match")):
        return Response(status=304, headers=answer.headers)
    return Response(answer.body, 200, headers=answer.headers, mimetype="application/json")


def _cron_params() -> dict[str, Any]:
    # Vercel Cron invokes its path with GET and no body: the same options then come from the
    # query string.
    if request.method == "GET":
        return v.query_ints()
    return v.json_body(optional=True)


@bp.route("/batch-generate", methods=["POST", "GET"])
@describe(
    Op(
        "batchGenerate",
        _BATCH,
        _BATCH_ANSWERS,
        security=ADMIN,
        body=BatchRequest,
        body_required=False,
        method="POST",
    ),
    Op(
        "batchGenerateCron",
        _BATCH + _CRON_GET + " budget_ms and max_items come from the query string.",
        _BATCH_ANSWERS,
        security=ADMIN,
        query=BatchRequest,
        method="GET",
    ),
)
def batch_generate() -> Response:
    """One time-budgeted batch; the engine's report as JSON. The budget counts from the
    request's arrival, as the platform's time limit does: opening the batch's connection (and,
    on a first request, the storage client) is part of it."""
    arrived = time.monotonic()
    st = state()
    config = st.config
    require_admin(config)
    body = _cron_params()
    check_body(body, BatchRequest)
    budget_ms, max_items = v.batch_options(config, body.get("budget_ms"), body.get("max_items"))
    # One batch at a time per process: they would share (and fight over) the render processes.
    if not st.batch_lock.acquire(blocking=False):
        raise ApiError(
            409,
            "batch_in_progress",
            "a batch is already running in this process; try again when it ends",
            {"Retry-After": str(BATCH_BUSY_RETRY_S)},
        )
    try:
        from worker.engine.batch import run_batch

        with st.dedicated_connection() as conn:
            result = run_batch(
                config,
                conn,
                st.storage(),
                st.render_pool(),
                budget_ms=budget_ms,
                max_items=max_items,
                started=arrived,
            )
    finally:
        st.batch_lock.release()
        st.progress_cache.forget()
    return json_response(result.response())


@bp.post("/enqueue")
@describe(
    Op(
        "enqueue",
        "Enqueue object versions (idempotent per key and etag; all or none).",
        {
            202: Answer("Accepted: counts and job ids.", EnqueueResult),
            **BAD_REQUEST,
            **ADMIN_ERRORS,
        },
        security=ADMIN,
        body=EnqueueRequest,
    )
)
def enqueue() -> Response:
    """Enqueue object versions; all or none (one statement after every item is validated)."""
    st = state()
    require_admin(st.config)
    items = v.enqueue_items(v.json_body())
    from worker.thumbnails.files import enqueue_keys

    try:
        with st.connection() as conn:
            result = enqueue_keys(conn, st.storage(), st.config, items)
    finally:
        st.progress_cache.forget()  # items may name several groups
    return json_response(result, 202)


@bp.post("/backfill")
@describe(
    Op(
        "backfill",
        "List storage under a prefix and enqueue every file lacking a thumbnail.",
        {202: Answer("Accepted.", BackfillResult), **BAD_REQUEST, **ADMIN_ERRORS},
        security=ADMIN,
        body=BackfillRequest,
    )
)
def backfill() -> Response:
    """List storage under a prefix and enqueue every file lacking a thumbnail."""
    st = state()
    require_admin(st.config)
    body = read_body(BackfillRequest)
    prefix = v.key_prefix(body["prefix"])
    group_id = v.group_id(body["group_id"]) if body.get("group_id") is not None else "default"
    from worker.thumbnails.files import backfill as backfill_prefix

    try:
        with st.connection() as conn:
            result = backfill_prefix(conn, st.storage(), st.config, prefix, group_id)
    finally:
        st.progress_cache.forget(group_id)
    return json_response(result, 202)


def _group_body() -> str:
    return v.group_id(read_body(GroupRequest)["group_id"])


def _group_op(op_id: str, summary: str, answer: type) -> Op:
    return Op(
        op_id,
        summary,
        {200: Answer("Done.", answer), **BAD_REQUEST, **ADMIN_ERRORS, 404: "NotFound"},
        security=ADMIN,
        body=GroupRequest,
    )


@bp.post("/retry-failed")
@describe(
    _group_op("retryFailed", "Queue a group's failed jobs again with fresh attempts.", Requeued)
)
def retry_failed() -> Response:
    """Queue a group's failed jobs again with fresh attempts."""
    st = state()
    require_admin(st.config)
    group_id = _group_body()
    with st.connection() as conn:
        queue = _queue(conn)
        n = queue.retry_failed(group_id)
        st.progress_cache.forget(group_id)
        if n == 0 and queue.progress(group_id) is None:
            raise group_not_found(group_id)
    return json_response({"requeued": n})


@bp.post("/cancel")
@describe(_group_op("cancel", "Cancel a group's pending and processing jobs.", Cancelled))
def cancel() -> Response:
    """Cancel a group's pending and processing jobs."""
    st = state()
    require_admin(st.config)
    group_id = _group_body()
    with st.connection() as conn:
        queue = _queue(conn)
        n = queue.cancel(group_id)
        st.progress_cache.forget(group_id)
        if n == 0 and queue.progress(group_id) is None:
            raise group_not_found(group_id)
    return json_response({"cancelled": n})


@bp.route("/cleanup-stale", methods=["POST", "GET"])
@describe(
    Op(
        "cleanupStale",
        _CLEANUP,
        _CLEANUP_ANSWERS,
        security=ADMIN,
        body=Empty,
        body_required=False,
        method="POST",
    ),
    Op("cleanupStaleCron", _CLEANUP + _CRON_GET, _CLEANUP_ANSWERS, security=ADMIN, method="GET"),
)
def cleanup_stale() -> Response:
    """Reset `processing` jobs whose lease expired, prune history past retention, and remove
    the temporary files of writes killed mid-way."""
    st = state()
    require_admin(st.config)
    check_body(_cron_params(), Empty)
    from worker.thumbnails.files import cleanup_stale as cleanup

    with st.connection() as conn:
        result = cleanup(conn, st.config, storage=st.storage())
    st.progress_cache.forget()
    return json_response(result)


@bp.get("/jobs/<job_id>")
@describe(
    Op(
        "getJob",
        "One job, every column.",
        {200: Answer("The job.", Job), 400: "BadRequest", 404: "NotFound", **ADMIN_ERRORS},
        security=ADMIN,
        path=JobPath,
    )
)
def job(job_id: str) -> Response:
    """One job, every column."""
    st = state()
    require_admin(st.config)
    jid = v.job_id(job_id)
    with st.connection() as conn:
        row = _queue(conn).job(jid)
    if row is None:
        raise ApiError(404, "job_not_found", f"no job {jid}")
    from api.signed import signer

    urls = signer()
    if urls is not None:
        row.update(urls.fields(row))
    thumbnails = row.get("thumbnails")
    if isinstance(thumbnails, dict):
        # `thumbnails` stays the first page's {size: key}; `pages` lists every page in order
        # (THUMBQ_PAGES), the job row keeps them inside its thumbnails.
        pages = thumbnails.pop("pages", None)
        row["pages"] = pages if pages else [{"page": 1, "thumbnails": thumbnails}]
    return json_response(row)
