"""The progress stream (GET /api/thumbnails/progress/stream) over real HTTP: an event per change
of a group that progresses while the stream is open, on `thumbq serve` with granian and with
waitress (neither buffers it), heartbeats, `retry:` and Last-Event-ID, the end when the group is
done, the progress route's auth, no database connection held between polls, and a bounded
number of streams per process."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from flask.testing import FlaskClient

import tests.support.tasks_fixture  # noqa: F401  (registers the tasks the batches here run)
from api import create_app
from tests.db.test_api import ADMIN, JWT_SECRET, SECRET, assert_error, bearer, user_token
from tests.support.liveapp import call, live_app, wait_listening, wait_until
from tests.support.s3fixtures import free_port
from worker.app.signing import page_token
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
PATH = "/api/thumbnails/progress/stream?group_id="


@pytest.fixture
def sconfig(config: Config) -> Config:
    return config.with_(
        cron_secret=SECRET, jwt_secret=JWT_SECRET, tasks=("tests.support.tasks_fixture",)
    )


class SseClient:
    """One stream read over a plain HTTP connection, an event (or comment) at a time, each with
    the moment it arrived."""

    def __init__(
        self, base_url: str, group: str, token: str = SECRET, last_event_id: str | None = None
    ) -> None:
        parts = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=20)
        headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        self.conn.request("GET", PATH + group, headers=headers)
        self.resp = self.conn.getresponse()

    def next(self) -> tuple[float, dict[str, str]] | None:
        """The next block: its fields (a comment as `comment`), or None at the end."""
        fields: dict[str, str] = {}
        while True:
            line = self.resp.readline()
            if not line:
                return None
            text = line.decode().rstrip("\r\n")
            if text == "":
                if fields:
                    return time.monotonic(), fields
                continue
            name, _, value = text.partition(":")
            fields["comment" if name == "" else name] = value.removeprefix(" ")

    def until(self, pred: Any, limit: int = 50) -> tuple[float, dict[str, str]]:
        for _ in range(limit):
            block = self.next()
            assert block is not None, "the stream ended"
            if pred(block[1]):
                return block
        raise AssertionError("no such block")

    def close(self) -> None:
        # The response holds the socket too (a response that ends with the connection is
        # detached from it), so both are closed.
        self.resp.close()
        self.conn.close()


def progress_of(block: dict[str, str]) -> dict[str, Any]:
    assert block.get("event") == "progress", block
    data: dict[str, Any] = json.loads(block["data"])
    return data


@pytest.fixture
def serve(request: pytest.FixtureRequest, db_url: str, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """`thumbq serve` in a process of its own, with the server named by the test's parameter."""
    server = request.param
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": db_url,
        "THUMBQ_HOME": str(tmp_path / "serve-home"),
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_CRON_SECRET": SECRET,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "serve", "--port", str(port), "--server", server],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(proc, port)
        yield f"http://127.0.0.1:{port}", server
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


@pytest.mark.parametrize("serve", ["granian", "waitress"], indirect=True)
def test_thumbq_serve_streams_an_event_per_change_while_the_group_progresses_and_ends(
    serve: tuple[str, str], sconfig: Config, conn: db.Conn
) -> None:
    url, _server = serve
    Queue(conn).enqueue_jobs([{"task": "echo_thread", "payload": i} for i in range(3)], "live")
    stream = SseClient(url, "live")
    try:
        assert stream.resp.status == 200
        assert stream.resp.getheader("Content-Type", "").startswith("text/event-stream")
        assert stream.resp.getheader("Cache-Control") == "no-cache"
        _, first = stream.next() or (0, {})
        assert first == {"retry": "2000"}
        _, block = stream.next() or (0, {})
        assert (progress_of(block)["pending"], progress_of(block)["completed"]) == (3, 0)
        ids = [block["id"]]
        storage = open_storage(sconfig)
        for done in (1, 2, 3):
            run_batch(sconfig, conn, storage, max_items=1)
            ran_at = time.monotonic()
            # The event for this change arrives while the rest of the group still waits: the
            # server sends it as it is written (one poll and one cache interval later), rather
            # than holding the response until the stream ends.
            arrived, block = stream.until(
                lambda b, done=done: (
                    b.get("event") == "progress" and json.loads(b["data"])["completed"] == done
                )
            )
            assert arrived - ran_at < 4.0, arrived - ran_at
            ids.append(block["id"])
        assert len(set(ids)) == len(ids)  # every event is a new version
        versions = [int(i.split("-")[0]) for i in ids]
        assert versions == sorted(versions)
        _, end = stream.until(lambda b: b.get("event") == "end")
        assert json.loads(end["data"]) == {"group_id": "live", "reason": "done"}
        assert stream.next() is None  # and the response ends
    finally:
        stream.close()


