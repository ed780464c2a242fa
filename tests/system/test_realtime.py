"""Realtime with the user's own token: the progress page (the real supabase-js in Chromium) and
`thumbq watch` (the `realtime` package) join the group's private broadcast topic as the user,
never as anon, and the page keeps polling at the endpoint's pace while Realtime says nothing.

Supabase Realtime itself is stood in by tests/support/realtime_stub.py, which speaks its websocket
protocol, refuses a private channel without an accepted token, records each join and delivers
the broadcasts a test sends. supabase-js comes from npm (tests/js, `npm ci` in .ci/run).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest

from tests.support.httpstub import HttpStub
from tests.support.liveapp import live_app, wait_until
from tests.support.pgtools import require
from tests.support.realtime_stub import RealtimeStub
from tests.system.test_progress_page import browser  # noqa: F401 (the Chromium fixture)
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.local.watch import WatchOptions, follow_realtime, watch

SECRET = "realtime-test-admin-secret-0123456789"
JWT_SECRET = "realtime-test-jwt-secret-0123456789abcdef"
GROUP = "talks-2026"
TOPIC = f"realtime:thumbq:group:{GROUP}"
SUPABASE_JS = (
    Path(__file__).resolve().parents[1]
    / "js/node_modules/@supabase/supabase-js/dist/umd/supabase.js"
)


def token(sub: str, role: str = "authenticated") -> str:
    claims = {"sub": sub, "aud": "authenticated", "role": role, "exp": int(time.time()) + 600}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


ALICE, ANON = token("alice"), token("anon", role="anon")


@pytest.fixture
def stub() -> Iterator[RealtimeStub]:
    """Realtime that accepts Alice's token for private topics (RLS would, she is a member)."""
    server = RealtimeStub(accepted_tokens={ALICE})
    yield server
    server.close()


@pytest.fixture
def group(conn: db.Conn) -> db.Conn:
    Queue(conn).enqueue_files([{"source_key": f"t/{i}.pdf", "etag": "e"} for i in range(4)], GROUP)
    conn.execute("insert into thumbq.group_members values (%s, 'alice')", [GROUP])
    return conn


# -- the page -----------------------------------------------------------------------------------


@pytest.fixture
def supabase_js() -> Iterator[str]:
    """The real supabase-js (its UMD build, made an ES module) served with CORS, as esm.sh is."""
    require(SUPABASE_JS.exists(), f"{SUPABASE_JS} is missing: npm ci --prefix tests/js")
    body = (
        SUPABASE_JS.read_text(encoding="utf-8") + "\nexport const { createClient } = supabase;\n"
    ).encode()

    headers = {"Content-Type": "text/javascript", "Access-Control-Allow-Origin": "*"}
    server = HttpStub(lambda _: (200, headers, body))
    yield f"{server.url}/supabase-js.mjs"
    server.close()


def _page_config(config: Config, stub: RealtimeStub, js_url: str) -> Config:
    return config.with_(
        cron_secret=SECRET,
        jwt_secret=JWT_SECRET,
        supabase_url=stub.url,
        supabase_anon_key=ANON,
        supabase_js_url=js_url,
        progress_cache_ms=0,
    )


def _count_polls(app: Any) -> list[float]:
    """Times of the progress requests the app answers."""
    seen: list[float] = []
    inner = app.wsgi_app

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ["PATH_INFO"] == "/api/thumbnails/progress":
            seen.append(time.monotonic())
        return inner(environ, start_response)

    app.wsgi_app = wsgi
    return seen


def _realtime_state(browser: Any) -> str:  # noqa: F811
    return str(browser.execute_script("return document.body.dataset.realtime || ''"))


