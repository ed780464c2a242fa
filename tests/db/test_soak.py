"""The soak of bench/soak.py, short: three invocations (`thumbq serve` answering batch-generate
in a loop and interactive posts, two `thumbq run-batch` loops), six ordering keys of ten
sequences at a time, mixed posts, sequences posted ahead of order, random cancels (running heads
too), re-enqueues, and a SIGKILL of a run-batch every 10 s, for 30 s, then a drain. Every
promise of docs/reliability.md, 12b (tasks under races), must hold at once (issue 20)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from bench.soak import Options, soak
from worker.engine import db
from worker.engine.queue import Queue


@pytest.mark.slow
def test_ordered_keys_stay_in_order_and_nothing_runs_twice_or_strands_under_kills_and_races(
    db_url: str, tmp_path: Path
) -> None:
    result = soak(
        Options(
            minutes=0.5,
            keys=6,
            segments=10,
            kill_every_s=10,
            database_url=db_url,
            work_dir=str(tmp_path),
            drain_s=90,
        )
    )
    print(json.dumps({"soak": result}, default=str))  # the figures, with `pytest -s`

    # It did what it is for: kills, cancels, mixed and interactive posts, ordered work done.
    assert result["kills"], "no run-batch was killed"
    assert result["driver"].get("mixed_202", 0) > 0
    assert any(k.startswith("cancel_") for k in result["driver"])
    assert result["answers"].get("POST /api/jobs 200", 0) > 0  # interactive runs
    assert result["statuses"].get("completed", 0) >= 30

    inv = result["invariants"]
    assert inv["every_key_in_sequence_order"], (
        result["out_of_order"],
        result["completed_out_of_order_in_db"],
    )
    assert inv["no_overlap_within_a_key"], result["overlaps_within_a_key"]
    assert inv["no_job_run_twice_at_once"], result["jobs_run_twice_at_once"]
    assert inv["every_job_terminal"], (
        result["keys_not_terminal"],
        result["left_unfinished_at_drain_end"],
    )
    assert inv["no_job_failed"], result["failed_jobs"]
    assert inv["no_deadlock_reported"], (result["deadlock_lines"], result["errors_answered"])
    assert inv["no_errors_answered"], (result["errors_answered"], result["run_batch_errors"])
    assert result["held"]


# -- what the soak found, pinned alone -----------------------------------------------------------


@pytest.mark.parametrize("run_ends", ["reported", "lease_expired"])
def test_a_job_enqueued_behind_a_head_cancelled_while_it_runs_gets_its_turn_when_the_run_stops(
    db_url: str, run_ends: str
) -> None:
    # Regression (bench/soak.py): seq 1 runs and is cancelled; seq 2 is enqueued while the
    # cancelled run still holds the key, so it gets no message; when the run stopped (its worker
    # reported, or its invocation was killed and the lease ran out) nothing sent it one, and
    # the rest of the key stayed pending for good.
    with db.connect(db_url) as conn:
        q = Queue(conn)
        (head,) = q.enqueue_jobs([{"task": "echo", "ordering_key": "k", "sequence": 1}], "g")
        lease_s = 2 if run_ends == "lease_expired" else 120
        (job,) = q.claim("w1", 1, lease_s).jobs
        assert job.id == head["job_id"]
        assert q.cancel_jobs([job.id]) == 1
        (nxt,) = q.enqueue_jobs([{"task": "echo", "ordering_key": "k", "sequence": 2}], "g")
        assert nxt["created"]
        # While the cancelled run may still go, the key is held: seq 2 must not start beside it.
        assert q.claim("w2", 1, 60).jobs == []
        if run_ends == "reported":
            assert q.complete("w1", [{"job_id": job.id, "msg_id": job.msg_id}]) == 0
        else:
            time.sleep(lease_s + 0.5)  # the invocation was killed: its lease runs out
        claimed: list[int] = []
        deadline = time.monotonic() + 5
        while not claimed and time.monotonic() < deadline:
            claimed = [j.id for j in q.claim("w2", 1, 60).jobs]
            time.sleep(0.2)
        row = conn.execute(
            "select status, msg_id from thumbq.jobs where id = %s", [nxt["job_id"]]
        ).fetchone()
        assert claimed == [nxt["job_id"]], row