def _app_state(server: Any) -> Any:
    return server.app.extensions["thumbq"]


def test_heartbeats_keep_a_quiet_stream_alive_and_last_event_id_resumes_without_repeats(
    sconfig: Config, conn: db.Conn
) -> None:
    Queue(conn).enqueue_jobs([{"task": "echo"}], "quiet")
    with live_app(sconfig) as server:
        st = _app_state(server)
        st.stream_heartbeat_s, st.stream_poll_s = 0.3, 0.05
        stream = SseClient(server.url, "quiet")
        try:
            stream.next()  # retry
            _, event = stream.next() or (0, {})
            tag = event["id"]
            beats = [stream.next() for _ in range(3)]
            assert all(b is not None and b[1] == {"comment": "heartbeat"} for b in beats)
            gaps = [b2[0] - b1[0] for b1, b2 in itertools.pairwise(beats) if b1 and b2]
            assert all(0.2 < g < 1.5 for g in gaps), gaps
        finally:
            stream.close()
        # A reconnect naming the version it has gets no event until the group changes.
        again = SseClient(server.url, "quiet", last_event_id=tag)
        try:
            assert again.next() == (pytest.approx(time.monotonic(), abs=5), {"retry": "2000"})
            _, block = again.next() or (0, {})
            assert block == {"comment": "heartbeat"}
            Queue(conn).enqueue_jobs([{"task": "echo"}], "quiet")
            _, block = again.until(lambda b: b.get("event") == "progress")
            assert block["id"] != tag and progress_of(block)["pending"] == 2
        finally:
            again.close()
        # A stream ends after its lifetime; the client reconnects.
        st.stream_max_s = 0.5
        short = SseClient(server.url, "quiet")
        try:
            started = time.monotonic()
            blocks = []
            while (b := short.next()) is not None:
                blocks.append(b[1])
            assert time.monotonic() - started < 3.0
            assert [b.get("event") for b in blocks if "event" in b] == ["progress"]
        finally:
            short.close()


def test_streams_hold_no_database_connection_between_polls_and_are_bounded_per_process(
    sconfig: Config, conn: db.Conn
) -> None:
    Queue(conn).enqueue_jobs([{"task": "echo"}], "busy")
    # One pooled connection, two streams allowed.
    with live_app(sconfig.with_(max_streams=2), pool_size=1) as server:
        st = _app_state(server)
        st.stream_heartbeat_s, st.stream_poll_s = 0.2, 0.05
        streams = [SseClient(server.url, "busy") for _ in range(2)]
        try:
            for s in streams:
                assert s.resp.status == 200
                s.until(lambda b: b.get("event") == "progress")
            status, body, headers = call("GET", f"{server.url}{PATH}busy", SECRET, timeout=10)
            assert status == 503 and body is not None
            assert body["error"]["code"] == "too_many_streams"
            assert headers["Retry-After"] == "5"
            # Both streams poll all along, yet the one connection is free for other requests.
            for _ in range(5):
                started = time.monotonic()
                status, _, _ = call(
                    "GET", f"{server.url}/api/thumbnails/progress?group_id=busy", SECRET
                )
                assert status == 200 and time.monotonic() - started < 1.5
            status, _, _ = call("POST", f"{server.url}/api/jobs", SECRET, {"task": "echo"})
            assert status == 202
            row = conn.execute(
                "select count(*) as n from pg_stat_activity"
                " where application_name = 'thumbq-api' and datname = current_database()"
            ).fetchone()
            assert row is not None and row["n"] <= 1
            # A client that leaves frees its stream at once: waitress keeps reading the
            # connection and says the client has gone, without waiting for a write to fail.
            st.stream_heartbeat_s = 60.0
            streams.pop().close()

            def admitted() -> bool:
                s = SseClient(server.url, "busy")
                if s.resp.status == 200:
                    streams.append(s)
                    return True
                s.close()
                return False

            wait_until(admitted, 3, 0.2)
        finally:
            for s in streams:
                s.close()


