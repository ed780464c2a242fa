"""Running one claimed job: its task's runner (a built-in task that runs on the worker's thread,
as the thumbnail task does: worker/thumbnails/task.py), or its handler.

The handler runs in a child process (killed at the deadline, like a render) or on a thread of
its own (`runs_in="thread"`: one that overruns the deadline keeps its job until it ends,
worker.engine.overrun), with a TaskContext whose checkpoints, progress and cancellation checks go to
the database.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from worker.engine import db, tasks
from worker.engine.budget import Budget, Predictor
from worker.engine.claiming import job_kind
from worker.engine.errors import RENDER_TIMEOUT, UNSUPPORTED_TASK, ThumbqError
from worker.engine.log import log_event
from worker.engine.overrun import Ending, HandlerThread, Keeper, keeper_for
from worker.engine.queue import ClaimedJob, Queue
from worker.engine.recording import Recorder
from worker.engine.retry import Failure
from worker.engine.sandbox import TaskNotStarted
from worker.engine.states import Outcome

if TYPE_CHECKING:
    from worker.engine.config import Config
    from worker.engine.processes import ProcessPool
    from worker.storage import Storage

# A thread handler is waited for this long past the deadline it was given (a checkpoint it
# returns at its last moment); one still running then is left to the keeper (worker.engine.overrun).
THREAD_GRACE_MS = 50.0


class _TaskBackend:
    """A task context's backend in the worker: saves and cancellation checks through the
    invocation's recorder, or through the keeper once the invocation left the thread handler
    running (worker.engine.overrun). It remembers whether this run saved a checkpoint: a handler
    killed at the deadline after one is handed back like a checkpoint, with no attempt used."""

    def __init__(self, recorder: Recorder, job: ClaimedJob) -> None:
        self.recorder = recorder
        self.job = job
        self.checkpointed = False  # a checkpoint with a new state was written in this run
        self._keeper: Keeper | None = None

    def save(self, state: Any | None, done: int | None, total: int | None) -> bool:
        keeper = self._keeper
        if keeper is not None:
            saved = keeper.save(self.recorder.worker_id, self.job, state, done, total)
        else:
            saved = self.recorder.save(self.job, state, done, total)
        if saved and state is not None:
            self.checkpointed = True
        return saved

    def cancelled(self) -> bool:
        keeper = self._keeper
        if keeper is not None:
            return keeper.is_cancelled(self.job)
        return self.recorder.is_cancelled(self.job)

    def hand_to(self, keeper: Keeper) -> None:
        """From now on the handler's saves and checks go through `keeper`."""
        self._keeper = keeper


