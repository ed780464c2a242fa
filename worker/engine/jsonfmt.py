"""JSON as thumbq writes it everywhere (HTTP API, CLI, logs): ISO 8601 dates, numbers as numbers."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from typing import Any


def default(value: Any) -> Any:
    """What `json.dumps` cannot write itself: datetimes as ISO 8601, Decimals (Postgres
    numerics) as numbers, durations as seconds."""
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    raise TypeError(f"cannot serialise {type(value).__name__}")


def dumps(value: Any, *, indent: int | None = None) -> str:
    """`value` as JSON: compact, or indented for a person when `indent` is given."""
    if indent is None:
        return json.dumps(value, default=default, separators=(",", ":"))
    return json.dumps(value, default=default, indent=indent)
