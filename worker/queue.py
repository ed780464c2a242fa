"""The job queue: Python's view of the SQL transition functions (one round trip each)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker import db, ratelimit
from worker.retry import BACKOFF_BASE_S, BACKOFF_CAP_S


@dataclass(frozen=True)
class ClaimedJob:
    """A job leased to one invocation, with the message that carries it."""

    id: int
    msg_id: int
    group_id: str
    source_key: str
    source_etag: str
    source_bytes: int | None
    content_type: str | None
    attempts: int
    max_attempts: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClaimedJob:
        return cls(
            id=int(d["id"]),
            msg_id=int(d["msg_id"]),
            group_id=str(d["group_id"]),
            source_key=str(d["source_key"]),
            source_etag=str(d["source_etag"]),
            source_bytes=d.get("source_bytes"),
            content_type=d.get("content_type"),
            attempts=int(d["attempts"]),
            max_attempts=int(d["max_attempts"]),
        )


@dataclass(frozen=True)
class Claim:
    """What one claim returned; `rate_limited` when the bucket had no token."""

    jobs: list[ClaimedJob]
    rate_limited: bool
    retry_after_ms: int | None


class Queue:
    """Transitions of `thumbq.jobs` and its pgmq messages on one connection."""

    def __init__(
        self, conn: db.Conn, *, bucket: str | None = "thumbnail_generation", max_attempts: int = 3
    ) -> None:
        self.conn = conn
        self.bucket = bucket
        self.max_attempts = max_attempts

    def enqueue(
        self, items: Sequence[Mapping[str, Any]], group_id: str = "default"
    ) -> list[dict[str, Any]]:
        """Enqueue object versions (`source_key`, `etag`, `content_type`, `group_id`, `bytes`);
        idempotent per (source_key, etag). Returns one row per distinct key."""
        return db.run(
            self.conn,
            "enqueue_batch",
            {
                "items": json.dumps(list(items)),
                "group_id": group_id,
                "max_attempts": self.max_attempts,
            },
        )

    def claim(self, worker_id: str, qty: int, vt_seconds: int) -> Claim:
        """Lease up to `qty` jobs under the rate limit.

        The tokens are taken first, in a transaction of their own, so that concurrent claims
        hold the bucket row only for that one statement, never for the whole claim; the claim
        gives back what it could not use."""
        prepaid = limited_by_bucket = False
        retry_after_ms: int | None = None
        if self.bucket is not None and qty > 0:
            grant = ratelimit.take(self.conn, self.bucket, qty, partial=True)
            if grant is not None:
                if grant.taken == 0:
                    return Claim([], True, grant.retry_after_ms)
                prepaid = True
                limited_by_bucket = grant.taken < qty
                retry_after_ms = grant.retry_after_ms
                qty = grant.taken
        row = db.one(
            self.conn,
            "claim",
            {
                "worker_id": worker_id,
                "qty": qty,
                "vt_seconds": vt_seconds,
                "bucket": self.bucket,
                "prepaid": prepaid,
            },
        )
        assert row is not None
        r = row["result"]
        jobs = [ClaimedJob.from_json(j) for j in r["jobs"]]
        if limited_by_bucket and int(r.get("read", 0)) >= qty:
            # The bucket, not the queue, cut this claim short: say so, or the caller takes the
            # short claim for a drained queue.
            return Claim(jobs, True, retry_after_ms)
        return Claim(jobs, bool(r["rate_limited"]), r.get("retry_after_ms"))

    def complete(self, worker_id: str, results: Iterable[Mapping[str, Any]]) -> int:
        """Record finished jobs (still leased by `worker_id`); returns how many changed."""
        payload = list(results)
        if not payload:
            return 0
        row = db.one(
            self.conn, "complete", {"worker_id": worker_id, "results": json.dumps(payload)}
        )
        return int(row["completed"]) if row else 0

    def fail(
        self, worker_id: str, job: ClaimedJob, code: str, message: str, permanent: bool
    ) -> dict[str, Any]:
        """Record a failed attempt: end the job, or schedule a retry with backoff."""
        row = db.one(
            self.conn,
            "fail",
            {
                "worker_id": worker_id,
                "msg_id": job.msg_id,
                "job_id": job.id,
                "error_code": code,
                "message": message,
                "permanent": permanent,
                "base_s": BACKOFF_BASE_S,
                "cap_s": BACKOFF_CAP_S,
            },
        )
        assert row is not None
        return dict(row["result"])

    def release(self, worker_id: str, job_ids: Sequence[int]) -> int:
        """Hand unstarted jobs' messages back at once, without counting an attempt."""
        if not job_ids:
            return 0
        row = db.one(
            self.conn,
            "release",
            {"worker_id": worker_id, "job_ids": list(job_ids), "bucket": self.bucket},
        )
        return int(row["released"]) if row else 0

    def reap_stale(self, limit: int = 5000) -> int:
        """Reset up to `limit` `processing` jobs whose lease expired; returns how many."""
        row = db.one(self.conn, "reap_stale", {"limit": limit})
        return int(row["reset_count"]) if row else 0

    def prune(self, days: int, limit: int = 5000) -> dict[str, int]:
        """Delete one chunk of history older than `days` (finished jobs and their dead
        letters, batch runs, archived messages); group summaries stay. Returns the counts."""
        row = db.one(self.conn, "prune", {"days": days, "limit": limit})
        return {k: int(v) for k, v in (row["result"] if row else {}).items()}

    def progress(self, group_id: str) -> dict[str, Any] | None:
        """The group's summary row with progress and ETA, or None for an unknown group."""
        return db.one(self.conn, "progress", {"group_id": group_id})

    def retry_failed(self, group_id: str) -> int:
        row = db.one(self.conn, "retry_failed", {"group_id": group_id})
        return int(row["requeued"]) if row else 0

    def cancel(self, group_id: str) -> int:
        row = db.one(self.conn, "cancel", {"group_id": group_id})
        return int(row["cancelled"]) if row else 0

    def job(self, job_id: int) -> dict[str, Any] | None:
        return db.one(self.conn, "get_job", {"job_id": job_id})

    def overview(self) -> dict[str, Any]:
        """Queue depth, in flight, oldest message, DLQ, jobs by status, bucket; and alerts."""
        row = db.one(self.conn, "queue_overview") or {}
        return {**row, "alerts": db.run(self.conn, "alerts")}
