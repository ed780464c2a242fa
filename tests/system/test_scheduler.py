"""The scheduler against a real app on loopback, its chaining rules, and `thumbq up` end to end."""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.liveapp import call, live_app, put_samples, wait_until
from tests.support.pgbouncer import free_port
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.local.cron import CronScheduler, cron_trigger
from worker.local.server import ServerThread
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys

SECRET = "scheduler-test-secret-0123456789"
ROOT = Path(__file__).resolve().parents[2]


# -- the chaining rules -----------------------------------------------------------------------


# -- against a real app ---------------------------------------------------------------------


def _config(tmp_path: Path, db_url: str, **env: str) -> Config:
    return Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_BUDGET_MS": "3000",
            "THUMBQ_BUFFER_MS": "500",
            **env,
        }
    )


def _calls(err: str) -> list[dict]:
    lines = [json.loads(x) for x in err.splitlines() if x.startswith("{")]
    return [x for x in lines if x["event"] == "scheduler_call"]


def test_scheduler_drains_a_real_queue_chaining_within_ticks(
    tmp_path: Path,
    db_url: str,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Four items per run: every run stops on max_items, so draining needs chained calls.
    config = _config(tmp_path, db_url, THUMBQ_BATCH_SIZE="4")
    storage = open_storage(config)
    items = put_samples(storage, "sched/", good=14, broken=2)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, items, "sched")
    caplog.set_level(logging.WARNING, logger="apscheduler")
    with live_app(config) as server:
        sched = CronScheduler(
            config, api_url=server.url, trigger=cron_trigger("*/5 * * * * *"), cleanup_every_s=1
        )
        sched.start(run_now=True)
        try:
            with db.connect(db_url) as conn:
                q = Queue(conn)

                def settled() -> bool:
                    p = q.progress("sched")
                    return bool(p and p["pending"] + p["processing"] == 0)

                wait_until(settled, 30)
                wait_until(lambda: sched.cleanups, 5)
                progress = q.progress("sched")
                runs = conn.execute(
                    "select started_at, finished_at from thumbq.batch_runs order by id"
                ).fetchall()
        finally:
            sched.shutdown()
    assert progress is not None
    assert (progress["completed"], progress["failed"]) == (14, 2)

    calls = _calls(capsys.readouterr().err)
    batch = [c for c in calls if c["job"] == "batch"]
    assert all(c["status"] == 200 for c in batch), batch
    assert any(c["chained"] for c in batch), "work remained after the first call but none chained"
    assert any(c["stopped_reason"] == "max_items" and c["next"] == "chain" for c in batch)
    assert {"url", "duration_ms", "stopped_reason", "remaining", "chained"} <= set(batch[0])
    assert any(c["job"] == "cleanup" and c["status"] == 200 for c in calls)
    # One at a time: no run started before the previous one finished, no tick was skipped.
    for prev, nxt in itertools.pairwise(runs):
        assert nxt["started_at"] >= prev["finished_at"]
    assert not [r for r in caplog.records if "maximum number of running" in r.getMessage()]
    # Chains end before the next tick: a tick's calls all lie within its 5 s window.
    assert max(t.calls for t in sched.ticks) >= 2


def test_scheduler_survives_the_api_being_down_and_resumes_next_tick(
    tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, db_url)
    storage = open_storage(config)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, put_samples(storage, "down/", good=4), "down")
    port = free_port()
    sched = CronScheduler(
        config, api_url=f"http://127.0.0.1:{port}", trigger=cron_trigger("* * * * * *")
    )
    sched.start(run_now=True)
    try:
        wait_until(lambda: len(sched.ticks) >= 2, 10, 0.05)
        assert all(t.stopped == "error" for t in sched.ticks)
        from api import create_app

        app = create_app(config)
        server = ServerThread(app, "127.0.0.1", port).start()
        try:
            with db.connect(db_url) as conn:
                q = Queue(conn)
                wait_until(lambda: (q.progress("down") or {}).get("completed") == 4, 20)
        finally:
            sched.shutdown()
            server.close()
            app.extensions["thumbq"].close()
    finally:
        sched.shutdown()
    calls = _calls(capsys.readouterr().err)
    refused = [c for c in calls if c["status"] is None]
    assert refused and all(c["error"] and c["next"] == "stop" for c in refused)
    assert any(c["status"] == 200 for c in calls)


