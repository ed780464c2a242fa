"""The words the engine stores and answers with, one list each.

A `StrEnum` member equals its string, so these go into JSON, SQL parameters and comparisons
as the plain words they are. Where the schema keeps one of them in a column, a check
constraint lists the same words (test_states compares them with the live schema).
"""

from __future__ import annotations

from enum import StrEnum


class JobStatus(StrEnum):
    """Where a job is (`thumbq.jobs.status`, and a count column of `thumbq.groups` each)."""

    PENDING = "pending"
    PROCESSING = "processing"
    COMPLETED = "completed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    CANCELLED = "cancelled"


# A job in one of these has ended: nothing runs it again unless a person retries it.
FINAL_STATUSES = frozenset(
    {JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.UNSUPPORTED, JobStatus.CANCELLED}
)


class Outcome(StrEnum):
    """How one item of an invocation ended (`run_batch`'s `on_item`, the run's counts)."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    # Ended `unsupported` (a type no renderer reads, a task no module registered).
    UNSUPPORTED = "unsupported"
    # Ended `cancelled` because its source is gone from storage (`source_missing`).
    MISSING = "missing"
    # Failed, and waits for its retry with backoff.
    RETRIED = "retried"
    # No longer this run's (cancelled or taken over meanwhile), or already done.
    SKIPPED = "skipped"
    # Its handler stopped to be resumed by a later invocation, no attempt used.
    CHECKPOINTED = "checkpointed"
    # Started late and killed at the deadline, or never started: back in the queue at once.
    RELEASED = "released"
    # A thread handler still running at the deadline: it keeps its job until it ends.
    OVERRAN = "overran"
    # The database did not take the outcome: the lease runs out and the job comes back.
    UNRECORDED = "unrecorded"
    # Not an end: a writer thread stores the item's thumbnails, then ends it.
    WRITING = "writing"


# The outcomes a run counts (BatchResult's fields beside `processed`), in its answer's order.
COUNTED = (
    Outcome.SUCCEEDED,
    Outcome.FAILED,
    Outcome.UNSUPPORTED,
    Outcome.MISSING,
    Outcome.RETRIED,
    Outcome.SKIPPED,
    Outcome.CHECKPOINTED,
)
# Each outcome that ends a job for good, as the status it ends with.
FINAL_OUTCOMES = {
    Outcome.SUCCEEDED: JobStatus.COMPLETED,
    Outcome.FAILED: JobStatus.FAILED,
    Outcome.UNSUPPORTED: JobStatus.UNSUPPORTED,
    Outcome.MISSING: JobStatus.CANCELLED,
}


def failure_outcome(owned: bool, status: str | None) -> Outcome:
    """How a failed item ended, from what thumbq.fail answered: whether the job was still this
    run's, and the status it has now."""
    if not owned:
        return Outcome.SKIPPED
    if status == JobStatus.PENDING:
        return Outcome.RETRIED
    if status == JobStatus.UNSUPPORTED:
        return Outcome.UNSUPPORTED
    if status == JobStatus.CANCELLED:
        return Outcome.MISSING  # the only failure that ends a job cancelled
    return Outcome.FAILED


class StopReason(StrEnum):
    """Why an invocation stopped (`thumbq.batch_runs.stopped_reason`, the batch's answer)."""

    # Nothing visible was left to claim.
    DRAINED = "drained"
    # The deadline came (or a stop was asked), with work possibly left.
    TIME_BUDGET = "time_budget"
    # A token bucket was empty: `retry_after_ms` says when it has a token again.
    RATE_LIMITED = "rate_limited"
    # The run claimed as many items as it was allowed (THUMBQ_BATCH_SIZE or `max_items`).
    MAX_ITEMS = "max_items"


class ErrorCode(StrEnum):
    """Why a job failed or was cancelled (`thumbq.jobs.error_code`): every code thumbq itself
    writes. A task module's `PermanentError` or `TransientError` may bring codes of its own."""

    # Permanent: the input itself is the problem; retrying cannot help.
    UNSUPPORTED_TYPE = "unsupported_type"
    CORRUPT_INPUT = "corrupt_input"
    ENCRYPTED_INPUT = "encrypted_input"
    TOO_LARGE = "too_large"
    SOURCE_MISSING = "source_missing"
    # A key enqueued without the API's checks (through SQL or RPC) that storage refuses.
    INVALID_KEY = "invalid_key"
    # A job names a task no module of THUMBQ_TASKS registered.
    UNSUPPORTED_TASK = "unsupported_task"
    # Transient: the world may be different next time.
    STORAGE_ERROR = "storage_error"
    RENDER_TIMEOUT = "render_timeout"
    DB_ERROR = "db_error"
    # A storage call or database statement cut at the invocation's deadline (a stall, a slow
    # drip, a lock held elsewhere).
    STORAGE_TIMEOUT = "storage_timeout"
    DB_TIMEOUT = "db_timeout"
    INTERNAL = "internal"
    # The invocation that held the job ended without a word (killed, crashed): thumbq.reap_stale.
    LEASE_EXPIRED = "lease_expired"
    # A task's handler raised PermanentError or TransientError without a code of its own.
    TASK_FAILED = "task_failed"
    TASK_ERROR = "task_error"
    # ctx.checkpoint(state) could not write the state (tasks.CheckpointNotSaved).
    CHECKPOINT_NOT_SAVED = "checkpoint_not_saved"
    # The built-in `webhook` task (worker.engine.webhooks).
    WEBHOOK_NOT_CONFIGURED = "webhook_not_configured"
    WEBHOOK_UNREACHABLE = "webhook_unreachable"
    WEBHOOK_REFUSED = "webhook_refused"
    # Cancelled: by a person (thumbq.cancel_jobs), or replaced by a newer version of its source
    # before it ran (thumbq.enqueue).
    CANCELLED = "cancelled"
    SUPERSEDED = "superseded"


# The codes that end a job at once, without a retry; every other code retries with backoff.
PERMANENT_CODES = frozenset(
    {
        ErrorCode.UNSUPPORTED_TYPE,
        ErrorCode.CORRUPT_INPUT,
        ErrorCode.ENCRYPTED_INPUT,
        ErrorCode.TOO_LARGE,
        ErrorCode.SOURCE_MISSING,
        ErrorCode.INVALID_KEY,
        ErrorCode.UNSUPPORTED_TASK,
    }
)
