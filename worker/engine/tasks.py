"""Tasks: any job of the same shape as a thumbnail runs on the engine.

A task is a function registered under a name with `@task`; a job names its task and carries a
JSON payload. The engine claims jobs, runs each task's handler with a `TaskContext` (the time
left, the state it checkpointed last, progress, cancellation) and records what it returns: a
result (stored as the job's `result`), or `ctx.checkpoint(state)` to be resumed by a later
invocation without using an attempt. Raising `PermanentError` ends the job `failed`;
`TransientError` (or anything unexpected) retries it with backoff.

    from worker.tasks import task, TaskContext, PermanentError

    @task("export_csv", rate_limit="exports", max_attempts=5)
    def export_csv(ctx: TaskContext, payload: dict) -> dict:
        state = ctx.state or {"offset": 0}
        while state["offset"] < payload["rows"]:
            if ctx.remaining_ms() < 500 or ctx.cancelled():
                return ctx.checkpoint(state)
            state = step(state)
            ctx.progress(state["offset"], payload["rows"])
        return {"rows": state["offset"]}

`THUMBQ_TASKS=module[,module]` names the modules that define tasks; `thumbnail` is built in
(worker/thumbnails/task.py registers it like any task, with the hooks of a task that runs on the
worker's thread: `Task.runner`, `kind`, `pool`, `prior_ms`).
Handlers run in the render child process by default (`runs_in="process"`: killed at the
deadline and on a memory limit, like a render), or on a thread of the invocation's process
(`runs_in="thread"`, for I/O-bound work), which must check `ctx.remaining_ms()` itself: a
thread cannot be stopped, and one still running at the deadline keeps its job until it ends
(worker.engine.overrun). `ctx.checkpoint` raises `CheckpointNotSaved` when its write failed.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from worker.engine.states import ErrorCode, Outcome

if TYPE_CHECKING:
    from worker.engine import db
    from worker.engine.config import Config
    from worker.engine.execution import Executor
    from worker.engine.processes import ProcessPool
    from worker.engine.queue import ClaimedJob
# The task a job names when it names none (the schema's default: the built-in thumbnail task).
THUMBNAIL = "thumbnail"
# The tasks thumbq ships, imported by name when the registry is first read, as THUMBQ_TASKS's
# modules are (the engine imports nothing of them).
BUILTIN_MODULES = ("worker.thumbnails.task",)
RUNS_IN = ("process", "thread")
# Error codes of a task's failures.
TASK_FAILED = ErrorCode.TASK_FAILED
TASK_ERROR = ErrorCode.TASK_ERROR
UNSUPPORTED_TASK = ErrorCode.UNSUPPORTED_TASK
CHECKPOINT_NOT_SAVED = ErrorCode.CHECKPOINT_NOT_SAVED


class PermanentError(Exception):
    """The job cannot succeed: it ends `failed` with `code` and the message, no retry."""

    def __init__(self, message: str, code: str = TASK_FAILED) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TransientError(Exception):
    """This attempt failed but another may not: the job retries with backoff."""

    def __init__(self, message: str, code: str = TASK_ERROR) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class CheckpointNotSaved(TransientError):
    """`ctx.checkpoint(state)` could not write `state` (the database did not answer in time, or
    failed): a crash now would resume from the checkpoint before. The handler may stop, or go on
    and checkpoint again; uncaught, the attempt fails and retries with backoff."""

    def __init__(self, message: str) -> None:
        super().__init__(message, CHECKPOINT_NOT_SAVED)


@dataclass(frozen=True)
class Checkpoint:
    """What a handler returns to stop now and be resumed later from `state`."""

    state: Any


HandlerFn = Callable[["TaskContext", Any], Any]
# A built-in task that runs on the worker's thread with the executor's parts (storage, the
# process pool, the recorder) rather than as a handler: its outcome (`succeeded`, `skipped`,
# `writing`, ...), as Executor.run returns it.
RunnerFn = Callable[["Executor", "ClaimedJob", float], Outcome]


@dataclass(frozen=True)
class Task:
    """A registered task: its handler and how the engine runs it."""

    name: str
    fn: HandlerFn
    rate_limit: str | None = None
    max_attempts: int | None = None
    runs_in: str = "process"
    # Hooks of a built-in task (not of `@task`): how its jobs run on the worker's thread, what
    # the predictor knows a job by (kind, size class), the process pool its jobs need (made from
    # the configuration) and what each of its kinds costs before anything was observed.
    runner: RunnerFn | None = None
    kind: Callable[[ClaimedJob], tuple[str, int]] | None = None
    pool: Callable[[Config], ProcessPool] | None = None
    prior_ms: Mapping[str, float] | None = None


class Registry:
    """The tasks this process knows, by name (with `builtin`, the modules imported when it is
    first read)."""

    def __init__(self, builtin: tuple[str, ...] = ()) -> None:
        self._tasks: dict[str, Task] = {}
        self._builtin = builtin
        self._builtin_lock = threading.RLock()
        self._builtin_loaded = not builtin

    def _load_builtin(self) -> None:
        if self._builtin_loaded:
            return
        with self._builtin_lock:
            if not self._builtin_loaded:
                for module in self._builtin:
                    importlib.import_module(module)
                self._builtin_loaded = True

    def add(self, t: Task) -> None:
        known = self._tasks.get(t.name)
        if known is not None and known.fn is not t.fn:
            raise ValueError(f"task {t.name!r} is registered twice")
        self._tasks[t.name] = t

    def get(self, name: str) -> Task | None:
        self._load_builtin()
        return self._tasks.get(name)

    def names(self) -> list[str]:
        self._load_builtin()
        return sorted(self._tasks)

    def __iter__(self) -> Iterator[Task]:
        self._load_builtin()
        return iter(list(self._tasks.values()))

    def priors(self) -> dict[str, float]:
        """What each kind of item costs before anything was observed, as the tasks say."""
        out: dict[str, float] = {}
        for t in self:
            out.update(t.prior_ms or {})
        return out

    def make_pool(self, config: Config) -> ProcessPool:
        """The process pool for these tasks' jobs: the one a built-in task makes (the thumbnail
        task's RenderPool, whose children run handlers too), else a plain one."""
        for t in self:
            if t.pool is not None:
                return t.pool(config)
        from worker.engine.processes import ProcessPool

        return ProcessPool(config.concurrency, config.render_memory_mb, task_modules=config.tasks)