def test_scheduler_waits_out_the_rate_limit_then_calls_again(
    tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path, db_url)
    storage = open_storage(config)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, put_samples(storage, "rl/", good=6), "rl")
        # One token, refilled at two a second: every run is cut short by the bucket.
        conn.execute(
            "update thumbq.rate_limits set capacity = 1, tokens = 1, refill_per_second = 2"
            " where name = %s",
            [config.rate_bucket],
        )
    with live_app(config) as server:
        # A yearly tick: the chain is bounded by the rules, not by a tick that happens to be near.
        sched = CronScheduler(config, api_url=server.url, trigger=cron_trigger("0 0 1 1 *"))
        summary = sched.tick()
    calls = _calls(capsys.readouterr().err)
    waits = [c for c in calls if c["next"] == "wait"]
    assert waits and all(c["stopped_reason"] == "rate_limited" for c in waits), json.dumps(calls)
    assert all(0 < c["wait_ms"] <= 500 for c in waits)
    assert summary.processed == 6 and summary.stopped == "nothing_remaining"


# -- thumbq up ----------------------------------------------------------------------------------


def test_up_serves_schedules_drains_and_stops_cleanly_on_ctrl_c(
    tmp_path: Path, db_url: str
) -> None:
    home = tmp_path / "home"
    port = free_port()
    env = {
        **os.environ,
        "THUMBQ_HOME": str(home),
        "DATABASE_URL": db_url,
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_SCHEDULE": "* * * * * *",
        "THUMBQ_BUDGET_MS": "3000",
        "THUMBQ_BUFFER_MS": "500",
        "THUMBQ_CONCURRENCY": "2",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("THUMBQ_CRON_SECRET", None)
    env.pop("CRON_SECRET", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "up", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        out = "".join(lines)
        assert f"http://127.0.0.1:{port}/progress" in out, out
        # The secret is kept in the home (mode 0600) and not printed: the link carries a
        # read-only page token instead.
        secret_file = home / "cron_secret"
        secret = secret_file.read_text().strip()
        assert secret_file.stat().st_mode & 0o777 == 0o600
        assert f"admin secret:  kept in {secret_file}" in out and secret not in out

        base = f"http://127.0.0.1:{port}"
        storage = open_storage(Config.from_env({"THUMBQ_STORAGE_URL": env["THUMBQ_STORAGE_URL"]}))
        items = put_samples(storage, "up/", good=6, broken=1)
        for item in items:
            item["group_id"] = "up"
        status, body, _ = call("POST", base + "/api/thumbnails/enqueue", secret, {"items": items})
        assert status == 202, body
        assert call("GET", base + "/api/thumbnails/progress?group_id=up")[0] == 401

        def settled() -> dict | None:
            status, p, _ = call("GET", base + "/api/thumbnails/progress?group_id=up", secret)
            assert status == 200, p
            return p if p and p["pending"] + p["processing"] == 0 else None

        progress = wait_until(settled, 30, 0.2)
        assert (progress["completed"], progress["failed"], progress["total"]) == (6, 1, 7)
        assert progress["progress_percentage"] == 100
        status, _, _ = call("GET", base + "/progress?group_id=up")
        assert status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "thumbq: stopped" in err
    assert "Traceback" not in err, err
    assert '"event":"scheduler_call"' in err
    with pytest.raises(OSError):
        call("GET", f"http://127.0.0.1:{port}/healthz", timeout=2)


def _stop(proc: subprocess.Popen[str], sig: int = signal.SIGTERM) -> str:
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err


def test_serve_and_scheduler_commands_drain_a_queue_and_stop_on_sigterm(
    tmp_path: Path, db_url: str
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "THUMBQ_HOME": str(tmp_path / "home"),
        "DATABASE_URL": db_url,
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_CRON_SECRET": SECRET,
        "THUMBQ_API_URL": f"http://127.0.0.1:{port}",
        "THUMBQ_SCHEDULE": "* * * * * *",
        "THUMBQ_BUDGET_MS": "2000",
        "THUMBQ_BUFFER_MS": "500",
        "THUMBQ_CONCURRENCY": "2",
        "PORT": str(port),  # serve's default port
    }
    config = _config(tmp_path, db_url)
    storage = open_storage(config)
    with db.connect(db_url) as conn:
        enqueue_keys(conn, storage, config, put_samples(storage, "cli/", good=4), "cli")

    def start(command: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "worker.cli", command],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )

    serve = start("serve")
    sched = None
    try:
        wait_until(lambda: _listening(port), 15, 0.05)
        sched = start("scheduler")
        with db.connect(db_url) as conn:
            q = Queue(conn)
            wait_until(lambda: (q.progress("cli") or {}).get("completed") == 4, 20)
    finally:
        sched_err = _stop(sched) if sched else ""
        serve_err = _stop(serve)
    assert sched is not None and sched.returncode == 0, sched_err
    assert serve.returncode == 0, serve_err
    assert '"event":"scheduler_call"' in sched_err and '"status":200' in sched_err
    assert "SIGTERM" in sched_err and "thumbq: stopped" in serve_err
    assert "Traceback" not in sched_err + serve_err
    assert not _listening(port)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
