"""Operations: the queue inspection view and the liveness check."""

from __future__ import annotations

import time

from flask import Blueprint, Response

from api.auth import require_admin
from api.errors import json_response
from api.thumbnails import state
from worker.engine import db
from worker.engine.queue import Queue

bp = Blueprint("ops", __name__)


@bp.get("/api/queues")
def queues() -> Response:
    """Queue depth, in flight, oldest message, DLQ, jobs by status, bucket tokens, alerts."""
    st = state()
    require_admin(st.config)
    with st.connection() as conn:
        overview = Queue(conn, bucket=st.config.rate_bucket).overview()
    return json_response(overview)


@bp.get("/healthz")
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
