"""The /api/thumbnails routes: translate requests into engine calls and results into JSON."""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from typing import Any

from flask import Blueprint, Response, current_app, request
from werkzeug.http import parse_etags

from api import validation as v
from api.auth import Principal, require_admin, require_reader
from api.errors import ApiError, json_body, json_response
from api.state import AppState
from worker.engine import db
from worker.engine.progress import poll_after_ms, progress_body
from worker.engine.queue import Queue

bp = Blueprint("thumbnails", __name__, url_prefix="/api/thumbnails")

BATCH_BUSY_RETRY_S = 10


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
def batch_generate() -> Response:
    """One time-budgeted batch; the engine's report as JSON. The budget counts from the
    request's arrival, as the platform's time limit does: opening the batch's connection (and,
    on a first request, the storage client) is part of it."""
    arrived = time.monotonic()
    st = state()
    config = st.config
    require_admin(config)
    body = _cron_params()
    v.check_fields(body, optional=("budget_ms", "max_items"))
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
def backfill() -> Response:
    """List storage under a prefix and enqueue every file lacking a thumbnail."""
    st = state()
    require_admin(st.config)
    body = v.json_body()
    v.check_fields(body, required=("prefix",), optional=("group_id",))
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
    body = v.json_body()
    v.check_fields(body, required=("group_id",))
    return v.group_id(body["group_id"])


@bp.post("/retry-failed")
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
def cleanup_stale() -> Response:
    """Reset `processing` jobs whose lease expired, prune history past retention, and remove
    the temporary files of writes killed mid-way."""
    st = state()
    require_admin(st.config)
    v.check_fields(_cron_params())
    from worker.thumbnails.files import cleanup_stale as cleanup

    with st.connection() as conn:
        result = cleanup(conn, st.config, storage=st.storage())
    st.progress_cache.forget()
    return json_response(result)


@bp.get("/jobs/<job_id>")
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
