"""The token bucket in `thumbq.rate_limits`, taken atomically by `thumbq.take_tokens`."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine import db


@dataclass(frozen=True)
class Grant:
    """What the bucket gave: `taken` tokens; when not granted, `retry_after_ms` says when."""

    granted: bool
    taken: int
    tokens_left: float
    retry_after_ms: int | None


def take(
    conn: db.Conn, name: str, n: int = 1, *, partial: bool = False, bound: db.Bound | None = None
) -> Grant | None:
    """Take `n` tokens (or as many as there are, with `partial`); None if no such bucket."""
    row = db.one(conn, "take_tokens", {"name": name, "n": n, "partial": partial}, bound=bound)
    if row is None:
        return None
    return Grant(
        bool(row["granted"]), int(row["taken"]), float(row["tokens_left"]), row["retry_after_ms"]
    )


def set_limit(conn: db.Conn, name: str, capacity: float, refill_per_second: float) -> None:
    """Create or change a bucket (e.g. an external API's quota), with no redeploy."""
    conn.execute(
        "insert into thumbq.rate_limits (name, capacity, refill_per_second, tokens)"
        " values (%s, %s, %s, %s) on conflict (name) do update set"
        " capacity = excluded.capacity, refill_per_second = excluded.refill_per_second,"
        " tokens = least(thumbq.rate_limits.tokens, excluded.capacity)",
        [name, capacity, refill_per_second, capacity],
    )
