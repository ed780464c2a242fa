"""One time-budgeted invocation: claim, run in parallel, record, release, report.

The deadline is start + budget - buffer. Three parts share the work: the claimer
(worker.engine.claiming) claims as many jobs as are predicted to fit and starts an item only if
it fits; the executor (worker.engine.execution) runs each one, its task's runner (the thumbnail
task's) or its handler, in child processes killed at the deadline; the recorder
(worker.engine.recording) writes and counts how each ended. What was claimed but not started is
released at once.

The deadline bounds every call, not only renders: each storage call is cut at it (a stall or a
slow drip costs the item, `storage_timeout`), each database statement carries a server-side
timeout from it (a lock held elsewhere costs the call, `db_timeout`), and the end of the run
(recording, release, finish) has its own reserve out of the buffer (`worker.engine.budget`).
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from worker.engine import db, stopping, tasks
from worker.engine.budget import FINISH_MS, RELEASE_MS, Budget, Predictor
from worker.engine.claiming import Claimer
from worker.engine.execution import Executor
from worker.engine.log import log_event
from worker.engine.queue import ClaimedJob, Queue
from worker.engine.recording import deadline_bound
from worker.engine.states import Outcome, StopReason
from worker.storage import BoundedStorage

if TYPE_CHECKING:
    from worker.engine.config import Config
    from worker.engine.processes import ProcessPool
    from worker.storage import Storage

__all__ = [
    "VT_MARGIN_S",
    "BatchResult",
    "new_worker_id",
    "run_batch",
]

# Messages stay invisible this long past the budget: a live invocation is never double-served,
# a killed one's messages come back soon after.
VT_MARGIN_S = 20
# Every statement is cancelled by the server at its deadline (worker.engine.db), the last of them
# about FINISH_MS after the deadline. A call still unanswered this long after the deadline (at the
# latest at the end of the budget) has its connection cut: a stopped server or a dropped network
# never answers, and a cancel request would need the stuck backend to act on it.
SEVER_AFTER_DEADLINE_MS = 600


@dataclass
class BatchResult:
    """The answer of one invocation (docs/how-it-works.md, "From enqueue to thumbnail")."""

    run_id: int
    processed: int
    succeeded: int
    failed: int
    retried: int
    skipped: int
    # None only when the run's row could not be written in time (a lock held elsewhere).
    remaining: int | None
    stopped_reason: StopReason
    duration_ms: int
    budget_ms: int
    retry_after_ms: int | None
    # Jobs this run ended without a thumbnail for a reason other than a failure, in the words
    # of their status: an unsupported type, or a source missing from storage (`cancelled`
    # with `source_missing`). `failed` counts only jobs that ended `failed`.
    unsupported: int = 0
    missing: int = 0
    # Jobs whose handler stopped to be resumed by a later invocation (worker.engine.tasks).
    checkpointed: int = 0
    claimed: int = 0
    released: int = 0
    alerts: list[str] = field(default_factory=list)

    def response(self) -> dict[str, Any]:
        """The JSON body of the HTTP response: every count but `claimed` and `released`, which
        the log line and the run's row keep, as do the `alerts`."""
        d = asdict(self)
        for extra in ("claimed", "released", "alerts"):
            d.pop(extra)
        return d


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def run_batch(
    config: Config,
    conn: db.Conn,
    storage: Storage,
    pool: ProcessPool | None = None,
    *,
    budget_ms: int | None = None,
    max_items: int | None = None,
    worker_id: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_item: Callable[[ClaimedJob, Outcome], None] | None = None,
    started: float | None = None,
    stop: threading.Event | None = None,
) -> BatchResult:
    """Run one invocation within `budget_ms` (default: the configured budget) and report.
    `on_item(job, outcome)` is called from the worker thread after each item the run started,
    with how it ended (an `Outcome` other than `writing`).
    `started` is `clock()`'s reading when the invocation began, if before this call (an HTTP
    request's arrival: the platform's limit counts from there); the budget counts from it.
    `stop` (default: the process's, set by SIGINT or SIGTERM) ends the run early and cleanly:
    nothing more is claimed, and its deadline becomes a short grace from then
    (worker.engine.stopping)."""
    stop = stop if stop is not None else stopping.requested()
    budget_ms = budget_ms or config.budget_ms
    buffer_ms = min(config.buffer_ms, budget_ms // 2)
    budget = Budget(budget_ms, buffer_ms, clock, started)
    worker_id = worker_id or new_worker_id()
    queue = Queue(
        conn,
        bucket=config.rate_bucket,
        max_attempts=config.max_attempts,
        ageing_s=config.priority_ageing_s,
    )
    bounded = BoundedStorage(storage, lambda: budget.remaining_ms() / 1000)

    own_pool = pool is None
    if pool is None:
        # The tasks' pool: the thumbnail task's RenderPool (worker.engine.tasks.Registry.make_pool).
        pool = tasks.REGISTRY.make_pool(config)
    sever_ms = min(budget_ms, budget_ms - buffer_ms + SEVER_AFTER_DEADLINE_MS)
    watchdog = threading.Timer(sever_ms / 1000, _sever, args=(conn, worker_id, sever_ms))
    watchdog.daemon = True
    watchdog.start()
    stopper = stopping.BatchStop(stop, budget, pool).start()
    try:
        prepare_tasks(config, conn, deadline_bound(budget))
        # Group events become webhook jobs in this run (only with THUMBQ_WEBHOOK_URL set).
        from worker.engine import webhooks

        webhooks.prepare(config, conn, deadline_bound(budget))
        start = db.one(
            conn,
            "start_run",
            {
                "worker_id": worker_id,
                "budget_ms": budget_ms,
                "buffer_ms": buffer_ms,
                "concurrency": config.concurrency,
            },
            bound=deadline_bound(budget),
        )
        assert start is not None
        run_id = int(start["result"]["run_id"])
        predictor = Predictor.from_rows(start["result"]["stats"], tasks.REGISTRY.priors())
        recorder = stopping.StoppableRecorder(queue, budget, worker_id, on_item, stop=stop)
        claimer = Claimer(
            queue,
            budget,
            predictor,
            recorder,
            worker_id=worker_id,
            concurrency=config.concurrency,
            max_items=max_items or config.batch_size,
            vt_seconds=math.ceil(budget_ms / 1000) + VT_MARGIN_S,
            stop=stop,
        )
        executor = Executor(config, queue, bounded, pool, budget, predictor, recorder)

        def work() -> None:
            while (job := claimer.next_job()) is not None:
                claimer.ended(job, executor.run(job))

        threads = [
            threading.Thread(target=work, name=f"thumbq-worker-{i}", daemon=True)
            for i in range(config.concurrency)
        ]
        for t in threads:
            t.start()
        for t in threads:
            # A worker never waits on a thread task's handler past the deadline (one still
            # running is left to the keeper, worker.engine.overrun); this bounds any other stall.
            t.join(max(budget.end_call_ms(RELEASE_MS), 0.0) / 1000)
        stuck = sum(t.is_alive() for t in threads)
        if stuck:
            recorder.errors.append(f"{stuck} worker threads ran past the deadline")
        executor.close()
        recorder.flush()
        if claimer.claim_error is not None:
            raise claimer.claim_error

        unstarted = recorder.unstarted(claimer.waiting)
        released = 0
        try:
            released = queue.release(worker_id, unstarted, bound=deadline_bound(budget, RELEASE_MS))
        except db.DeadlineExceeded as exc:
            # Their leases run out instead: back in budget + VT_MARGIN_S.
            recorder.errors.append(f"could not release {len(unstarted)} unstarted jobs: {exc}")
        counts = recorder.counts
        # A job handed back by its handler (a checkpoint) waits, visible at once, for more
        # time: the run stopped for time, so that a scheduler calls again now.
        reason = (
            StopReason.TIME_BUDGET
            if claimer.time_stopped or unstarted or counts[Outcome.CHECKPOINTED]
            else claimer.exhausted or StopReason.DRAINED
        )
        duration_ms = round(budget.elapsed_ms())
        summary = {
            **counts,
            "claimed": claimer.claimed,
            "released": released,
            "stopped_reason": reason,
            "duration_ms": duration_ms,
            "retry_after_ms": claimer.retry_after_ms,
        }
        finished: dict[str, Any] = {"remaining": None, "alerts": []}
        try:
            row = db.one(
                conn,
                "finish_run",
                {"run_id": run_id, "summary": _json(summary), "stats": _json(predictor.summary())},
                bound=deadline_bound(budget, FINISH_MS),
            )
            assert row is not None
            finished = row["result"]
        except db.DeadlineExceeded as exc:
            # The counts are still right; only the run's row and `remaining` are missing.
            recorder.errors.append(f"could not finish run {run_id}: {exc}")
        result = BatchResult(
            run_id=run_id,
            processed=counts["processed"],
            succeeded=counts["succeeded"],
            failed=counts["failed"],
            unsupported=counts["unsupported"],
            missing=counts["missing"],
            retried=counts["retried"],
            skipped=counts["skipped"],
            checkpointed=counts["checkpointed"],
            remaining=None if finished["remaining"] is None else int(finished["remaining"]),
            stopped_reason=reason,
            duration_ms=duration_ms,
            budget_ms=budget_ms,
            retry_after_ms=claimer.retry_after_ms if reason == StopReason.RATE_LIMITED else None,
            claimed=claimer.claimed,
            released=released,
            alerts=list(finished["alerts"]),
        )
        log_event(
            "batch_run", worker_id=worker_id, **asdict(result), errors=recorder.errors[:5] or None
        )
        return result
    finally:
        watchdog.cancel()
        stopper.close()
        bounded.close()
        if own_pool:
            pool.close()


# Databases this process has told its registered tasks (thumbq.tasks), by URL.
_SYNCED: set[tuple[str, tuple[str, ...]]] = set()


def prepare_tasks(config: Config, conn: db.Conn, call_bound: db.Bound | None = None) -> None:
    """Import THUMBQ_TASKS's modules and, once per process and database, write their tasks'
    buckets and limits to `thumbq.tasks`, where claims read them."""
    if not config.tasks:
        return
    names = tuple(tasks.load_modules(config.tasks))
    key = (conn.info.dsn, names)
    if key in _SYNCED:
        return
    tasks.sync(conn, call_bound=call_bound)
    _SYNCED.add(key)


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


def _json(value: Any) -> str:
    import json

    return json.dumps(value)
