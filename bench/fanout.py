"""Fan-out: do concurrent invocations add up, or wait on each other?

1, 2, 4 and 8 invocations run at once, each in its own process with its own connection, as
serverless invocations do, against one backlog. Each item costs 20 ms of waiting and no CPU (an
I/O-bound handler: an HTTP call, a storage copy), so the engine's claims, completions, bucket
and group rows are what could serialise them. The figure is items per second for each count,
and the ratio to one invocation; the target is 8 invocations >= 6x one.

Run: python -m bench.fanout [--counts 1,2,4,8] [--seconds 8] [--sleep-ms 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

from bench.common import NoopPool, NoopStorage, scratch_database, write_result
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue

CONCURRENCY = 2  # worker threads per invocation: the default on this 2-CPU machine


def invocation(url: str, seconds: float, sleep_ms: float, start_at: float, out: Any) -> None:
    """One invocation: a batch whose work window is `seconds`, started at `start_at`."""
    config = Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_CONCURRENCY": str(CONCURRENCY),
            "THUMBQ_BUDGET_MS": str(int(seconds * 1000) + 2000),
            "THUMBQ_BUFFER_MS": "2000",
            "THUMBQ_BATCH_SIZE": "10000",
        }
    )
    with db.connect(url) as conn:
        time.sleep(max(0.0, start_at - time.time()))
        r = run_batch(config, conn, NoopStorage(), NoopPool(sleep_ms))  # type: ignore[arg-type]
    out.put({"succeeded": r.succeeded, "duration_ms": r.duration_ms})


def measure(url: str, count: int, seconds: float, sleep_ms: float) -> dict[str, Any]:
    with db.connect(url) as conn:
        conn.execute("select pgmq.purge_queue('thumbq_jobs')")
        conn.execute("delete from thumbq.jobs")
        # Enough for every invocation to stay busy for the whole window.
        n = int(count * CONCURRENCY * seconds * 1000 / sleep_ms * 1.5) + 100
        q = Queue(conn)
        for i in range(0, n, 1000):
            q.enqueue_files(
                [{"source_key": f"f/{j}.jpg", "etag": "e"} for j in range(i, min(n, i + 1000))],
                "fanout",
            )
        conn.execute("analyze thumbq.jobs")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    start_at = time.time() + 2.0  # after every process has imported and connected
    procs = [
        ctx.Process(target=invocation, args=(url, seconds, sleep_ms, start_at, out))
        for _ in range(count)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join()
    done = sum(r["succeeded"] for r in results)
    longest_s = max(r["duration_ms"] for r in results) / 1000
    return {
        "invocations": count,
        "items": done,
        "items_per_s": round(done / longest_s, 1),
        "longest_ms": max(r["duration_ms"] for r in results),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    args = ap.parse_args()
    url = scratch_database("thumbq_bench_fanout")
    with db.connect(url) as conn:
        # The default bucket (100/s) exists to cap exactly this; here the engine is measured.
        conn.execute(
            "update thumbq.rate_limits set capacity = 1e9, tokens = 1e9, refill_per_second = 1e9"
        )
    rows = [measure(url, int(c), args.seconds, args.sleep_ms) for c in args.counts.split(",")]
    one = rows[0]["items_per_s"]
    for r in rows:
        r["x_one"] = round(r["items_per_s"] / one, 2)
    ideal = CONCURRENCY * 1000 / args.sleep_ms
    write_result(
        "fanout",
        {
            "sleep_ms_per_item": args.sleep_ms,
            "threads_per_invocation": CONCURRENCY,
            "ideal_items_per_s_per_invocation": ideal,
            "work_window_s": args.seconds,
            "rows": rows,
            "target": "8 invocations >= 6x one",
        },
    )


if __name__ == "__main__":
    main()
