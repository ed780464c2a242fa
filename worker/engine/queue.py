"""The job queue: Python's view of the SQL transition functions (one round trip each)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from worker.engine import db
from worker.engine.retry import BACKOFF_BASE_S, BACKOFF_CAP_S
from worker.engine.states import JobStatus


def _left(bound: db.Bound | None, started: float) -> db.Bound | None:
    """What is left of `bound` for a statement sent now, in a call that started at `started`."""
    if bound is None:
        return None
    return replace(bound, timeout_ms=bound.timeout_ms - (time.monotonic() - started) * 1000)


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
    task: str = "thumbnail"
    payload: Any = None
    state: Any = None
    priority: int = 0
    ordering_key: str | None = None
    sequence: int | None = None
    checkpoints: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ClaimedJob:
        return cls(
            id=int(d["id"]),
            msg_id=int(d["msg_id"]),
            group_id=str(d["group_id"]),
            source_key=str(d.get("source_key") or ""),
            source_etag=str(d.get("source_etag") or ""),
            source_bytes=d.get("source_bytes"),
            content_type=d.get("content_type"),
            attempts=int(d["attempts"]),
            max_attempts=int(d["max_attempts"]),
            task=str(d.get("task") or "thumbnail"),
            payload=d.get("payload"),
            state=d.get("state"),
            priority=int(d.get("priority") or 0),
            ordering_key=d.get("ordering_key"),
            sequence=d.get("sequence"),
            checkpoints=int(d.get("checkpoints") or 0),
        )

    def as_dict(self) -> dict[str, Any]:
        """The job's fields (what a task's context is made from)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class Claim:
    """What one claim returned; `rate_limited` when the bucket had no token. `limited` jobs
    were read but refused by their task's own bucket (thumbq.tasks): they wait for it, hidden
    for `retry_after_ms`."""

    jobs: list[ClaimedJob]
    rate_limited: bool
    retry_after_ms: int | None
    limited: int = 0


