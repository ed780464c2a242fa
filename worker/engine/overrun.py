"""Thread handlers that outlive their invocation: they keep their job until they end.

A task with `runs_in="thread"` runs its handler on a thread of its own (HandlerThread), which
the invocation waits for until its deadline. A thread cannot be killed: one that is still
running then is handed to the process's Keeper, and the invocation answers in time. The keeper
renews the job's lease (and its message's visibility) every RENEW_EVERY_S on a connection of
its own while the thread runs, so that no claim hands the job to a second run meanwhile
(a job never runs twice at once: docs/reliability.md, 12b), and records the handler's
outcome (complete, fail, checkpoint) when it ends. If the process dies, the renewals stop and
the lease expires within KEEP_LEASE_S: the job comes back as after any crash.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.engine import db, tasks
from worker.engine.log import log_event
from worker.engine.queue import ClaimedJob, Queue
from worker.engine.retry import Failure, classify
from worker.engine.states import Outcome, failure_outcome

# A kept job's lease is renewed this often, each time for KEEP_LEASE_S: a keeper that misses a
# renewal or two (a slow database) still holds its jobs, and a process that dies with a handler
# running gives its job back within KEEP_LEASE_S.
RENEW_EVERY_S = 3.0
KEEP_LEASE_S = 20
# Each of the keeper's calls (a renewal, a save, an outcome) may take this long.
CALL_MS = 5000.0
# After a call failed (the database away), the keeper tries again this soon; an outcome it
# could not record after RECORD_TRIES tries is left to the lease's end (logged).
RETRY_S = 1.0
RECORD_TRIES = 10


@dataclass(frozen=True)
class Ending:
    """How a handler ended: a result, a checkpoint (`value` is then its state), or a failure."""

    checkpoint: bool = False
    value: Any = None
    progress: tuple[int, int | None] | None = None
    failure: Failure | None = None


class HandlerThread:
    """A thread task's handler on a thread of its own, so that its invocation can stop waiting
    for it at the deadline. Its Ending is set when it returns or raises."""

    def __init__(self, registered: tasks.Task, ctx: tasks.TaskContext) -> None:
        self.done = threading.Event()
        self.ending: Ending | None = None
        self.started = time.monotonic()
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, args=(registered, ctx), name=f"thumbq-task-{ctx.job_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def wait(self, timeout_s: float) -> Ending | None:
        """The handler's Ending once it ended, or None if it still runs after `timeout_s`."""
        self.done.wait(max(timeout_s, 0.0))
        return self.ending

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the handler ends (at once if it has)."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def _run(self, registered: tasks.Task, ctx: tasks.TaskContext) -> None:
        try:
            value = registered.fn(ctx, ctx.payload)
            if isinstance(value, tasks.Checkpoint):
                ending = Ending(checkpoint=True, value=value.state, progress=ctx.last_progress())
            else:
                json.dumps(value)  # a result the database cannot store fails here, as the handler's
                ending = Ending(value=value, progress=ctx.last_progress())
        except tasks.PermanentError as exc:
            ending = Ending(failure=Failure(exc.code, exc.message, True))
        except tasks.TransientError as exc:
            ending = Ending(failure=Failure(exc.code, exc.message, False))
        except Exception as exc:  # every failure is classified and recorded, none escapes
            ending = Ending(failure=classify(exc))
        with self._lock:
            self.ending = ending
            self.done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


@dataclass(eq=False)
class _Kept:
    job: ClaimedJob
    worker_id: str
    handler: HandlerThread
    gone: bool = False  # cancelled, or no longer this worker's: not renewed any more
    tries: int = 0


