"""Task handlers for the tests of the task engine (THUMBQ_TASKS=tests.support.tasks_fixture)."""

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


@task("overrun_thread", runs_in="thread")
def overrun_thread(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Sleeps `sleep_s` whatever its deadline says (a thread cannot be stopped), logging when it
    starts and ends."""
    log = payload["log"]
    with open(log, "a") as f:
        f.write(json.dumps({"at": "start", "t": time.time()}) + "\n")
    time.sleep(payload["sleep_s"])
    with open(log, "a") as f:
        f.write(json.dumps({"at": "end", "t": time.time()}) + "\n")
    return {"slept_s": payload["sleep_s"]}


@task("checkpoint_then_overrun")
def checkpoint_then_overrun(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Checkpoints its first step, then takes longer than its deadline over the second (a step
    that took longer than it looked): killed at the deadline. Resumed, it finishes at once."""
    if ctx.state is not None:
        return {"resumed_from": ctx.state}
    ctx.checkpoint({"step": 1})
    end = time.monotonic() + ctx.remaining_ms() / 1000 + 5
    while time.monotonic() < end:
        pass
    return {"never": "reached"}


def _unsaved_checkpoint(ctx: TaskContext, payload: Any) -> Any:
    """A checkpoint that Postgres refuses (a NUL character, which jsonb cannot hold): says
    whether `ctx.checkpoint` raised, and what."""
    try:
        ctx.checkpoint({"name": "nul\x00here"})
    except Exception as exc:
        return {"raised": type(exc).__name__, "code": getattr(exc, "code", None)}
    return {"raised": None}


task("unsaved_checkpoint")(_unsaved_checkpoint)
task("unsaved_checkpoint_thread", runs_in="thread")(_unsaved_checkpoint)


@task("progress_burst", runs_in="thread")
def progress_burst(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Reports progress every 10 ms for `burst_s`, then a last value right away, and returns."""
    end, i = time.monotonic() + payload["burst_s"], 0
    while time.monotonic() < end:
        i += 1
        ctx.progress(i)
        time.sleep(0.01)
    ctx.progress(payload["last"])
    return {"calls": i + 1}


@task("progress_under_lock", runs_in="thread")
def progress_under_lock(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """Reports progress around a row lock the test holds, telling it each step by a file:
    how long the report made while the row was locked took, and when the next one was made."""
    folder = payload["dir"]

    def wait_for(name: str) -> None:
        end = time.monotonic() + 10
        while not os.path.exists(os.path.join(folder, name)) and time.monotonic() < end:
            time.sleep(0.01)

    def tell(name: str, text: str = "") -> None:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)

    ctx.progress(1)
    tell("ready")
    wait_for("locked")
    time.sleep(0.6)  # past the throttle: this report is written (or tried)
    started = time.monotonic()
    ctx.progress(2)
    tell("tried", str((time.monotonic() - started) * 1000))
    wait_for("unlocked")
    ctx.progress(3)
    tell("reported")
    wait_for("checked")
    return {"ok": True}
