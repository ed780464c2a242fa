"""Logs are one JSON object a line with stable keys (`event`, `run_id`, `duration_ms`, ...)."""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO


def log_event(event: str, *, stream: TextIO | None = None, **fields: Any) -> None:
    """Write one JSON line `{"ts", "event", ...fields}` to stderr (or `stream`)."""
    record = {"ts": round(time.time(), 3), "event": event, **fields}
    print(
        json.dumps(record, default=str, separators=(",", ":")),
        file=stream or sys.stderr,
        flush=True,
    )
