"""`thumbq jobs enqueue|show|cancel` as a user runs them (the installed script in a subprocess,
against a real Postgres): the API's JSON shapes, the API's validation in one line, and a job run
here at once with --wait-ms; `thumbq run-batch` runs the tasks THUMBQ_TASKS names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.support.clirun import thumbq, thumbq_running
from tests.support.liveapp import jpeg, wait_until
from tests.system.test_cli import _api_error, _home_env, one_line_error
from worker.engine.config import Config
from worker.storage import open_storage

SECRET = "parity-secret-0123456789"
TASKS = "tests.support.tasks_fixture"


def _json(proc: Any) -> Any:
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def test_jobs_enqueue_show_and_cancel_answer_in_the_apis_shapes(
    tmp_path: Path, db_url: str
) -> None:
    env = _home_env(tmp_path, db_url)
    argv = ["jobs", "enqueue", "echo", "--payload", '{"n": 1}', "--group", "g", "--priority", "3"]
    first = _json(thumbq(*argv, "--idempotency-key", "k1", env=env))
    assert set(first) == {
        "job_id",
        "task",
        "created",
        "status",
        "ordering_key",
        "sequence",
        "missing",
    }
    assert (first["task"], first["created"], first["status"]) == ("echo", True, "pending")
    again = _json(thumbq(*argv, "--idempotency-key", "k1", env=env))
    assert (again["job_id"], again["created"]) == (first["job_id"], False)

    shown = _json(thumbq("jobs", "show", str(first["job_id"]), env=env))
    assert (shown["id"], shown["payload"], shown["priority"]) == (first["job_id"], {"n": 1}, 3)
    assert (shown["group_id"], shown["idempotency_key"]) == ("g", "k1")

    cancelled = thumbq("jobs", "cancel", str(first["job_id"]), env=env)
    assert _json(cancelled) == {
        "job_id": first["job_id"],
        "cancelled": True,
        "status": "cancelled",
        "group_id": "g",
    }
    twice = thumbq("jobs", "cancel", str(first["job_id"]), env=env)
    assert _json(twice)["cancelled"] is False
    assert "had already ended (cancelled)" in twice.stderr

    line = one_line_error(thumbq("jobs", "show", "99999", env=env))
    assert line == "thumbq: no job 99999"
    line = one_line_error(thumbq("jobs", "cancel", "abc", env=env), code=2)
    assert "must be a job id" in line


def test_jobs_enqueue_with_wait_runs_the_job_here_and_prints_its_result(
    tmp_path: Path, db_url: str
) -> None:
    env = _home_env(tmp_path, db_url, THUMBQ_TASKS=TASKS)
    out = _json(
        thumbq("jobs", "enqueue", "echo", "--payload", '{"n": 2}', "--wait-ms", "5000", env=env)
    )
    assert out["status"] == "completed" and out["wait"]["ran"]
    assert out["job"]["result"]["payload"] == {"n": 2}
    # A thumbnail job, its file's version asked of storage.
    config = Config.from_env({"THUMBQ_STORAGE_URL": env["THUMBQ_STORAGE_URL"]})
    open_storage(config).put("uploads/x.jpg", jpeg(5), "image/jpeg")
    payload = json.dumps({"source_key": "uploads/x.jpg"})
    out = _json(
        thumbq("jobs", "enqueue", "thumbnail", "--payload", payload, "--wait-ms", "5000", env=env)
    )
    assert out["status"] == "completed"
    assert out["job"]["result"]["thumbnail_key"].startswith("thumbnails/uploads/x.jpg/")
    # One that cannot run now says so on stderr, and still answers in JSON.
    _json(thumbq("jobs", "enqueue", "segment", "--ordering-key", "v", env=env))
    waits = thumbq("jobs", "enqueue", "segment", "--ordering-key", "v", "--wait-ms", "500", env=env)
    assert _json(waits)["wait"]["reason"] == "not_ready"
    assert "still waits (not_ready)" in waits.stderr


def test_thumbq_run_batch_runs_the_tasks_thumbq_tasks_names(tmp_path: Path, db_url: str) -> None:
    env = _home_env(tmp_path, db_url, THUMBQ_TASKS=TASKS)
    job = _json(thumbq("jobs", "enqueue", "echo", "--payload", "7", env=env))
    report = _json(thumbq("run-batch", env=env))
    assert report["succeeded"] == 1
    shown = _json(thumbq("jobs", "show", str(job["job_id"]), env=env))
    assert shown["status"] == "completed" and shown["result"]["payload"] == 7
    # Without THUMBQ_TASKS, a task nobody registered ends unsupported, saying what to set.
    plain = _home_env(tmp_path, db_url)
    job = _json(thumbq("jobs", "enqueue", "echo", env=plain))
    _json(thumbq("run-batch", env=plain))
    shown = _json(thumbq("jobs", "show", str(job["job_id"]), env=plain))
    assert (shown["status"], shown["error_code"]) == ("unsupported", "unsupported_task")
    assert "THUMBQ_TASKS" in shown["last_error"]


def test_a_task_module_in_the_directory_thumbq_runs_in_is_found(
    tmp_path: Path, db_url: str
) -> None:
    # A user's tasks live in their project, not in site-packages; the installed script does not
    # put its working directory on the path, so thumbq looks there (last) itself.
    project = tmp_path / "project"
    project.mkdir()
    (project / "my_tasks.py").write_text(
        "from worker.tasks import task\n\n"
        "@task('shout')\n"
        "def shout(ctx, payload):\n"
        "    return payload.upper()\n"
    )
    env = _home_env(tmp_path, db_url, THUMBQ_TASKS="my_tasks")
    job = _json(thumbq("jobs", "enqueue", "shout", "--payload", '"hi"', env=env, cwd=project))
    report = _json(thumbq("run-batch", env=env, cwd=project))
    assert report["succeeded"] == 1, report
    shown = _json(thumbq("jobs", "show", str(job["job_id"]), env=env, cwd=project))
    assert (shown["status"], shown["result"]) == ("completed", "HI")


def test_thumbq_up_runs_the_tasks_thumbq_tasks_names(tmp_path: Path, db_url: str) -> None:
    # `up`'s schedule calls the batch endpoint of its own API, whose app reads THUMBQ_TASKS.
    env = _home_env(tmp_path, db_url, THUMBQ_TASKS=TASKS)
    job = _json(thumbq("jobs", "enqueue", "echo", "--payload", '"up"', env=env))
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C"):

        def done() -> bool:
            shown = _json(thumbq("jobs", "show", str(job["job_id"]), env=env))
            return bool(shown["status"] == "completed" and shown["result"]["payload"] == "up")

        wait_until(done, 60, 0.5)


def test_jobs_enqueue_validates_like_the_api(tmp_path: Path, db_url: str) -> None:
    from api import create_app

    env = _home_env(tmp_path, db_url, THUMBQ_CRON_SECRET=SECRET)
    app = create_app(Config.from_env({k: v for k, v in env.items() if k != "HOME"}))
    thumb = '{"source_key": "a.jpg"}'
    cases = [
        (
            ["echo", "--priority", "12"],
            {"task": "echo", "priority": 12},
            ("priority", "--priority"),
        ),
        (["echo", "--sequence", "3"], {"task": "echo", "sequence": 3}, ("sequence", "--sequence")),
        (
            ["echo", "--ordering-key", "k", "--sequence", "-1"],
            {"task": "echo", "ordering_key": "k", "sequence": -1},
            ("sequence", "--sequence"),
        ),
        (["no spaces"], {"task": "no spaces"}, ("task", "TASK")),
        (["echo", "--group", "a b"], {"task": "echo", "group_id": "a b"}, ("group_id", "--group")),
        (
            ["echo", "--payload", '{"a": "\\u0000"}'],
            {"task": "echo", "payload": {"a": "\x00"}},
            ("payload", "--payload"),
        ),
        (["echo", "--wait-ms", "50"], {"task": "echo", "wait_ms": 50}, ("wait_ms", "--wait-ms")),
        (
            ["echo", "--max-attempts", "0"],
            {"task": "echo", "max_attempts": 0},
            ("max_attempts", "--max-attempts"),
        ),
        (
            ["thumbnail", "--payload", thumb, "--idempotency-key", "k"],
            {"task": "thumbnail", "payload": {"source_key": "a.jpg"}, "idempotency_key": "k"},
            ("idempotency_key", "--idempotency-key"),
        ),
        (
            ["thumbnail", "--payload", '{"source_key": "../x"}'],
            {"task": "thumbnail", "payload": {"source_key": "../x"}},
            ("payload", "--payload"),
        ),
    ]
    try:
        for argv, body, names in cases:
            status, api_message = _api_error(app, "post", "/api/jobs", body)
            assert status == 400, (body, api_message)
            line = one_line_error(thumbq("jobs", "enqueue", *argv, env=env))
            assert line == "thumbq: " + api_message.replace(*names), (argv, line, api_message)
    finally:
        app.extensions["thumbq"].close()
    line = one_line_error(thumbq("jobs", "enqueue", "echo", "--payload", "{nope", env=env))
    assert line.startswith("thumbq: --payload is not JSON")
    # Nothing was enqueued by any of them.
    assert _json(thumbq("jobs", "enqueue", "echo", env=env))["job_id"] == 1
