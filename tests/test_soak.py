"""The soak of bench/soak.py, short: three invocations (`thumbq serve` answering batch-generate
in a loop and interactive posts, two `thumbq run-batch` loops), six ordering keys of ten
sequences at a time, mixed posts, sequences posted ahead of order, random cancels (running heads
too), re-enqueues, and a SIGKILL of a run-batch every 10 s, for 30 s, then a drain. Every
promise DESIGN makes for tasks under races must hold at once (issue 20)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.soak import Options, soak


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
    assert inv["no_deadlock_reported"], (result["deadlock_lines"], result["errors_answered"])
    assert inv["no_errors_answered"], (result["errors_answered"], result["run_batch_errors"])
    assert result["held"]
