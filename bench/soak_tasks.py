"""The task of bench/soak.py (THUMBQ_TASKS=bench.soak_tasks): a step that records each run.

Every run appends two lines to the log file its payload names, one when it starts and one when
it ends, each with a single `write` on an `O_APPEND` descriptor (lines from concurrent processes
never interleave; a SIGKILL never leaves half a line): the run's own id, the job, its ordering
key and sequence, the process, the invocation (`SOAK_INVOCATION` in the environment the soak
gives each invocation, inherited by its render processes) and the wall-clock times. A run with a
start and no end was killed; the soak ends it when its invocation was killed, or at its deadline.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from worker.tasks import TaskContext, task

INVOCATION_ENV = "SOAK_INVOCATION"
# Stop this long before the deadline: the handler's end line and its return to the worker.
STOP_MARGIN_MS = 300.0


def append(path: str, record: dict[str, Any]) -> None:
    """One JSON line, written at once."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def step(ctx: TaskContext, payload: dict[str, Any]) -> dict[str, Any]:
    """Works `payload["ms"]` milliseconds (less if the deadline is nearer), polling
    `ctx.cancelled()` when `payload["poll"]`; logs its start and its end."""
    run = uuid.uuid4().hex
    base = {
        "run": run,
        "job": ctx.job_id,
        "key": payload.get("key"),
        "seq": payload.get("seq"),
        "pid": os.getpid(),
        "inv": os.environ.get(INVOCATION_ENV, "?"),
    }
    started = time.time()
    left_ms = ctx.remaining_ms()
    append(
        payload["log"], {**base, "ev": "start", "t": started, "deadline": started + left_ms / 1000}
    )
    work_s = min(float(payload["ms"]), max(left_ms - STOP_MARGIN_MS, 0.0)) / 1000
    until = time.monotonic() + work_s
    cancelled = False
    while time.monotonic() < until:
        if payload.get("poll") and ctx.cancelled():
            cancelled = True
            break
        time.sleep(min(0.02, max(until - time.monotonic(), 0.0)))
    append(payload["log"], {**base, "ev": "end", "t": time.time(), "cancelled": cancelled})
    return {"run": run, "key": base["key"], "seq": base["seq"], "pid": base["pid"]}


task("soak_step")(step)
task("soak_step_thread", runs_in="thread")(step)
