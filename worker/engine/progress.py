"""A group's progress in the one shape the HTTP API, the CLI and the page share."""

from __future__ import annotations

from typing import Any

from worker.engine.states import JobStatus

# How long a progress poller should wait, from the group's state alone (so that one version of
# a group is always the same bytes, which a strong ETag promises):
POLL_RUNNING_MS = 1_000  # jobs are processing: the bar moves every second or so
POLL_WAITING_MS = 5_000  # jobs wait for the next scheduled batch (up to 5 minutes away)
POLL_SETTLED_MS = 30_000  # nothing pending or processing: only a new enqueue changes anything


def poll_after_ms(row: dict[str, Any]) -> int:
    """When to poll again: soon while work runs, rarely when the group is settled."""
    if row[JobStatus.PROCESSING] > 0:
        return POLL_RUNNING_MS
    if row[JobStatus.PENDING] > 0:
        return POLL_WAITING_MS
    return POLL_SETTLED_MS


def progress_body(row: dict[str, Any]) -> dict[str, Any]:
    """The progress of a group (a row of `thumbq.progress_v2`): counts per status, the
    percentage as a number, the ETA, when it last changed, when to ask again, and the sums of
    its jobs' own progress (what tasks report with `ctx.progress(done, total)`)."""
    pct = row["progress_percentage"]
    return {
        "group_id": row["group_id"],
        "total": row["total"],
        **{status.value: row[status] for status in JobStatus},
        "progress_percentage": float(pct) if pct is not None else 0.0,
        "estimated_time_remaining_seconds": row["estimated_time_remaining_seconds"],
        "rate_per_second": row["rate_per_second"],
        "updated_at": row["updated_at"],
        "version": row["version"],
        "poll_after_ms": poll_after_ms(row),
        "progress_done": int(row.get("progress_done") or 0),
        "progress_total": int(row.get("progress_total") or 0),
    }
