"""Configuration mistakes are named, not reported as bugs (issue 23, item 6): each test runs the
real `thumbq` in a subprocess, or the real app behind a real HTTP server, and each failed on the
code before its fix.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.clirun import one_line_error, schemas, thumbq, thumbq_running, user_env
from tests.support.liveapp import call, live_app
from tests.support.pgbouncer import free_port
from worker.engine.config import Config

SECRET = "config-errors-secret-0123456789"


def unwritable_home(tmp_path: Path) -> Path:
    """A THUMBQ_HOME that cannot be created (its parent is a file), as on a read-only host;
    root ignores permissions, a file in the way it does not."""
    blocker = tmp_path / "read-only"
    blocker.write_text("a file where a folder would go")
    return blocker / "thumbq"


# -- (a) no DATABASE_URL where no embedded Postgres can run ---------------------------------------


@pytest.mark.parametrize(
    "command",
    [["serve", "--server", "waitress"], ["status"], ["up"], ["run-batch"], ["db", "init"]],
)
def test_no_database_url_where_no_embedded_postgres_can_run_is_one_line_naming_it(
    tmp_path: Path, command: list[str]
) -> None:
    # Regression: `thumbq serve` said "No such file or directory: /proc/...", after a note
    # about the admin secret; `thumbq status` offered to create a database with `thumbq up`.
    env = user_env(tmp_path, THUMBQ_HOME=str(unwritable_home(tmp_path)))
    args = [*command, "--port", str(free_port())] if command[0] in ("serve", "up") else command
    line = one_line_error(thumbq(*args, env=env, timeout=60))
    assert "DATABASE_URL" in line, line
    assert str(unwritable_home(tmp_path)) in line
    assert "No such file" not in line and "Not a directory" not in line.split("(")[0]


def test_the_api_without_database_url_where_no_embedded_postgres_can_run_answers_503_everywhere(
    tmp_path: Path,
) -> None:
    # Regression: under Vercel (no writable home, no pgserver) every route answered 500
    # "internal error", /healthz included.
    config = Config.from_env(
        {"THUMBQ_HOME": str(unwritable_home(tmp_path)), "THUMBQ_CRON_SECRET": SECRET}
    )
    with live_app(config) as server:
        for method, path in (
            ("GET", "/healthz"),
            ("GET", "/api/thumbnails/progress?group_id=g"),
            ("POST", "/api/thumbnails/batch-generate"),
            ("GET", "/api/queues"),
            ("GET", "/api/ops/overview"),
            ("GET", "/progress"),
            ("GET", "/api/openapi.json"),
            ("GET", "/no/such/route"),
        ):
            status, body, headers = call(method, server.url + path, SECRET)
            assert status == 503, (path, status, body)
            assert body and body["error"]["code"] == "not_configured", (path, body)
            assert "DATABASE_URL" in body["error"]["message"]
            assert headers.get("Cache-Control") == "no-store"


def no_pgserver(tmp_path: Path) -> str:
    """A PYTHONPATH entry whose `pgserver` fails to import, as where it is not installed (its
    wheels exist for Linux x86_64 and macOS only; a lean serverless bundle leaves it out)."""
    shadow = tmp_path / "no-pgserver"
    shadow.mkdir(exist_ok=True)
    (shadow / "pgserver.py").write_text("raise ImportError('pgserver is not installed here')\n")
    return str(shadow)


def test_no_database_url_and_no_pgserver_is_one_line_naming_database_url(tmp_path: Path) -> None:
    env = user_env(tmp_path, PYTHONPATH=no_pgserver(tmp_path))
    for command in (["status"], ["serve", "--server", "waitress", "--port", str(free_port())]):
        line = one_line_error(thumbq(*command, env=env, timeout=60))
        assert "DATABASE_URL is not set" in line and "pgserver" in line, line


def test_the_vercel_entry_point_without_database_url_and_pgserver_answers_503_naming_it(
    tmp_path: Path,
) -> None:
    # Regression: on Vercel (no DATABASE_URL set yet, no pgserver in the bundle) every route,
    # /healthz included, answered 500 "internal error".
    from tests.support.liveapp import wait_listening
    from tests.system.test_deploy import ROOT, VERCEL_LIKE_LOADER

    port = free_port()
    loader = "import sys\nsys.modules['pgserver'] = None\n" + VERCEL_LIKE_LOADER
    env = {"PATH": "/usr/bin:/bin", "CRON_SECRET": SECRET, "HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", loader, str(ROOT), str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(proc, port)
        for path in ("/healthz", "/api/thumbnails/batch-generate", "/progress"):
            status, body, _ = call("GET", f"http://127.0.0.1:{port}{path}", SECRET)
            assert status == 503 and body, (path, status, body)
            assert body["error"]["code"] == "not_configured"
            assert "DATABASE_URL is not set" in body["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err


# -- (b) an unknown THUMBQ_TASKS module ------------------------------------------------------------


def test_an_unknown_thumbq_tasks_module_is_a_configuration_error_naming_it_at_start(
    tmp_path: Path, empty_db_url: str
) -> None:
    # Regression: "unexpected error: ImportError ... please report it", after the schema had
    # been created in the database.
    env = user_env(
        tmp_path,
        DATABASE_URL=empty_db_url,
        THUMBQ_STORAGE_URL=(tmp_path / "storage").as_uri(),
        THUMBQ_TASKS="myapp.taskz",
    )
    for command in (["run-batch"], ["serve", "--server", "waitress", "--port", str(free_port())]):
        line = one_line_error(thumbq(*command, env=env, timeout=60))
        assert "THUMBQ_TASKS" in line and "'myapp.taskz'" in line, line
        assert "unexpected" not in line and "report" not in line
    assert schemas(empty_db_url) == set(), "nothing is written before the configuration is read"


def test_the_api_with_an_unknown_thumbq_tasks_module_answers_503_naming_it(
    tmp_path: Path, db_url: str
) -> None:
    config = Config.from_env(
        {
            "DATABASE_URL": db_url,
            "THUMBQ_HOME": str(tmp_path / "home"),
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_TASKS": "myapp.taskz",
        }
    )
    with live_app(config) as server:
        for method, path in (("GET", "/healthz"), ("POST", "/api/thumbnails/batch-generate")):
            status, body, _ = call(method, server.url + path, SECRET)
            assert status == 503 and body, (path, status, body)
            assert body["error"]["code"] == "not_configured"
            assert "'myapp.taskz'" in body["error"]["message"]


# -- (c) `thumbq up` on a database that holds other schemas and no thumbq --------------------------


def test_up_on_a_database_with_other_schemas_and_no_thumbq_asks_for_yes_before_writing(
    tmp_path: Path, empty_db_url: str
) -> None:
    # Regression: `thumbq up` applied the whole schema to someone else's database without a word.
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute("create schema billing; create table billing.invoices (id int)")
    env = user_env(
        tmp_path,
        DATABASE_URL=empty_db_url,
        THUMBQ_STORAGE_URL=(tmp_path / "storage").as_uri(),
    )
    line = one_line_error(thumbq("up", "--port", "0", env=env, timeout=60))
    assert "billing" in line and "--yes" in line and "thumbq db init" in line, line
    assert schemas(empty_db_url) == set()

    with thumbq_running("up", "--yes", "--port", "0", env=env, ready="Press Ctrl-C"):
        pass
    assert schemas(empty_db_url) == {"thumbq", "pgmq"}
    # Once thumbq's schema is there, `up` asks nothing.
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C"):
        pass


def test_up_on_an_empty_database_asks_nothing(tmp_path: Path, empty_db_url: str) -> None:
    env = user_env(
        tmp_path,
        DATABASE_URL=empty_db_url,
        THUMBQ_STORAGE_URL=(tmp_path / "storage").as_uri(),
    )
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C") as up:
        # up also says where the operator page is.
        line = next(line for line in up.out if "operator page:" in line)
        status, _, _ = call("GET", line.split()[2])
        assert status == 200, line
    assert schemas(empty_db_url) == {"thumbq", "pgmq"}


# -- (d) the progress page says where the admin secret is -----------------------------------------


def test_the_progress_pages_key_form_says_where_the_admin_secret_is(
    tmp_path: Path, db_url: str
) -> None:
    # Regression: it said the secret "is printed by `thumbq up`", which it deliberately is not.
    config = Config.from_env({"DATABASE_URL": db_url, "THUMBQ_HOME": str(tmp_path / "home")})
    with live_app(config) as server:
        import urllib.request

        with urllib.request.urlopen(server.url + "/progress") as resp:
            html = resp.read().decode()
    hint = html.split('id="key-form"', 1)[1].split("</form>", 1)[0]
    assert "printed by" not in hint
    assert "THUMBQ_CRON_SECRET" in hint and "cron_secret" in hint


# -- (e) the embedded Postgres note only when it matters -------------------------------------------


def test_a_command_beside_thumbq_up_says_nothing_about_the_embedded_postgres_it_joined(
    tmp_path: Path,
) -> None:
    # Regression: "left the embedded Postgres running: thumbq up (pid ...) still uses it" ended
    # every command, and came before the real error of one that failed.
    env = user_env(tmp_path)
    with thumbq_running("up", "--port", "0", env=env, ready="Press Ctrl-C"):
        status = thumbq("status", env=env)
        assert status.returncode == 0, status.stderr
        assert status.stderr == "", status.stderr
        bad = thumbq("status", "--group", "x" * 300, env=env)
        line = one_line_error(bad, bad.returncode if bad.returncode in (1, 2) else 1)
        assert "embedded Postgres" not in line
