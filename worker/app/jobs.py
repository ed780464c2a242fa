"""Jobs of any task as the HTTP API (`/api/jobs`) and the CLI (`thumbq jobs`) see them: enqueue,
one job's public view, cancel.

A `thumbnail` job goes through the thumbnail enqueue (worker.thumbnails.files): storage is asked for
the etag of a file given without one, a missing file is listed and ended `source_missing` by its
run, and the same version enqueued again is the same job. Any other task goes through
`thumbq.enqueue_jobs` (idempotency keys, ordering keys, priorities). Items are checked by
worker.app.validation before anything is written; a request that mixes both kinds writes them in one
transition (`thumbq.enqueue_mixed`), so that it is all or nothing like any other enqueue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from worker.engine.queue import Queue
from worker.engine.states import JobStatus
from worker.engine.tasks import THUMBNAIL

if TYPE_CHECKING:
    from worker.app.urls import UrlSigner
    from worker.engine import db
    from worker.engine.config import Config
    from worker.storage import Storage

# A job in one of these has ended: nothing more happens to it unless someone acts.
# What a job's public view carries, besides `payload` and `result` (which a thumbnail job builds
# from its columns). The checkpointed `state` stays inside: it is the handler's, not the caller's.
VIEW_FIELDS = (
    "id",
    "task",
    "group_id",
    "status",
    "error_code",
    "last_error",
    "attempts",
    "max_attempts",
    "priority",
    "ordering_key",
    "sequence",
    "idempotency_key",
    "progress_done",
    "progress_total",
    "checkpoints",
    "duration_ms",
    "created_at",
    "updated_at",
    "started_at",
    "completed_at",
    "next_attempt_at",
)
# A completed thumbnail job's result: where its thumbnails are and what they look like.
THUMBNAIL_RESULT = (
    "thumbnail_key",
    "thumbnails",
    "thumbnail_content_type",
    "width",
    "height",
    "bytes",
    "thumbhash",
    "dominant_color",
    "degraded",
)


class SequenceConflict(Exception):
    """A job would run out of order: its sequence is behind one of its ordering key that has
    already started (SQLSTATE 23P01 from thumbq.enqueue_jobs). Nothing was enqueued."""

    code = "sequence_conflict"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def submit(
    conn: db.Conn, storage: Storage, config: Config, items: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Enqueue validated job items (worker.app.validation.job_item); one answer per item, in order:
    `job_id`, `task`, `created` (false: the same version, idempotency key or sequence named an
    existing job, or an earlier item of the call), `status`, `ordering_key`, `sequence`, and
    `missing` (a thumbnail's file storage does not have)."""
    from worker.engine.batch import prepare_tasks
    from worker.thumbnails.files import resolve_versions

    # The tasks of THUMBQ_TASKS, with their own max_attempts and buckets (thumbq.tasks).
    prepare_tasks(config, conn)
    queue = Queue(conn, bucket=config.rate_bucket, max_attempts=config.max_attempts)
    thumbs = [(i, it) for i, it in enumerate(items) if it["task"] == THUMBNAIL]
    others = [(i, it) for i, it in enumerate(items) if it["task"] != THUMBNAIL]
    todo: list[dict[str, Any]] = []
    missing: set[str] = set()
    if thumbs:
        # Storage is asked before any transaction begins.
        todo, missing = resolve_versions(
            storage, [{k: v for k, v in it.items() if k != "task"} for _, it in thumbs]
        )
    out: list[dict[str, Any]] = [{} for _ in items]
    try:
        # Both kinds in one request: one transition, all or nothing, with every lock of both
        # in the one order (a transaction of two statements could deadlock another).
        file_rows: list[dict[str, Any]] = []
        job_rows: list[dict[str, Any]] = []
        if thumbs and others:
            file_rows, job_rows = queue.enqueue_mixed(todo, [it for _, it in others])
        elif thumbs:
            file_rows = queue.enqueue_files(todo)
        elif others:
            job_rows = queue.enqueue_jobs([it for _, it in others])
        if thumbs:
            rows = {r["source_key"]: r for r in file_rows}
            seen: set[int] = set()
            for (i, _), item in zip(thumbs, todo, strict=True):
                row = rows[item["source_key"]]
                out[i] = {
                    "job_id": row["job_id"],
                    "task": THUMBNAIL,
                    # An item repeating a key of the same call names the same job.
                    "created": bool(row["created"]) and row["job_id"] not in seen,
                    "status": row["status"],
                    "ordering_key": None,
                    "sequence": None,
                    "missing": item["source_key"] in missing,
                }
                seen.add(row["job_id"])
        for (i, _), row in zip(others, job_rows, strict=True):
            out[i] = {
                "job_id": row["job_id"],
                "task": row["task"],
                "created": bool(row["created"]),
                "status": row["status"],
                "ordering_key": row["ordering_key"],
                "sequence": row["sequence"],
                "missing": False,
            }
    except psycopg.errors.ExclusionViolation as exc:
        text = (exc.diag.message_primary or str(exc)).removeprefix("sequence_conflict: ")
        raise SequenceConflict(text) from None
    return out


def view(row: Mapping[str, Any], urls: UrlSigner | None = None) -> dict[str, Any]:
    """A job's public view (GET /api/jobs/<id>, `thumbq jobs show`): status, payload, result,
    error, attempts, priority, ordering, progress and times. A thumbnail job's payload is its
    source (`source_key`, `etag`, `content_type`) and its result, once completed, its
    thumbnails' keys and look; with `urls` (THUMBQ_SIGNED_URL_TTL_S), `thumbnail_url` and
    `thumbnail_urls` that fetch them without credentials until they expire."""
    out = {k: row.get(k) for k in VIEW_FIELDS}
    if urls is not None:
        out.update(urls.fields(row))
    if (row.get("task") or THUMBNAIL) == THUMBNAIL:
        out["task"] = THUMBNAIL
        out["payload"] = {
            "source_key": row.get("source_key"),
            "etag": row.get("source_etag"),
            "content_type": row.get("content_type"),
        }
        out["result"] = (
            {k: row.get(k) for k in THUMBNAIL_RESULT}
            if row.get("status") == JobStatus.COMPLETED
            else None
        )
    else:
        out["payload"] = row.get("payload")
        out["result"] = row.get("result")
    return out


def get(conn: db.Conn, job_id: int, urls: UrlSigner | None = None) -> dict[str, Any] | None:
    """One job's public view (with signed thumbnail URLs when `urls` is given), or None when
    there is no such job."""
    row = Queue(conn).job(job_id)
    return None if row is None else view(row, urls)


def cancel(conn: db.Conn, job_id: int) -> dict[str, Any] | None:
    """Cancel a job that waits or runs (a running handler sees `ctx.cancelled()` at its next
    check; the next job of its ordering key goes). Returns `job_id`, `cancelled` (false: it had
    already ended), `status` and `group_id`; None when there is no such job."""
    queue = Queue(conn)
    n = queue.cancel_jobs([job_id])
    row = queue.job(job_id)
    if row is None:
        return None
    return {
        "job_id": job_id,
        "cancelled": n == 1,
        "status": row["status"],
        "group_id": row["group_id"],
    }
