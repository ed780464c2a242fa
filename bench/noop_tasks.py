"""Tasks that do nothing: what the engine itself costs (THUMBQ_TASKS=bench.noop_tasks)."""

from __future__ import annotations

from typing import Any

from worker.tasks import TaskContext, task


@task("bench_noop")
def noop(ctx: TaskContext, payload: Any) -> Any:
    """Returns its payload, from a render process."""
    return payload


@task("bench_noop_thread", runs_in="thread")
def noop_thread(ctx: TaskContext, payload: Any) -> Any:
    """Returns its payload, from the caller's thread."""
    return payload
