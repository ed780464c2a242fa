"""One time-budgeted invocation: claim, render in parallel, record, release, report.

The deadline is start + budget - buffer. Jobs are claimed as many as are predicted to fit; an
item starts only if its predicted duration fits before the deadline; rendering runs in child
processes killed at the deadline; what was claimed but not started is released at once.

The deadline bounds every call, not only renders: each storage call is cut at it (a stall or a
slow drip costs the item, `storage_timeout`), each database statement carries a server-side
timeout from it (a lock held elsewhere costs the call, `db_timeout`), and the end of the run
(recording, release, finish) has its own reserve out of the buffer (`worker.budget`).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from worker import db
from worker.budget import (
    FINISH_MS,
    RECORD_MS,
    RELEASE_MS,
    Budget,
    Predictor,
    kind_of,
    size_class,
)
from worker.errors import RENDER_TIMEOUT, STORAGE_TIMEOUT, UNSUPPORTED_TASK, ThumbqError
from worker.log import log_event
from worker.queue import ClaimedJob, Queue
from worker.retry import classify
from worker.storage import BoundedStorage

if TYPE_CHECKING:
    from worker.config import Config
    from worker.render import Thumbnail
    from worker.render.process import RenderPool
    from worker.storage import Storage

# Messages stay invisible this long past the budget: a live invocation is never double-served,
# a killed one's messages come back soon after.
VT_MARGIN_S = 20
# Completions are written in small batches: fewer round trips, progress still near real time.
FLUSH_EVERY_N = 64
# One claim takes at most this many: tiny items would otherwise be claimed all at once, holding
# them away from concurrent invocations and making one long transaction.
CLAIM_CHUNK_MAX = 250
FLUSH_EVERY_S = 0.25
# An item killed at the deadline counts as an attempt only if it had at least this share of
# the invocation's working time; one that merely started late is released and goes first next
# time, where it gets a whole window.
FAIR_SHARE = 0.5
# A render still running after this share of its window is stopped, and a cheaper (degraded) one
# gets the rest, rather than the item failing `render_timeout` (items that started late get no
# such fallback: they are released and get a whole window next time).
DEGRADE_AT = 0.75
# Every statement is cancelled by the server at its deadline (worker.db), the last of them about
# FINISH_MS after the deadline. A call still unanswered this long after the deadline (at the
# latest at the end of the budget) has its connection cut: a stopped server or a dropped network
# never answers, and a cancel request would need the stuck backend to act on it.
SEVER_AFTER_DEADLINE_MS = 600
# Cut at the deadline: the item had less time than it needed, which says nothing of the file.
_CUT_AT_DEADLINE = (RENDER_TIMEOUT, STORAGE_TIMEOUT)


@dataclass
class BatchResult:
    """The response of one invocation (DESIGN.md, "The batch")."""

    run_id: int
    processed: int
    succeeded: int
    failed: int
    retried: int
    skipped: int
    # None only when the run's row could not be written in time (a lock held elsewhere).
    remaining: int | None
    stopped_reason: str
    duration_ms: int
    budget_ms: int
    retry_after_ms: int | None
    # Jobs this run ended without a thumbnail for a reason other than a failure, in the words
    # of their status: an unsupported type, or a source missing from storage (`cancelled`
    # with `source_missing`). `failed` counts only jobs that ended `failed`.
    unsupported: int = 0
    missing: int = 0
    claimed: int = 0
    released: int = 0
    alerts: list[str] = field(default_factory=list)

    def response(self) -> dict[str, Any]:
        """The JSON body of the HTTP response (DESIGN.md's fields, with `unsupported` and
        `missing` beside `failed`)."""
        d = asdict(self)
        for extra in ("claimed", "released", "alerts"):
            d.pop(extra)
        return d


def thumbnail_key(source_key: str, etag: str, size: int, ext: str) -> str:
    """`thumbnails/<source key>/<etag>-<size>.<ext>`; the etag made safe for a key."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in etag) or "noetag"
    return f"thumbnails/{source_key}/{safe}-{size}.{ext}"


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class _Run:
    """The state of one invocation, shared by its worker threads under one lock."""

    def __init__(
        self,
        config: Config,
        queue: Queue,
        storage: Storage,
        pool: RenderPool,
        budget: Budget,
        predictor: Predictor,
        worker_id: str,
        max_items: int,
    ) -> None:
        self.config = config
        self.queue = queue
        self.storage = storage
        self.pool = pool
        self.budget = budget
        self.predictor = predictor
        self.worker_id = worker_id
        self.max_items = max_items
        self.vt_seconds = math.ceil(config.budget_ms / 1000) + VT_MARGIN_S
        self.lock = threading.Lock()
        self.waiting: deque[ClaimedJob] = deque()
        self.claimed = 0
        self.in_flight = 0
        self.exhausted: str | None = None  # drained | rate_limited | max_items | error
        self.claim_error: Exception | None = None
        self.time_stopped = False
        self.retry_after_ms: int | None = None
        self.counts = {
            "processed": 0,
            "succeeded": 0,
            "failed": 0,
            "unsupported": 0,
            "missing": 0,
            "retried": 0,
            "skipped": 0,
        }
        # Called after each item with how it ended (the CLI's progress bar moves per file).
        self.on_item: Callable[[ClaimedJob, str], None] | None = None
        self.late: list[int] = []  # job ids killed at the deadline after starting late
        self.pending_done: list[dict[str, Any]] = []
        self.last_flush = time.monotonic()
        self.flush_lock = threading.Lock()
        self.errors: list[str] = []
        # Write-behind: a worker hands a rendered item's uploads and completion to a writer
        # thread and starts its next item, so that its render process does not sit idle while
        # storage writes (a local file's fsyncs took 4.6 ms an item; an S3 PUT takes longer).
        # One pending write per worker: a worker whose last write has not ended waits for it.
        self.writer = ThreadPoolExecutor(
            max_workers=config.concurrency, thread_name_prefix="thumbq-writer"
        )
        self.write_slots = threading.Semaphore(config.concurrency)

    # -- choosing work ----------------------------------------------------------------------

    def _predict(self, job: ClaimedJob) -> float:
        return self.predictor.start_ms(
            kind_of(job.content_type, job.source_key), size_class(job.source_bytes)
        )

    def _claim_more(self) -> None:
        """Claim about half of what is predicted to fit in the remaining time."""
        if self.claimed >= self.max_items:
            self.exhausted = "max_items"
            return
        remaining = self.budget.remaining_ms()
        typical = self.predictor.typical_ms()
        if self.waiting:
            typical = sum(self._predict(j) for j in self.waiting) / len(self.waiting)
        fit = self.config.concurrency * remaining / max(typical, 1.0)
        want = max(self.config.concurrency, math.ceil(fit / 2)) - len(self.waiting)
        want = min(want, self.max_items - self.claimed, CLAIM_CHUNK_MAX)
        if want <= 0:
            return
        claim = self.queue.claim(self.worker_id, want, self.vt_seconds, bound=_bound(self.budget))
        self.claimed += len(claim.jobs)
        self.waiting.extend(claim.jobs)
        if claim.rate_limited:
            self.exhausted = "rate_limited"
            self.retry_after_ms = claim.retry_after_ms
        elif len(claim.jobs) < want:
            self.exhausted = "drained"
        elif self.claimed >= self.max_items:
            self.exhausted = "max_items"

    def next_job(self) -> ClaimedJob | None:
        """The next job to start, or None when this worker should stop."""
        with self.lock:
            while True:
                if self.budget.expired():
                    self.time_stopped = True
                    return None
                # Early in the run an item starts even when predicted not to fit: otherwise one
                # predicted longer than any window would wait forever. It gets its fair share
                # and is killed at the deadline if it needs more (an attempt, then the DLQ).
                early = self.budget.remaining_ms() >= FAIR_SHARE * self.budget.work_ms
                for job in self.waiting:
                    if early or self.budget.fits(self._predict(job)):
                        self.waiting.remove(job)
                        self.in_flight += 1
                        return job
                if self.waiting:
                    # Nothing claimed fits any more; later claims would not either.
                    self.time_stopped = True
                    return None
                if self.exhausted:
                    return None
                try:
                    self._claim_more()
                except db.DeadlineExceeded as exc:
                    # A lock held elsewhere (the bucket row, a job row) kept the claim past the
                    # deadline; it changed nothing. Out of time, not an error of the run.
                    self.errors.append(str(exc))
                    self.time_stopped = True
                    self.exhausted = "timeout"
                    return None
                except Exception as exc:
                    # The database is gone: stop claiming; run_batch reports it after the
                    # items in flight have ended (their leases keep them safe meanwhile).
                    self.claim_error = exc
                    self.exhausted = "error"
                    return None

    # -- doing work -------------------------------------------------------------------------

    def process(self, job: ClaimedJob) -> None:
        started = time.monotonic()
        kind = kind_of(job.content_type, job.source_key)
        size_cls = size_class(job.source_bytes)
        render_window_ms = self.budget.remaining_ms()
        outcome = "succeeded"
        try:
            if job.task != "thumbnail":
                raise ThumbqError(
                    UNSUPPORTED_TASK, f"no handler for task {job.task!r} in this invocation"
                )
            data, info = self.storage.get(job.source_key, max_bytes=self.config.max_bytes)
            if job.source_etag and info.etag != job.source_etag:
                # The object changed since it was enqueued: the new version supersedes this job.
                self.queue.enqueue(
                    [
                        {
                            "source_key": job.source_key,
                            "etag": info.etag,
                            "content_type": job.content_type,
                            "group_id": job.group_id,
                            "bytes": info.size,
                        }
                    ],
                    bound=_bound(self.budget, RECORD_MS),
                )
                self._count("skipped")
                outcome = "skipped"
                return
            size_cls = size_class(info.size)
            timeout_s = self.budget.remaining_ms() / 1000
            fair = timeout_s * 1000 >= FAIR_SHARE * self.budget.work_ms
            thumb = self.pool.render(
                data,
                job.content_type or info.content_type,
                timeout_s=timeout_s,
                degrade_after_s=timeout_s * DEGRADE_AT if fair else None,
            )
            self.write_slots.acquire()
            try:
                self.writer.submit(
                    self._record, job, info.etag, thumb, started, (kind, size_cls), render_window_ms
                )
            except BaseException:
                self.write_slots.release()
                raise
            outcome = "writing"  # _record ends the item
        except Exception as exc:  # every failure is classified and recorded, none escapes
            outcome = self._failed(job, exc, render_window_ms)
        finally:
            if outcome != "writing":
                self._end_item(job, outcome)

    def _record(
        self,
        job: ClaimedJob,
        etag: str,
        thumb: Thumbnail,
        started: float,
        stat_key: tuple[str, int],
        render_window_ms: float,
    ) -> None:
        """Upload every size and queue the completion (on a writer thread)."""
        outcome = "succeeded"
        try:
            keys = self._store(job.source_key, etag, thumb)
            ms = (time.monotonic() - started) * 1000
            if not thumb.degraded:
                # A degraded render says how long the cheap path took, not the real one.
                self.predictor.observe(*stat_key, ms)
            largest = str(max(keys, key=int))
            self._done(
                {
                    "job_id": job.id,
                    "msg_id": job.msg_id,
                    "thumbnail_key": keys[largest],
                    "thumbnail_content_type": thumb.content_type,
                    "width": thumb.width,
                    "height": thumb.height,
                    "bytes": len(thumb.data),
                    "duration_ms": round(ms),
                    "source_type": thumb.source_type,
                    "thumbnails": keys,
                    "thumbhash": thumb.thumbhash,
                    "dominant_color": thumb.dominant_color,
                    "degraded": thumb.degraded,
                }
            )
        except Exception as exc:  # every failure is classified and recorded, none escapes
            outcome = self._failed(job, exc, render_window_ms)
        finally:
            self.write_slots.release()
            self._end_item(job, outcome)

    def _end_item(self, job: ClaimedJob, outcome: str) -> None:
        with self.lock:
            self.in_flight -= 1
        if self.on_item is not None:
            self.on_item(job, outcome)

    def _store(self, source_key: str, etag: str, thumb: Thumbnail) -> dict[str, str]:
        """Write every rendition under its own key; returns {"<size>": key}."""
        keys: dict[str, str] = {}
        renditions = thumb.renditions or ()
        if not renditions:
            from worker.render import Rendition

            renditions = (Rendition(self.config.thumb_size, thumb.data, thumb.width, thumb.height),)
        for rendition in renditions:
            key = thumbnail_key(source_key, etag, rendition.size, self.config.thumb_ext)
            self.storage.put(key, rendition.data, thumb.content_type)
            keys[str(rendition.size)] = key
        return keys

    def _failed(self, job: ClaimedJob, exc: Exception, window_ms: float) -> str:
        """Record a failed item; how it ended, in the words of the run's counts (`released`
        for an item killed after starting late, `unrecorded` when the database is gone)."""
        failure = classify(exc)
        # A killed render says only that this file took longer than it had: not evidence about
        # others of its kind and size, so the predictor does not learn from it.
        killed = isinstance(exc, ThumbqError) and exc.code in _CUT_AT_DEADLINE
        if killed and window_ms < FAIR_SHARE * self.budget.work_ms:
            with self.lock:
                self.late.append(job.id)
            return "released"
        try:
            outcome = self.queue.fail(
                self.worker_id,
                job,
                failure.code,
                failure.message,
                failure.permanent,
                bound=_bound(self.budget, RECORD_MS),
            )
        except Exception as db_exc:
            # The lease runs out and the message comes back: nothing is lost.
            self.errors.append(f"could not record failure of job {job.id}: {db_exc}")
            return "unrecorded"
        if not outcome.get("owned"):
            counted = "skipped"
        elif outcome.get("status") == "pending":
            counted = "retried"
        elif outcome.get("status") == "unsupported":
            counted = "unsupported"
        elif outcome.get("status") == "cancelled":
            counted = "missing"  # the only failure that ends a job cancelled
        else:
            counted = "failed"
        self._count(counted)
        return counted

    def _count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1
            self.counts["processed"] += 1

    def _done(self, result: dict[str, Any]) -> None:
        with self.lock:
            self.pending_done.append(result)
            due = (
                len(self.pending_done) >= FLUSH_EVERY_N
                or time.monotonic() - self.last_flush >= FLUSH_EVERY_S
            )
        if due:
            self.flush()

    def flush(self) -> None:
        """Write buffered completions in one call."""
        with self.flush_lock:
            with self.lock:
                batch, self.pending_done = self.pending_done, []
                self.last_flush = time.monotonic()
            if not batch:
                return
            try:
                completed = self.queue.complete(
                    self.worker_id, batch, bound=_bound(self.budget, RECORD_MS)
                )
            except Exception as exc:
                # Thumbnails are written; their messages come back after the lease and the
                # next run renders them again (same key, same bytes).
                self.errors.append(f"could not record {len(batch)} completions: {exc}")
                return
            with self.lock:
                self.counts["succeeded"] += completed
                self.counts["skipped"] += len(batch) - completed
                self.counts["processed"] += len(batch)

    def worker(self) -> None:
        while (job := self.next_job()) is not None:
            self.process(job)


