"""Helpers for the fault tests (tests/system/test_faults.py): reading the storage log that
`bench.harness.LoggingStorage` writes (render attempts per key and process, overlaps, writes per
thumbnail) and finding leftover processes. The worker driver, the memory sampler and the hostile
run are in bench/harness.py (bench/hostile.py uses them too).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

THUMB_PREFIX = "thumbnails/"


# -- the storage log --------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One line of a storage log."""

    op: str  # get | put | run_start | run_end | ready
    key: str
    pid: int
    t: float


def read_log(path: str | os.PathLike[str]) -> list[Event]:
    """Every complete line of a storage log, in file order."""
    events = []
    for line in Path(path).read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue  # cannot happen with single-write lines; tolerated all the same
        events.append(Event(d["op"], d["key"], int(d["pid"]), float(d["t"])))
    return events


def source_of(thumbnail_key: str) -> str:
    """The source key of `thumbnails/<source key>/<etag>-<size>.<ext>`."""
    assert thumbnail_key.startswith(THUMB_PREFIX), thumbnail_key
    return thumbnail_key[len(THUMB_PREFIX) :].rpartition("/")[0]


@dataclass(frozen=True)
class Render:
    """One render attempt of a source key by one process: from its `get` to its `put`, or to the
    end of its run or the death of its process when no thumbnail was written."""

    key: str
    pid: int
    start: float
    end: float
    wrote: bool


def renders(events: Sequence[Event], deaths: dict[int, float]) -> list[Render]:
    """Render attempts reconstructed from a storage log and the death time of killed pids."""
    out: list[Render] = []
    open_: dict[tuple[int, str], float] = {}

    def close_all(pid: int, t: float) -> None:
        for (p, key), start in list(open_.items()):
            if p == pid:
                out.append(Render(key, pid, start, t, False))
                del open_[(p, key)]

    for e in events:
        if e.op == "get" and not e.key.startswith(THUMB_PREFIX):
            open_[(e.pid, e.key)] = e.t
        elif e.op == "put" and e.key.startswith(THUMB_PREFIX):
            key = source_of(e.key)
            start = open_.pop((e.pid, key), None)
            out.append(Render(key, e.pid, e.t if start is None else start, e.t, True))
        elif e.op == "run_end":
            # Every render of a run has ended when run_batch returns (its threads are joined).
            close_all(e.pid, e.t)
    last = max((e.t for e in events), default=time.time())
    for pid in {p for p, _ in open_}:
        close_all(pid, deaths.get(pid, last))
    return out


def overlapping(attempts: Iterable[Render]) -> list[tuple[Render, Render]]:
    """Pairs of render attempts of the same key whose time intervals overlap."""
    by_key: dict[str, list[Render]] = defaultdict(list)
    for r in attempts:
        by_key[r.key].append(r)
    pairs = []
    for rs in by_key.values():
        rs.sort(key=lambda r: r.start)
        # Against the attempt that ends last so far: finds every attempt that overlaps another.
        longest = rs[0]
        for r in rs[1:]:
            if r.start < longest.end:
                pairs.append((longest, r))
            if r.end > longest.end:
                longest = r
    return pairs


def put_counts(events: Iterable[Event]) -> Counter[str]:
    """How many times each thumbnail key was written."""
    return Counter(e.key for e in events if e.op == "put" and e.key.startswith(THUMB_PREFIX))


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker` (to find leftovers)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found
