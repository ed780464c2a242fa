"""Which work an invocation takes, and when it starts each item.

Jobs are claimed as many as are predicted to fit in the remaining time across the workers
(about half of it per claim, so that concurrent invocations share a backlog), and an item starts
only if its predicted duration fits before the deadline. A claim that comes back short ends the
claiming, except while jobs of ordering keys run: each that completes lets its key's next job
be claimed, so an invocation goes on down its keys for as long as it has time.
"""

from __future__ import annotations

import math
import threading
from collections import deque

from worker.engine import db
from worker.engine.budget import Budget, Predictor
from worker.engine.queue import ClaimedJob, Queue
from worker.engine.recording import FAIR_SHARE, Recorder, deadline_bound
from worker.engine.states import Outcome, StopReason
from worker.engine.tasks import REGISTRY, Registry

# One claim takes at most this many: tiny items would otherwise be claimed all at once, holding
# them away from concurrent invocations and making one long transaction.
CLAIM_CHUNK_MAX = 250
# A worker waiting for the jobs of ordering keys looks at the stop event this often.
STOP_POLL_S = 0.1


def job_kind(job: ClaimedJob, registry: Registry = REGISTRY) -> tuple[str, int]:
    """What the predictor knows a job by: what its task says (Task.kind: the thumbnail task's
    file kind and size class), else its task's name."""
    registered = registry.get(job.task)
    if registered is not None and registered.kind is not None:
        return registered.kind(job)
    return f"task:{job.task}", 0


class Claimer:
    """Claims and hands out work to an invocation's worker threads, under one lock."""

    def __init__(
        self,
        queue: Queue,
        budget: Budget,
        predictor: Predictor,
        recorder: Recorder,
        *,
        worker_id: str,
        concurrency: int,
        max_items: int,
        vt_seconds: int,
        stop: threading.Event | None = None,
    ) -> None:
        """`stop`, once set (a signal: worker.engine.stopping), ends the claiming: no item
        starts."""
        self.queue = queue
        self.budget = budget
        self.predictor = predictor
        self.recorder = recorder
        self.worker_id = worker_id
        self.concurrency = concurrency
        self.max_items = max_items
        self.vt_seconds = vt_seconds
        self.stop = stop
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.waiting: deque[ClaimedJob] = deque()
        # Jobs of ordering keys: each one that completes gives the next job of its key a
        # message, which a claim made before could not see. They are claimed in this run too.
        self.ordered_running = 0
        self.heads_released = 0
        self._released_at_claim = 0
        self.claimed = 0
        # Why claiming stopped; the run stops for time (`time_stopped`) or on a claim error
        # (`claim_error`) whatever it says.
        self.exhausted: StopReason | None = None
        self.claim_error: Exception | None = None
        self.time_stopped = False
        self.retry_after_ms: int | None = None

    def _predict(self, job: ClaimedJob) -> float:
        return self.predictor.start_ms(*job_kind(job))

    def _claim_more(self) -> None:
        """Claim about half of what is predicted to fit in the remaining time."""
        if self.claimed >= self.max_items:
            self.exhausted = StopReason.MAX_ITEMS
            return
        remaining = self.budget.remaining_ms()
        typical = self.predictor.typical_ms()
        if self.waiting:
            typical = sum(self._predict(j) for j in self.waiting) / len(self.waiting)
        fit = self.concurrency * remaining / max(typical, 1.0)
        want = max(self.concurrency, math.ceil(fit / 2)) - len(self.waiting)
        want = min(want, self.max_items - self.claimed, CLAIM_CHUNK_MAX)
        if want <= 0:
            return
        self._released_at_claim = self.heads_released
        claim = self.queue.claim(
            self.worker_id, want, self.vt_seconds, bound=deadline_bound(self.budget)
        )
        self.claimed += len(claim.jobs)
        self.waiting.extend(claim.jobs)
        if claim.rate_limited:
            self.exhausted = StopReason.RATE_LIMITED
            self.retry_after_ms = claim.retry_after_ms
        elif len(claim.jobs) < want and claim.limited:
            # A task's own bucket, not the queue, left the claim short: the run is rate limited
            # (and says when to come back), not drained.
            self.exhausted = StopReason.RATE_LIMITED
            self.retry_after_ms = claim.retry_after_ms
        elif len(claim.jobs) < want:
            self.exhausted = StopReason.DRAINED
        elif self.claimed >= self.max_items:
            self.exhausted = StopReason.MAX_ITEMS

    def ended(self, job: ClaimedJob, outcome: Outcome) -> None:
        """A job `next_job` handed out has ended with `outcome` (`Executor.run`'s word)."""
        if job.ordering_key is None:
            return
        with self.changed:
            self.ordered_running -= 1
            if outcome == Outcome.SUCCEEDED:
                self.heads_released += 1
            self.changed.notify_all()

    def next_job(self) -> ClaimedJob | None:
        """The next job to start, or None when the calling worker should stop."""
        with self.lock:
            while True:
                if self.budget.expired() or (self.stop is not None and self.stop.is_set()):
                    self.time_stopped = True
                    return None
                # Early in the run an item starts even when predicted not to fit: otherwise one
                # predicted longer than any window would wait forever. It gets its fair share
                # and is killed at the deadline if it needs more (an attempt, then the DLQ).
                early = self.budget.remaining_ms() >= FAIR_SHARE * self.budget.work_ms
                for job in self.waiting:
                    if early or self.budget.fits(self._predict(job)):
                        self.waiting.remove(job)
                        if job.ordering_key is not None:
                            self.ordered_running += 1
                        return job
                if self.waiting:
                    # Nothing claimed fits any more; later claims would not either.
                    self.time_stopped = True
                    return None
                if (
                    self.exhausted == StopReason.DRAINED
                    and self.heads_released > self._released_at_claim
                ):
                    # Jobs of ordering keys completed since the last claim: once their
                    # completions are written, the next job of each key can be claimed.
                    self.recorder.flush()
                    self.exhausted = None
                elif self.exhausted == StopReason.DRAINED and self.ordered_running:
                    # Wait for them rather than end this worker: each may let its key's next
                    # job go. In slices, so that a stop is seen at once.
                    self.changed.wait(min(self.budget.remaining_ms() / 1000, STOP_POLL_S))
                    continue
                elif self.exhausted or self.claim_error is not None:
                    return None
                try:
                    self._claim_more()
                except db.DeadlineExceeded as exc:
                    # A lock held elsewhere (the bucket row, a job row) kept the claim past the
                    # deadline; it changed nothing. Out of time, not an error of the run.
                    self.recorder.errors.append(str(exc))
                    self.time_stopped = True
                    self.exhausted = StopReason.TIME_BUDGET
                    return None
                except Exception as exc:
                    # The database is gone: stop claiming; run_batch reports it after the
                    # items in flight have ended (their leases keep them safe meanwhile).
                    self.claim_error = exc
                    return None
