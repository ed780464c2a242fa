"""Operations: the queue inspection view and the liveness check."""

from __future__ import annotations

import time
from typing import Any, Literal

from flask import Blueprint, Response
from msgspec import UNSET, Struct

from api.auth import require_admin
from api.contract import ADMIN, ADMIN_ERRORS, Absent, Answer, Op, describe
from api.errors import json_response
from api.thumbnails import state
from worker.engine import db
from worker.engine.queue import Queue

bp = Blueprint("ops", __name__)


class Alert(Struct, kw_only=True):
    name: str | Absent = UNSET
    figure: Any | Absent = UNSET
    threshold: Any | Absent = UNSET
    detail: Any | Absent = UNSET


class QueueOverview(Struct):
    """The thumbq.queue_overview view (queue length, visible, in flight, oldest message age, DLQ
    length, jobs by status, bucket tokens) plus the open alerts."""

    alerts: list[Alert]


class Health(Struct, kw_only=True):
    status: Literal["ok"]
    database: Literal["ok"]
    database_ms: float | Absent = UNSET


@bp.get("/api/queues")
@describe(
    Op(
        "getQueues",
        "The inspection view as JSON.",
        {200: Answer("Queue state and alerts.", QueueOverview), **ADMIN_ERRORS},
        security=ADMIN,
    )
)
def queues() -> Response:
    """Queue depth, in flight, oldest message, DLQ, jobs by status, bucket tokens, alerts."""
    st = state()
    require_admin(st.config)
    with st.connection() as conn:
        overview = Queue(conn, bucket=st.config.rate_bucket).overview()
    return json_response(overview)


@bp.get("/healthz")
@describe(
    Op(
        "healthz",
        "Liveness plus a database round trip.",
        {200: Answer("Alive.", Health), 503: "Unavailable"},
    )
)
def healthz() -> Response:
    """Liveness plus a database round trip; 503 with Retry-After when the database is down."""
    st = state()
    started = time.perf_counter()
    with st.connection() as conn:
        db.one(conn, "ping")
    ms = round((time.perf_counter() - started) * 1000, 2)
    return json_response(
        {"status": "ok", "database": "ok", "database_ms": ms},
        headers={"Cache-Control": "no-store"},
    )
