"""Ordered processing of the segments of a long file (seed system 003).

A long recording (a video, here a generated sensor signal: a data file of float64 samples) is
cut into N segments, one job each, which must run strictly in order: segment N starts from
what segment N-1 left (here the state of a smoothing filter, a running count and a digest of
every sample so far; for a video, the encoder's state or the last frame). What the example shows:

- One ordering key per file, one sequence number per segment (`jobs_for`): the engine runs a
  key's jobs in sequence order, one at a time, across all concurrent invocations. Only the
  key's head has a queue message, so no invocation ever holds a segment it may not start.
- Never twice: a completed segment is never claimed again, and a segment that finds its output
  already written (its invocation was killed after writing it) returns it without redoing it.
- Resumable: a segment checkpoints after every chunk of samples (its position and the filter's
  state); an invocation that runs out of time hands it back (`ctx.checkpoint`, no attempt used)
  and a SIGKILL loses at most the chunk in progress. The result does not depend on where the
  work was cut: `summarize` over the whole file in one pass gives the same numbers.
- A segment whose predecessor left no output fails `out_of_order` (it cannot happen while the
  engine keeps the order; the check is what makes a mistake loud).

Run it:

    THUMBQ_TASKS=examples.segments thumbq up
    python -m examples.segments enqueue --files 3 --segments 8 --group signals

Each file's summary is in `segments/<file>/<n>.json` in storage, and in each job's result.
`SEGMENTS_JOURNAL=/some/file.jsonl` makes every handler append what it does (start, each
checkpointed chunk, done) to that file, to watch the order as it happens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any

from examples import common
from worker.storage import NotFound
from worker.tasks import PermanentError, TaskContext, task

TASK = "signal_segment"
# Samples per checkpoint by default (about 8 ms of work).
CHUNK = 20_000
# Stop to be resumed later when less than this is left of the invocation besides the time a
# chunk takes (its computation, pace and checkpoint: the slowest recent one, kept in the
# checkpoint so that a run starts from what the segment has seen; FIRST_STEP_MS before any):
# room for a busy machine, on which a chunk cut by the deadline before the run's first
# checkpoint costs an attempt.
STOP_MS = 400.0
FIRST_STEP_MS = 100.0
SAMPLE_BYTES = 8
JOURNAL_ENV = "SEGMENTS_JOURNAL"
# The smoothing filter: an exponential moving average.
ALPHA = 0.01
# The digest: a polynomial hash of the samples' bits, modulo a Mersenne prime.
DIGEST_BASE = 1_000_003
DIGEST_MOD = 2**61 - 1


def start_carry() -> dict[str, Any]:
    """What the first segment starts from."""
    return {"ema": 0.0, "count": 0, "digest": 0}


def summarize(samples: Sequence[float], carry: dict[str, Any]) -> dict[str, Any]:
    """Carry `carry` over `samples`: the filter's state, the running count, and a digest that
    folds in every sample in order (any reordering shows). Returns the new carry with the
    smoothed signal's minimum and maximum over these samples. Sample by sample, so cutting the
    samples anywhere and carrying across the cut gives the same numbers as one pass."""
    ema, lo, hi = float(carry["ema"]), float("inf"), float("-inf")
    digest = int(carry["digest"])
    for x, bits in zip(samples, array("Q", array("d", samples).tobytes()), strict=True):
        ema += ALPHA * (x - ema)
        lo = min(lo, ema)
        hi = max(hi, ema)
        digest = (digest * DIGEST_BASE + bits) % DIGEST_MOD
    return {
        "ema": ema,
        "count": int(carry["count"]) + len(samples),
        "digest": digest,
        "min": lo,
        "max": hi,
    }


def output_key(source: str, segment: int) -> str:
    """Where segment `segment` of `source` writes its summary."""
    return f"segments/{source}/{segment}.json"


def make_file(source: str, segments: int, samples_per_segment: int, seed: int = 0) -> int:
    """Write a generated signal (a random walk) of segments x samples float64 values to
    storage as `source`; returns its size in bytes."""
    rng = random.Random(seed)
    values = array("d")
    x = 0.0
    for _ in range(segments * samples_per_segment):
        x += rng.gauss(0.0, 1.0)
        values.append(x)
    data = values.tobytes()
    common.storage().put(source, data, "application/octet-stream")
    return len(data)


def jobs_for(
    source: str, segments: int, samples_per_segment: int, **extra: Any
) -> list[dict[str, Any]]:
    """One job per segment of `source`, in order: ordering key the file, sequence the segment.
    `extra` goes into every payload (`chunk`, `pace_ms`)."""
    return [
        {
            "task": TASK,
            "ordering_key": f"file:{source}",
            "sequence": n,
            "payload": {
                "source": source,
                "segment": n,
                "first": (n - 1) * samples_per_segment,
                "count": samples_per_segment,
                **extra,
            },
        }
        for n in range(1, segments + 1)
    ]


def _journal(event: str, payload: dict[str, Any], **fields: Any) -> None:
    path = os.environ.get(JOURNAL_ENV)
    if not path:
        return
    line = {
        "event": event,
        "source": payload["source"],
        "segment": payload["segment"],
        "pid": os.getpid(),
        "t": time.time(),
        **fields,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


@task(TASK, max_attempts=5)
def process_segment(ctx: TaskContext, payload: Any) -> Any:
    """Carry the previous segment's state over this segment's samples, a chunk at a time."""
    source, n = str(payload["source"]), int(payload["segment"])
    first, count = int(payload["first"]), int(payload["count"])
    chunk = int(payload.get("chunk") or CHUNK)
    pace_s = float(payload.get("pace_ms") or 0) / 1000
    storage = common.storage()
    mine = output_key(source, n)
    try:
        data, _ = storage.get(mine)
        # Written by an invocation killed before it could record the job: done already.
        return json.loads(data)
    except NotFound:
        pass
    state = ctx.state
    if state is None:
        if n == 1:
            carry = start_carry()
        else:
            try:
                data, _ = storage.get(output_key(source, n - 1))
            except NotFound:
                raise PermanentError(
                    f"segment {n - 1} of {source!r} has no output: segments ran out of order",
                    code="out_of_order",
                ) from None
            carry = json.loads(data)["carry"]
        state = {"pos": 0, "carry": carry, "min": None, "max": None}
    raw, _ = storage.get(source)
    samples = array("d")
    samples.frombytes(raw[first * SAMPLE_BYTES : (first + count) * SAMPLE_BYTES])
    if len(samples) != count:
        raise PermanentError(
            f"{source!r} has no samples {first}..{first + count - 1}", code="bad_segment"
        )
    started = False
    step_ms = float(state.get("step_ms") or FIRST_STEP_MS)
    while state["pos"] < count:
        if ctx.remaining_ms() < STOP_MS + step_ms or ctx.cancelled():
            return ctx.checkpoint({**state, "step_ms": step_ms})
        if not started:
            # Journalled once it has the time for a chunk: a run that hands the segment back
            # at once (too little time left after fetching the file) did not start it.
            _journal("start", payload, pos=state["pos"])
            started = True
        step_started = time.monotonic()
        end = min(state["pos"] + chunk, count)
        carried = summarize(samples[state["pos"] : end], state["carry"])
        lo, hi = carried.pop("min"), carried.pop("max")
        state = {
            "pos": end,
            "carry": carried,
            "min": lo if state["min"] is None else min(state["min"], lo),
            "max": hi if state["max"] is None else max(state["max"], hi),
            "step_ms": step_ms,
        }
        if pace_s:
            time.sleep(pace_s)  # the demo's pace: a chunk of real work takes longer
        ctx.checkpoint(state)
        ctx.progress(end, count)
        observed = (time.monotonic() - step_started) * 1000
        step_ms = max(observed, (step_ms + observed) / 2)
        _journal("chunk", payload, pos=end)
    out = {
        "source": source,
        "segment": n,
        "samples": count,
        "min": state["min"],
        "max": state["max"],
        "carry": state["carry"],
    }
    storage.put(mine, json.dumps(out).encode(), "application/json")
    _journal("done", payload)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m examples.segments enqueue`: generate files and enqueue their segments."""
    parser = argparse.ArgumentParser(prog="python -m examples.segments", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    enqueue = sub.add_parser("enqueue", help="generate signal files and enqueue their segments")
    enqueue.add_argument("--files", type=int, default=3)
    enqueue.add_argument("--segments", type=int, default=8)
    enqueue.add_argument("--samples", type=int, default=200_000, help="per segment")
    enqueue.add_argument("--pace-ms", type=int, default=50, help="added to each chunk's work")
    enqueue.add_argument("--group", default="segments-demo")
    args = parser.parse_args(argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    items = []
    for i in range(1, args.files + 1):
        source = f"signals/{stamp}-{i}.f64"
        size = make_file(source, args.segments, args.samples, seed=i)
        items += jobs_for(source, args.segments, args.samples, pace_ms=args.pace_ms)
        print(f"{source}: {size} bytes, {args.segments} segments")
    rows = common.enqueue(items, args.group)
    print(f"{len(rows)} segment jobs in group {args.group!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
