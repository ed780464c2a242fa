"""The operator page (`GET /operator`) in a real browser (Debian's chromium, headless, through
chromedriver), against a real database with real batches, and its JSON endpoints behind the
admin secret.

`THUMBQ_UPDATE_SCREENSHOT=1 python -m pytest tests/system/test_operator_page.py -n 0 -k browser`
writes docs/operator.png (docs/operations.md shows it).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import chromium
from tests.support.liveapp import call, live_app, put_samples, wait_until
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.task import render_options

SECRET = "operator-page-secret-0123456789"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "operator.png"
HOSTILE_KEY = "dead/<img src=x onerror=window.pwned=1>.jpg"


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium("1100,1500") as driver:
        yield driver


def _config(tmp_path: Path, db_url: str, secret: str | None = SECRET) -> Config:
    env = {
        "THUMBQ_HOME": str(tmp_path / "home"),
        "DATABASE_URL": db_url,
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_CONCURRENCY": "2",
        "THUMBQ_BUDGET_MS": "8000",
        "THUMBQ_BUFFER_MS": "500",
    }
    if secret:
        env["THUMBQ_CRON_SECRET"] = secret
    return Config.from_env(env)


def _operators_day(config: Config, db_url: str) -> dict[str, int]:
    """A real batch over photos (two broken), then a job dead-lettered after its last attempt,
    one running, three waiting. Returns the ids of the dead and the running job."""
    from worker.thumbnails.render.process import RenderPool

    storage = open_storage(config)
    items = put_samples(storage, "spring/", good=8, broken=2)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "event-spring")
        with RenderPool(render_options(config), 2, config.render_memory_mb) as pool:
            run_batch(config, conn, storage, pool)
        q = Queue(conn, max_attempts=1)
        q.enqueue_files([{"source_key": HOSTILE_KEY, "etag": "e1"}], "uploads")
        q.enqueue_files([{"source_key": "live/keynote.pdf", "etag": "e1"}], "uploads")
        claim = q.claim("worker-test", 2, 600)
        by_key = {j.source_key: j for j in claim.jobs}
        dead, live = by_key[HOSTILE_KEY], by_key["live/keynote.pdf"]
        q.fail("worker-test", dead, "storage_timeout", "storage did not answer in 20 s", False)
        q.enqueue_files(
            [{"source_key": f"wait/{i}.jpg", "etag": "e1"} for i in range(3)], "uploads"
        )
    return {"dead": dead.id, "live": live.id}


def _job(db_url: str, job_id: int) -> dict[str, Any]:
    with db.connect(db_url) as conn:
        row = conn.execute(
            "select status, attempts, dlq_msg_id, msg_id,"
            " (select count(*) from pgmq.q_thumbq_jobs m where (m.message->>'job_id')::bigint"
            "   = j.id) as messages,"
            " (select count(*) from pgmq.q_thumbq_dlq m where (m.message->>'job_id')::bigint"
            "   = j.id) as dead_letters"
            " from thumbq.jobs j where id = %s",
            [job_id],
        ).fetchone()
    assert row is not None
    return dict(row)


def test_operator_page_in_a_browser_shows_queues_failures_and_replays_and_cancels(
    browser: Any, tmp_path: Path, db_url: str
) -> None:
    from selenium.webdriver.common.by import By

    config = _config(tmp_path, db_url)
    ids = _operators_day(config, db_url)
    assert _job(db_url, ids["dead"])["status"] == "failed"
    with live_app(config) as server:
        status, _, headers = call("GET", server.url + "/operator")
        assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]

        # Without the secret the page reads nothing and asks for it.
        browser.get(server.url + "/operator")
        wait_until(lambda: browser.find_element(By.ID, "key-form").is_displayed(), 10)
        assert "THUMBQ_CRON_SECRET" in browser.find_element(By.ID, "key-form").text
        browser.find_element(By.ID, "key-input").send_keys(SECRET)
        browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
        wait_until(
            lambda: browser.find_element(By.TAG_NAME, "body").get_attribute("data-loaded"), 10
        )
        assert not browser.find_element(By.ID, "key-form").is_displayed()
        assert browser.execute_script("return sessionStorage.getItem('thumbq.admin')") == SECRET

        # The work queue: three waiting, one running; one dead letter.
        queue = browser.find_element(By.CSS_SELECTOR, 'tr[data-queue="thumbq_jobs"]')
        assert queue.text.split()[:3] == ["thumbq_jobs", "3", "1"]
        dlq = browser.find_element(By.CSS_SELECTOR, 'tr[data-queue="thumbq_dlq"] .waiting')
        assert dlq.text == "1"
        failures = browser.find_element(By.ID, "failures-body").text
        assert "corrupt_input" in failures and "storage_timeout" in failures
        assert "spring/" in failures  # an example file of the broken ones
        assert HOSTILE_KEY in failures  # shown as text, not markup
        assert browser.execute_script("return window.pwned === undefined")
        bars = browser.find_elements(By.CSS_SELECTOR, "#chart rect.completed")
        assert bars, "the throughput chart shows the batch's completed jobs"
        runs = browser.find_element(By.ID, "runs-body").text
        assert "8" in runs
        _screenshot(browser, tmp_path)

        # Replay: the dead letter comes back to pending with fresh attempts and one message.
        row = browser.find_element(By.CSS_SELECTOR, f'#dlq-body tr[data-job="{ids["dead"]}"]')
        row.find_element(By.CSS_SELECTOR, "button.replay").click()
        wait_until(
            lambda: (
                browser.find_element(By.ID, "dlq-result").text
                == "1 job(s) queued again with fresh attempts."
            ),
            10,
        )
        wait_until(lambda: browser.find_element(By.ID, "dlq-empty").is_displayed(), 10)
        job = _job(db_url, ids["dead"])
        assert job["status"] == "pending" and job["attempts"] == 0
        assert (job["messages"], job["dead_letters"], job["dlq_msg_id"]) == (1, 0, None)

        # Cancel: the running job is cancelled.
        row = browser.find_element(By.CSS_SELECTOR, f'#running-body tr[data-job="{ids["live"]}"]')
        row.find_element(By.CSS_SELECTOR, "button.cancel").click()
        wait_until(
            lambda: (
                browser.find_element(By.ID, "cancel-result").text == f"Job {ids['live']} cancelled."
            ),
            10,
        )
        wait_until(lambda: browser.find_element(By.ID, "running-empty").is_displayed(), 10)
        assert _job(db_url, ids["live"])["status"] == "cancelled"
        wait_until(
            lambda: (
                browser.find_element(By.CSS_SELECTOR, 'tr[data-queue="thumbq_jobs"] .waiting').text
                == "4"
            ),  # three waiting and the replayed one
            10,
        )
        failures = browser.find_element(By.ID, "failures-body").text
        assert "cancelled" not in failures  # a cancel on request is no failure


def _screenshot(browser: Any, tmp_path: Path) -> None:
    """The whole page as it is now; with THUMBQ_UPDATE_SCREENSHOT=1 also docs/operator.png."""
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1100, int(height) + 120)
    time.sleep(0.3)
    shot = tmp_path / "operator.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if os.environ.get("THUMBQ_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, SCREENSHOT)


def test_operator_endpoints_answer_401_without_the_secret_and_503_without_one_configured(
    tmp_path: Path, db_url: str
) -> None:
    with live_app(_config(tmp_path, db_url)) as server:
        for method, path, body in (
            ("GET", "/api/ops/overview", None),
            ("POST", "/api/ops/dlq/replay", {"all": True}),
            ("POST", "/api/jobs/1/cancel", {}),
        ):
            for token in (None, "not-the-secret"):
                status, answer, _ = call(method, server.url + path, token, body)
                assert status == 401, (path, token, answer)
                assert answer and answer["error"]["code"] == "unauthorized"
    with live_app(_config(tmp_path, db_url, secret=None)) as server:
        for method, path, body in (
            ("GET", "/api/ops/overview", None),
            ("POST", "/api/ops/dlq/replay", {"all": True}),
        ):
            status, answer, _ = call(method, server.url + path, "anything", body)
            assert status == 503 and answer and answer["error"]["code"] == "not_configured"


def test_replay_refuses_bad_bodies_and_skips_jobs_that_are_no_dead_letters(
    tmp_path: Path, db_url: str
) -> None:
    config = _config(tmp_path, db_url)
    with db.connect(db_url) as conn:
        q = Queue(conn, max_attempts=1)
        rows = q.enqueue_files([{"source_key": f"d/{i}.jpg", "etag": "e"} for i in range(3)], "g")
        claim = q.claim("w", 3, 600)
        for job in claim.jobs[:2]:
            q.fail("w", job, "storage_timeout", "slow", False)
        waiting = q.enqueue_files([{"source_key": "d/waiting.jpg", "etag": "e"}], "g")[0]["job_id"]
    dead = sorted(j.id for j in claim.jobs[:2])
    with live_app(config) as server:
        url = server.url + "/api/ops/dlq/replay"
        for body in (
            {},
            {"job_ids": [], "all": True},
            {"job_ids": ["1"]},
            {"all": False},
            {"job_ids": [0]},
            {"job_ids": [1], "x": 1},
        ):
            status, answer, _ = call("POST", url, SECRET, body)
            assert status == 400, (body, answer)
        status, answer, _ = call("POST", url, SECRET, {"job_ids": [dead[0], waiting]})
        assert status == 200
        assert answer == {"replayed": 1, "job_ids": [dead[0]], "skipped": [waiting]}
        status, answer, _ = call("POST", url, SECRET, {"all": True})
        assert answer == {"replayed": 1, "job_ids": [dead[1]], "skipped": []}
        status, overview, _ = call("GET", server.url + "/api/ops/overview", SECRET)
    assert status == 200 and overview is not None
    assert overview["dead_letters"] == [] and overview["dead_letters_total"] == 0
    for job_id in [*dead, waiting]:
        row = _job(db_url, job_id)
        assert (row["status"], row["messages"], row["dead_letters"]) == ("pending", 1, 0)
    running = [j.id for j in claim.jobs[2:]]
    assert [r["job_id"] for r in overview["running"]] == running
    assert {q["queue"]: q["depth"] for q in overview["queues"]}["thumbq_jobs"] == 4
    assert len(rows) == 3


def test_replaying_an_ordering_keys_dead_head_gives_it_one_message_and_keeps_the_rest_behind(
    db_url: str,
) -> None:
    with db.connect(db_url) as conn:
        q = Queue(conn, max_attempts=1)
        rows = q.enqueue_jobs([{"task": "seg", "ordering_key": "video-1"} for _ in range(2)], "g")
        head, follower = (r["job_id"] for r in rows)
        [job] = q.claim("w", 2, 600).jobs  # only the head runs
        assert job.id == head
        q.fail("w", job, "storage_timeout", "slow", False)
        assert _job(db_url, head)["dead_letters"] == 1
        row = db.one(conn, "replay_dead_letters", {"job_ids": [head, follower]})
    assert row is not None and row["replayed"] == [head]
    assert {k: _job(db_url, head)[k] for k in ("status", "attempts", "messages")} == {
        "status": "pending",
        "attempts": 0,
        "messages": 1,
    }
    assert {k: _job(db_url, follower)[k] for k in ("status", "msg_id", "messages")} == {
        "status": "pending",
        "msg_id": None,
        "messages": 0,
    }
