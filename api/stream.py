"""GET /api/thumbnails/progress/stream?group_id=: a group's progress as Server-Sent Events.

For deployments that serve long responses (`thumbq serve`, on granian or waitress, neither of
which buffers it); serverless functions end a response at their time limit, so there a page
polls the progress endpoint or follows Supabase Realtime instead.

Same credentials as the progress endpoint (the admin secret, a page token or a user JWT, RLS
deciding what a user sees) and the same read: the stream asks for the group's progress every
`stream_poll_s` through the progress cache, so streams and pollers of one group share one query
per interval, and a connection is taken from the pool for each read and given back at once;
nothing is held between reads. What it sends:

    retry: 2000                      (reconnect after 2 s if the connection drops)

    id: <the group's ETag>           (one event per change of the group: its `version`)
    event: progress
    data: <the progress endpoint's JSON>

    : heartbeat                      (a comment after 15 s without an event)

    event: end                       (nothing pending or processing: the stream ends)
    data: {"group_id": "...", "reason": "done"}

A client that reconnects with `Last-Event-ID` gets no event for the version it already has. A
stream ends after `stream_max_s` (30 minutes) or when the user's token expires, and the client
reconnects (checked afresh); `reason` is `not_found` when the group is gone or the user may no
longer see it. Each open stream holds a request thread: a process serves at most
THUMBQ_MAX_STREAMS at once and answers 503 `too_many_streams` beyond.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Generator, Iterator
from typing import TYPE_CHECKING

import msgspec
import psycopg
from flask import Blueprint, Response, request
from msgspec import UNSET, Struct

from api import validation as v
from api.auth import Principal, require_reader
from api.contract import (
    ADMIN_ERRORS,
    READER,
    RETRY_AFTER,
    Absent,
    Answer,
    Error,
    GroupQuery,
    Op,
    describe,
)
from api.errors import ApiError
from api.thumbnails import Progress, ProgressAnswer, group_not_found, read_progress, state
from worker.engine.log import log_event

if TYPE_CHECKING:
    from api.state import AppState

bp = Blueprint("stream", __name__)

RETRY_MS = 2000
# Seconds a client refused for lack of a free stream should wait (or poll meanwhile).
BUSY_RETRY_S = 5
END_REASONS = ("done", "not_found")


class StreamHeaders(Struct):
    last_event_id: str | Absent = msgspec.field(default=UNSET, name="Last-Event-ID")


def _json_data(schema: dict[str, object]) -> dict[str, object]:
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


_EVENTS = {
    "description": "Server-Sent Events until nothing is pending or processing: a `retry:` hint, "
    "one `progress` event per change of the group (`id` is its ETag, `data` the progress "
    "endpoint's JSON), a `: heartbeat` comment after 15 s without an event, and an `end` event "
    '(`{"group_id", "reason": "done" | "not_found"}`). It also ends after 30 minutes or when a '
    "user's token expires; a client reconnects with Last-Event-ID and gets no event for the "
    "version it has. For servers that hold long responses (`thumbq serve`); serverless "
    "deployments poll or use Realtime.",
    # As OpenAPI 3.2 reads a stream's `itemSchema` (and tools read `schema` before 3.2): each
    # event, with its JSON data described by contentSchema.
    "content": {
        "text/event-stream": {
            "schema": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["event", "id", "data"],
                        "properties": {
                            "event": {"const": "progress"},
                            "id": {"type": "string", "description": "The group's ETag."},
                            "data": _json_data({"$ref": Progress}),
                        },
                    },
                    {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": {"const": "end"},
                            "data": _json_data(
                                {
                                    "type": "object",
                                    "required": ["group_id", "reason"],
                                    "properties": {
                                        "group_id": {"type": "string"},
                                        "reason": {"enum": list(END_REASONS)},
                                    },
                                }
                            ),
                        },
                    },
                ]
            }
        }
    },
    "headers": {"Cache-Control": {"schema": {"const": "no-cache"}}},
}


@bp.get("/api/thumbnails/progress/stream")
@describe(
    Op(
        "streamProgress",
        "A group's progress as Server-Sent Events, one event per change, until it is done.",
        {
            200: Answer(
                str(_EVENTS["description"]),
                content=_EVENTS["content"],  # type: ignore[arg-type]
                headers=_EVENTS["headers"],  # type: ignore[arg-type]
            ),
            400: "BadRequest",
            404: "NotFound",
            **ADMIN_ERRORS,
            503: Answer(
                "too_many_streams (this process holds THUMBQ_MAX_STREAMS open; Retry-After), "
                "streams_disabled, not_configured, or the database is unavailable.",
                Error,
                headers=RETRY_AFTER,
            ),
        },
        security=READER,
        query=GroupQuery,
        headers=StreamHeaders,
    )
)
def progress_stream() -> Response:
    """The group's progress as Server-Sent Events until nothing is pending or processing."""
    st = state()
    who = require_reader(st.auth)
    group_id = v.query_group_id()
    first = read_progress(st, group_id, who)
    if first is None:
        raise group_not_found(group_id)
    if not st.streams_enabled:
        raise ApiError(
            503,
            "streams_disabled",
            "progress streams are turned off here (THUMBQ_MAX_STREAMS=0): poll "
            "/api/thumbnails/progress instead",
        )
    if not st.stream_slots.acquire(blocking=False):
        raise ApiError(
            503,
            "too_many_streams",
            "this process serves as many progress streams as it may (THUMBQ_MAX_STREAMS): "
            "poll /api/thumbnails/progress, or try again shortly",
            {"Retry-After": str(BUSY_RETRY_S)},
        )
    last_id = request.headers.get("Last-Event-ID", "")[:200]
    # waitress tells whether the client has gone (it keeps reading the connection); elsewhere
    # a client that left is noticed when a write fails, at the next heartbeat at the latest.
    gone = request.environ.get("waitress.client_disconnected")
    body = EventStream(st, group_id, who, first, last_id, gone if callable(gone) else None)
    return Response(
        body,
        200,
        mimetype="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            # nginx (and proxies that honour it) would otherwise buffer the stream.
            "X-Accel-Buffering": "no",
            "Vary": "Authorization",
        },
    )


