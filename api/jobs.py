"""The /api/jobs routes: jobs of any task (worker.tasks), the built-in `thumbnail` included.

`POST /api/jobs` enqueues one job or `{"items": [...]}`; with `wait_ms`, one job runs here at once
when it can (worker.engine.interactive) and the answer is 200 with how it ended, or 202 with why it
still waits. `GET /api/jobs/<id>` shows one; `POST /api/jobs/<id>/cancel` cancels one that waits or
runs. Admin only, like the other routes that write or show single jobs.
"""

from __future__ import annotations

import math
from typing import Any

from flask import Blueprint, Response

from api import validation as v
from api.auth import require_admin
from api.errors import ApiError, json_response
from api.signed import signer
from api.thumbnails import state
from worker.app.jobs import SequenceConflict, view
from worker.engine import db

bp = Blueprint("jobs", __name__)


@bp.post("/api/jobs")
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
def show(job_id: str) -> Response:
    """One job: status, payload, result or error, attempts, ordering, progress, times."""
    st = state()
    require_admin(st.config)
    jid = v.job_id(job_id)
    with st.connection() as conn:
        row = _row(conn, jid)
    return json_response(view(row, signer()))


@bp.post("/api/jobs/<job_id>/cancel")
def cancel(job_id: str) -> Response:
    """Cancel a job that waits or runs; a running handler sees `ctx.cancelled()`."""
    st = state()
    require_admin(st.config)
    jid = v.job_id(job_id)
    v.check_fields(v.json_body(optional=True))
    from worker.app.jobs import cancel as cancel_job

    with st.connection() as conn:
        result = cancel_job(conn, jid)
    if result is None:
        raise ApiError(404, "job_not_found", f"there is no job {jid}")
    st.progress_cache.forget(result["group_id"])
    return json_response(result)