# Tasks register themselves when their module is imported, as with any decorator-based
# registry (Flask routes, Celery tasks); what is registered depends only on what is imported.
REGISTRY = Registry(BUILTIN_MODULES)


def task(
    name: str,
    *,
    rate_limit: str | None = None,
    max_attempts: int | None = None,
    runs_in: str = "process",
) -> Callable[[HandlerFn], HandlerFn]:
    """Register the decorated function as the handler of task `name`.

    `rate_limit` names a bucket of `thumbq.rate_limits` that every job of the task takes a token
    from; `max_attempts` overrides THUMBQ_MAX_ATTEMPTS for its jobs; `runs_in` is "process"
    (default: a killable child process) or "thread"."""
    if not name or len(name) > 200:
        raise ValueError("a task name is 1 to 200 characters")
    if runs_in not in RUNS_IN:
        raise ValueError(f"runs_in must be one of {RUNS_IN}, not {runs_in!r}")
    if max_attempts is not None and not 1 <= max_attempts <= 100:
        raise ValueError("max_attempts must be 1 to 100")

    def register(fn: HandlerFn) -> HandlerFn:
        REGISTRY.add(Task(name, fn, rate_limit, max_attempts, runs_in))
        return fn

    return register


def search_working_dir() -> None:
    """Put the current directory last on the module path, once (see `load_modules`)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.append(here)


def load_modules(modules: Iterable[str]) -> list[str]:
    """Import the modules of THUMBQ_TASKS (registering their tasks); return the task names.

    A module is looked for where Python looks, then in the current directory (last, so that
    installed packages win), as `flask --app` and gunicorn do: an installed `thumbq` script
    does not put the directory it runs in on the path, and a user's tasks usually live there."""
    search_working_dir()
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            from worker.engine.config import ConfigError

            raise ConfigError(
                f"THUMBQ_TASKS names {module!r}, which cannot be imported: {exc}"
            ) from exc
    return REGISTRY.names()


