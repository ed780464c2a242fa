"""Task handlers of bench/tasks.py (THUMBQ_TASKS=bench.task_handlers): a CPU-bound export that
checkpoints, and a 5 ms segment."""

from __future__ import annotations

import csv
import hashlib
import io
import statistics
import time
from typing import Any

from worker.tasks import TaskContext, task

# The handler stops when less than this is left besides 1.5 units: its last checkpoint (a round
# trip to the worker and one UPDATE, 1-3 ms) and the return.
STOP_MS = 15.0


def export_unit(i: int, rows: int, digest: str) -> str:
    """One unit of an export's CPU work: format `rows` rows as CSV and fold them into the
    running digest (the result depends on every unit, in order)."""
    out = io.StringIO()
    writer = csv.writer(out)
    base = i * rows
    for n in range(base, base + rows):
        writer.writerow(
            (n, f"{n * 2654435761 % 2**32:08x}", f"{n % 100000 / 100:.2f}", "2026-01-01")
        )
    data = out.getvalue().encode()
    return hashlib.sha256(bytes.fromhex(digest) + data).hexdigest()


@task("bench_cpu_export")
def cpu_export(ctx: TaskContext, payload: Any) -> Any:
    """CSV formatting, a unit at a time, until `work_ms` of work (the units' own time, summed
    over every invocation) is done: a job that needs that much work, whatever a unit costs
    today. Checkpoints every `checkpoint_every_ms` and stops, to be resumed, just before its
    deadline. The state carries the work time and CPU time spent in the units it
    checkpointed, so that a benchmark can tell each invocation's share."""
    target_ms, rows = float(payload["work_ms"]), int(payload["rows_per_unit"])
    every_s = float(payload.get("checkpoint_every_ms", 250)) / 1000
    state = ctx.state or {"done": 0, "digest": "", "work_ms": 0.0, "cpu_ms": 0.0}
    slowest_ms = float(payload.get("unit_ms", 10.0))
    saved_at = time.monotonic()
    cpu_at = time.process_time()
    work_ms = 0.0
    digest, done = state["digest"], state["done"]

    def snapshot() -> dict[str, Any]:
        return {
            "done": done,
            "digest": digest,
            "work_ms": state["work_ms"] + work_ms,
            "cpu_ms": state["cpu_ms"] + (time.process_time() - cpu_at) * 1000,
        }

    while state["work_ms"] + work_ms < target_ms:
        if ctx.remaining_ms() < STOP_MS + 1.5 * slowest_ms:
            return ctx.checkpoint(snapshot())
        t = time.perf_counter()
        digest = export_unit(done, rows, digest)
        ms = (time.perf_counter() - t) * 1000
        done += 1
        work_ms += ms
        slowest_ms = max(slowest_ms, ms)
        if time.monotonic() - saved_at >= every_s:
            ctx.checkpoint(snapshot())
            ctx.progress(round(state["work_ms"] + work_ms), round(target_ms))
            saved_at = time.monotonic()
    return {**snapshot(), "units": done}


@task("bench_calibrate")
def calibrate(ctx: TaskContext, payload: Any) -> Any:
    """The mean time of one export unit here, over about `ms` milliseconds of units (the mean:
    the export's work is their sum)."""
    rows = int(payload["rows_per_unit"])
    times, digest, i = [], "", 0
    end = time.perf_counter() + float(payload.get("ms", 1000)) / 1000
    while time.perf_counter() < end:
        t = time.perf_counter()
        digest = export_unit(i, rows, digest)
        times.append((time.perf_counter() - t) * 1000)
        i += 1
    return {"unit_ms": statistics.fmean(times), "units": i}


@task("bench_segment")
def segment(ctx: TaskContext, payload: Any) -> Any:
    """A segment that takes `sleep_ms` (5 ms) of waiting, as on a codec or a remote call."""
    time.sleep(float(payload.get("sleep_ms", 5)) / 1000)
    return {"seq": payload.get("seq")}