def test_the_page_joins_the_private_topic_as_the_user_and_keeps_polling_while_it_is_silent(
    browser: Any,  # noqa: F811
    config: Config,
    group: db.Conn,
    stub: RealtimeStub,
    supabase_js: str,
) -> None:
    from selenium.webdriver.common.by import By

    # Jobs running: the endpoint asks for a poll every second.
    group.execute(
        "update thumbq.jobs set status = 'processing', started_at = now(),"
        " lease_expires_at = now() + interval '1 hour', attempts = 1 where group_id = %s",
        [GROUP],
    )
    with live_app(_page_config(config, stub, supabase_js)) as server:
        polls = _count_polls(server.app)
        browser.get(f"{server.url}/progress?group_id={GROUP}#key={ALICE}")
        wait_until(lambda: _realtime_state(browser) == "live", 15)
        [join] = stub.joins
        # The group's private broadcast topic, joined with Alice's token, not the anon key.
        assert join["topic"] == TOPIC
        assert join["payload"]["config"]["private"] is True
        assert join["payload"]["access_token"] == ALICE
        # Subscribed, but Realtime says nothing: the page polls at the endpoint's pace (1 s),
        # not at the 15 s backstop a delivering channel allows.
        start = time.monotonic()
        time.sleep(6)
        silent = [t for t in polls if t > start]
        assert len(silent) >= 4, f"{len(silent)} polls in 6 s while Realtime was silent"
        assert "live (Realtime)" not in browser.find_element(By.ID, "mode").text

        # Realtime delivers a change: the page fetches it at once and relaxes its polling.
        group.execute(
            "update thumbq.jobs set status = 'completed', completed_at = now(),"
            " lease_expires_at = null where group_id = %s and source_key = 't/0.pdf'",
            [GROUP],
        )
        assert stub.broadcast(TOPIC, "progress", {"operation": "UPDATE"}) == 1
        # Within a few seconds even on a loaded CI machine (a browser's timers slow down there);
        # the mode below says the page heard Realtime, not a poll.
        wait_until(lambda: browser.find_element(By.ID, "count-completed").text == "1", 6, 0.05)
        wait_until(lambda: "live (Realtime)" in browser.find_element(By.ID, "mode").text, 6)
        heard = time.monotonic()
        time.sleep(4)
        assert len([t for t in polls if t > heard + 0.5]) <= 1, "polling did not relax"


def test_the_page_never_joins_with_the_admin_secret_or_as_anon(
    browser: Any,  # noqa: F811
    config: Config,
    group: db.Conn,
    stub: RealtimeStub,
    supabase_js: str,
) -> None:
    from selenium.webdriver.common.by import By

    with live_app(_page_config(config, stub, supabase_js)) as server:
        browser.get(f"{server.url}/progress?group_id={GROUP}#key={SECRET}")
        wait_until(lambda: browser.find_element(By.ID, "done-of-total").text == "0 of 4 files", 10)
        wait_until(lambda: _realtime_state(browser) == "off", 5)
        time.sleep(1)
    assert stub.joins == []


def test_a_refused_join_falls_back_to_polling(
    browser: Any,  # noqa: F811
    config: Config,
    group: db.Conn,
    supabase_js: str,
) -> None:
    from selenium.webdriver.common.by import By

    bob = token("bob")  # a valid user, but Realtime does not let him receive this topic
    refusing = RealtimeStub(accepted_tokens=set())
    group.execute("insert into thumbq.group_members values (%s, 'bob')", [GROUP])
    try:
        with live_app(_page_config(config, refusing, supabase_js)) as server:
            browser.get(f"{server.url}/progress?group_id={GROUP}#key={bob}")
            wait_until(lambda: _realtime_state(browser) == "failed", 15)
            assert refusing.joins and refusing.joins[0]["payload"]["access_token"] == bob
            assert "polling" in browser.find_element(By.ID, "mode").text
            wait_until(
                lambda: browser.find_element(By.ID, "done-of-total").text == "0 of 4 files", 10
            )
    finally:
        refusing.close()


# -- thumbq watch -------------------------------------------------------------------------------


def test_watch_joins_the_private_topic_with_the_users_token_and_follows_broadcasts(
    stub: RealtimeStub,
) -> None:
    opts = WatchOptions(
        api_url="http://127.0.0.1:9",  # no API: only Realtime can end this watch
        supabase_url=stub.url,
        supabase_anon_key=ANON,
        user_jwt=ALICE,
        timeout_s=30,
    )
    out, err = io.StringIO(), io.StringIO()
    result: dict[str, Any] = {}
    watcher = threading.Thread(
        target=lambda: result.update(code=follow_realtime(opts, GROUP, out, err))
    )
    watcher.start()
    wait_until(lambda: stub.subscribers(TOPIC) == 1, 15)
    [join] = stub.joins
    assert join["payload"]["access_token"] == ALICE and join["payload"]["config"]["private"]
    for done in (1, 4):
        record = {
            "group_id": GROUP,
            "total": 4,
            "pending": 4 - done,
            "processing": 0,
            "completed": done,
        }
        stub.broadcast(TOPIC, "progress", {"operation": "UPDATE", "record": record})
    watcher.join(30)
    assert result.get("code") == 0, err.getvalue()
    assert "25.0%  1/4" in out.getvalue() and "100.0%  4/4" in out.getvalue()


def test_watch_without_a_users_token_never_connects_as_anon(stub: RealtimeStub) -> None:
    opts = WatchOptions(
        api_url="http://127.0.0.1:9",
        supabase_url=stub.url,
        supabase_anon_key=ANON,
        user_jwt=None,
        timeout_s=5,
    )
    err = io.StringIO()
    assert watch(opts, GROUP, io.StringIO(), err) == 1
    assert "needs a group member's access token in THUMBQ_USER_JWT" in err.getvalue()
    assert stub.joins == []