def run_batch(
    config: Config,
    conn: db.Conn,
    storage: Storage,
    pool: RenderPool | None = None,
    *,
    budget_ms: int | None = None,
    max_items: int | None = None,
    worker_id: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_item: Callable[[ClaimedJob, str], None] | None = None,
) -> BatchResult:
    """Run one invocation within `budget_ms` (default: the configured budget) and report.
    `on_item(job, outcome)` is called from the worker thread after each item the run started:
    `succeeded`, `failed`, `unsupported`, `missing`, `retried`, `skipped`, `released` (started
    late and killed at the deadline: back in the queue) or `unrecorded`."""
    budget_ms = budget_ms or config.budget_ms
    buffer_ms = min(config.buffer_ms, budget_ms // 2)
    budget = Budget(budget_ms, buffer_ms, clock)
    worker_id = worker_id or new_worker_id()
    queue = Queue(conn, bucket=config.rate_bucket, max_attempts=config.max_attempts)

    bounded = BoundedStorage(storage, lambda: budget.remaining_ms() / 1000)

    own_pool = pool is None
    if pool is None:
        from worker.render.process import RenderPool

        pool = RenderPool(render_options(config), config.concurrency, config.render_memory_mb)
    sever_ms = min(budget_ms, budget_ms - buffer_ms + SEVER_AFTER_DEADLINE_MS)
    watchdog = threading.Timer(sever_ms / 1000, _sever, args=(conn, worker_id, sever_ms))
    watchdog.daemon = True
    watchdog.start()
    try:
        start = db.one(
            conn,
            "start_run",
            {
                "worker_id": worker_id,
                "budget_ms": budget_ms,
                "buffer_ms": buffer_ms,
                "concurrency": config.concurrency,
            },
            bound=_bound(budget),
        )
        assert start is not None
        run_id = int(start["result"]["run_id"])
        predictor = Predictor.from_rows(start["result"]["stats"])
        run = _Run(
            config,
            queue,
            bounded,
            pool,
            budget,
            predictor,
            worker_id,
            max_items or config.batch_size,
        )
        run.on_item = on_item

        threads = [
            threading.Thread(target=run.worker, name=f"thumbq-worker-{i}", daemon=True)
            for i in range(config.concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The last items' writes (bounded by the deadline like every storage call).
        run.writer.shutdown(wait=True)
        run.flush()
        if run.claim_error is not None:
            raise run.claim_error

        unstarted = [j.id for j in run.waiting] + run.late
        released = 0
        try:
            released = queue.release(worker_id, unstarted, bound=_bound(budget, RELEASE_MS))
        except db.DeadlineExceeded as exc:
            # Their leases run out instead: back in budget + VT_MARGIN_S.
            run.errors.append(f"could not release {len(unstarted)} unstarted jobs: {exc}")
        reason = "time_budget" if run.time_stopped or unstarted else run.exhausted or "drained"
        duration_ms = round(budget.elapsed_ms())
        summary = {
            **run.counts,
            "claimed": run.claimed,
            "released": released,
            "stopped_reason": reason,
            "duration_ms": duration_ms,
            "retry_after_ms": run.retry_after_ms,
        }
        fin: dict[str, Any] = {"remaining": None, "alerts": []}
        try:
            row = db.one(
                conn,
                "finish_run",
                {"run_id": run_id, "summary": _json(summary), "stats": _json(predictor.summary())},
                bound=_bound(budget, FINISH_MS),
            )
            assert row is not None
            fin = row["result"]
        except db.DeadlineExceeded as exc:
            # The counts are still right; only the run's row and `remaining` are missing.
            run.errors.append(f"could not finish run {run_id}: {exc}")
        result = BatchResult(
            run_id=run_id,
            processed=run.counts["processed"],
            succeeded=run.counts["succeeded"],
            failed=run.counts["failed"],
            unsupported=run.counts["unsupported"],
            missing=run.counts["missing"],
            retried=run.counts["retried"],
            skipped=run.counts["skipped"],
            remaining=None if fin["remaining"] is None else int(fin["remaining"]),
            stopped_reason=reason,
            duration_ms=duration_ms,
            budget_ms=budget_ms,
            retry_after_ms=run.retry_after_ms if reason == "rate_limited" else None,
            claimed=run.claimed,
            released=released,
            alerts=list(fin["alerts"]),
        )
        log_event("batch_run", worker_id=worker_id, **asdict(result), errors=run.errors[:5] or None)
        return result
    finally:
        watchdog.cancel()
        bounded.close()
        if own_pool:
            pool.close()


def _sever(conn: db.Conn, worker_id: str, after_ms: int) -> None:
    """Shut the connection's socket down, so that every call waiting on it fails at once with
    OperationalError and the invocation ends (its leases expire as if it had been killed).

    Only a server or network that stopped answering gets here: every statement carries its own
    timeout, which the server enforces while it runs.

    Only shutdown, not close: the descriptor stays the connection's until it is closed."""
    try:
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=os.dup(fd))
    except Exception:  # already closed or broken: nothing is waiting on it
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()
    log_event("batch_db_severed", worker_id=worker_id, after_ms=after_ms)


def _bound(budget: Budget, after_ms: float | None = None) -> db.Bound:
    """A database call's bound: until the deadline, or (a call that records the run's outcome)
    until `after_ms` past it. One made after the deadline does not wait for the WAL flush to
    commit (db.Bound): the answer is due, and a lost commit only means a redone item."""
    if after_ms is None:
        return db.Bound(budget.remaining_ms())
    return db.Bound(budget.end_call_ms(after_ms), durable=not budget.expired())


def render_options(config: Config) -> Any:
    """The renderer's options from the configuration."""
    from worker.render import RenderOptions

    sizes = config.all_thumb_sizes
    return RenderOptions(
        size=max(sizes),
        sizes=sizes,
        soffice=config.soffice,
        format=config.thumb_format,
        pdf_page=config.pdf_page,
        max_pixels=config.max_pixels,
        max_pages=config.max_pages,
        max_bytes=config.max_bytes,
    )


def _json(value: Any) -> str:
    import json

    return json.dumps(value)
