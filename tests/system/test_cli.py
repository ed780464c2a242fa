"""The `thumbq` command line as a newcomer meets it (issue 10): the installed console script,
run as a subprocess with a user's own HOME, against a real Postgres and the real embedded one.

Each test names the bug it pins; each failed on the code before the fix.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.clirun import one_line_error, schemas, thumbq, thumbq_running, user_env
from tests.support.liveapp import call, jpeg, put_samples, wait_until
from worker.engine.config import Config
from worker.storage import open_storage

ISO_8601 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)$")


def postgres_processes(pgdata: Path) -> list[int]:
    import psutil

    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if proc.info["name"] == "postgres" and str(pgdata) in cmd and "-D" in cmd:
            found.append(proc.pid)
    return found


def data_home(tmp_path: Path) -> Path:
    """Where thumbq keeps its data for the test's user by default (platformdirs on Linux)."""
    return tmp_path / "user-home" / ".local" / "share" / "thumbq"


# -- 1. read-only commands never change a schema --------------------------------------------------


@pytest.mark.parametrize("command", [["status"], ["queues"], ["status", "--group", "g"]])
def test_read_only_commands_leave_a_database_without_the_schema_untouched(
    tmp_path: Path, empty_db_url: str, command: list[str]
) -> None:
    # Regression: `thumbq status` against an existing database created thumbq's and pgmq's
    # schemas in it.
    proc = thumbq(*command, env=user_env(tmp_path, DATABASE_URL=empty_db_url))
    line = one_line_error(proc)
    assert "has no thumbq schema" in line and "thumbq db init" in line
    assert schemas(empty_db_url) == set()


