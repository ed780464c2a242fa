"""Interactive runs: one given job, now, within the caller's wait (seed 001's button click:
`POST /api/jobs` with `wait_ms`, `thumbq jobs enqueue --wait-ms`).

The parts of a batch (worker.engine.batch), for one job: it is claimed with the same lease and
rate limit (`Queue.claim_job`), run by the Executor (its task's runner, as the thumbnail task's,
or its handler in a child process or on a thread of its own) and recorded by the Recorder, under
a Budget whose deadline is the end of the wait. Recording gets the same reserve after the
deadline as a batch's end (worker.engine.budget), so the answer comes within `wait_ms` + about
0.3 s.


What cannot finish in the wait stays queued, and the answer says why: the bucket has no token
(`rate_limited`, with `retry_after_ms`), another invocation holds the job (`busy`), it waits
behind an earlier job of its ordering key or for its retry (`not_ready`), the durations observed
for its kind say it would not fit (`too_long`), or it was cut at the deadline (`timeout`: handed
back at once, its attempt and token given back, for the next batch). A handler that checkpoints
is resumed by a later batch (`checkpointed`); a transient failure retries with backoff
(`retrying`). A thread handler still running at the end of the wait cannot be stopped: it keeps
its job (its lease renewed) until it ends, and its outcome is recorded then (`running`,
worker.engine.overrun).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from worker.engine import db, tasks
from worker.engine.batch import VT_MARGIN_S, new_worker_id, prepare_tasks
from worker.engine.budget import RELEASE_MS, Budget, Predictor
from worker.engine.claiming import job_kind
from worker.engine.errors import ThumbqError
from worker.engine.execution import Executor
from worker.engine.log import log_event
from worker.engine.queue import ClaimedJob, Queue
from worker.engine.recording import CUT_AT_DEADLINE, Recorder, deadline_bound
from worker.engine.states import FINAL_STATUSES, JobStatus, Outcome
from worker.engine.tasks import THUMBNAIL
from worker.storage import BoundedStorage

if TYPE_CHECKING:
    from worker.engine.config import Config
    from worker.engine.processes import ProcessPool
    from worker.storage import Storage

# Why a job did not end within the wait (InlineRun.reason).
REASONS = (
    "rate_limited",
    "busy",
    "not_ready",
    "too_long",
    "timeout",
    "checkpointed",
    "retrying",
    "unrecorded",
    "running",
)


@dataclass(frozen=True)
class InlineRun:
    """How an interactive run went: whether the job ran here, whether it has ended (its row's
    status is final), and if not, why (`reason`, one of REASONS) in words (`message`)."""

    job_id: int
    ran: bool
    finished: bool
    reason: str | None
    message: str
    retry_after_ms: int | None
    duration_ms: int
    row: dict[str, Any] | None

    def summary(self) -> dict[str, Any]:
        """What an answer says of the wait (the job itself is shown apart)."""
        return {
            "ran": self.ran,
            "finished": self.finished,
            "reason": self.reason,
            "message": self.message,
            "retry_after_ms": self.retry_after_ms,
            "duration_ms": self.duration_ms,
        }


class _InlineRecorder(Recorder):
    """A batch's recorder, except that an item cut at the deadline is always handed back: the
    caller chose how long to wait, which says nothing of the job, so it costs no attempt and
    waits for no backoff (a batch counts the attempt when the item had a fair share)."""

    def failed(self, job: ClaimedJob, exc: BaseException, window_ms: float) -> Outcome:
        if isinstance(exc, ThumbqError) and exc.code in CUT_AT_DEADLINE:
            with self.lock:
                self.late.append(job.id)
            return Outcome.RELEASED
        return super().failed(job, exc, window_ms)


def run_job(
    config: Config,
    conn: db.Conn,
    storage: Storage,
    pool: ProcessPool,
    job_id: int,
    wait_ms: int,
    *,
    task: str | None = None,
    worker_id: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> InlineRun:
    """Run job `job_id` here if it waits and fits in `wait_ms`; otherwise leave it queued and
    say why. `task`, when the caller knows it, picks the bucket the claim takes its token
    from first: the thumbnail bucket for thumbnails, the task's own (thumbq.tasks) otherwise."""
    buffer_ms = config.buffer_ms
    budget = Budget(wait_ms + buffer_ms, buffer_ms, clock)
    worker_id = worker_id or new_worker_id()
    # A task with a bucket of its own takes its token in SQL (thumbq.tasks names the bucket);
    # taking one from the thumbnail bucket first would refuse it while that bucket is empty.
    bucket = config.rate_bucket if task in (None, THUMBNAIL) else None
    queue = Queue(
        conn, bucket=bucket, max_attempts=config.max_attempts, ageing_s=config.priority_ageing_s
    )
    vt_seconds = math.ceil((wait_ms + buffer_ms) / 1000) + VT_MARGIN_S

    def answer(
        ran: bool, reason: str | None, message: str, retry_after_ms: int | None = None
    ) -> InlineRun:
        row = queue.job(job_id)
        finished = row is not None and row["status"] in FINAL_STATUSES
        run = InlineRun(
            job_id=job_id,
            ran=ran,
            finished=finished,
            reason=None if finished else reason,
            message=_finished_message(row) if finished and row is not None else message,
            retry_after_ms=None if finished else retry_after_ms,
            duration_ms=round(budget.elapsed_ms()),
            row=row,
        )
        log_event(
            "job_inline",
            worker_id=worker_id,
            job_id=job_id,
            ran=ran,
            finished=finished,
            reason=run.reason,
            status=None if row is None else row["status"],
            duration_ms=run.duration_ms,
            wait_ms=wait_ms,
        )
        return run

    try:
        prepare_tasks(config, conn, deadline_bound(budget))
        job, why = queue.claim_job(worker_id, job_id, vt_seconds, bound=deadline_bound(budget))
    except db.DeadlineExceeded as exc:
        return answer(False, "busy", f"the claim could not finish within the wait ({exc})")
    if job is None:
        reason, message, retry_after = _not_claimed(queue.job(job_id), why)
        return answer(False, reason, message, retry_after)

    predictor = Predictor.from_rows(
        db.run(conn, "render_stats", bound=deadline_bound(budget)), tasks.REGISTRY.priors()
    )
    expected_ms = predictor.expected_ms(*job_kind(job))
    if expected_ms > budget.remaining_ms():
        queue.release(worker_id, [job.id], bound=deadline_bound(budget, RELEASE_MS))
        return answer(
            False,
            "too_long",
            f"a job like this one takes about {expected_ms:.0f} ms, more than the "
            f"{wait_ms} ms waited: it stays queued for the next batch",
        )

    outcomes: list[Outcome] = []
    recorder = _InlineRecorder(queue, budget, worker_id, lambda _job, o: outcomes.append(o))
    bounded = BoundedStorage(storage, lambda: budget.remaining_ms() / 1000)
    executor = Executor(config, queue, bounded, pool, budget, predictor, recorder)
    try:
        executor.run(job)
        executor.close()
        recorder.flush()
    finally:
        bounded.close()
    outcome = outcomes[-1] if outcomes else Outcome.UNRECORDED
    if recorder.late:
        # If even that is cut, its lease runs out instead: back in wait + VT_MARGIN_S seconds.
        with contextlib.suppress(db.DeadlineExceeded):
            queue.release(worker_id, recorder.late, bound=deadline_bound(budget, RELEASE_MS))
    if outcome == Outcome.RELEASED:
        return answer(
            True,
            "timeout",
            f"it did not finish within the {wait_ms} ms waited: it was stopped and handed "
            "back, without using an attempt, for the next batch",
        )
    if outcome == Outcome.CHECKPOINTED:
        return answer(
            True,
            "checkpointed",
            "its handler checkpointed within the wait: a later batch resumes it",
        )
    if outcome == Outcome.OVERRAN:
        return answer(
            True,
            "running",
            f"its handler was still running at the end of the {wait_ms} ms waited: it keeps "
            "the job (its lease is renewed) until it ends, and its outcome is recorded then",
        )
    if outcome == Outcome.RETRIED:
        return answer(True, "retrying", "it failed and will be retried with backoff")
    if outcome in (Outcome.UNRECORDED, Outcome.SKIPPED):
        errors = "; ".join(recorder.errors[:2])
        return answer(
            True,
            "unrecorded" if outcome == Outcome.UNRECORDED else "busy",
            f"its outcome could not be recorded ({errors or outcome}); it runs again when its "
            "lease ends"
            if outcome == Outcome.UNRECORDED
            else "another invocation took the job over",
        )
    return answer(True, None, "")


