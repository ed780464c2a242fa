"""Logs are one JSON object a line with stable keys (`ts`, `event`, `run_id`, `duration_ms`, ...);
`ts` is ISO 8601 in UTC with milliseconds."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TextIO

from worker.engine import jsonfmt

# Where log lines go instead of stderr, innermost last (the CLI sends them to a file while it
# draws a progress bar on a terminal). Shared by all threads, like a logging handler.
_sinks: list[TextIO] = []


def timestamp() -> str:
    """Now, as log lines write it: 2026-11-26T03:41:42.123Z."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def log_event(event: str, *, stream: TextIO | None = None, **fields: Any) -> None:
    """Write one JSON line `{"ts", "event", ...fields}` to stderr (or `stream`)."""
    record = {"ts": timestamp(), "event": event, **fields}
    out = stream or (_sinks[-1] if _sinks else sys.stderr)
    print(jsonfmt.dumps(record), file=out, flush=True)


@contextmanager
def redirected(stream: TextIO) -> Iterator[None]:
    """Send log lines that name no stream to `stream` for the duration."""
    _sinks.append(stream)
    try:
        yield
    finally:
        _sinks.remove(stream)
