"""Does the cost of a batch, a progress read and an enqueue grow with history?

Two databases on the same server, in the same run: one empty, one holding a long history
(default 1 000 000 finished jobs in 100 000 groups, and 100 000 batch runs, all older than an
hour as a real history would be). On each, rounds of: enqueue 200 items, one batch of them with
a no-op renderer and storage (only the engine's own work: claims, completions, the run's row,
its remaining count and alerts), and progress reads. The figure is the ratio of the medians,
history over empty; the target is at most 1.2x for the run.

Run: python -m bench.growth [--jobs 1000000] [--groups 100000] [--runs 100000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench.common import NoopPool, NoopStorage, median, scratch_database, write_result
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue

ITEMS = 200


def fill_history(url: str, jobs: int, groups: int, runs: int) -> None:
    """Bulk-load finished jobs and runs, through the same triggers that keep groups exact."""
    with db.connect(url) as conn:
        step = 200_000
        for start in range(0, jobs, step):
            conn.execute(
                "insert into thumbq.jobs (group_id, source_key, source_etag, status, attempts,"
                " thumbnail_key, created_at, updated_at, started_at, completed_at)"
                " select 'h' || (i %% %(groups)s), 'history/' || i || '.pdf', 'e', 'completed',"
                " 1, 'thumbnails/history/' || i || '.webp', t, t, t, t"
                " from generate_series(%(lo)s::integer, %(hi)s::integer) i,"
                " lateral (select now() - interval '2 days' - i * interval '1 second') x(t)",
                {"groups": groups, "lo": start, "hi": min(start + step, jobs) - 1},
            )
        conn.execute(
            "insert into thumbq.batch_runs (worker_id, started_at, finished_at, budget_ms,"
            " buffer_ms, concurrency, claimed, processed, succeeded, stopped_reason, duration_ms)"
            " select 'history', t, t + interval '8 s', 10000, 2000, 2, 50, 50, 50, 'drained',"
            " 8000 from generate_series(1, %s::integer) i,"
            " lateral (select now() - interval '2 days' - i * interval '10 seconds') x(t)",
            [runs],
        )
        conn.execute("vacuum analyze thumbq.jobs")
        conn.execute("vacuum analyze thumbq.groups")
        conn.execute("vacuum analyze thumbq.batch_runs")


def one_round(url: str, config: Config, tag: str) -> dict[str, float]:
    with db.connect(url) as conn:
        q = Queue(conn)
        items = [{"source_key": f"{tag}/{i}.jpg", "etag": "e"} for i in range(ITEMS)]
        t = time.perf_counter()
        q.enqueue_files(items, tag)
        enqueue_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        r = run_batch(config, conn, NoopStorage(), NoopPool())  # type: ignore[arg-type]
        run_ms = (time.perf_counter() - t) * 1000
        assert r.succeeded == ITEMS, r
        reads = []
        for _ in range(50):
            t = time.perf_counter()
            q.progress(tag)
            reads.append((time.perf_counter() - t) * 1000)
    return {"enqueue_ms": enqueue_ms, "run_ms": run_ms, "progress_ms": median(reads)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--groups", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    config = Config.from_env({"THUMBQ_CONCURRENCY": "2", "THUMBQ_BATCH_SIZE": "1000"})
    urls = {
        "empty": scratch_database("thumbq_bench_growth_empty"),
        "history": scratch_database("thumbq_bench_growth_history"),
    }
    t = time.perf_counter()
    fill_history(urls["history"], args.jobs, args.groups, args.runs)
    load_s = time.perf_counter() - t
    for url in urls.values():
        with db.connect(url) as conn:
            conn.execute("update thumbq.rate_limits set capacity = 1e9, tokens = 1e9")
    samples: dict[str, dict[str, list[float]]] = {k: {} for k in urls}
    for r in range(args.rounds):
        # Alternate which database goes first, so that drift in the machine's load cancels.
        order = list(urls.items()) if r % 2 == 0 else list(reversed(urls.items()))
        for name, url in order:
            for k, v in one_round(url, config.with_(database_url=url), f"round{r}").items():
                samples[name].setdefault(k, []).append(v)
    medians = {name: {k: round(median(v), 2) for k, v in s.items()} for name, s in samples.items()}
    ratio = {k: round(medians["history"][k] / medians["empty"][k], 3) for k in medians["empty"]}
    result: dict[str, Any] = {
        "history": {"jobs": args.jobs, "groups": args.groups, "batch_runs": args.runs},
        "items_per_round": ITEMS,
        "rounds": args.rounds,
        "history_load_s": round(load_s, 1),
        "median_ms": medians,
        "history_over_empty": ratio,
        "target": "run_ms ratio <= 1.2",
        "all_ms": {
            name: {k: [round(x, 2) for x in v] for k, v in s.items()} for name, s in samples.items()
        },
    }
    write_result("growth", result)


if __name__ == "__main__":
    main()