class Keeper:
    """Holds the jobs of one database's thread handlers that outlived their invocation: renews
    their leases while they run and records their outcomes when they end (module docstring).
    One per process and database (`keeper_for`); its thread runs while it holds a job."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._conn_lock = threading.Lock()
        self._kept: dict[int, _Kept] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._queue: Queue | None = None

    def adopt(self, job: ClaimedJob, worker_id: str, handler: HandlerThread) -> None:
        """Hold `job` (leased to `worker_id`) until `handler` ends, then record its outcome."""
        with self._lock:
            self._kept[job.id] = _Kept(job, worker_id, handler)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="thumbq-keeper", daemon=True
                )
                self._thread.start()
        handler.on_done(self._wake.set)
        self._wake.set()  # renew at once: the invocation's lease may be near its end

    def held(self) -> list[int]:
        """The ids of the jobs held now (for tests and operators)."""
        with self._lock:
            return sorted(self._kept)

    def save(
        self,
        worker_id: str,
        job: ClaimedJob,
        state: Any | None,
        done: int | None,
        total: int | None,
    ) -> bool:
        """A kept handler's checkpoint or progress (tasks.ContextBackend.save's meaning)."""
        try:
            r = self._connection().checkpoint(
                worker_id, job, state, done, total, requeue=False, bound=db.Bound(CALL_MS)
            )
        except Exception as exc:
            log_event("keeper_save_failed", job_id=job.id, error=str(exc)[:300])
            self._drop_connection()
            return False
        if not r.get("owned"):
            self._mark_gone(job.id)
        return True

    def is_cancelled(self, job: ClaimedJob) -> bool:
        """Whether a kept job was cancelled (or taken over), as of the last renewal."""
        with self._lock:
            kept = self._kept.get(job.id)
            return kept is not None and kept.gone

    # -- the keeper's thread --------------------------------------------------------------

    def _loop(self) -> None:
        renew_at = 0.0
        while True:
            self._wake.clear()
            with self._lock:
                if not self._kept:
                    # Decided under the lock that adopt() takes: a job adopted from now on
                    # starts a thread (and a connection) of its own.
                    self._thread = None
                    with self._conn_lock:
                        last, self._queue = self._queue, None
                    break
                kept = list(self._kept.values())
            wait_s = RENEW_EVERY_S
            try:
                queue = self._connection()
                for k in kept:
                    if k.handler.done.is_set():
                        self._record(queue, k)
                # A cancelled job's run keeps its lease too while its thread runs: the next
                # job of its ordering key waits for it (sql/functions/10_helpers.sql, held_by).
                running = [k for k in kept if not k.handler.done.is_set()]
                if running and time.monotonic() >= renew_at:
                    self._renew(queue, running)
                    renew_at = time.monotonic() + RENEW_EVERY_S
                wait_s = max(0.0, renew_at - time.monotonic()) if running else RETRY_S
            except Exception as exc:  # the database away: the next round tries again
                log_event("keeper_failed", error=str(exc)[:300])
                self._drop_connection()
                wait_s = RETRY_S
            self._wake.wait(wait_s)
        if last is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to close
                last.conn.close()

    def _renew(self, queue: Queue, running: list[_Kept]) -> None:
        by_worker: dict[str, list[int]] = {}
        for k in running:
            by_worker.setdefault(k.worker_id, []).append(k.job.id)
        for worker_id, ids in by_worker.items():
            held = queue.extend_leases(worker_id, ids, KEEP_LEASE_S, bound=db.Bound(CALL_MS))
            for job_id in set(ids) - held:
                self._mark_gone(job_id)

    def _record(self, queue: Queue, k: _Kept) -> None:
        """Record a kept handler's outcome; it stays kept (and is tried again) while the call
        fails, up to RECORD_TRIES."""
        ending = k.handler.ending
        assert ending is not None
        job, call = k.job, db.Bound(CALL_MS)
        k.tries += 1
        try:
            if ending.failure is not None:
                f = ending.failure
                r = queue.fail(k.worker_id, job, f.code, f.message, f.permanent, bound=call)
                outcome = failure_outcome(bool(r.get("owned")), r.get("status"))
            elif ending.checkpoint:
                done, total = ending.progress or (None, None)
                r = queue.checkpoint(
                    k.worker_id, job, ending.value, done, total, requeue=True, bound=call
                )
                outcome = Outcome.CHECKPOINTED if r.get("owned") else Outcome.SKIPPED
            else:
                ms = round((time.monotonic() - k.handler.started) * 1000)
                record = {
                    "job_id": job.id,
                    "msg_id": job.msg_id,
                    "result": ending.value,
                    "duration_ms": ms,
                    "progress_done": None if ending.progress is None else ending.progress[0],
                }
                if queue.complete(k.worker_id, [record], bound=call):
                    outcome = Outcome.SUCCEEDED
                elif queue.not_held(k.worker_id, [job.id], bound=call):
                    outcome = Outcome.SKIPPED
                else:
                    # Still ours: its row was held elsewhere for a moment; the next round.
                    raise db.DeadlineExceeded(f"job {job.id}'s row was busy")
        except Exception:
            if k.tries < RECORD_TRIES:
                raise
            outcome = Outcome.UNRECORDED
        with self._lock:
            self._kept.pop(job.id, None)
        log_event(
            "task_overrun_ended",
            job_id=job.id,
            worker_id=k.worker_id,
            outcome=outcome,
            duration_ms=round((time.monotonic() - k.handler.started) * 1000),
        )

    # -- its connection -------------------------------------------------------------------

    def _connection(self) -> Queue:
        with self._conn_lock:
            if self._queue is None or self._queue.conn.closed:
                conn = db.connect(self.url, application_name="thumbq-keeper")
                self._queue = Queue(conn, bucket=None)
            return self._queue

    def _drop_connection(self) -> None:
        with self._conn_lock:
            queue, self._queue = self._queue, None
        if queue is not None:
            with contextlib.suppress(Exception):  # already broken: nothing to close
                queue.conn.close()

    def _mark_gone(self, job_id: int) -> None:
        with self._lock:
            kept = self._kept.get(job_id)
            if kept is not None and not kept.gone:
                kept.gone = True
                log_event("task_overrun_released", job_id=job_id, worker_id=kept.worker_id)


# One keeper per database for the whole process: the handlers it holds outlive the invocations
# (and their connections) that started them, so it cannot belong to any one of them.
_KEEPERS: dict[str, Keeper] = {}
_KEEPERS_LOCK = threading.Lock()


def keeper_for(url: str) -> Keeper:
    """This process's keeper for the database at `url`."""
    with _KEEPERS_LOCK:
        keeper = _KEEPERS.get(url)
        if keeper is None:
            keeper = _KEEPERS[url] = Keeper(url)
        return keeper