class EventStream:
    """The body of one stream: an iterator of SSE chunks. The server closes it when the stream
    ends or the client goes away (noticed at the next write, a heartbeat at the latest), which
    frees the stream's slot; a body closed before it was read frees it too. Where the server says
    whether the client is still there (`client_gone`, waitress), a stream ends at the poll after
    the client left."""

    def __init__(
        self,
        st: AppState,
        group_id: str,
        who: Principal,
        first: ProgressAnswer,
        last_id: str,
        client_gone: Callable[[], bool] | None = None,
    ) -> None:
        self.st = st
        self.group_id = group_id
        self.who = who
        self.client_gone = client_gone
        self._events = self._run(first, last_id)
        self._open = True
        self.sent = 0

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        return next(self._events)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._events.close()
            self.st.stream_slots.release()

    def _ends_at(self, started: float) -> float:
        end = started + self.st.stream_max_s
        exp = (self.who.claims or {}).get("exp")
        if isinstance(exp, int | float):
            # A user's stream ends with the token: the reconnect shows a fresh one (or a 401).
            end = min(end, started + (exp - time.time()))
        return end

    def _run(self, first: ProgressAnswer, last_id: str) -> Generator[bytes, None, None]:
        st = self.st
        started = time.monotonic()
        ends_at = self._ends_at(started)
        yield f"retry: {RETRY_MS}\n\n".encode()
        answer: ProgressAnswer | None = first
        sent_tag = last_id
        quiet_since = time.monotonic()
        reason = "client_closed"
        try:
            while True:
                if answer is None:
                    reason = "not_found"
                    yield _end(self.group_id, reason)
                    return
                if answer.tag != sent_tag:
                    sent_tag = answer.tag
                    self.sent += 1
                    yield b"id: %s\nevent: progress\ndata: %s\n\n" % (
                        answer.tag.encode(),
                        answer.body,
                    )
                    quiet_since = time.monotonic()
                if answer.settled:
                    reason = "done"
                    yield _end(self.group_id, reason)
                    return
                now = time.monotonic()
                if now >= ends_at:
                    reason = "expired"
                    return  # the client reconnects, with Last-Event-ID
                if now - quiet_since >= st.stream_heartbeat_s:
                    yield b": heartbeat\n\n"
                    quiet_since = now
                time.sleep(max(0.0, min(st.stream_poll_s, ends_at - now)))
                if self.client_gone is not None and self.client_gone():
                    return
                try:
                    answer = read_progress(st, self.group_id, self.who)
                except (psycopg.Error, ApiError) as exc:
                    # Ended rather than held open blind; the client reconnects after `retry`
                    # and is told 503 while the database stays away.
                    reason = "database_unavailable"
                    log_event("stream_error", group_id=self.group_id, error=str(exc)[:200])
                    yield b": the database is unreachable; reconnect later\n\n"
                    return
        finally:
            log_event(
                "progress_stream",
                group_id=self.group_id,
                events=self.sent,
                reason=reason,
                duration_ms=round((time.monotonic() - started) * 1000),
            )


def _end(group_id: str, reason: str) -> bytes:
    data = json.dumps({"group_id": group_id, "reason": reason})
    return f"event: end\ndata: {data}\n\n".encode()
