"""What bounding every call by the deadline costs when nothing stalls.

- A database call with its server-side timeout (`db.run(..., bound=db.Bound(ms))`: the query sent
  with `set_config('statement_timeout'/'lock_timeout', ..., true)` in the same message) against
  the same call without one, interleaved, on one connection.
- A storage call through `BoundedStorage` (handed to a helper thread, waited for at most the time
  left) against the same call made directly: a local file of 20 KB, and a storage that answers
  at once (the hand-over alone).

Run: python -m bench.deadlines [--calls 5000]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import median, p99, scratch_database, write_result
from worker.engine import db
from worker.storage import BoundedStorage, ObjectInfo
from worker.storage.file import FileStorage


class Instant:
    """A storage whose get answers at once and that does not claim it cannot stall."""

    url = "instant://"

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        return b"x", ObjectInfo(key, "e", 1)


def _interleaved(fns: dict[str, Callable[[], Any]], calls: int) -> dict[str, list[float]]:
    """Each function `calls` times, in a shuffled order (so drift in load hits them alike)."""
    order = [name for name in fns for _ in range(calls)]
    random.Random(1).shuffle(order)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name in fns:  # warm up
        for _ in range(50):
            fns[name]()
    for name in order:
        t = time.perf_counter()
        fns[name]()
        times[name].append((time.perf_counter() - t) * 1e6)
    return times


def _summary(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {
        name: {"median_us": round(median(v), 1), "p99_us": round(p99(v), 1)}
        for name, v in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    url = scratch_database("thumbq_bench_deadlines")
    result: dict[str, Any] = {"calls": args.calls}
    with db.connect(url) as conn:
        job = {"job_id": 1}
        times = _interleaved(
            {
                "plain": lambda: db.run(conn, "get_job", job),
                "bounded": lambda: db.run(conn, "get_job", job, bound=db.Bound(5000)),
            },
            args.calls,
        )
    result["db_call_get_job"] = _summary(times)
    result["db_bound_cost_us"] = round(median(times["bounded"]) - median(times["plain"]), 1)

    with tempfile.TemporaryDirectory() as tmp:
        files = FileStorage(Path(tmp), fsync=False)
        files.put("photo.jpg", bytes(20_000), "image/jpeg")
        instant = Instant()
        bounded_files = BoundedStorage(files, lambda: 60.0)
        bounded_instant = BoundedStorage(instant, lambda: 60.0)  # type: ignore[arg-type]
        try:
            times = _interleaved(
                {
                    "file_get": lambda: files.get("photo.jpg"),
                    "file_get_bounded": lambda: bounded_files.get("photo.jpg"),
                    "instant_get": lambda: instant.get("photo.jpg"),
                    "instant_get_bounded": lambda: bounded_instant.get("photo.jpg"),
                },
                args.calls,
            )
        finally:
            bounded_files.close()
            bounded_instant.close()
    result["storage_get"] = _summary(times)
    result["storage_bound_cost_us"] = {
        "file": round(median(times["file_get_bounded"]) - median(times["file_get"]), 1),
        "instant": round(median(times["instant_get_bounded"]) - median(times["instant_get"]), 1),
    }
    write_result("deadlines", result)


if __name__ == "__main__":
    main()
