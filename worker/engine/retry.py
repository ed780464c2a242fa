"""Error classes and backoff: which failures end a job and which try again, and when.

The backoff itself is applied in SQL (`thumbq.fail` moves the message's visibility timeout), so
that nobody sleeps inside a time budget; this module holds its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from worker.engine.db import DeadlineExceeded
from worker.engine.errors import (
    DB_ERROR,
    DB_TIMEOUT,
    INTERNAL,
    INVALID_KEY,
    PERMANENT_CODES,
    InvalidKey,
    ThumbqError,
)

BACKOFF_BASE_S = 30
BACKOFF_CAP_S = 15 * 60


@dataclass(frozen=True)
class Failure:
    """A classified failure: stable code, readable message, and whether it is permanent."""

    code: str
    message: str
    permanent: bool


def classify(exc: BaseException) -> Failure:
    """Map an exception raised while processing a job to a `Failure`."""
    if isinstance(exc, ThumbqError):
        return Failure(exc.code, exc.message, exc.code in PERMANENT_CODES)
    if isinstance(exc, InvalidKey):
        return Failure(INVALID_KEY, f"the source key cannot be stored: {exc}", True)
    if isinstance(exc, DeadlineExceeded):
        return Failure(DB_TIMEOUT, f"database call cut at the deadline: {exc}".strip(), False)
    if isinstance(exc, psycopg.Error):
        return Failure(DB_ERROR, f"database error: {exc}".strip(), False)
    return Failure(INTERNAL, f"{type(exc).__name__}: {exc}", False)