def _not_claimed(row: dict[str, Any] | None, why: dict[str, Any]) -> tuple[str, str, int | None]:
    """Why a job that claim_job refused stays where it is: reason, words, retry_after_ms."""
    reason = why.get("reason")
    if reason == "rate_limited":
        retry = why.get("retry_after_ms")
        return (
            "rate_limited",
            "the rate limit has no token for it now: it stays queued"
            + (f"; a token comes in {retry} ms" if retry is not None else ""),
            None if retry is None else int(retry),
        )
    if row is None:
        return "not_ready", "there is no such job", None
    if reason == "busy" or row["status"] == JobStatus.PROCESSING:
        return "busy", "another invocation is running it", None
    if row["status"] == JobStatus.PENDING and row.get("ordering_key") and row.get("msg_id") is None:
        return (
            "not_ready",
            f"it waits for the jobs before sequence {row.get('sequence')} of ordering key "
            f"{row['ordering_key']!r}",
            None,
        )
    if row["status"] == JobStatus.PENDING and row.get("next_attempt_at") is not None:
        return (
            "not_ready",
            f"it waits for its retry at {row['next_attempt_at'].isoformat()}",
            None,
        )
    return "not_ready", f"it is {row['status']} and cannot run now", None


def _finished_message(row: dict[str, Any]) -> str:
    if row["status"] == JobStatus.COMPLETED:
        return "completed"
    detail = f" ({row['error_code']}: {row['last_error']})" if row.get("error_code") else ""
    return f"{row['status']}{detail}"
