"""Task handlers for the tests of the task engine (THUMBQ_TASKS=tests.tasks_fixture)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from worker.tasks import PermanentError, TaskContext, TransientError, task


@task("echo")
def echo(ctx: TaskContext, payload: Any) -> Any:
    """Returns its payload, and where it ran."""
    return {"payload": payload, "pid": os.getpid(), "attempts": ctx.attempts}


@task("echo_thread", runs_in="thread")
def echo_thread(ctx: TaskContext, payload: Any) -> Any:
    return {"payload": payload, "pid": os.getpid()}


@task("refuse")
def refuse(ctx: TaskContext, payload: Any) -> Any:
    raise PermanentError("this request can never succeed", code="bad_request")


@task("flaky", max_attempts=2)
def flaky(ctx: TaskContext, payload: Any) -> Any:
    raise TransientError("the upstream API answered 503", code="upstream_unavailable")


def _steps(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """`steps` steps of `step_ms` each, summing the step numbers; checkpoints every step, and
    stops to be resumed when less than 500 ms are left (a step and its checkpoint, with room
    for a busy machine). The result does not depend on where it was stopped or killed."""
    state = ctx.state or {"i": 0, "sum": 0}
    while state["i"] < payload["steps"]:
        if ctx.remaining_ms() < 500 or ctx.cancelled():
            return ctx.checkpoint(state)
        end = time.monotonic() + payload["step_ms"] / 1000
        while time.monotonic() < end:  # CPU, as a real step would use
            pass
        state = {"i": state["i"] + 1, "sum": state["sum"] + state["i"]}
        ctx.checkpoint(state)
        ctx.progress(state["i"], payload["steps"])
        if payload.get("log"):
            with open(payload["log"], "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "i": state["i"]}) + "\n")
    return {"sum": state["sum"], "steps": state["i"]}


task("steps")(_steps)
task("steps_thread", runs_in="thread")(_steps)


def _until_cancelled(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Works until cancelled (or out of time), writing a partial file it removes on cancel."""
    partial = payload["partial"]
    with open(partial, "w") as f:
        f.write("partial output")
    started = time.monotonic()
    while ctx.remaining_ms() > 200:
        if ctx.cancelled():
            os.remove(partial)
            with open(payload["seen"], "w") as f:
                f.write(str(time.monotonic() - started))
            return ctx.checkpoint({"cancelled": True})
        time.sleep(0.01)
    return ctx.checkpoint({"still": "running"})


task("until_cancelled")(_until_cancelled)
task("until_cancelled_thread", runs_in="thread")(_until_cancelled)


@task("segment")
def segment(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Appends when it starts and ends (with its key and sequence) to a log file."""
    log = payload["log"]
    job = {"key": payload["key"], "seq": payload["seq"], "pid": os.getpid()}
    with open(log, "a") as f:
        f.write(json.dumps({**job, "at": "start", "t": time.time()}) + "\n")
    time.sleep(payload.get("sleep_ms", 5) / 1000)
    with open(log, "a") as f:
        f.write(json.dumps({**job, "at": "end", "t": time.time()}) + "\n")
    return {"seq": payload["seq"]}
