"""The operator page (`GET /operator`) and the JSON it reads and writes.

The page is static HTML, JS and CSS like the progress page; every read and every action goes
through the admin secret (`Authorization: Bearer <THUMBQ_CRON_SECRET>`), which the page asks
for and keeps in the tab's sessionStorage. `GET /api/ops/overview` is one SQL call
(`thumbq.operator_overview`, sql/functions/80_operator.sql): queues, tasks, throughput per minute,
failures by code with examples, the dead-letter queue, running jobs, recent batch runs.
`POST /api/ops/dlq/replay` with `{"job_ids": [...]}` or `{"all": true}` queues dead-lettered
jobs again with fresh attempts and one message each. Cancelling is `POST
/api/jobs/<id>/cancel` (api/jobs.py).
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from importlib import resources
from typing import Annotated, Any, Literal

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
    JobId,
    Op,
    describe,
    field_names,
    html,
)
from api.errors import bad_request, json_response
from api.thumbnails import state
from worker.engine import db

bp = Blueprint("operator", __name__)

OVERVIEW_LIMIT = 50
MAX_REPLAY_IDS = 1000
_CSP = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)


# -- answers and requests ---------------------------------------------------------------------


class QueueRow(Struct, kw_only=True):
    queue: str | Absent = UNSET
    priority: int | Absent | None = UNSET
    depth: int | Absent = UNSET
    waiting: int | Absent = UNSET
    in_flight: int | Absent = UNSET
    oldest_age_s: int | Absent | None = UNSET


class TaskRow(Struct, kw_only=True):
    task: str | Absent = UNSET


class MinuteRow(Struct, kw_only=True):
    minute: str | Absent = UNSET
    completed: int | Absent = UNSET
    failed: int | Absent = UNSET


class FailureRow(Struct, kw_only=True):
    error_code: str | Absent = UNSET
    count: int | Absent = UNSET


class JobRow(Struct, kw_only=True):
    job_id: int | Absent = UNSET


class RunRow(Struct, kw_only=True):
    id: int | Absent = UNSET


class OpsOverview(Struct):
    generated_at: datetime
    queues: list[QueueRow]
    tasks: list[TaskRow]
    throughput: list[MinuteRow]
    failures: list[FailureRow]
    dead_letters: list[JobRow]
    dead_letters_total: int
    running: list[JobRow]
    runs: list[RunRow]


class ReplayRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """Either "job_ids" or "all": true."""

    job_ids: Annotated[list[JobId], Meta(min_length=1, max_length=MAX_REPLAY_IDS)] | Absent = UNSET
    all: Literal[True] | Absent = UNSET


class Replayed(Struct):
    replayed: int
    job_ids: list[int]
    skipped: list[int]


@cache
def _page() -> str:
    return resources.files("api").joinpath("static/operator.html").read_text(encoding="utf-8")


@bp.get("/operator")
@describe(
    Op(
        "operatorPage",
        "The operator page: queues, throughput, failures, dead letters, running jobs.",
        {200: html("An HTML page; it asks for the admin secret.")},
    )
)
def operator_page() -> Response:
    """The operator page; it asks for the admin secret before it reads anything."""
    return Response(
        _page(),
        mimetype="text/html",
        headers={
            "Content-Security-Policy": _CSP,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )


@bp.get("/api/ops/overview")
@describe(
    Op(
        "getOpsOverview",
        "Everything the operator page shows, from one SQL call.",
        {200: Answer("The overview.", OpsOverview), **ADMIN_ERRORS},
        security=ADMIN,
    )
)
def overview() -> Response:
    """Queues, tasks, throughput, failures, dead letters, running jobs and recent runs."""
    st = state()
    require_admin(st.config)
    with st.connection() as conn:
        row = db.one(conn, "operator_overview", {"limit": OVERVIEW_LIMIT})
    assert row is not None
    return json_response(row["overview"], headers={"Cache-Control": "no-store"})


def _replay_ids(body: dict[str, Any]) -> list[int] | None:
    unknown = set(body) - set(field_names(ReplayRequest)[1])
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(sorted(unknown))}")
    if ("job_ids" in body) == ("all" in body):
        raise bad_request('give either "job_ids": [ids] or "all": true')
    if "all" in body:
        if body["all"] is not True:
            raise bad_request('"all" must be true')
        return None
    ids = body["job_ids"]
    if (
        not isinstance(ids, list)
        or not 1 <= len(ids) <= MAX_REPLAY_IDS
        or not all(
            isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= v.MAX_JOB_ID for i in ids
        )
    ):
        raise bad_request(
            f'"job_ids" must be a list of 1 to {MAX_REPLAY_IDS} job ids (positive integers)',
            "invalid_job_id",
        )
    return sorted(set(ids))


@bp.post("/api/ops/dlq/replay")
@describe(
    Op(
        "replayDeadLetters",
        "Queue dead-lettered jobs again: fresh attempts, one new message each.",
        {
            200: Answer("What was replayed, and the ids that were not dead letters.", Replayed),
            **BAD_REQUEST,
            **ADMIN_ERRORS,
        },
        security=ADMIN,
        body=ReplayRequest,
    )
)
def replay() -> Response:
    """Queue dead-lettered jobs again: fresh attempts, one new message each; answers which."""
    st = state()
    require_admin(st.config)
    ids = _replay_ids(v.json_body())
    with st.connection() as conn:
        row = db.one(conn, "replay_dead_letters", {"job_ids": ids})
    assert row is not None
    replayed = list(row["replayed"] or [])
    st.progress_cache.forget()  # the jobs may belong to any group
    skipped = [] if ids is None else sorted(set(ids) - set(replayed))
    return json_response({"replayed": len(replayed), "job_ids": replayed, "skipped": skipped})
