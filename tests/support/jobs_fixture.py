"""Task handlers for the tests of /api/jobs and `thumbq jobs` (with tests.support.tasks_fixture)."""

from __future__ import annotations

import time
from typing import Any

from worker.tasks import TaskContext, task


@task("spin")
def spin(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Busy for `ms` milliseconds whatever its deadline says (a handler that never checks)."""
    end = time.monotonic() + payload["ms"] / 1000
    while time.monotonic() < end:
        pass
    return {"spun_ms": payload["ms"]}


@task("limited", rate_limit="jobs_test_quota")
def limited(ctx: TaskContext, payload: Any) -> Any:
    """A task with a bucket of its own."""
    return {"ok": True}
