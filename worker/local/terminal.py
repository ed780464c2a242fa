"""What the CLI shows a person: JSON, tables, and a group's progress bar.

On a terminal the bar is redrawn in place and moves per file (the batch reports each item as it
ends); the JSON log lines that would cut through it go to a log file instead. Anywhere else
(a pipe, CI) it prints one line per change and the log lines stay on stderr.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

from worker.engine import jsonfmt
from worker.engine.states import FINAL_OUTCOMES, FINAL_STATUSES, JobStatus, Outcome

# The statuses a job ends with, in the order the bar shows them.
FINAL = tuple(s for s in JobStatus if s in FINAL_STATUSES)


def print_json(value: Any, stream: TextIO | None = None) -> None:
    """`value` as indented JSON, in the API's shape (ISO 8601 dates, numbers as numbers)."""
    print(jsonfmt.dumps(value, indent=2), file=stream or sys.stdout)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if hasattr(value, "isoformat"):
        return str(value.isoformat())
    return str(value)


def print_table(
    rows: Sequence[dict[str, Any]], columns: list[str], stream: TextIO | None = None
) -> None:
    """Rows as aligned columns (dates in ISO 8601)."""
    stream = stream or sys.stdout
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)), file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)), file=stream)


def _done(counts: dict[str, int]) -> int:
    return counts.get("total", 0) - counts.get("pending", 0) - counts.get("processing", 0)


class ProgressBar:
    """A group's progress on `stream`. `update` takes the group's counts from the database;
    `item_done` moves the bar by one file at once, before the database's counts (written in
    small batches) catch up."""

    WIDTH = 30

    def __init__(self, stream: TextIO, tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        # Files seen ending here, per status, that the database's counts do not show yet
        # (completions are written in small batches).
        self.ahead: dict[str, int] = dict.fromkeys(FINAL, 0)
        self.last_line: str | None = None
        self.drawn = False

    def update(self, counts: dict[str, Any]) -> None:
        """The group's counts per status (a `thumbq.progress` row or the API's body)."""
        with self.lock:
            fresh = {k: int(counts.get(k) or 0) for k in ("total", "pending", "processing")}
            fresh |= {k: int(counts.get(k) or 0) for k in FINAL}
            for k in FINAL:  # what the database has caught up with
                self.ahead[k] = max(0, self.ahead[k] - (fresh[k] - self.counts.get(k, 0)))
            self.counts = fresh
        self._draw()

    def item_done(self, _job: Any, outcome: Outcome) -> None:
        """A file has been through a batch (called from its worker threads); the bar moves for
        the ones that ended (not those that will be retried or were handed back)."""
        status = FINAL_OUTCOMES.get(outcome)
        if status is None:
            return
        with self.lock:
            self.ahead[status] += 1
        self._draw()

    def line(self) -> str:
        """The bar as one line of text."""
        c = self.counts
        total = c.get("total", 0)
        done = min(total, _done(c) + sum(self.ahead.values()))
        pct = 100.0 * done / total if total else 0.0
        filled = round(self.WIDTH * pct / 100)
        outcomes = "  ".join(f"{k} {c.get(k, 0) + self.ahead[k]}" for k in FINAL)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        return f"[{bar}] {pct:5.1f}%  {done}/{total}  {outcomes}"

    def _draw(self) -> None:
        with self.lock:
            if not self.counts:
                return
            line = self.line()
            if line == self.last_line:
                return
            self.last_line = line
            if self.tty:
                self.stream.write("\r\x1b[2K" + line)
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
            self.drawn = True

    def close(self) -> None:
        """End the bar's line (on a terminal)."""
        with self.lock:
            if self.tty and self.drawn:
                self.stream.write("\n")
                self.stream.flush()
            self.drawn = False