def test_read_only_commands_create_no_embedded_database_in_a_fresh_home(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    for command in (["status"], ["queues"]):
        line = one_line_error(thumbq(*command, env=env))
        assert "no embedded database" in line and "thumbq up" in line
    assert not (data_home(tmp_path) / "pgdata").exists()


# -- 2. every error is one line naming what to do -------------------------------------------------


def test_a_database_that_is_down_missing_or_not_a_url_is_one_line_each(
    tmp_path: Path, pg_server_url: str
) -> None:
    # Regression: each of these printed a Python traceback.
    from tests.support.pgbouncer import free_port

    missing = str(psycopg.conninfo.make_conninfo(pg_server_url, dbname="no_such_db_thumbq"))
    cases = {
        f"postgresql://postgres@127.0.0.1:{free_port()}/postgres": "connection refused",
        missing: 'database "no_such_db_thumbq" does not exist; create it',
        "notaurl": "DATABASE_URL is not a Postgres connection string",
    }
    for url, expected in cases.items():
        for command in (["status"], ["run-batch"], ["enqueue", "a.jpg"]):
            line = one_line_error(thumbq(*command, env=user_env(tmp_path, DATABASE_URL=url)))
            assert line.startswith("thumbq: ") and expected in line, (command, line)
            assert "DATABASE_URL" in line  # what to fix


def test_bad_keys_and_settings_are_one_line_each(tmp_path: Path, db_url: str) -> None:
    env = user_env(tmp_path, DATABASE_URL=db_url)
    line = one_line_error(thumbq("enqueue", "../etc/passwd", env=env))
    assert "'..'" in line and "keys are paths inside" in line
    line = one_line_error(thumbq("status", env={**env, "THUMBQ_BUDGET_MS": "ten"}))
    assert line == "thumbq: THUMBQ_BUDGET_MS must be an integer, got 'ten'"
    line = one_line_error(thumbq("enqueue", "a.jpg", env={**env, "THUMBQ_STORAGE_URL": "ftp://x"}))
    assert "THUMBQ_STORAGE_URL must start with file:// or s3://" in line


def test_thumbq_debug_shows_the_traceback(tmp_path: Path) -> None:
    env = user_env(tmp_path, DATABASE_URL="postgresql://postgres@127.0.0.1:1/postgres")
    proc = thumbq("status", env={**env, "THUMBQ_DEBUG": "1"})
    assert proc.returncode == 1 and "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("thumbq: cannot reach")


def test_a_usage_error_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    line = one_line_error(thumbq("run-batch", "--budget-ms", "abc", env=env), code=2)
    assert "invalid int value: 'abc'" in line and "thumbq run-batch --help" in line
    line = one_line_error(thumbq("nope", env=env), code=2)
    assert "invalid choice: 'nope'" in line
    line = one_line_error(thumbq("up", "--port", "70000", env=env), code=2)
    assert "0 to 65535" in line


# -- 3. after enqueue/backfill: when the next batch comes, or --now -------------------------------


def _home_env(tmp_path: Path, db_url: str, **extra: str) -> dict[str, str]:
    return user_env(
        tmp_path,
        DATABASE_URL=db_url,
        THUMBQ_STORAGE_URL=(tmp_path / "storage").as_uri(),
        THUMBQ_CONCURRENCY="2",
        **extra,
    )


def _put(tmp_path: Path, db_url: str, prefix: str, good: int, broken: int = 0) -> list[str]:
    config = Config.from_env(
        {"THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(), "DATABASE_URL": db_url}
    )
    return [i["source_key"] for i in put_samples(open_storage(config), prefix, good, broken)]


def test_enqueue_says_no_batch_is_scheduled_and_offers_now(tmp_path: Path, db_url: str) -> None:
    # Regression: after enqueue nothing happened for up to 5 minutes, and nothing said so.
    keys = _put(tmp_path, db_url, "in/", good=2)
    proc = thumbq("enqueue", *keys, "--group", "g1", env=_home_env(tmp_path, db_url))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["enqueued"] == 2
    note = proc.stderr.strip()
    assert "2 job(s) of group 'g1' wait for a batch" in note
    assert "no batch is scheduled" in note and "thumbq up" in note and "--now" in note


def test_backfill_says_when_the_next_batch_of_this_homes_thumbq_up_is_due(
    tmp_path: Path, db_url: str
) -> None:
    env = _home_env(tmp_path, db_url, THUMBQ_SCHEDULE="*/5 * * * *")
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C") as up:
        _put(tmp_path, db_url, "later/", good=2)
        proc = thumbq("backfill", "--prefix", "later/", "--group", "g2", env=env)
        assert proc.returncode == 0, proc.stderr
        pid = up.proc.pid
    note = proc.stderr
    match = re.search(r"the next batch is due at (\d\d:\d\d:\d\d) UTC \(in ([^)]+)\)", note)
    assert match, note
    assert int(match.group(1).split(":")[1]) % 5 == 0  # on the */5 schedule
    assert f"by thumbq up (pid {pid})" in note and "--now" in note
    assert re.search(
        r"follow group 'g2' in a browser: http://127\.0\.0\.1:\d+/progress"
        r"\?group_id=g2#key=tqp\.1\.",
        note,
    ), note


def test_enqueue_now_runs_batches_until_the_group_is_done(tmp_path: Path, db_url: str) -> None:
    keys = _put(tmp_path, db_url, "now/", good=3, broken=1)
    env = _home_env(tmp_path, db_url)
    proc = thumbq("enqueue", *keys, "--group", "g3", "--now", env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "Group g3: 100.0% done" in proc.stdout
    status = json.loads(thumbq("status", "--group", "g3", env=env).stdout)
    assert (status["completed"], status["failed"], status["pending"]) == (3, 1, 0)
    assert "wait for a batch" not in proc.stderr
    # Why the one failed, without a job id or the API: its key, status, code and message.
    failures = thumbq("status", "--group", "g3", "--failures", env=env)
    assert failures.returncode == 0, failures.stderr
    (line,) = [row for row in failures.stdout.splitlines() if row.startswith("now/")]
    assert "failed" in line and "corrupt_input" in line and "damaged" in line, line
    alone = thumbq("status", "--failures", env=env)
    assert alone.returncode != 0 and "--failures needs --group" in alone.stderr


# -- 4 and 5. one home per user, shared; the embedded Postgres stops with its last user -----------


def test_commands_in_one_home_share_its_database_and_secret_from_any_directory(
    tmp_path: Path,
) -> None:
    # Regressions: THUMBQ_HOME defaulted to ./.thumbq, so `cd elsewhere && thumbq status`
    # started a second, empty database; `thumbq watch` said no secret was set while `thumbq up`
    # had generated one; a second command started (or stopped) the server another was using.
    env = user_env(tmp_path, THUMBQ_CONCURRENCY="2")
    a, b = tmp_path / "project-a", tmp_path / "elsewhere"
    a.mkdir()
    b.mkdir()
    pgdata = data_home(tmp_path) / "pgdata"
    with thumbq_running("up", "--port", "0", env=env, cwd=a, ready="Press Ctrl-C") as up:
        assert up.printed("started the embedded Postgres")
        assert len(postgres_processes(pgdata)) >= 1
        servers = set(postgres_processes(pgdata))
        # Files and a group, from the second directory, through the same home's storage.
        storage = open_storage(Config.from_env({"THUMBQ_HOME": str(data_home(tmp_path))}))
        put_samples(storage, "shared/", good=2)
        added = thumbq(
            "backfill", "--prefix", "shared/", "--group", "shared", "--now", env=env, cwd=b
        )
        assert added.returncode == 0, added.stderr
        assert "started the embedded Postgres" not in added.stderr
        # Joining up's server and leaving it to up is the normal case: nothing to say.
        assert "embedded Postgres" not in added.stderr
        assert set(postgres_processes(pgdata)) == servers  # no second server

        # watch reads the secret up made, and finds up's API, with nothing configured.
        watched = thumbq("watch", "shared", "--timeout", "60", env=env, cwd=b, timeout=90)
        assert watched.returncode == 0, watched.stderr
        assert "100.0%  2/2" in watched.stdout

        status = thumbq("status", env=env, cwd=b)
        assert status.returncode == 0 and "shared" in status.stdout, status.stderr
        assert "embedded Postgres" not in status.stderr
        # up's database is still there after the others have ended.
        api = re.search(r"API:\s+(\S+)", "\n".join(up.out))
        assert api and call("GET", api.group(1) + "/healthz")[0] == 200

        # `down` refuses while up uses it.
        down = thumbq("down", env=env, cwd=b)
        assert "in use by thumbq up" in one_line_error(down)
    assert up.proc.returncode == 0, up.err
    assert up.printed("stopped the embedded Postgres")
    wait_until(lambda: not postgres_processes(pgdata), 10, 0.1)
    gone = thumbq("down", env=env)
    assert gone.returncode == 0 and "is not running" in gone.stdout


def test_serve_in_the_same_home_uses_the_secret_up_made(tmp_path: Path, db_url: str) -> None:
    from tests.support.pgbouncer import free_port

    env = _home_env(tmp_path, db_url)
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C"):
        pass
    secret = (data_home(tmp_path) / "cron_secret").read_text().strip()
    port = free_port()
    with thumbq_running(
        "serve", "--server", "waitress", "--port", str(port), env=env, ready="serving on"
    ) as serve:
        status, body, _ = call("GET", f"http://127.0.0.1:{port}/api/queues", secret)
        assert status == 200, body
        assert not serve.printed("no admin secret")


def test_a_command_alone_starts_the_embedded_postgres_and_stops_it_when_it_ends(
    tmp_path: Path,
) -> None:
    # Regression: the embedded Postgres kept running after every command, with no way to stop.
    env = user_env(tmp_path)
    pgdata = data_home(tmp_path) / "pgdata"
    init = thumbq("db", "init", env=env)
    assert init.returncode == 0, init.stderr
    assert "started the embedded Postgres" in init.stderr
    assert "stopped the embedded Postgres" in init.stderr
    assert postgres_processes(pgdata) == []
    status = thumbq("status", env=env)
    assert status.returncode == 0 and "No groups yet" in status.stdout
    assert "started" in status.stderr and "stopped the embedded Postgres" in status.stderr
    assert postgres_processes(pgdata) == []


def test_down_stops_a_server_whose_command_was_killed(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    pgdata = data_home(tmp_path) / "pgdata"
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C") as up:
        up.proc.send_signal(signal.SIGKILL)
        up.proc.wait(10)
    assert postgres_processes(pgdata), "a killed command leaves its server behind"
    down = thumbq("down", env=env)
    assert down.returncode == 0 and "Stopped the embedded Postgres" in down.stdout, down.stderr
    assert postgres_processes(pgdata) == []


# -- 6 and 7. missing files; one vocabulary and one JSON shape ------------------------------------


def test_a_missing_file_is_reported_at_enqueue_and_counted_apart_from_failures(
    tmp_path: Path, db_url: str
) -> None:
    # Regressions: a missing file was reported as enqueued; the batch summary's `failed`
    # counted unsupported and missing files too.
    env = _home_env(tmp_path, db_url)
    storage = open_storage(Config.from_env({"THUMBQ_STORAGE_URL": env["THUMBQ_STORAGE_URL"]}))
    storage.put("mix/good.jpg", jpeg(1), "image/jpeg")
    storage.put("mix/cut.jpg", jpeg(2, (640, 480))[:300], "image/jpeg")
    storage.put("mix/notes.txt", b"plain text", "text/plain")
    keys = ["mix/good.jpg", "mix/cut.jpg", "mix/notes.txt", "mix/gone.jpg"]
    proc = thumbq("enqueue", *keys, "--group", "mix", env=env)
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert (answer["enqueued"], answer["existing"], answer["missing"]) == (3, 0, 1)
    assert [j["source_key"] for j in answer["jobs"] if j["missing"]] == ["mix/gone.jpg"]
    assert "not found" in proc.stderr and "mix/gone.jpg" in proc.stderr

    batch = thumbq("run-batch", env=env)
    assert batch.returncode == 0, batch.stderr
    run = json.loads(batch.stdout)
    assert (run["succeeded"], run["failed"], run["unsupported"], run["missing"]) == (1, 1, 1, 1)
    assert run["processed"] == 4


def test_the_cli_answers_in_the_apis_json_shape(tmp_path: Path, db_url: str) -> None:
    # Regression: `status --group` printed progress_percentage as a string and dates as
    # "2026-01-01 12:00:00+00:00".
    from api import create_app

    env = _home_env(tmp_path, db_url, THUMBQ_CRON_SECRET="shape-secret-0123456789")
    keys = _put(tmp_path, db_url, "shape/", good=2)
    assert thumbq("enqueue", *keys, "--group", "shape", env=env).returncode == 0
    cli_batch = json.loads(thumbq("run-batch", env=env).stdout)
    cli = json.loads(thumbq("status", "--group", "shape", env=env).stdout)
    assert isinstance(cli["progress_percentage"], float) and cli["progress_percentage"] == 100.0
    assert ISO_8601.match(cli["updated_at"]), cli["updated_at"]
    datetime.fromisoformat(cli["updated_at"])

    app = create_app(Config.from_env({k: v for k, v in env.items() if k != "HOME"}))
    try:
        client = app.test_client()
        admin = {"Authorization": "Bearer shape-secret-0123456789"}
        api = client.get("/api/thumbnails/progress?group_id=shape", headers=admin).get_json()
        api_batch = client.post("/api/thumbnails/batch-generate", headers=admin).get_json()
    finally:
        app.extensions["thumbq"].close()
    assert cli == api
    assert set(cli_batch) == set(api_batch)
    assert {k: type(v) for k, v in cli_batch.items() if v is not None} == {
        k: type(v) for k, v in api_batch.items() if v is not None
    }


# -- 8. the CLI refuses what the API refuses, with the API's words --------------------------------


def _api_error(app: Any, method: str, path: str, body: Any) -> tuple[int, str]:
    r = getattr(app.test_client(), method)(
        path, json=body, headers={"Authorization": "Bearer parity-secret-0123456789"}
    )
    return r.status_code, r.get_json()["error"]["message"]


def test_the_cli_validates_like_the_api(tmp_path: Path, db_url: str) -> None:
    # Regressions: `run-batch --budget-ms -5` ran; `backfill` without a prefix listed the whole
    # bucket; `retry-failed nope` exited 0.
    from api import create_app

    env = _home_env(tmp_path, db_url, THUMBQ_CRON_SECRET="parity-secret-0123456789")
    app = create_app(Config.from_env({k: v for k, v in env.items() if k != "HOME"}))
    try:
        cases = [
            (
                ["run-batch", "--budget-ms", "-5"],
                ("post", "/api/thumbnails/batch-generate", {"budget_ms": -5}),
                ("budget_ms", "--budget-ms"),
            ),
            (
                ["run-batch", "--max-items", "0"],
                ("post", "/api/thumbnails/batch-generate", {"max_items": 0}),
                ("max_items", "--max-items"),
            ),
            (
                ["retry-failed", "nope"],
                ("post", "/api/thumbnails/retry-failed", {"group_id": "nope"}),
                None,
            ),
            (
                ["cancel", "<script>"],
                ("post", "/api/thumbnails/cancel", {"group_id": "<script>"}),
                ("group_id", "GROUP"),
            ),
            (
                ["enqueue", "a.jpg", "--etag", "e" * 201],
                (
                    "post",
                    "/api/thumbnails/enqueue",
                    {"items": [{"source_key": "a.jpg", "etag": "e" * 201}]},
                ),
                ("items[0].etag", "--etag"),
            ),
            (
                ["backfill", "--prefix", "/abs"],
                ("post", "/api/thumbnails/backfill", {"prefix": "/abs"}),
                ("prefix", "--prefix"),
            ),
        ]
        for argv, (method, path, body), names in cases:
            status, api_message = _api_error(app, method, path, body)
            assert 400 <= status < 500
            line = one_line_error(thumbq(*argv, env=env))
            expected = api_message if names is None else api_message.replace(*names)
            assert line.startswith("thumbq: " + expected), (argv, line, api_message)
    finally:
        app.extensions["thumbq"].close()
    # The API requires a prefix ("" for everything); so does the CLI, as a usage error.
    line = one_line_error(thumbq("backfill", env=env), code=2)
    assert "--prefix" in line
    assert schemas(db_url) == {"thumbq", "pgmq"}


# -- 9. --help and --version ----------------------------------------------------------------------


def test_help_describes_every_option_and_the_environment_and_version_answers(
    tmp_path: Path,
) -> None:
    # Regression: `--help` said little (options without help, no environment), no --version.
    import argparse
    from importlib.metadata import version

    from worker.cli import build_parser

    env = user_env(tmp_path)
    top = thumbq("--help", env=env)
    assert top.returncode == 0 and "environment:" in top.stdout
    assert "DATABASE_URL" in top.stdout and "THUMBQ_HOME" in top.stdout
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands: list[tuple[list[str], argparse.ArgumentParser]] = []
    for name, sp in subs.choices.items():
        nested = [a for a in sp._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            commands += [([name, n], p) for n, p in nested[0].choices.items()]
        else:
            commands.append(([name], sp))
        assert name in top.stdout, name
    for argv, sp in commands:
        out = thumbq(*argv, "--help", env=env)
        assert out.returncode == 0, out.stderr
        assert "environment:" in out.stdout and "THUMBQ_DEBUG" in out.stdout, argv
        for action in sp._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and len(action.help) > 8, (argv, action.dest)
            shown = action.option_strings[0] if action.option_strings else action.metavar
            assert shown and shown in out.stdout, (argv, shown)
    reads_database = {"status", "queues", "enqueue", "backfill", "run-batch", "up", "demo"}
    for argv, _ in commands:
        if argv[0] in reads_database:
            assert "DATABASE_URL" in thumbq(*argv, "--help", env=env).stdout, argv
    v = thumbq("--version", env=env)
    assert v.returncode == 0 and v.stdout.strip() == f"thumbq {version('thumbq')}"


# -- 10. the demo's bar moves per file on a terminal, logs stay out of its way --------------------


def _run_on_a_terminal(argv: list[str], env: dict[str, str], timeout: float) -> str:
    """Run `thumbq ARGV` with a pseudo-terminal as stdout and stderr; what it wrote there."""
    import pty
    import select

    from tests.support.clirun import thumbq_exe

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [thumbq_exe(), *argv], env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the other side closed
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        assert proc.wait(10) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return b"".join(chunks).decode(errors="replace")


def test_the_demo_bar_moves_per_file_on_a_terminal_with_the_logs_in_a_file(
    tmp_path: Path, db_url: str
) -> None:
    # Regression: the bar jumped 0 -> 100% with the batch's JSON log line cutting through it.
    env = _home_env(tmp_path, db_url, THUMBQ_HOME=str(tmp_path / "home"))
    screen = _run_on_a_terminal(["demo"], env, timeout=180)
    assert '{"ts"' not in screen, screen
    frames = re.findall(r"\r\x1b\[2K\[[#.]+\]\s+([\d.]+)%  (\d+)/(\d+)", screen)
    done = [int(d) for _, d, _ in frames]
    assert done[0] == 0 and done[-1] == int(frames[-1][2]) == 11, frames
    assert len(set(done)) >= 6, f"the bar should move per file: {done}"
    assert done == sorted(done)
    log = tmp_path / "home" / "logs" / "demo.log"
    assert str(log) in screen.replace("\r\n", "\n").replace("\n", "")
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert any(x["event"] == "batch_run" for x in lines)
    assert all(ISO_8601.match(x["ts"]) for x in lines), lines[0]["ts"]


def test_log_lines_carry_iso_8601_timestamps(tmp_path: Path, db_url: str) -> None:
    env = _home_env(tmp_path, db_url)
    proc = thumbq("run-batch", env=env)
    assert proc.returncode == 0, proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("{")]
    ts = json.loads(line)["ts"]
    assert ISO_8601.match(ts) and ts.endswith("Z"), ts
