"""An ordering key's history against the cost of its next step.

One key holds `--history` completed jobs (200 000 by default), another none; for each, the median
time of `enqueue_jobs` (one more job of the key) and of `claim` + `complete` of its head, side
by side in one run. The head lookups read jobs_ordering_active_idx (the key's active jobs only),
so both keys should cost the same.

Run: python -m bench.ordered_history [--history 200000] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json

from bench.common import median, scratch_database, timed_ms, write_result
from worker.engine import db
from worker.engine.queue import Queue


def _step_ms(q: Queue, key: str) -> tuple[float, float]:
    """One enqueue of the key's next job, then claim + complete of its head: (enqueue, done)."""
    enq_ms, _ = timed_ms(q.enqueue_jobs, [{"task": "seg", "ordering_key": key}], "bench")
    jobs = q.claim("bench", 1, 60).jobs
    assert len(jobs) == 1 and jobs[0].ordering_key == key, jobs
    done_ms, n = timed_ms(q.complete, "bench", [{"job_id": jobs[0].id, "msg_id": jobs[0].msg_id}])
    assert n == 1
    return enq_ms, done_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    url = scratch_database("thumbq_bench_ordered_history")
    with db.connect(url) as conn:
        conn.execute(
            "insert into thumbq.jobs (group_id, task, ordering_key, sequence, status,"
            " completed_at) select 'bench', 'seg', 'old', s, 'completed', now()"
            " from generate_series(1, %s) s",
            [args.history],
        )
        conn.execute("analyze thumbq.jobs")
        q = Queue(conn, bucket=None)
        times: dict[str, dict[str, list[float]]] = {
            k: {"enqueue": [], "complete": []} for k in ("old", "new")
        }
        for _ in range(args.rounds):
            for key in ("old", "new"):  # in turns, so that drift moves both
                enq, done = _step_ms(q, key)
                times[key]["enqueue"].append(enq)
                times[key]["complete"].append(done)
    result = {
        "history": args.history,
        "rounds": args.rounds,
        "median_ms": {
            key: {step: round(median(v), 2) for step, v in steps.items()}
            for key, steps in times.items()
        },
    }
    result["ratio_old_to_new"] = {
        step: round(result["median_ms"]["old"][step] / result["median_ms"]["new"][step], 2)
        for step in ("enqueue", "complete")
    }
    write_result("ordered_history", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
