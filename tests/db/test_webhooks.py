"""Webhooks against a real HTTP receiver: one signed group.completed event per finished group,
retried with the same webhook-id after a failure, none for a group still running."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import tests.support.tasks_fixture  # noqa: F401  (registers the echo tasks in this process too)
from worker.engine import db, webhooks
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.storage import open_storage

SECRET = "whsec_" + base64.b64encode(b"a key of thirty-two bytes, fixed").decode()


class Receiver:
    """A webhook endpoint on a loopback port: answers the given statuses in turn (then 200)
    and keeps every request's headers and body."""

    def __init__(self, statuses: list[int]) -> None:
        self.statuses = list(statuses)
        self.requests: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/thumbq"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([500])
    yield r
    r.close()


def enqueue(conn: db.Conn, group: str, n: int) -> None:
    db.run(
        conn,
        "enqueue_jobs",
        {
            "items": json.dumps([{"task": "echo_thread", "payload": i} for i in range(n)]),
            "group_id": group,
            "max_attempts": 3,
        },
    )


def retries_due(conn: db.Conn) -> None:
    """Make the webhook jobs' retries due now instead of after the 30 s backoff."""
    conn.execute(
        "select pgmq.set_vt(thumbq.band_queue(priority), msg_id, 0) from thumbq.jobs"
        " where task = 'webhook' and status = 'pending' and msg_id is not null"
    )
    conn.execute(
        "update thumbq.jobs set next_attempt_at = clock_timestamp()"
        " where task = 'webhook' and status = 'pending'"
    )


def verify_as_docs_say(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """The receiver's check of docs/operations.md, written out."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(
        hmac.compare_digest(f"v1,{expected}", s) for s in headers["webhook-signature"].split()
    )


def test_a_finished_group_is_posted_once_signed_and_again_with_the_same_id_after_a_500(
    config: Config, conn: db.Conn, receiver: Receiver
) -> None:
    config = config.with_(
        tasks=("tests.support.tasks_fixture",),
        webhook_url=receiver.url,
        webhook_key=base64.b64decode(SECRET.removeprefix("whsec_")),
    )
    storage = open_storage(config)
    enqueue(conn, "photos", 2)
    enqueue(conn, "still-running", 1)

    # Run 1 takes the two jobs of `photos` (FIFO): that group is done, the other still waits.
    run_batch(config, conn, storage, max_items=2)
    # Run 2 delivers the event first (webhook jobs have priority 9): the receiver answers 500.
    run_batch(config, conn, storage, max_items=1)
    assert len(receiver.requests) == 1
    job = conn.execute("select * from thumbq.jobs where task = 'webhook'").fetchone()
    assert job is not None and job["status"] == "pending" and job["error_code"] == "webhook_refused"
    # Run 3, once the backoff is over: 200.
    retries_due(conn)
    run_batch(config, conn, storage, max_items=1)
    assert len(receiver.requests) == 2

    (h1, b1), (h2, b2) = receiver.requests
    assert h1["webhook-id"] == h2["webhook-id"] and h1["webhook-id"].startswith("msg_")
    assert b1 == b2
    for headers, body in receiver.requests:
        assert abs(int(headers["webhook-timestamp"]) - time.time()) < 60
        assert verify_as_docs_say(SECRET, headers, body)
        assert webhooks.verify(SECRET, headers, body)
        assert not verify_as_docs_say(SECRET, headers, body.replace(b"photos", b"photoz"))
    event = json.loads(b1)
    assert event["type"] == "group.completed"
    counts = {k: event["data"][k] for k in ("group_id", "total", "completed", "pending")}
    assert counts == {"group_id": "photos", "total": 2, "completed": 2, "pending": 0}
    job = conn.execute("select * from thumbq.jobs where task = 'webhook'").fetchone()
    assert job is not None and job["status"] == "completed" and job["attempts"] == 2
    # Nothing for the group that still has a job waiting.
    waiting = conn.execute(
        "select status from thumbq.jobs where group_id = 'still-running'"
    ).fetchone()
    assert waiting is not None and waiting["status"] == "pending"
    assert all(b"still-running" not in body for _, body in receiver.requests)

    # Once it is done, its own event, with an id of its own.
    run_batch(config, conn, storage)
    run_batch(config, conn, storage)
    assert len(receiver.requests) == 3
    headers, body = receiver.requests[2]
    assert json.loads(body)["data"]["group_id"] == "still-running"
    assert headers["webhook-id"] != h1["webhook-id"]
    # The webhook jobs' own group never sends an event of its own.
    run_batch(config, conn, storage)
    assert len(receiver.requests) == 3


def test_without_a_webhook_url_no_events_pile_up(config: Config, conn: db.Conn) -> None:
    config = config.with_(tasks=("tests.support.tasks_fixture",))
    enqueue(conn, "quiet", 2)
    run_batch(config, conn, open_storage(config))
    row = conn.execute("select count(*) as n from thumbq.events").fetchone()
    assert row is not None and row["n"] == 0


def test_a_receiver_that_drips_its_answer_costs_a_delivery_no_more_than_its_window() -> None:
    """A server that sends a byte every 100 ms never trips a per-read timeout; the delivery
    still ends when its window does."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\n")
        while not stop.is_set():
            try:
                conn.sendall(b"X-Drip: 1\r\n")
            except OSError:
                break
            time.sleep(0.1)
        conn.close()

    threading.Thread(target=drip, daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
    started = time.monotonic()
    try:
        with pytest.raises(OSError):
            webhooks.post(url, b"{}", {"Content-Type": "application/json"}, 1.0)
    finally:
        stop.set()
        listener.close()
    assert time.monotonic() - started < 1.5


def test_an_event_enqueued_twice_is_one_job(conn: db.Conn) -> None:
    """The job's idempotency key comes from the event id: an outbox row handed out again (its
    job_id cleared by hand) names the same job."""
    conn.execute(
        "insert into thumbq.events (type, group_id, payload)"
        " values ('group.completed', 'g', '{\"group_id\": \"g\"}')"
    )
    first = db.one(conn, "enqueue_events", {"limit": 10, "max_attempts": 10})
    conn.execute("update thumbq.events set job_id = null")
    second = db.one(conn, "enqueue_events", {"limit": 10, "max_attempts": 10})
    assert first == second == {"enqueued": 1}
    jobs = conn.execute(
        "select count(*) as n, min(priority) as p, min(group_id) as g from thumbq.jobs"
        " where task = 'webhook'"
    ).fetchone()
    assert jobs == {"n": 1, "p": 9, "g": "thumbq_webhooks"}
