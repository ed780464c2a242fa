"""The operator page (`GET /operator`) and the JSON it reads and writes.

The page is static HTML, JS and CSS like the progress page; every read and every action goes
through the admin secret (`Authorization: Bearer <THUMBQ_CRON_SECRET>`), which the page asks
for and keeps in the tab's sessionStorage. `GET /api/ops/overview` is one SQL call
(`thumbq.operator_overview`, sql/013_operator.sql): queues, tasks, throughput per minute,
failures by code with examples, the dead-letter queue, running jobs, recent batch runs.
`POST /api/ops/dlq/replay` with `{"job_ids": [...]}` or `{"all": true}` queues dead-lettered
jobs again with fresh attempts and one message each. Cancelling is `POST
/api/jobs/<id>/cancel` (api/jobs.py).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from flask import Blueprint, Response

from api import validation as v
from api.auth import require_admin
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


@cache
def _page() -> str:
    return resources.files("api").joinpath("static/operator.html").read_text(encoding="utf-8")


@bp.get("/operator")
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
def overview() -> Response:
    """Queues, tasks, throughput, failures, dead letters, running jobs and recent runs."""
    st = state()
    require_admin(st.config)
    with st.connection() as conn:
        row = db.one(conn, "operator_overview", {"limit": OVERVIEW_LIMIT})
    assert row is not None
    return json_response(row["overview"], headers={"Cache-Control": "no-store"})


def _replay_ids(body: dict[str, object]) -> list[int] | None:
    unknown = set(body) - {"job_ids", "all"}
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


def _paths() -> dict[str, object]:
    from api.openapi import _ADMIN_ERRORS, _BODY_ERRORS, ADMIN, _body, _json, _op

    def listed(**props: object) -> dict[str, object]:
        return {"type": "array", "items": {"type": "object", "properties": props}}

    overview = {
        "type": "object",
        "required": [
            "generated_at",
            "queues",
            "tasks",
            "throughput",
            "failures",
            "dead_letters",
            "dead_letters_total",
            "running",
            "runs",
        ],
        "properties": {
            "generated_at": {"type": "string", "format": "date-time"},
            "queues": listed(
                queue={"type": "string"},
                priority={"type": ["integer", "null"]},
                depth={"type": "integer"},
                waiting={"type": "integer"},
                in_flight={"type": "integer"},
                oldest_age_s={"type": ["integer", "null"]},
            ),
            "tasks": listed(task={"type": "string"}),
            "throughput": listed(
                minute={"type": "string"}, completed={"type": "integer"}, failed={"type": "integer"}
            ),
            "failures": listed(error_code={"type": "string"}, count={"type": "integer"}),
            "dead_letters": listed(job_id={"type": "integer"}),
            "dead_letters_total": {"type": "integer"},
            "running": listed(job_id={"type": "integer"}),
            "runs": listed(id={"type": "integer"}),
        },
    }
    replay_body = {
        "type": "object",
        "description": 'Either "job_ids" or "all": true.',
        "properties": {
            "job_ids": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_REPLAY_IDS,
                "items": {"type": "integer", "minimum": 1},
            },
            "all": {"const": True},
        },
        "additionalProperties": False,
    }
    ids = {"type": "array", "items": {"type": "integer"}}
    replayed = {
        "type": "object",
        "required": ["replayed", "job_ids", "skipped"],
        "properties": {"replayed": {"type": "integer"}, "job_ids": ids, "skipped": ids},
    }
    return {
        "/operator": {
            "get": _op(
                "The operator page: queues, throughput, failures, dead letters, running jobs.",
                {
                    "200": {
                        "description": "An HTML page; it asks for the admin secret.",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
                op_id="operatorPage",
            )
        },
        "/api/ops/overview": {
            "get": _op(
                "Everything the operator page shows, from one SQL call.",
                {"200": _json(overview, "The overview."), **_ADMIN_ERRORS},
                security=ADMIN,
                op_id="getOpsOverview",
            )
        },
        "/api/ops/dlq/replay": {
            "post": _op(
                "Queue dead-lettered jobs again: fresh attempts, one new message each.",
                {
                    "200": _json(
                        replayed, "What was replayed, and the ids that were not dead letters."
                    ),
                    **_BODY_ERRORS,
                    **_ADMIN_ERRORS,
                },
                security=ADMIN,
                body=_body(replay_body),
                op_id="replayDeadLetters",
            )
        },
    }


def __getattr__(name: str) -> object:
    # Built on first use (api/openapi.py asks for it), so that serving a request never imports
    # the OpenAPI module.
    if name == "openapi_paths":
        return _paths()
    raise AttributeError(name)
