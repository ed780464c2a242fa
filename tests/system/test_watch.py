"""`thumbq watch GROUP` against the real app on loopback, and over Supabase Realtime (opt-in).

The polling path runs for real: the app serves the progress endpoint while batches run in a
thread, and the command follows the group until it is done. The Realtime path needs a live
Supabase project and is skipped, with the reason, unless its variables are set.
"""

from __future__ import annotations

import io
import itertools
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import jwt
import pytest

from tests.support.liveapp import call, live_app, put_samples
from tests.support.pgtools import require_module
from worker.cli import main as cli_main
from worker.engine import db
from worker.engine.config import Config
from worker.local.watch import ProgressClient, WatchOptions, follow_realtime, poll
from worker.storage import open_storage

SECRET = "watch-test-secret-0123456789"
JWT_SECRET = "watch-test-jwt-secret-0123456789abcdef0123"


@pytest.fixture
def app_config(config: Config) -> Config:
    return config.with_(cron_secret=SECRET, jwt_secret=JWT_SECRET, budget_ms=5000, buffer_ms=500)


@pytest.fixture
def watch_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """An environment without Supabase or a user token, whatever the machine has."""
    for name in ("SUPABASE_URL", "SUPABASE_ANON_KEY", "THUMBQ_USER_JWT", "CRON_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("THUMBQ_CRON_SECRET", SECRET)
    yield monkeypatch


def _token(sub: str) -> str:
    claims = {"sub": sub, "aud": "authenticated", "role": "authenticated", "exp": time.time() + 600}
    return jwt.encode(claims, JWT_SECRET, algorithm="HS256")


def _enqueue(url: str, config: Config, group: str, good: int, broken: int = 0) -> None:
    items = put_samples(open_storage(config), f"{group}/", good=good, broken=broken)
    items = [{**item, "group_id": group} for item in items]
    status, body, _ = call("POST", url + "/api/thumbnails/enqueue", SECRET, {"items": items})
    assert status == 202, body


def _batches_until_done(url: str, errors: list[str]) -> None:
    """Small batches one after another, with pauses, so the watcher sees several changes."""
    for _ in range(30):
        status, body, _ = call(
            "POST", url + "/api/thumbnails/batch-generate", SECRET, {"max_items": 2}
        )
        if status != 200 or body is None:
            errors.append(f"batch answered {status}: {body}")
            return
        if body["remaining"] == 0:
            return
        time.sleep(0.3)
    errors.append("the batches did not drain the group")


def test_watch_polls_the_api_until_the_group_is_done(
    app_config: Config, watch_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with live_app(app_config) as server:
        _enqueue(server.url, app_config, "watched", good=5, broken=1)
        watch_env.setenv("THUMBQ_API_URL", server.url)
        errors: list[str] = []
        worker = threading.Thread(target=_batches_until_done, args=(server.url, errors))
        worker.start()
        try:
            code = cli_main(["watch", "watched", "--timeout", "120"])
        finally:
            worker.join()
    out, err = capsys.readouterr()
    assert errors == []
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) >= 2, out  # it followed the group, not just its end
    assert lines[0].startswith("[") and "/6" in lines[0]
    assert " 100.0%  6/6" in lines[-1] and "completed 5  failed 1" in lines[-1]
    # One line per change: never the same line twice in a row.
    assert all(a != b for a, b in itertools.pairwise(lines))


def test_watch_uses_the_user_token_and_rls_decides(
    app_config: Config, conn: db.Conn, watch_env: pytest.MonkeyPatch
) -> None:
    with live_app(app_config) as server:
        _enqueue(server.url, app_config, "members-only", good=2)
        conn.execute("insert into thumbq.group_members values ('members-only', 'alice')")
        status, _, _ = call("POST", server.url + "/api/thumbnails/batch-generate", SECRET, {})
        assert status == 200

        def run(token: str) -> tuple[int, str, str]:
            out, err = io.StringIO(), io.StringIO()
            opts = WatchOptions(api_url=server.url, api_token=token, timeout_s=30)
            return poll(opts, "members-only", out, err), out.getvalue(), err.getvalue()

        code, out, _ = run(_token("alice"))
        assert code == 0 and "100.0%  2/2" in out
        # Someone else's group looks like no group at all.
        code, out, err = run(_token("mallory"))
        assert (code, out) == (1, "") and "no group 'members-only'" in err
        code, out, err = run("not-the-secret-and-not-a-jwt")
        assert code == 1 and "the API refused" in err


def test_watch_sends_if_none_match_and_an_unchanged_group_costs_a_304(
    app_config: Config, watch_env: pytest.MonkeyPatch
) -> None:
    with live_app(app_config) as server:
        _enqueue(server.url, app_config, "etag", good=1)
        client = ProgressClient(server.url, SECRET)
        first = client.fetch("etag")
        again = client.fetch("etag")
        call("POST", server.url + "/api/thumbnails/batch-generate", SECRET, {})
        changed = client.fetch("etag")
    assert first.status == 200 and first.body is not None
    # The server's advice is what the watcher waits: 5 s while jobs only wait for a batch.
    assert first.poll_after_ms == first.body["poll_after_ms"] == 5000
    assert (again.status, again.body, again.poll_after_ms) == (304, None, 5000)
    assert changed.status == 200 and changed.body is not None
    assert changed.body["completed"] == 1 and changed.poll_after_ms == 30000


def test_watch_of_an_unknown_group_exits_1(
    app_config: Config, watch_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with live_app(app_config) as server:
        watch_env.setenv("THUMBQ_API_URL", server.url)
        assert cli_main(["watch", "no-such-group"]) == 1
    assert "no group 'no-such-group'" in capsys.readouterr().err


def test_watch_falls_back_to_polling_when_the_realtime_subscription_fails(
    app_config: Config, watch_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    require_module("supabase", "the supabase library: pip install -e '.[test]'")
    from tests.support.pgbouncer import free_port

    with live_app(app_config) as server:
        _enqueue(server.url, app_config, "fallback", good=1)
        call("POST", server.url + "/api/thumbnails/batch-generate", SECRET, {})
        watch_env.setenv("THUMBQ_API_URL", server.url)
        # Nothing listens there: the Realtime connection is refused.
        watch_env.setenv("SUPABASE_URL", f"http://127.0.0.1:{free_port()}")
        watch_env.setenv("SUPABASE_ANON_KEY", _token("anon"))
        watch_env.setenv("THUMBQ_USER_JWT", _token("alice"))
        watch_env.setenv("THUMBQ_CRON_SECRET", SECRET)
        # The fallback polls with alice's token (a user's token goes before the admin secret),
        # and she is no member of the group: to her it does not exist.
        assert cli_main(["watch", "fallback", "--timeout", "30"]) == 1
        watch_env.delenv("THUMBQ_USER_JWT")
        assert cli_main(["watch", "fallback", "--timeout", "30"]) == 0
    out, err = capsys.readouterr()
    assert "Realtime subscription failed" in err and "polling the API instead" in err
    assert "needs a group member's access token in THUMBQ_USER_JWT" in err
    assert "100.0%  1/1" in out


# -- Supabase Realtime, live (opt-in) ---------------------------------------------------------


# Skipped by conftest unless pgtools.SUPABASE_LIVE_VARS are set (in CI too: no project there).
@pytest.mark.supabase
def test_watch_follows_the_private_group_topic_over_supabase_realtime() -> None:
    require_module("supabase", "the supabase library: pip install -e '.[supabase]'")
    user_jwt = os.environ["THUMBQ_USER_JWT"]
    sub = jwt.decode(user_jwt, options={"verify_signature": False})["sub"]
    group = f"watch-live-{uuid.uuid4().hex[:8]}"
    opts = WatchOptions(
        api_url="http://127.0.0.1:9",  # no snapshot: only Realtime can end this watch
        supabase_url=os.environ["SUPABASE_URL"],
        supabase_anon_key=os.environ["SUPABASE_ANON_KEY"],
        user_jwt=user_jwt,
        timeout_s=60,
    )
    out, err = io.StringIO(), io.StringIO()
    result: dict[str, Any] = {}
    with db.connect(os.environ["SUPABASE_DB_URL"]) as conn:
        conn.execute("insert into thumbq.group_members values (%s, %s)", [group, sub])
        try:
            for key in ("a.jpg", "b.jpg"):
                conn.execute(
                    "select * from thumbq.enqueue(%s, 'live', %s)", [f"{group}/{key}", group]
                )
            watcher = threading.Thread(
                target=lambda: result.update(code=follow_realtime(opts, group, out, err))
            )
            watcher.start()
            time.sleep(5)  # let the channel join before the change it must see
            conn.execute("select thumbq.cancel(%s)", [group])
            watcher.join(90)
        finally:
            conn.execute("delete from thumbq.jobs where group_id = %s", [group])
            conn.execute("delete from thumbq.groups where group_id = %s", [group])
            conn.execute("delete from thumbq.group_members where group_id = %s", [group])
    assert result.get("code") == 0, err.getvalue()
    assert "100.0%  2/2" in out.getvalue() and "cancelled 2" in out.getvalue()