class Queue:
    """Transitions of `thumbq.jobs` and its pgmq messages on one connection."""

    def __init__(
        self,
        conn: db.Conn,
        *,
        bucket: str | None = "thumbnail_generation",
        max_attempts: int = 3,
        ageing_s: int = 60,
    ) -> None:
        self.conn = conn
        self.bucket = bucket
        self.max_attempts = max_attempts
        self.ageing_s = ageing_s
        # Threads of one invocation share the connection; a bounded call counts its wait for it.
        self._connection_lock = threading.Lock()

    @contextlib.contextmanager
    def _holding_connection(self, name: str, bound: db.Bound | None) -> Iterator[float]:
        """Hold the connection for one bounded call (other threads of the invocation share it);
        yields when the call started, so that waiting for the connection counts in its bound."""
        started = time.monotonic()
        if bound is None:
            yield started
            return
        if not self._connection_lock.acquire(timeout=max(bound.timeout_ms, 0.0) / 1000):
            raise db.DeadlineExceeded(
                f"{name}: the connection stayed busy for {bound.timeout_ms:.0f} ms"
            )
        try:
            yield started
        finally:
            self._connection_lock.release()

    def _run(
        self, name: str, params: Mapping[str, Any], bound: db.Bound | None
    ) -> list[dict[str, Any]]:
        """Run a named query; with `bound`, the wait for the connection (busy with another
        thread's call) and the statement together end within it (`db.DeadlineExceeded`)."""
        with self._holding_connection(name, bound) as started:
            return db.run(self.conn, name, params, bound=_left(bound, started))

    def _one(
        self, name: str, params: Mapping[str, Any], bound: db.Bound | None
    ) -> dict[str, Any] | None:
        rows = self._run(name, params, bound)
        return rows[0] if rows else None

    def enqueue_files(
        self,
        items: Sequence[Mapping[str, Any]],
        group_id: str = "default",
        *,
        bound: db.Bound | None = None,
    ) -> list[dict[str, Any]]:
        """Enqueue object versions (`source_key`, `etag`, `content_type`, `group_id`, `bytes`);
        idempotent per (source_key, etag). Returns one row per distinct key.

        Every transition takes a `bound` (`db.Bound`): it then ends within its time or raises
        `db.DeadlineExceeded`, having changed nothing."""
        return self._run(
            "enqueue_batch",
            {
                "items": json.dumps(list(items)),
                "group_id": group_id,
                "max_attempts": self.max_attempts,
            },
            bound,
        )

    def claim(
        self, worker_id: str, qty: int, vt_seconds: int, *, bound: db.Bound | None = None
    ) -> Claim:
        """Lease up to `qty` jobs, each under its own bucket's rate limit (thumbnails: this
        queue's bucket; tasks: theirs). One statement: the tokens are taken at its end, after
        every other lock (sql/functions/10_helpers.sql), so concurrent claims hold a bucket row only
        while nothing waits."""
        params = {
            "worker_id": worker_id,
            "qty": qty,
            "vt_seconds": vt_seconds,
            "bucket": self.bucket,
            "ageing_s": self.ageing_s,
        }
        row = self._one("claim", params, bound)
        assert row is not None
        r = row["result"]
        return Claim(
            [ClaimedJob.from_json(j) for j in r["jobs"]],
            bool(r["rate_limited"]),
            r.get("retry_after_ms"),
            int(r.get("limited") or 0),
        )

    def claim_job(
        self, worker_id: str, job_id: int, vt_seconds: int, *, bound: db.Bound | None = None
    ) -> tuple[ClaimedJob | None, dict[str, Any]]:
        """Lease one given job if it waits (an interactive run), under the same lease, rules
        and rate limit as a batch. Returns the job, or None and why not (`reason`: busy,
        not_waiting, rate_limited, with `retry_after_ms`)."""
        params = {
            "worker_id": worker_id,
            "job_id": job_id,
            "vt_seconds": vt_seconds,
            "bucket": self.bucket,
        }
        row = self._one("claim_job", params, bound)
        assert row is not None
        r = dict(row["result"])
        if r["jobs"]:
            return ClaimedJob.from_json(r["jobs"][0]), r
        return None, r

    def extend_leases(
        self,
        worker_id: str,
        job_ids: Sequence[int],
        vt_seconds: int,
        *,
        bound: db.Bound | None = None,
    ) -> set[int]:
        """Renew the leases (and messages) of jobs `worker_id` still runs; returns the ids it
        still holds (a job cancelled meanwhile keeps its run's lease but is not held)."""
        if not job_ids:
            return set()
        row = self._one(
            "extend_leases",
            {"worker_id": worker_id, "job_ids": list(job_ids), "vt_seconds": vt_seconds},
            bound,
        )
        return {int(i) for i in (row["held"] if row else None) or []}

    def enqueue_mixed(
        self,
        files: Sequence[Mapping[str, Any]],
        jobs: Sequence[Mapping[str, Any]],
        group_id: str = "default",
        *,
        bound: db.Bound | None = None,
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Enqueue file versions (as `enqueue`) and task jobs (as `enqueue_jobs`) in one
        transition, every lock of both in the one order; returns both answers."""
        row = self._one(
            "enqueue_mixed",
            {
                "files": json.dumps(list(files)),
                "jobs": json.dumps(self._with_task_limits(jobs)),
                "group_id": group_id,
                "max_attempts": self.max_attempts,
            },
            bound,
        )
        assert row is not None
        files_out = [
            {
                "job_id": r["id"],
                "source_key": r["source_key"],
                "source_etag": r["source_etag"],
                "created": r["created"],
                "status": r["status"],
            }
            for r in row["result"]["files"]
        ]
        return files_out, list(row["result"]["jobs"])

    def enqueue_jobs(
        self,
        items: Sequence[Mapping[str, Any]],
        group_id: str = "default",
        *,
        bound: db.Bound | None = None,
    ) -> list[dict[str, Any]]:
        """Enqueue jobs of any task (`task`, `payload`, `priority`, `ordering_key`, `sequence`,
        `idempotency_key`, `group_id`, `max_attempts`); one row per item, in order. A task
        registered in this process gives its jobs its own max_attempts."""
        return self._run(
            "enqueue_jobs",
            {
                "items": json.dumps(self._with_task_limits(items)),
                "group_id": group_id,
                "max_attempts": self.max_attempts,
            },
            bound,
        )

    @staticmethod
    def _with_task_limits(items: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        """The items, each with its task's own max_attempts where this process registered one."""
        from worker.engine.tasks import REGISTRY

        todo = []
        for item in items:
            registered = REGISTRY.get(str(item.get("task")))
            if registered is not None and registered.max_attempts and "max_attempts" not in item:
                item = {**item, "max_attempts": registered.max_attempts}
            todo.append(item)
        return todo

    def checkpoint(
        self,
        worker_id: str,
        job: ClaimedJob,
        state: Any,
        done: int | None,
        total: int | None,
        *,
        requeue: bool,
        bound: db.Bound | None = None,
    ) -> dict[str, Any]:
        """Save a running job's state and progress; with `requeue`, hand it back to wait for a
        later invocation without using an attempt. `owned` is false once it was cancelled."""
        row = self._one(
            "checkpoint",
            {
                "worker_id": worker_id,
                "job_id": job.id,
                "msg_id": job.msg_id,
                "state": None if state is None else json.dumps(state),
                "done": done,
                "total": total,
                "requeue": requeue,
            },
            bound,
        )
        assert row is not None
        return dict(row["result"])

    def cancel_jobs(self, job_ids: Sequence[int]) -> int:
        """Cancel jobs that wait or run (a running one sees `ctx.cancelled()`)."""
        row = self._one("cancel_jobs", {"job_ids": list(job_ids)}, None)
        return int(row["cancelled"]) if row else 0

    def not_held(
        self, worker_id: str, job_ids: Sequence[int], *, bound: db.Bound | None = None
    ) -> set[int]:
        """Of `job_ids`, those `worker_id` no longer holds (cancelled, or taken over)."""
        if not job_ids:
            return set()
        rows = self._run("still_held", {"job_ids": list(job_ids), "worker_id": worker_id}, bound)
        return {int(r["id"]) for r in rows}

    def complete(
        self,
        worker_id: str,
        results: Iterable[Mapping[str, Any]],
        *,
        bound: db.Bound | None = None,
    ) -> int:
        """Record finished jobs (still leased by `worker_id`); returns how many changed.

        A job whose row another transaction holds (a cancel under way, an operator's
        statement) is first left aside, so that it does not hold up the rest, then waited for
        alone within `bound`: a report is recorded, never dropped because a row was briefly
        locked."""
        payload = list(results)
        if not payload:
            return 0
        with self._holding_connection("complete", bound) as started:
            rows = db.run(
                self.conn,
                "complete",
                {"worker_id": worker_id, "results": json.dumps(payload), "wait": False},
                bound=_left(bound, started),
            )
            busy = {int(r["job_id"]) for r in rows if r["outcome"] == "busy"}
            done = sum(r["outcome"] == JobStatus.COMPLETED for r in rows)
            if busy:
                rest = [p for p in payload if int(p["job_id"]) in busy]
                try:
                    rows = db.run(
                        self.conn,
                        "complete",
                        {"worker_id": worker_id, "results": json.dumps(rest), "wait": True},
                        bound=_left(bound, started),
                    )
                except db.DeadlineExceeded:
                    # Held past the call's bound: the rest is recorded; these come back with
                    # their lease.
                    return done
                done += sum(r["outcome"] == JobStatus.COMPLETED for r in rows)
        return done

    def fail(
        self,
        worker_id: str,
        job: ClaimedJob,
        code: str,
        message: str,
        permanent: bool,
        *,
        bound: db.Bound | None = None,
    ) -> dict[str, Any]:
        """Record a failed attempt: end the job, or schedule a retry with backoff."""
        row = self._one(
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
            bound,
        )
        assert row is not None
        return dict(row["result"])

    def release(
        self, worker_id: str, job_ids: Sequence[int], *, bound: db.Bound | None = None
    ) -> int:
        """Hand unstarted jobs' messages back at once, without counting an attempt."""
        if not job_ids:
            return 0
        row = self._one(
            "release",
            {"worker_id": worker_id, "job_ids": list(job_ids), "bucket": self.bucket},
            bound,
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