def sync(
    conn: db.Conn, registry: Registry = REGISTRY, *, call_bound: db.Bound | None = None
) -> None:
    """Write the registered tasks' buckets and limits to `thumbq.tasks`, where claims read
    them and an operator sees them (a bucket a task names is created if missing)."""
    rows = [
        {
            "name": t.name,
            "bucket": t.rate_limit,
            "max_attempts": t.max_attempts,
            "runs_in": t.runs_in,
        }
        for t in registry
        if t.runner is None  # a built-in's row is the schema's
    ]
    if rows:
        import json

        from worker.engine import db as dbm

        dbm.run(conn, "sync_tasks", {"tasks": json.dumps(rows)}, bound=call_bound)


class ContextBackend(Protocol):
    """Where a context's checkpoints, progress and cancellation checks go: the database from a
    worker thread, the parent over a socket from a child process."""

    def save(self, state: Any | None, done: int | None, total: int | None) -> bool:
        """Write a checkpoint (`state` not None) or progress now; whether it was written (a job
        cancelled meanwhile counts as written: `cancelled()` says the rest)."""
        ...

    def cancelled(self) -> bool: ...


# A running job writes its progress at most this often (the group row, and Realtime, follow
# every write); the last value is always written with the job's outcome.
PROGRESS_EVERY_S = 0.5


class TaskContext:
    """What a handler sees of its job and its invocation."""

    def __init__(
        self,
        job: Mapping[str, Any],
        deadline: float | Callable[[], float],
        backend: ContextBackend,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job_id: int = int(job["id"])
        self.task: str = str(job.get("task") or THUMBNAIL)
        self.payload: Any = job.get("payload")
        self.state: Any = job.get("state")
        self.attempts: int = int(job.get("attempts") or 1)
        self.group_id: str = str(job.get("group_id") or "default")
        self._deadline = deadline
        self._backend = backend
        self._clock = clock
        self._progress: tuple[int, int | None] | None = None
        self._progress_saved_at = 0.0

    def remaining_ms(self) -> float:
        """Milliseconds left before this invocation's deadline (a handler stops well before)."""
        # A callable deadline follows its invocation's (a stop moves it closer:
        # worker.engine.stopping).
        deadline = self._deadline() if callable(self._deadline) else self._deadline
        return max(0.0, (deadline - self._clock()) * 1000)

    def checkpoint(self, state: Any) -> Checkpoint:
        """Save `state` now; a later attempt (after a crash too) starts from it. Return the
        result to stop and be resumed by a later invocation without using an attempt."""
        done, total = self._progress or (None, None)
        if not self._backend.save(state, done, total):
            raise CheckpointNotSaved(
                "the checkpoint could not be written: a crash now resumes from the one before"
            )
        self.state = state
        self._progress_saved_at = self._clock()
        return Checkpoint(state)

    def progress(self, done: int, total: int | None = None) -> None:
        """Report progress (counts for the job, its group row and the progress endpoint). It is
        written at most every PROGRESS_EVERY_S; a write that fails is not the handler's error
        and is tried again at the next call; the last value goes with the outcome anyway."""
        if done < 0 or (total is not None and total < 0):
            raise ValueError("progress counts cannot be negative")
        self._progress = (int(done), None if total is None else int(total))
        now = self._clock()
        if now - self._progress_saved_at >= PROGRESS_EVERY_S and self._backend.save(
            None, self._progress[0], self._progress[1]
        ):
            self._progress_saved_at = now

    def last_progress(self) -> tuple[int, int | None] | None:
        """The last progress reported, written or not yet."""
        return self._progress

    def cancelled(self) -> bool:
        """True once the job was cancelled (its group, or it alone): stop, clean up, return."""
        return self._backend.cancelled()