@pytest.fixture
def client(sconfig: Config) -> Iterator[FlaskClient]:
    app = create_app(sconfig.with_(progress_cache_ms=0), db_timeout_s=2.0)
    app.extensions["thumbq"].stream_poll_s = 0.05
    yield app.test_client()
    app.extensions["thumbq"].close()


def _first_chunks(resp: Any, n: int) -> list[bytes]:
    it = iter(resp.response)
    chunks = [next(it) for _ in range(n)]
    resp.close()
    return chunks


def test_the_stream_takes_the_progress_routes_credentials_and_rls_decides_for_users(
    client: FlaskClient, conn: db.Conn, config: Config
) -> None:
    Queue(conn).enqueue_jobs([{"task": "echo"}], "team")
    conn.execute("insert into thumbq.group_members values ('team', 'alice')")
    assert_error(client.get(PATH + "team"), 401, "unauthorized")
    assert_error(client.get(PATH + "team", headers=bearer("wrong")), 401, "unauthorized")
    assert_error(
        client.get(PATH + "team", headers=bearer(user_token("bob"))), 404, "group_not_found"
    )
    assert_error(client.get(PATH + "nope", headers=ADMIN), 404, "group_not_found")
    assert_error(client.get(PATH + "a%0Ab", headers=ADMIN), 400, "invalid_group_id")
    for token in (SECRET, page_token(SECRET), user_token("alice")):
        resp = client.get(PATH + "team", headers=bearer(token), buffered=False)
        assert resp.status_code == 200 and resp.mimetype == "text/event-stream"
        retry, event = _first_chunks(resp, 2)
        assert retry == b"retry: 2000\n\n" and b"event: progress" in event
    # A user's stream ends when the token does: the reconnect is checked afresh.
    resp = client.get(
        PATH + "team", headers=bearer(user_token("alice", exp=int(time.time()) + 2)), buffered=False
    )
    started = time.monotonic()
    assert b"".join(resp.response).count(b"event: progress") == 1
    assert 0.5 < time.monotonic() - started < 4.0
    closed = create_app(config.with_(cron_secret=None, jwt_secret=None), db_timeout_s=2.0)
    try:
        assert_error(closed.test_client().get(PATH + "team", headers=ADMIN), 503, "not_configured")
    finally:
        closed.extensions["thumbq"].close()


def test_a_settled_group_gets_its_progress_and_the_end_at_once(
    client: FlaskClient, conn: db.Conn
) -> None:
    rows = Queue(conn).enqueue_jobs([{"task": "echo"}], "over")
    Queue(conn).cancel_jobs([rows[0]["job_id"]])
    resp = client.get(PATH + "over", headers=ADMIN, buffered=False)
    body = b"".join(resp.response).decode()
    blocks = [b for b in body.split("\n\n") if b]
    assert blocks[0] == "retry: 2000"
    assert blocks[1].startswith("id: ") and "event: progress" in blocks[1]
    assert '"cancelled":1' in blocks[1]
    assert blocks[2] == 'event: end\ndata: {"group_id": "over", "reason": "done"}'
    assert len(blocks) == 3


def test_streams_can_be_turned_off(sconfig: Config, conn: db.Conn) -> None:
    Queue(conn).enqueue_jobs([{"task": "echo"}], "g")
    app = create_app(sconfig.with_(max_streams=0), db_timeout_s=2.0)
    try:
        r = app.test_client().get(PATH + "g", headers=ADMIN)
        assert_error(r, 503, "streams_disabled")
        # Polling still answers.
        assert (
            app.test_client().get("/api/thumbnails/progress?group_id=g", headers=ADMIN).status_code
            == 200
        )
    finally:
        app.extensions["thumbq"].close()