class Executor:
    """Runs the jobs one invocation claimed, each to an outcome the recorder counts."""

    def __init__(
        self,
        config: Config,
        queue: Queue,
        storage: Storage,
        pool: ProcessPool,
        budget: Budget,
        predictor: Predictor,
        recorder: Recorder,
        registry: tasks.Registry = tasks.REGISTRY,
    ) -> None:
        self.config = config
        self.queue = queue
        self.storage = storage
        self.pool = pool
        self.budget = budget
        self.predictor = predictor
        self.recorder = recorder
        self.registry = registry
        # Write-behind: a worker hands a rendered item's uploads and completion to a writer
        # thread and starts its next item, so that its render process does not sit idle while
        # storage writes (a local file's fsyncs took 4.6 ms an item; an S3 PUT takes longer).
        # One pending write per worker: a worker whose last write has not ended waits for it.
        self.writer = ThreadPoolExecutor(
            max_workers=config.concurrency, thread_name_prefix="thumbq-writer"
        )
        self.write_slots = threading.Semaphore(config.concurrency)

    def run(self, job: ClaimedJob) -> Outcome:
        """Run `job` to its outcome (`writing` while a writer thread stores its thumbnails and
        then ends it)."""
        window_ms = self.budget.remaining_ms()
        try:
            registered = self.registry.get(job.task)
            if registered is not None and registered.runner is not None:
                outcome = registered.runner(self, job, window_ms)
            else:
                outcome = self._task(job, window_ms)
        except Exception as exc:  # every failure is classified and recorded, none escapes
            outcome = self.recorder.failed(job, exc, window_ms)
        if outcome != Outcome.WRITING:
            self.recorder.item_ended(job, outcome)
        return outcome

    def close(self) -> None:
        """Wait for the last items' writes (bounded by the deadline like every storage call)."""
        self.writer.shutdown(wait=True)

    # -- registered tasks -----------------------------------------------------------------

    def _task(self, job: ClaimedJob, window_ms: float) -> Outcome:
        registered = self.registry.get(job.task)
        if registered is None:
            raise ThumbqError(
                UNSUPPORTED_TASK,
                f"no handler for task {job.task!r} here: set THUMBQ_TASKS to the module that "
                "defines it",
            )
        started = time.monotonic()
        backend = _TaskBackend(self.recorder, job)
        self.recorder.started(job)
        try:
            if registered.runs_in == "thread":
                ending = self._in_thread(registered, job, backend)
                if ending is None:
                    return Outcome.OVERRAN
            else:
                ending = self._in_process(job, backend)
        except TaskNotStarted:
            # Its process took the window to start (or none became free): the handler never
            # ran, which says nothing of the job.
            return self.recorder.not_started(job)
        except ThumbqError as exc:
            if exc.code == RENDER_TIMEOUT and backend.checkpointed:
                # Killed at the deadline after a checkpoint of this run: it made progress and
                # is resumed from it, like a handler that returned its checkpoint (no attempt,
                # no backoff; the state saved last is kept).
                return self.recorder.checkpointed(job, None, None)
            raise
        finally:
            self.recorder.ended(job)
        if ending.failure is not None:
            return self.recorder.failure(job, ending.failure)
        if ending.checkpoint:
            return self.recorder.checkpointed(job, ending.value, ending.progress)
        ms = (time.monotonic() - started) * 1000
        self.predictor.observe(*job_kind(job), ms)
        self.recorder.done(
            {
                "job_id": job.id,
                "msg_id": job.msg_id,
                "result": ending.value,
                "duration_ms": round(ms),
                # The last progress goes with the outcome (with no total, it says how far the
                # handler got).
                "progress_done": None if ending.progress is None else ending.progress[0],
            }
        )
        return Outcome.SUCCEEDED

    def _in_thread(
        self, registered: tasks.Task, job: ClaimedJob, backend: _TaskBackend
    ) -> Ending | None:
        """Run the handler on a thread of its own until the deadline (and THREAD_GRACE_MS, for
        a checkpoint returned at the last moment). One still running then cannot be stopped:
        it is handed to the process's keeper, which holds its job until it ends (None)."""
        budget = self.budget
        ctx = tasks.TaskContext(job.as_dict(), lambda: budget.deadline, backend, budget.clock)
        handler = HandlerThread(registered, ctx)
        handler.start()
        # In short waits, so that a deadline moved closer (a stop) is seen at once.
        while (left_s := budget.remaining_ms(THREAD_GRACE_MS) / 1000) > 0:
            ending = handler.wait(min(left_s, 0.1))
            if ending is not None:
                return ending
        ending = handler.wait(0)
        if ending is not None:
            return ending
        keeper = keeper_for(db.database_url(self.config))
        backend.hand_to(keeper)
        keeper.adopt(job, self.recorder.worker_id, handler)
        self.recorder.errors.append(
            f"job {job.id}'s thread handler ran past the deadline: it keeps its job until it ends"
        )
        log_event("task_overran", worker_id=self.recorder.worker_id, job_id=job.id)
        return None

    def _in_process(self, job: ClaimedJob, backend: _TaskBackend) -> Ending:
        reply = self.pool.run_task(
            job.task,
            job.as_dict(),
            timeout_s=self.budget.remaining_ms() / 1000,
            on_save=backend.save,
            is_cancelled=backend.cancelled,
        )
        if not reply.ok:
            failure = Failure(reply.code or "internal", reply.message or "", reply.permanent)
            return Ending(failure=failure)
        if reply.checkpoint:
            return Ending(checkpoint=True, value=reply.state, progress=reply.progress)
        return Ending(value=reply.result, progress=reply.progress)
