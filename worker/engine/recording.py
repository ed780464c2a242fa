"""What an invocation records, and how it counts each item's end.

Completions are buffered and written in small batches (fewer round trips, progress still near
real time); failures, checkpoints and a running job's saves are written as they happen. Every
call is bounded by the invocation's deadline (or its reserve after it, worker.engine.budget).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from worker.engine import db
from worker.engine.budget import RECORD_MS, Budget
from worker.engine.errors import RENDER_TIMEOUT, STORAGE_TIMEOUT, ThumbqError
from worker.engine.queue import ClaimedJob, Queue
from worker.engine.retry import Failure, classify
from worker.engine.states import COUNTED, Outcome, failure_outcome

# Completions are written in small batches: fewer round trips, progress still near real time.
FLUSH_EVERY_N = 64
FLUSH_EVERY_S = 0.25
# An item killed at the deadline counts as an attempt only if it had at least this share of
# the invocation's working time; one that merely started late is released and goes first next
# time, where it gets a whole window.
FAIR_SHARE = 0.5
# Which running jobs were cancelled is asked at most this often, for all of them in one query.
CANCEL_POLL_S = 0.25
# A running job's progress write waits at most this long (a row held elsewhere): progress is
# tried again at the handler's next report, and its last value goes with the outcome.
PROGRESS_BOUND_MS = 250.0
# Cut at the deadline: the item had less time than it needed, which says nothing of the file.
CUT_AT_DEADLINE = (RENDER_TIMEOUT, STORAGE_TIMEOUT)
# What a run counts: every item it processed, and how each of them ended.
COUNTS = ("processed", *COUNTED)


def deadline_bound(budget: Budget, after_ms: float | None = None) -> db.Bound:
    """A database call's bound: until the deadline, or (a call that records the run's outcome)
    until `after_ms` past it. One made after the deadline does not wait for the WAL flush to
    commit (db.Bound): the answer is due, and a lost commit only means a redone item."""
    if after_ms is None:
        return db.Bound(budget.remaining_ms())
    return db.Bound(budget.end_call_ms(after_ms), durable=not budget.expired())


class Recorder:
    """Records the outcomes of one invocation's items, shared by its worker threads."""

    def __init__(
        self,
        queue: Queue,
        budget: Budget,
        worker_id: str,
        on_item: Callable[[ClaimedJob, Outcome], None] | None = None,
    ) -> None:
        self.queue = queue
        self.budget = budget
        self.worker_id = worker_id
        self.on_item = on_item
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.late: list[int] = []  # job ids killed at the deadline after starting late
        self.errors: list[str] = []
        self._pending: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._flush_lock = threading.Lock()
        self._running: set[int] = set()
        self._cancelled: set[int] = set()
        self._polled_at = 0.0

    # -- completions ----------------------------------------------------------------------

    def done(self, record: dict[str, Any]) -> None:
        """Buffer a completion ({"job_id", "msg_id", ...columns or "result"})."""
        with self.lock:
            self._pending.append(record)
            due = (
                len(self._pending) >= FLUSH_EVERY_N
                or time.monotonic() - self._last_flush >= FLUSH_EVERY_S
            )
        if due:
            self.flush()

    def flush(self) -> None:
        """Write buffered completions in one call."""
        with self._flush_lock:
            with self.lock:
                batch, self._pending = self._pending, []
                self._last_flush = time.monotonic()
            if not batch:
                return
            try:
                completed = self.queue.complete(
                    self.worker_id, batch, bound=deadline_bound(self.budget, RECORD_MS)
                )
            except Exception as exc:
                # The work is done (thumbnails written); the messages come back after the lease
                # and the next run does it again (same keys, same bytes).
                self.errors.append(f"could not record {len(batch)} completions: {exc}")
                return
            with self.lock:
                self.counts[Outcome.SUCCEEDED] += completed
                self.counts[Outcome.SKIPPED] += len(batch) - completed
                self.counts["processed"] += len(batch)

    # -- failures -------------------------------------------------------------------------

    def failed(self, job: ClaimedJob, exc: BaseException, window_ms: float) -> Outcome:
        """Record a failed item from its exception; how it ended, in the words of the run's
        counts (`released` for an item killed after starting late, `unrecorded` when the
        database is gone)."""
        killed = isinstance(exc, ThumbqError) and exc.code in CUT_AT_DEADLINE
        if killed and window_ms < FAIR_SHARE * self.budget.work_ms:
            with self.lock:
                self.late.append(job.id)
            return Outcome.RELEASED
        return self.failure(job, classify(exc))

    def not_started(self, job: ClaimedJob) -> Outcome:
        """An item that never ran (no time was left to start it): handed back at the run's end
        with the unstarted ones, no attempt used."""
        with self.lock:
            self.late.append(job.id)
        return Outcome.RELEASED

    def failure(self, job: ClaimedJob, failure: Failure) -> Outcome:
        """Record a classified failure: the job ends, or retries with backoff."""
        try:
            outcome = self.queue.fail(
                self.worker_id,
                job,
                failure.code,
                failure.message,
                failure.permanent,
                bound=deadline_bound(self.budget, RECORD_MS),
            )
        except Exception as db_exc:
            # The lease runs out and the message comes back: nothing is lost.
            self.errors.append(f"could not record failure of job {job.id}: {db_exc}")
            return Outcome.UNRECORDED
        counted = failure_outcome(bool(outcome.get("owned")), outcome.get("status"))
        self.count(counted)
        return counted

    # -- running tasks --------------------------------------------------------------------

    def started(self, job: ClaimedJob) -> None:
        """A task's handler starts: its cancellation is watched."""
        with self.lock:
            self._running.add(job.id)

    def ended(self, job: ClaimedJob) -> None:
        with self.lock:
            self._running.discard(job.id)

    def save(self, job: ClaimedJob, state: Any | None, done: int | None, total: int | None) -> bool:
        """A running job's checkpoint or progress, written now (a checkpoint must survive a
        crash right after it). True once written, or when the job is no longer this run's
        (cancelled: `is_cancelled` says so from now on); False when the write failed, which a
        checkpoint's handler is told (tasks.CheckpointNotSaved) and progress tries again.

        A checkpoint gets the reserve after the deadline that an outcome gets: one sent just
        before the deadline is the handler's last word, and must not be lost to the kill.
        Progress gets at most PROGRESS_BOUND_MS: it is worth no more of the handler's time."""
        if state is None:
            call_bound = db.Bound(min(self.budget.remaining_ms(), PROGRESS_BOUND_MS))
        else:
            call_bound = deadline_bound(self.budget, RECORD_MS)
        try:
            r = self.queue.checkpoint(
                self.worker_id, job, state, done, total, requeue=False, bound=call_bound
            )
        except Exception as exc:
            self.errors.append(f"could not save job {job.id}: {exc}")
            return False
        if not r.get("owned"):
            with self.lock:
                self._cancelled.add(job.id)
        return True

    def checkpointed(
        self, job: ClaimedJob, state: Any, progress: tuple[int, int | None] | None
    ) -> Outcome:
        """A handler stopped to be resumed by a later invocation: the job waits again, no
        attempt used."""
        done, total = progress or (None, None)
        try:
            r = self.queue.checkpoint(
                self.worker_id,
                job,
                state,
                done,
                total,
                requeue=True,
                bound=deadline_bound(self.budget, RECORD_MS),
            )
        except Exception as exc:
            self.errors.append(f"could not checkpoint job {job.id}: {exc}")
            return Outcome.UNRECORDED
        counted = Outcome.CHECKPOINTED if r.get("owned") else Outcome.SKIPPED
        self.count(counted)
        return counted

    def is_cancelled(self, job: ClaimedJob) -> bool:
        """Whether a running job was cancelled (or taken over). All running jobs are asked
        about in one query, at most every CANCEL_POLL_S."""
        with self.lock:
            if job.id in self._cancelled:
                return True
            due = time.monotonic() - self._polled_at >= CANCEL_POLL_S
            running = sorted(self._running) if due else []
            if due:
                self._polled_at = time.monotonic()
        if running:
            try:
                gone = self.queue.not_held(
                    self.worker_id, running, bound=deadline_bound(self.budget)
                )
            except Exception:
                gone = set()
            with self.lock:
                self._cancelled |= gone
        with self.lock:
            return job.id in self._cancelled

    # -- counts ---------------------------------------------------------------------------

    def count(self, name: Outcome) -> None:
        with self.lock:
            self.counts[name] += 1
            self.counts["processed"] += 1

    def item_ended(self, job: ClaimedJob, outcome: Outcome) -> None:
        if self.on_item is not None:
            self.on_item(job, outcome)

    def unstarted(self, waiting: Iterable[ClaimedJob]) -> list[int]:
        """What the run hands back at its end: the jobs it never started, and the late ones."""
        return [j.id for j in waiting] + self.late
