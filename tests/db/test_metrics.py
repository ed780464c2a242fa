"""GET /metrics: Prometheus' text format over a real server, behind the admin secret or the
metrics token, with figures equal to what `thumbq queues`, `thumbq status` and pgmq say; and a
scrape whose cost does not grow with finished history."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import tests.support.tasks_fixture  # noqa: F401  (registers the echo tasks in this process too)
from tests.support.clirun import thumbq, user_env
from tests.support.liveapp import live_app, put_samples
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage

SECRET = "admin-secret-0123456789"
TOKEN = "metrics-token-0123456789"
QUEUES = ["thumbq_jobs", *(f"thumbq_jobs_p{p}" for p in range(1, 10)), "thumbq_dlq"]


def scrape(url: str, token: str | None) -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(url + "/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> labels -> value, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def total(series: dict[tuple[tuple[str, str], ...], float], **match: str) -> float:
    return sum(v for k, v in series.items() if all((n, match[n]) in k for n in match))


def test_metrics_are_closed_without_a_secret_and_open_to_the_token_or_the_admin_secret(
    config: Config,
) -> None:
    with live_app(config.with_(cron_secret=None, metrics_token=None)) as server:
        status, body, _ = scrape(server.url, "anything")
        assert status == 503 and json.loads(body)["error"]["code"] == "not_configured"
    with live_app(config.with_(cron_secret=SECRET, metrics_token=TOKEN)) as server:
        assert scrape(server.url, None)[0] == 401
        status, body, _ = scrape(server.url, "not-the-token-at-all")
        assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
        for token in (TOKEN, SECRET):
            status, body, headers = scrape(server.url, token)
            assert status == 200, body
            assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert "# TYPE thumbq_queue_messages gauge" in body
        # The metrics token is read-only: it opens no admin route.
        req = urllib.request.Request(server.url + "/api/queues")
        req.add_header("Authorization", f"Bearer {TOKEN}")
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("the metrics token opened /api/queues")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401


def test_metrics_equal_what_thumbq_queues_thumbq_status_and_pgmq_say(
    config: Config, conn: db.Conn, tmp_path: Path
) -> None:
    config = config.with_(
        cron_secret=SECRET, metrics_token=TOKEN, tasks=("tests.support.tasks_fixture",)
    )
    storage = open_storage(config)
    # Two thumbnails made and one broken file, in one batch run.
    items = put_samples(storage, "metrics/", good=2, broken=1)
    Queue(conn).enqueue_files(items, "photos")
    run_batch(config, conn, storage)
    # A backlog: four thumbnails waiting, and two jobs of another task, one of them claimed.
    Queue(conn).enqueue_files(
        [{"source_key": f"later/{i}.jpg", "etag": "e"} for i in range(4)], "later"
    )
    db.run(
        conn,
        "enqueue_jobs",
        {
            "items": json.dumps(
                [{"task": "echo_thread", "priority": 3, "payload": i} for i in (1, 2)]
            ),
            "group_id": "reports",
            "max_attempts": 3,
        },
    )
    claim = Queue(conn).claim("metrics-test", 1, 600)
    assert len(claim.jobs) == 1 and claim.jobs[0].task == "echo_thread"

    with live_app(config) as server:
        status, text, _ = scrape(server.url, TOKEN)
    assert status == 200, text
    m = samples(text)
    with conn.transaction():
        overview = db.one(conn, "queue_overview")
        pgmq = {q: conn.execute("select * from pgmq.metrics(%s)", [q]).fetchone() for q in QUEUES}
    assert overview is not None

    # Jobs that wait or run: by task, and in all as thumbq queues counts them.
    jobs = m["thumbq_jobs"]
    assert total(jobs, task="thumbnail", status="pending") == 4
    assert total(jobs, task="echo_thread", status="pending") == 1
    assert total(jobs, task="echo_thread", status="processing") == 1
    assert total(jobs, status="pending") == overview["jobs_pending"]
    assert total(jobs, status="processing") == overview["jobs_processing"]
    cli = thumbq("queues", env=user_env(tmp_path, DATABASE_URL=config.database_url or ""))
    assert cli.returncode == 0, cli.stderr
    said = json.loads(cli.stdout)
    assert total(jobs, status="pending") == said["jobs_pending"]
    assert total(jobs, status="processing") == said["jobs_processing"]

    # What ended in the last hour equals the group's counts (`thumbq status --group photos`).
    cli = thumbq(
        "status",
        "--group",
        "photos",
        env=user_env(tmp_path, DATABASE_URL=config.database_url or ""),
    )
    assert cli.returncode == 0, cli.stderr
    group = json.loads(cli.stdout)
    finished = m["thumbq_jobs_finished_15m"]
    assert total(finished, task="thumbnail", status="completed") == group["completed"] == 2
    assert total(finished, task="thumbnail", status="failed") == group["failed"] == 1
    assert total(m["thumbq_failures_15m"], code="corrupt_input") == 1

    # Each queue as pgmq.metrics says: waiting + in flight is its length, and its oldest's age.
    messages, ages = m["thumbq_queue_messages"], m["thumbq_queue_oldest_message_age_seconds"]
    for q in QUEUES:
        row = pgmq[q]
        assert row is not None
        assert total(messages, queue=q) == row["queue_length"], q
        assert abs(total(ages, queue=q) - (row["oldest_msg_age_sec"] or 0)) <= 1, q
    assert total(messages, queue="thumbq_jobs_p3", state="in_flight") == 1
    assert total(messages, queue="thumbq_jobs_p3", state="waiting") == 1
    assert total(messages, queue="thumbq_jobs", state="waiting") == 4

    # Rate limits, and the histograms of the last hour.
    assert total(m["thumbq_rate_limit_capacity"], bucket="thumbnail_generation") == 1000
    assert 0 <= total(m["thumbq_rate_limit_tokens"], bucket="thumbnail_generation") <= 1000
    assert m["thumbq_batch_duration_seconds_gcount"][()] == 1
    assert total(m["thumbq_batch_duration_seconds_bucket"], le="+Inf") == 1
    renders = m["thumbq_render_duration_seconds_bucket"]
    done = total(renders, content_type="image/jpeg", le="+Inf") + total(
        renders, content_type="application/pdf", le="+Inf"
    )
    assert done == 2


def _explain(conn: db.Conn) -> list[dict[str, Any]]:
    """The plans of the statements thumbq.metrics_rows runs (auto_explain, nested)."""
    plans: list[dict[str, Any]] = []

    def notice(diag: Any) -> None:
        text = diag.message_primary or ""
        if "{" in text:
            plans.append(json.loads(text[text.index("{") :]))

    conn.add_notice_handler(notice)
    with conn.transaction():
        for setting in (
            "load 'auto_explain'",
            "set local auto_explain.log_min_duration = 0",
            "set local auto_explain.log_analyze = on",
            "set local auto_explain.log_nested_statements = on",
            "set local auto_explain.log_format = json",
            "set local client_min_messages = log",
        ):
            conn.execute(setting)
        db.run(conn, "metrics")
    conn.remove_notice_handler(notice)
    return plans


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = [plan]
    for child in plan.get("Plans", []):
        out.extend(_nodes(child))
    return out


def test_a_scrape_does_not_read_finished_history(conn: db.Conn) -> None:
    """With 100 000 jobs that ended a day ago, no statement of the scrape reads the jobs table
    past its indexes of live jobs and of the last hour, and a scrape stays fast."""
    conn.execute(
        "insert into thumbq.jobs (group_id, source_key, source_etag, content_type, status,"
        " duration_ms, error_code, created_at, updated_at, completed_at)"
        " select 'old-' || (i % 100), 'old/' || i, 'e', 'image/jpeg',"
        " case when i % 10 = 0 then 'failed' else 'completed' end, 40,"
        " case when i % 10 = 0 then 'corrupt_input' end,"
        " now() - interval '1 day', now() - interval '1 day', now() - interval '1 day'"
        " from generate_series(1, 100000) i"
    )
    conn.execute("analyze thumbq.jobs")
    plans = _explain(conn)
    jobs_reads = [n for p in plans for n in _nodes(p["Plan"]) if n.get("Relation Name") == "jobs"]
    assert jobs_reads, "no plan of the jobs table was seen"
    assert all(n["Node Type"] != "Seq Scan" for n in jobs_reads), jobs_reads
    assert all("Actual Rows" in n for n in jobs_reads)
    # The rows each read of jobs returned: nothing of the 100 000 old jobs.
    assert all(n.get("Actual Rows", 0) == 0 for n in jobs_reads), jobs_reads
    started = time.perf_counter()
    for _ in range(10):
        db.run(conn, "metrics")
    per_scrape_ms = (time.perf_counter() - started) * 100
    print(
        f"scrape: {per_scrape_ms:.1f} ms;",
        sorted({(n["Node Type"], n.get("Index Name")) for n in jobs_reads}),
    )
    assert per_scrape_ms < 100, per_scrape_ms


def test_a_histogram_bucket_counts_the_durations_up_to_and_including_its_bound(
    conn: db.Conn,
) -> None:
    from api.metrics import exposition

    conn.execute(
        "insert into thumbq.jobs (source_key, source_etag, content_type, status, duration_ms,"
        " completed_at) select 'h/' || d, 'e', 'image/png', 'completed', d, now()"
        " from unnest(array[10, 11, 250, 20000]) d"
    )
    m = samples(exposition(db.run(conn, "metrics")).decode())
    buckets = m["thumbq_render_duration_seconds_bucket"]
    got = {dict(k)["le"]: v for k, v in buckets.items() if ("content_type", "image/png") in k}
    assert got["0.01"] == 1 and got["0.025"] == 2 and got["0.1"] == 2 and got["0.25"] == 3
    assert got["10.0"] == 3 and got["+Inf"] == 4
    assert m["thumbq_render_duration_seconds_gsum"][(("content_type", "image/png"),)] == 20.271
    # Batch runs: none in the hour, yet the histogram is there, all zero.
    assert total(m["thumbq_batch_duration_seconds_bucket"]) == 0
    assert len(m["thumbq_batch_duration_seconds_bucket"]) == 11


def test_a_task_with_nothing_waiting_reports_zero_rather_than_no_series(conn: db.Conn) -> None:
    from api.metrics import exposition

    m = samples(exposition(db.run(conn, "metrics")).decode())
    assert m["thumbq_jobs"][(("status", "pending"), ("task", "thumbnail"))] == 0
    assert m["thumbq_jobs"][(("status", "processing"), ("task", "thumbnail"))] == 0
