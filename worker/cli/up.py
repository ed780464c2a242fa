"""`thumbq up`: the main job (database, schema, API server, schedule and progress page in one
command), and the admin secret it keeps in THUMBQ_HOME."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from worker.app.signing import PAGE_TOKEN_TTL_S
from worker.cli.errors import CliError, checked
from worker.cli.hints import page_link
from worker.cli.runtime import Runtime, connect_error
from worker.cli.serve import (
    SERVING_ARGS,
    close_app,
    default_port,
    listen,
    schedule_ok,
    server_threads,
)
from worker.cli.spec import (
    ENV_API,
    ENV_BATCH,
    ENV_DATABASE,
    ENV_SCHEDULE,
    ENV_STORAGE,
    Arg,
    Command,
)
from worker.engine import db, stopping
from worker.engine.config import SECRET_FILE, Config, read_secret_file


def ensure_cron_secret(config: Config) -> tuple[str, Path | None]:
    """The admin secret and the file that keeps it (None: it came from THUMBQ_CRON_SECRET).

    Without THUMBQ_CRON_SECRET, a random secret is made once and kept in THUMBQ_HOME (mode 0600)
    so that the scheduler, bookmarks and scripts keep working across restarts, and every
    command of the home (serve, scheduler, watch) reads the same one.
    """
    import secrets

    path = config.home / SECRET_FILE
    if config.cron_secret and config.cron_secret_source != str(path):
        return config.cron_secret, None
    config.home.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        secret = read_secret_file(path)
        if secret:
            return secret, path
        # An empty or truncated file (a crash while writing) is replaced, not trusted.
        path.unlink()
        return ensure_cron_secret(config.with_(cron_secret=None))
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret, path


def _ask_before_writing(conn: db.Conn, rt: Runtime) -> None:
    """Refuse to put thumbq's schema into a database that holds other schemas and no thumbq
    (someone else's database, reached by a stray DATABASE_URL) unless told to (--yes)."""
    row = db.one(conn, "other_schemas")
    if row and not row["has_thumbq"] and row["schemas"]:
        names = ", ".join(row["schemas"][:5]) + (", ..." if len(row["schemas"]) > 5 else "")
        raise CliError(
            f"{rt.where} holds other schemas ({names}) and no thumbq: `thumbq up` would add "
            "the schemas thumbq and pgmq to it. If it is the database you mean, run `thumbq up "
            "--yes` (or `thumbq db init` once); otherwise set DATABASE_URL to a database of its own"
        )


def cmd_up(rt: Runtime, args: argparse.Namespace) -> int:
    from api import create_app
    from worker.local.cron import CronScheduler, cron_trigger

    out = sys.stdout
    config = rt.config
    checked(lambda: schedule_ok(config.schedule, cron_trigger))
    url = rt.database_url()
    import psycopg

    try:
        conn = db.connect(url)
    except psycopg.OperationalError as exc:
        raise CliError(connect_error(exc, rt, url)) from None
    with conn:
        if not rt.embedded and not args.yes:
            _ask_before_writing(conn, rt)
        schema = db.init_schema(conn)
        latest = db.run(conn, "groups", {"limit": 1})
    secret, secret_from = ensure_cron_secret(config)
    config = config.with_(database_url=url, cron_secret=secret)

    port = args.port if args.port is not None else default_port()
    app = create_app(config)
    try:
        server = listen(app, args.host, port, server_threads(config, args.threads))
    except CliError:
        close_app(app)
        raise
    rt.announce(api_url=server.url, schedule=config.schedule)
    sched = CronScheduler(config, api_url=server.url)
    print("thumbq up", file=out)
    print(f"  database:      {rt.where}", file=out)
    if schema["applied"]:
        print(f"  schema:        applied {', '.join(schema['applied'])}", file=out)
    print(f"  storage:       {config.storage_url}", file=out)
    print(f"  API:           {server.url}", file=out)
    print(f"  progress page: {page_link(server.url, secret, latest)}", file=out)
    print(
        f"                 (opens signed in, read-only, for {PAGE_TOKEN_TTL_S // 3600} h;"
        " the admin secret is not in the link)",
        file=out,
    )
    print(f"  operator page: {server.url}/operator (asks for the admin secret)", file=out)
    if secret_from is None:
        print("  admin secret:  from THUMBQ_CRON_SECRET", file=out)
    else:
        print(f"  admin secret:  kept in {secret_from} (mode 0600)", file=out)
    print(
        f"  schedule:      {config.schedule} (UTC), and a first batch now unless a scheduled"
        " one is due within a batch's budget",
        file=out,
    )
    print("Press Ctrl-C to stop.", file=out, flush=True)
    with stopping.on_signals() as stop:
        sched.start(run_now=True)
        try:
            sig = stopping.wait_for(stop)
            print(f"thumbq: {sig}, stopping", file=sys.stderr, flush=True)
        finally:
            # The batch in flight sees the same stop and ends within its grace; the
            # scheduler's call gets its answer, then the server closes.
            sched.shutdown(timeout_s=stopping.CALL_WAIT_S)
            server.close(stopping.SERVER_WAIT_S)
            close_app(app)
    print("thumbq: stopped", file=sys.stderr, flush=True)
    return stop.exit_code(server=True)


COMMANDS = (
    Command(
        "up",
        cmd_up,
        "the main job: database, schema, API server, schedule and progress page in one command",
        "Applies the schema, serves the HTTP API (waitress, in this process), calls the batch "
        "endpoint on THUMBQ_SCHEDULE (and once at start), and prints a link that opens the "
        "progress page signed in, read-only. Ctrl-C stops it.",
        env=(
            ENV_DATABASE,
            ENV_STORAGE,
            ENV_API,
            ENV_SCHEDULE,
            ENV_BATCH,
            {"PORT": "default port"},
        ),
        args=(
            *SERVING_ARGS,
            Arg(
                "--yes",
                action="store_true",
                help="apply the schema to a DATABASE_URL that holds other schemas and no thumbq "
                "yet (asked otherwise)",
            ),
        ),
    ),
)
