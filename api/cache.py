"""A short-lived, per-process memory of database reads, so that many pollers of one group cost the
database one query per interval instead of one per request.

The app keeps two (api/state.py): a group's progress answer, and whether a user may see a group
(decided by RLS, keyed by the group and the user's verified claims). An entry lives at most its
time to live from the moment its read began, which bounds how stale an answer can be. Requests
that miss at the same moment wait for one read instead of each sending their own (no stampede
when an entry expires under hundreds of pollers). Writes made through this process forget what
they touch, so a caller never reads its own change as not yet made; other processes' writes show
within the time to live.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

Row = Any  # what the loader returns
Key = tuple[str, Hashable]
MISS = object()

DEFAULT_MAX_ENTRIES = 10_000


class TimedCache:
    """Values by (group_id, ...) key, each kept for at most `ttl_s` seconds."""

    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[Key, tuple[float, Row]] = {}
        self._loading: dict[Key, threading.Lock] = {}
        self._lock = threading.Lock()
        self._generation = 0

    def get(
        self, key: Key, load: Callable[[], Row], ttl_of: Callable[[Row], float] | None = None
    ) -> Row:
        """The cached value for `key`, or `load()`'s (kept when it returns; errors are not kept),
        for `ttl_s`, or for `ttl_of(value)` when given (at most `ttl_s`)."""
        if self.ttl_s <= 0:
            return load()
        entry = self._entries.get(key)
        if entry is not None and entry[0] > time.monotonic():
            return entry[1]
        with self._lock:
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:
            entry = self._entries.get(key)
            if entry is not None and entry[0] > time.monotonic():
                return entry[1]  # another request read it while this one waited
            generation = self._generation
            started = time.monotonic()
            try:
                row = load()
            except BaseException:
                with self._lock:
                    self._loading.pop(key, None)
                raise
            with self._lock:
                self._loading.pop(key, None)
                # A write in this process during the read may not be in the row: don't keep it.
                if generation == self._generation:
                    self._make_room(started)
                    ttl = self.ttl_s if ttl_of is None else min(self.ttl_s, ttl_of(row))
                    self._entries[key] = (started + ttl, row)
            return row

    def peek(self, key: Key) -> Any:
        """The fresh value kept for `key`, else MISS (never reads the database)."""
        entry = self._entries.get(key)
        if entry is not None and self.ttl_s > 0 and entry[0] > time.monotonic():
            return entry[1]
        return MISS

    def _make_room(self, now: float) -> None:
        if len(self._entries) < self.max_entries:
            return
        live = {k: e for k, e in self._entries.items() if e[0] > now}
        self._entries = live if len(live) < self.max_entries else {}

    def forget(self, group_id: str | None = None) -> None:
        """Drop what is kept for `group_id` (every group when None) after a write to it."""
        with self._lock:
            self._generation += 1
            if group_id is None:
                self._entries = {}
            else:
                self._entries = {k: e for k, e in self._entries.items() if k[0] != group_id}
