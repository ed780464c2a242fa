"""The progress page in a real browser (Debian's chromium, headless, through chromedriver)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import chromium
from tests.support.liveapp import call, put_samples, wait_until
from tests.support.pgbouncer import free_port
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.local.server import ServerThread
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.task import render_options

SECRET = "progress-page-secret-0123456789"
# THUMBQ_UPDATE_SCREENSHOT=1 copies the page that `thumbq up`'s link opens here, for the README.
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "progress.png"
# A file whose key looks like markup: the page must show it as text.
HOSTILE_KEY = "uploads/<img src=x onerror=window.pwned=1>.jpg"


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium("1000,900") as driver:
        yield driver


def _record(app: Any) -> list[tuple[str, str | None, int]]:
    """Record (path, If-None-Match, status) of every request the app answers."""
    seen: list[tuple[str, str | None, int]] = []
    inner = app.wsgi_app

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        def start(status: str, headers: Any, exc_info: Any = None) -> Any:
            seen.append((environ["PATH_INFO"], environ.get("HTTP_IF_NONE_MATCH"), int(status[:3])))
            return start_response(status, headers, exc_info)

        return inner(environ, start)

    app.wsgi_app = wsgi
    return seen


def _drain_in_background(config: Config, group: str, stop: threading.Event) -> threading.Thread:
    """Run real batches, a little apart so that the page sees the bar move, until settled."""
    from worker.thumbnails.render.process import RenderPool

    def work() -> None:
        storage = open_storage(config)
        with (
            db.connect(db.database_url(config)) as conn,
            RenderPool(render_options(config), config.concurrency, config.render_memory_mb) as pool,
        ):
            q = Queue(conn)
            while not stop.is_set():
                run_batch(config, conn, storage, pool)
                p = q.progress(group) or {}
                if p.get("pending", 0) + p.get("processing", 0) == 0:
                    return
                # Apart enough that a page polling every 5 s while work waits sees it move.
                stop.wait(1.2)

    t = threading.Thread(target=work, name="batches", daemon=True)
    t.start()
    return t


def test_progress_page_follows_batches_to_100_percent_and_lists_failures(
    browser: Any, tmp_path: Path, db_url: str
) -> None:
    from selenium.webdriver.common.by import By

    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_BUDGET_MS": "3000",
            "THUMBQ_BUFFER_MS": "500",
            "THUMBQ_BATCH_SIZE": "3",
            # Realtime configured, but the key is the admin secret, not a user's token: the page
            # does not join the group's private topic (tests/system/test_realtime.py), it polls.
            "SUPABASE_URL": "https://project-ref.supabase.co",
            "SUPABASE_ANON_KEY": "anon-key-for-the-test",
        }
    )
    storage = open_storage(config)
    group = "event-2026-spring"
    items = put_samples(storage, "slides/", good=18, broken=2)
    bad = storage.put(HOSTILE_KEY, b"\xff\xd8\xff\xe0 not really a jpeg", "image/jpeg")
    items.append({"source_key": HOSTILE_KEY, "etag": bad.etag, "content_type": "image/jpeg"})
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, group)

    from api import create_app

    app = create_app(config)
    app.config["THUMBQ_SUPABASE_JS_URL"] = f"http://127.0.0.1:{free_port()}/supabase-js.mjs"
    seen = _record(app)
    stop = threading.Event()
    server = ServerThread(app).start()
    try:
        page = f"{server.url}/progress?group_id={group}"
        status, _, headers = call("GET", page)
        assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]

        # The secret comes in the fragment (never sent to the server) and moves to sessionStorage.
        browser.get(f"{page}#key={SECRET}")
        wait_until(lambda: browser.find_element(By.ID, "done-of-total").text == "0 of 21 files", 10)
        assert browser.execute_script("return location.hash") == ""
        assert browser.execute_script("return sessionStorage.getItem('thumbq.key')") == SECRET
        wait_until(
            lambda: (
                browser.find_element(By.TAG_NAME, "body").get_attribute("data-realtime") == "off"
            ),
            10,
        )
        # Coming back to the tab polls at once, with the ETag: nothing changed, so 304.
        browser.execute_script("document.dispatchEvent(new Event('visibilitychange'))")
        wait_until(lambda: any(s == 304 for _, _, s in seen), 5)

        worker = _drain_in_background(config, group, stop)
        bar = browser.find_element(By.CSS_SELECTOR, ".bar")
        values: list[float] = []

        def full() -> bool:
            values.append(float(bar.get_attribute("aria-valuenow") or 0))
            return values[-1] == 100

        wait_until(full, 40, 0.05)
        worker.join(10)
        assert any(0 < v < 100 for v in values), "the bar jumped straight to 100%"
        assert browser.find_element(By.ID, "percent").text == "100%"
        assert browser.find_element(By.ID, "count-completed").text == "18"
        assert browser.find_element(By.ID, "count-failed").text == "3"
        assert browser.find_element(By.ID, "eta").text == "finished"

        rows = wait_until(
            lambda: (
                (r := browser.find_elements(By.CSS_SELECTOR, "#failures-body tr"))
                and len(r) == 3
                and r
            ),
            10,
        )
        text = "\n".join(r.text for r in rows)
        assert "corrupt_input" in text
        assert HOSTILE_KEY in text  # shown as text ...
        assert browser.find_elements(By.CSS_SELECTOR, "#failures-body img") == []  # ... not markup
        assert browser.execute_script("return window.pwned === undefined")

        progress_requests = [r for r in seen if r[0] == "/api/thumbnails/progress"]
        assert all(inm for _, inm, _ in progress_requests[1:])
        assert {s for _, _, s in progress_requests} <= {200, 304}

        # Retry failed: the button posts with the kept secret; the group goes back to work.
        browser.find_element(By.ID, "retry").click()
        wait_until(
            lambda: browser.find_element(By.ID, "retry-result").text == "3 job(s) queued again.", 10
        )
        wait_until(lambda: browser.find_element(By.ID, "count-pending").text == "3", 10)
        assert float(bar.get_attribute("aria-valuenow") or 0) < 100
        worker = _drain_in_background(config, group, stop)
        wait_until(lambda: browser.find_element(By.ID, "percent").text == "100%", 20)
        worker.join(10)
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#failures-body tr")) == 3, 5)
        browser.execute_script("document.getElementById('retry-result').textContent = ''")
        browser.set_window_size(1000, 780)
        time.sleep(0.5)  # the bar's width transition
        shot = tmp_path / "progress.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        stop.set()
        server.close()
        app.extensions["thumbq"].close()


def test_progress_page_asks_for_the_key_and_shows_no_group_without_one(
    browser: Any, tmp_path: Path, db_url: str
) -> None:
    from selenium.webdriver.common.by import By

    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CRON_SECRET": SECRET,
        }
    )
    from api import create_app

    app = create_app(config)
    server = ServerThread(app).start()
    try:
        browser.get(f"{server.url}/progress")
        assert browser.find_element(By.ID, "group-form").is_displayed()
        browser.get(f"{server.url}/progress?group_id=nothing-here")
        form = browser.find_element(By.ID, "key-form")
        assert form.is_displayed()
        browser.find_element(By.ID, "key-input").send_keys("not-the-secret")
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_until(lambda: "not the admin secret" in browser.find_element(By.ID, "message").text, 5)
        browser.find_element(By.ID, "key-input").send_keys(SECRET)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_until(lambda: "No group" in browser.find_element(By.ID, "message").text, 5)
        assert not form.is_displayed()
    finally:
        server.close()
        app.extensions["thumbq"].close()


def test_failures_endpoint_has_the_progress_endpoints_auth_and_its_documented_shape(
    config: Config, conn: db.Conn
) -> None:
    import jwt
    from jsonschema import Draft202012Validator

    from api import create_app
    from api.contract import spec

    jwt_secret = "failures-jwt-secret-0123456789abcdef0123"
    config = config.with_(cron_secret=SECRET, jwt_secret=jwt_secret)
    storage = open_storage(config)
    enqueue_keys(conn, storage, config, put_samples(storage, "f/", good=1, broken=2), "fg")
    from worker.thumbnails.render.process import RenderPool

    with RenderPool(render_options(config), 1, config.render_memory_mb) as pool:
        run_batch(config, conn, storage, pool)
    conn.execute("insert into thumbq.group_members values ('fg', 'ann')")
    app = create_app(config)
    try:
        client = app.test_client()
        admin = {"Authorization": f"Bearer {SECRET}"}

        def user(sub: str) -> dict[str, str]:
            claims = {"sub": sub, "aud": "authenticated", "exp": time.time() + 60}
            return {"Authorization": "Bearer " + jwt.encode(claims, jwt_secret, "HS256")}

        r = client.get("/api/thumbnails/failures?group_id=fg&limit=5", headers=admin)
        assert r.status_code == 200
        body = r.get_json()
        doc = spec()
        schema = doc["paths"]["/api/thumbnails/failures"]["get"]["responses"]["200"]
        body_schema = schema["content"]["application/json"]["schema"]
        Draft202012Validator({**body_schema, "components": doc["components"]}).validate(body)
        assert [f["error_code"] for f in body["failures"]] == ["corrupt_input"] * 2
        assert (
            client.get("/api/thumbnails/failures?group_id=fg", headers=user("ann")).status_code
            == 200
        )
        for headers, query, status in (
            ({}, "group_id=fg", 401),
            ({"Authorization": "Bearer wrong"}, "group_id=fg", 401),
            (user("bob"), "group_id=fg", 404),
            (admin, "group_id=nope", 404),
            (admin, "group_id=fg&limit=0", 400),
            (admin, "group_id=fg&limit=abc", 400),
            (admin, "group_id=<script>", 400),
            (admin, "", 400),
        ):
            r = client.get(f"/api/thumbnails/failures?{query}", headers=headers)
            assert r.status_code == status, (query, r.get_json())
            assert set(r.get_json()["error"]) == {"code", "message"}
    finally:
        app.extensions["thumbq"].close()


LONG_KEY = "uploads/2026/spring-conference/keynote-presentation-final-version-speaker-notes.pdf"

# Where a cell's text wraps: "x|y" for each line break between the characters x and y.
_LINE_BREAKS_JS = """
const walker = document.createTreeWalker(arguments[0], NodeFilter.SHOW_TEXT);
const chars = [];
while (walker.nextNode()) {
  const node = walker.currentNode;
  for (let i = 0; i < node.length; i++) {
    const range = document.createRange();
    range.setStart(node, i);
    range.setEnd(node, i + 1);
    const rect = range.getClientRects()[0];
    if (rect) chars.push([node.data[i], rect.top]);
  }
}
const breaks = [];
for (let i = 1; i < chars.length; i++) {
  if (chars[i][1] > chars[i - 1][1] + 2) breaks.push(chars[i - 1][0] + "|" + chars[i][0]);
}
return breaks;
"""


def test_progress_page_shows_each_outcome_wraps_names_between_parts_and_promises_only_real_retries(
    browser: Any, tmp_path: Path, db_url: str
) -> None:
    # Regressions (issue 10): the bar was all green at 100% though files failed; file names
    # broke mid-word (word-break: break-all); a permanent failure read "Attempts 1 / 3", as if
    # a retry would come; a file missing from storage was not listed at all.
    from selenium.webdriver.common.by import By

    from worker.thumbnails.render.process import RenderPool

    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "1",
            "THUMBQ_CRON_SECRET": SECRET,
        }
    )
    storage = open_storage(config)
    group = "split"
    items = put_samples(storage, "ok/", good=4)
    broken = storage.put(LONG_KEY, b"%PDF-1.7 cut short", "application/pdf")
    items.append({"source_key": LONG_KEY, "etag": broken.etag, "content_type": "application/pdf"})
    text = storage.put("notes/readme.txt", b"just text", "text/plain")
    items.append({"source_key": "notes/readme.txt", "etag": text.etag})
    items.append({"source_key": "gone/deleted-before-the-batch.jpg", "etag": "v1"})
    storage.put("flaky/photo.jpg", b"\xff\xd8\xff", "image/jpeg")
    items.append({"source_key": "flaky/photo.jpg", "etag": "e1", "content_type": "image/jpeg"})
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, group)
        q = Queue(conn)
        # The flaky photo fails once with a transient error, through the real transitions.
        claim = q.claim("test-worker", 100, 60)
        flaky = next(j for j in claim.jobs if j.source_key == "flaky/photo.jpg")
        q.fail("test-worker", flaky, "storage_error", "storage answered 503", permanent=False)
        q.release("test-worker", [j.id for j in claim.jobs if j.id != flaky.id])
        with RenderPool(render_options(config), 1, config.render_memory_mb) as pool:
            run_batch(config, conn, storage, pool)
        p = q.progress(group)
    assert p is not None
    assert (p["completed"], p["failed"], p["unsupported"], p["cancelled"], p["pending"]) == (
        4,
        1,
        1,
        1,
        1,
    )

    from api import create_app

    app = create_app(config)
    server = ServerThread(app).start()
    try:
        browser.set_window_size(1000, 900)
        browser.get(f"{server.url}/progress?group_id={group}#key={SECRET}")
        rows = wait_until(
            lambda: (
                (r := browser.find_elements(By.CSS_SELECTOR, "#failures-body tr"))
                and len(r) == 4
                and r
            ),
            10,
        )
        by_key = {r.find_element(By.CSS_SELECTOR, "td.key").text.replace("\n", ""): r for r in rows}
        assert set(by_key) == {
            LONG_KEY,
            "notes/readme.txt",
            "gone/deleted-before-the-batch.jpg",
            "flaky/photo.jpg",
        }

        def cells(key: str) -> dict[str, str]:
            tds = by_key[key].find_elements(By.TAG_NAME, "td")
            return {"status": tds[1].text, "why": tds[2].text, "retry": tds[3].text}

        missing = cells("gone/deleted-before-the-batch.jpg")
        assert missing["status"] == "cancelled" and "source_missing" in missing["why"]
        for key in (LONG_KEY, "notes/readme.txt", "gone/deleted-before-the-batch.jpg"):
            retry = cells(key)["retry"]
            assert retry.startswith("no retry"), (key, retry)
            assert " of 3" not in retry and "/ 3" not in retry
        flaky_cells = cells("flaky/photo.jpg")
        assert flaky_cells["status"] == "retrying"
        assert flaky_cells["retry"].startswith("attempt 2 of 3 at ")

        # The long name wraps, and only right after a separator.
        key_cell = by_key[LONG_KEY].find_element(By.CSS_SELECTOR, "td.key")
        breaks = browser.execute_script(_LINE_BREAKS_JS, key_cell)
        assert breaks, "the long name should wrap in its column"
        assert all(b[0] in "/-_." for b in breaks), breaks

        # The bar: each outcome's share of the 8 files, side by side.
        def share(name: str) -> float:
            return float(
                browser.execute_script(
                    "const s = document.getElementById(arguments[0]);"
                    "return s.getBoundingClientRect().width"
                    " / s.parentElement.getBoundingClientRect().width;",
                    f"seg-{name}",
                )
            )

        time.sleep(0.6)  # the segments' width transition
        shares = {s: share(s) for s in ("completed", "failed", "unsupported", "cancelled")}
        assert abs(shares["completed"] - 4 / 8) < 0.02, shares
        for name in ("failed", "unsupported", "cancelled"):
            assert abs(shares[name] - 1 / 8) < 0.02, shares
        assert browser.find_element(By.ID, "percent").text == "87.5%"
        assert browser.save_screenshot(str(tmp_path / "split.png"))
    finally:
        server.close()
        app.extensions["thumbq"].close()


def test_the_link_thumbq_up_prints_opens_the_page_signed_in_read_only_with_a_gallery(
    browser: Any, tmp_path: Path, db_url: str
) -> None:
    # Regression (issue 10): `thumbq up` printed a link that asked for a key, and the admin
    # secret beside it. Now the link carries a read-only page token in its fragment, and the
    # page shows the finished thumbnails, a page at a time as the grid scrolls.
    import re

    from selenium.webdriver.common.by import By

    from tests.support.clirun import thumbq_running, user_env

    home = tmp_path / "home"
    storage_url = (tmp_path / "storage").as_uri()
    config = Config.from_env(
        {"THUMBQ_HOME": str(home), "DATABASE_URL": db_url, "THUMBQ_STORAGE_URL": storage_url}
    )
    storage = open_storage(config)
    # Older material first, then the demo's varied files (slides, a report, photos, a PNG, a
    # GIF, one broken and one unsupported): the newest jobs head the grid of the screenshot.
    items = put_samples(storage, "archive/", good=46)
    from worker.local.samples import demo_files

    for name, (data, content_type) in demo_files().items():
        storage.put(f"talks/{name}", data, content_type)
        items.append({"source_key": f"talks/{name}"})
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "conference-2026")
    env = user_env(
        tmp_path,
        DATABASE_URL=db_url,
        THUMBQ_HOME=str(home),
        THUMBQ_STORAGE_URL=storage_url,
        THUMBQ_CONCURRENCY="2",
    )
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C") as up:
        output = "\n".join(up.out)
        secret = (home / "cron_secret").read_text().strip()
        assert secret not in output + "\n".join(up.err)
        link = re.search(r"progress page: (\S+)", output)
        assert link, output
        url = link.group(1)
        assert "/progress?group_id=conference-2026#key=tqp.1." in url

        browser.set_window_size(1000, 900)
        browser.get(url)
        wait_until(lambda: browser.find_element(By.ID, "percent").text == "100%", 60)
        assert browser.execute_script("return location.hash") == ""
        kept = browser.execute_script("return sessionStorage.getItem('thumbq.key')")
        assert kept.startswith("tqp.1.") and secret not in kept
        assert not browser.find_element(By.ID, "key-form").is_displayed()

        # The gallery: the first page of 48, then the rest as its end scrolls into view.
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#grid li")) == 48, 15)
        browser.execute_script("document.getElementById('grid-more').scrollIntoView()")
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#grid li")) == 55, 15)
        browser.execute_script("window.scrollTo(0, 0)")
        loaded = wait_until(
            lambda: browser.execute_script(
                "return [...document.querySelectorAll('#grid img')].slice(0, 6)"
                ".every(i => i.complete && i.naturalWidth > 0)"
            ),
            15,
        )
        assert loaded
        names = [e.get_attribute("title") for e in browser.find_elements(By.CSS_SELECTOR, ".name")]
        assert len(set(names)) == 55 and names[0].startswith("talks/")
        assert not [n for n in names if "broken/" in n]

        wait_until(
            lambda: len(browser.find_elements(By.CSS_SELECTOR, "#failures-body tr")) == 2, 10
        )
        browser.set_window_size(1000, 1150)
        time.sleep(1.0)  # the bar's transition, and the images in view
        shot = tmp_path / "progress.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        # The README's picture is refreshed on request only: a test run leaves the tree clean.
        if os.environ.get("THUMBQ_UPDATE_SCREENSHOT") == "1":
            shutil.copyfile(shot, SCREENSHOT)

        # Read-only: retrying needs the admin secret, which the link does not carry.
        browser.find_element(By.ID, "retry").click()
        wait_until(lambda: browser.find_element(By.ID, "key-form").is_displayed(), 10)
        assert "admin secret" in browser.find_element(By.ID, "message").text
        browser.find_element(By.ID, "key-input").send_keys(secret)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_until(lambda: not browser.find_element(By.ID, "key-form").is_displayed(), 10)
        browser.find_element(By.ID, "retry").click()
        wait_until(
            lambda: browser.find_element(By.ID, "retry-result").text == "1 job(s) queued again.",
            10,
        )
        wait_until(lambda: browser.find_element(By.ID, "count-pending").text == "1", 10)
    assert up.proc.returncode == 0, "\n".join(up.err[-20:])
