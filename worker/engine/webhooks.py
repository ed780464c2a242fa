"""Webhooks: a signed `group.completed` event, delivered at least once by the engine itself.

When a group's last waiting or running job ends, a trigger on `thumbq.groups` writes an event to
the outbox `thumbq.events` (sql/010_engine.sql). At each batch's start, when
THUMBQ_WEBHOOK_URL is set, `prepare` turns undelivered events into jobs of the built-in
`webhook` task (`thumbq.enqueue_events`, in a transaction of its own: never from inside the
trigger, which holds a group row). The task POSTs the event, signed as the Standard Webhooks
specification says; a failure raises TransientError, so the job retries with the engine's
backoff, with the same `webhook-id` every time (receivers deduplicate on it).

    webhook-id: msg_<event uuid>
    webhook-timestamp: <unix seconds of this attempt>
    webhook-signature: v1,<base64 HMAC-SHA256(key, "<id>.<timestamp>.<body>")>

The body is `{"type": "group.completed", "timestamp": <when the group was done>, "data": {...}}`
with the group's counts; the same bytes on every attempt.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from worker.engine import tasks
from worker.engine.log import log_event
from worker.engine.states import ErrorCode
from worker.engine.tasks import TaskContext, TransientError, task

if TYPE_CHECKING:
    from worker.engine import db
    from worker.engine.config import Config

WEBHOOK_TASK = "webhook"
# With the engine's backoff (30 s doubling, capped at 15 min), ten attempts span about an hour
# and a half of a receiver being down.
MAX_ATTEMPTS = 10
# Events turned into jobs per batch start (the rest wait for the next one).
ENQUEUE_LIMIT = 100
# A delivery never starts with less than this left of the invocation: it checkpoints instead
# and goes in a later one, without using an attempt.
MIN_WINDOW_MS = 500
# The longest one delivery may take, however long the invocation has left.
MAX_TIMEOUT_S = 10.0
USER_AGENT = "thumbq-webhooks"


@dataclass(frozen=True)
class Sender:
    """Where events go and the key that signs them."""

    url: str
    key: bytes


# The sender of this process, set by `prepare` at each batch's start: a `webhook` job runs in a
# thread of the batch that prepared it, and reads where to send from here.
_sender: Sender | None = None
_synced: set[str] = set()
_lock = threading.Lock()


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` and the base64 HMAC-SHA256 of `id.timestamp.body`."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def verify(secret: str, headers: dict[str, str], body: bytes, tolerance_s: int = 300) -> bool:
    """What a receiver checks (docs/operations.md shows the same in a few lines): a
    `whsec_...` secret, the three headers, a timestamp within `tolerance_s` of now."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    msg_id, ts = headers["webhook-id"], int(headers["webhook-timestamp"])
    if abs(time.time() - ts) > tolerance_s:
        return False
    expected = sign(key, msg_id, ts, body).encode()
    return any(
        hmac.compare_digest(expected, s.encode()) for s in headers["webhook-signature"].split()
    )


def body_of(payload: dict[str, Any]) -> tuple[str, bytes]:
    """The event's `webhook-id` and body bytes, the same on every attempt."""
    event = {"type": payload["type"], "timestamp": payload["timestamp"], "data": payload["data"]}
    body = json.dumps(event, separators=(",", ":"), sort_keys=True).encode()
    return f"msg_{payload['id']}", body


def prepare(config: Config, conn: db.Conn, call_bound: db.Bound | None = None) -> None:
    """At a batch's start: with THUMBQ_WEBHOOK_URL set, make this process the sender, write the
    `webhook` task's row (once per database) and enqueue the events not yet enqueued. A failure
    here is logged and does not stop the batch; the events wait for the next one."""
    global _sender
    if not config.webhook_url or config.webhook_key is None:
        return
    from worker.engine import db as dbm

    with _lock:
        _sender = Sender(config.webhook_url, config.webhook_key)
    try:
        dsn = conn.info.dsn
        if dsn not in _synced:
            registered = tasks.REGISTRY.get(WEBHOOK_TASK)
            assert registered is not None
            only = tasks.Registry()
            only.add(registered)
            tasks.sync(conn, only, call_bound=call_bound)
            _synced.add(dsn)
        row = dbm.one(
            conn,
            "enqueue_events",
            {"limit": ENQUEUE_LIMIT, "max_attempts": MAX_ATTEMPTS},
            bound=call_bound,
        )
        if row and row["enqueued"]:
            log_event("webhooks_enqueued", count=row["enqueued"])
    except Exception as exc:  # the batch's own work goes on; events stay in the outbox
        log_event("webhooks_enqueue_failed", error=f"{type(exc).__name__}: {exc}")


@task(WEBHOOK_TASK, runs_in="thread", max_attempts=MAX_ATTEMPTS)
def deliver(ctx: TaskContext, payload: dict[str, Any]) -> Any:
    """POST one event to THUMBQ_WEBHOOK_URL within the invocation's remaining time."""
    sender = _sender
    if sender is None:
        raise TransientError(
            "THUMBQ_WEBHOOK_URL is not set where this job ran",
            code=ErrorCode.WEBHOOK_NOT_CONFIGURED,
        )
    if ctx.remaining_ms() < MIN_WINDOW_MS:
        return ctx.checkpoint(ctx.state or {})
    msg_id, body = body_of(payload)
    timestamp = int(time.time())
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": sign(sender.key, msg_id, timestamp, body),
    }
    # Room to record the outcome after the call.
    timeout_s = min(MAX_TIMEOUT_S, (ctx.remaining_ms() - 200) / 1000)
    started = time.monotonic()
    try:
        status = post(sender.url, body, headers, timeout_s)
    except OSError as exc:
        raise TransientError(
            f"the webhook {_where(sender.url)} did not answer: {exc}",
            code=ErrorCode.WEBHOOK_UNREACHABLE,
        ) from None
    if not 200 <= status < 300:
        raise TransientError(
            f"the webhook {_where(sender.url)} answered {status}", code=ErrorCode.WEBHOOK_REFUSED
        )
    return {
        "webhook_id": msg_id,
        "status": status,
        "duration_ms": round((time.monotonic() - started) * 1000),
    }


def _where(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> int:
    """POST `body`; the answer's status. The whole exchange ends within `timeout_s`: a timer
    shuts the socket down at the end (a server that drips its answer a byte at a time would
    otherwise hold a per-read timeout for ever); redirects are not followed."""
    import http.client

    parts = urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "", parts.port, timeout=max(timeout_s, 0.05))
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")

    cut_off = threading.Event()

    def cut() -> None:
        cut_off.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout_s, cut)
    timer.daemon = True
    timer.start()
    try:
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        response.read(64 * 1024)
    except (http.client.HTTPException, OSError) as exc:
        if cut_off.is_set():
            raise TimeoutError(f"no whole answer within {timeout_s:.1f} s") from None
        raise OSError(f"{type(exc).__name__}: {exc}") from None
    finally:
        timer.cancel()
        conn.close()
    # A socket shut down in the middle of the headers reads as their end: not an answer.
    if cut_off.is_set():
        raise TimeoutError(f"no whole answer within {timeout_s:.1f} s")
    return int(response.status)
