"""The commands that only read: status, queues, watch. They never create or change a schema."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from worker.app import validation
from worker.cli import spec
from worker.cli.errors import CliError, checked, unknown_group
from worker.cli.runtime import Runtime, connect, queue_of, read_only
from worker.cli.spec import ENV_DATABASE, Arg, Command
from worker.engine import db
from worker.engine.config import Config
from worker.local.terminal import print_json, print_table

DEFAULT_API_URL = "http://127.0.0.1:8000"


def cmd_status(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.engine.progress import progress_body

    group = args.group and checked(lambda: validation.group_id(args.group, "--group"))
    with connect(rt, readonly=True) as conn, read_only(conn):
        if group:
            row = queue_of(rt, conn).progress(group)
            if row is None:
                raise unknown_group(group)
            if args.failures:
                failures = db.run(
                    conn,
                    "recent_failures_of_group",
                    {"group_id": group, "limit": FAILURES_SHOWN},
                )
                _print_failures(group, failures)
                return 0
            print_json(progress_body(row))
            return 0
        if args.failures:
            raise CliError("--failures needs --group: whose failures to list")
        rows = db.run(conn, "groups", {"limit": 50})
    if not rows:
        print(f"No groups yet in {rt.where}: enqueue files with `thumbq enqueue` or `backfill`.")
        return 0
    print_table(
        rows,
        [
            "group_id",
            "total",
            "pending",
            "processing",
            "completed",
            "failed",
            "unsupported",
            "cancelled",
            "updated_at",
        ],
    )
    return 0


# How many of a group's failures `status --failures` lists, newest first.
FAILURES_SHOWN = 100


def _print_failures(group: str, rows: list[dict[str, Any]]) -> None:
    """A group's files without a thumbnail and why, newest first (the API's /failures)."""
    if not rows:
        print(f"Group {group}: no failed, unsupported, missing or retrying files.")
        return
    print_table(
        [{**r, "last_error": (r["last_error"] or "")[:120]} for r in rows],
        ["source_key", "status", "error_code", "attempts", "last_error"],
    )
    if len(rows) == FAILURES_SHOWN:
        print(f"(the newest {FAILURES_SHOWN})")


def cmd_queues(rt: Runtime, args: argparse.Namespace) -> int:
    with connect(rt, readonly=True) as conn, read_only(conn):
        print_json(queue_of(rt, conn).overview())
    return 0


def _local_api_url(config: Config) -> str | None:
    """The API a `thumbq up` of this home serves, when THUMBQ_API_URL is left at its default."""
    from worker.local import home

    if config.api_url != DEFAULT_API_URL:
        return None
    ups = [r for r in home.running(config.home) if r.api_url and r.command == "up"]
    return ups[0].api_url if ups else None


def cmd_watch(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.local.watch import WatchOptions, watch

    config = rt.config
    group = checked(lambda: validation.group_id(args.group, "GROUP"))
    # A user's access token is a per-person credential, not service configuration: read here,
    # for this command only.
    user_jwt = args.token or os.environ.get("THUMBQ_USER_JWT") or None
    if not user_jwt and not config.cron_secret:
        raise CliError(
            "no credentials to read progress with: start `thumbq up` once in this THUMBQ_HOME "
            f"({config.home}; it keeps an admin secret there), or set THUMBQ_CRON_SECRET or "
            "THUMBQ_USER_JWT"
        )
    api_url = args.api_url or _local_api_url(config) or config.api_url
    opts = WatchOptions(
        api_url=api_url.rstrip("/"),
        # The user's token first: it sees what that user may see, and no more.
        api_token=user_jwt or config.cron_secret,
        supabase_url=config.supabase_url,
        supabase_anon_key=config.supabase_anon_key,
        user_jwt=user_jwt,
        timeout_s=args.timeout,
    )
    return watch(opts, group, sys.stdout, sys.stderr)


COMMANDS = (
    Command(
        "status",
        cmd_status,
        "the latest groups and their counts, or one group's progress as JSON",
        "Read-only: never creates or changes a schema.",
        env=(ENV_DATABASE,),
        args=(
            Arg("--group", default=None, help="one group's progress, in the API's JSON shape"),
            Arg(
                "--failures",
                action="store_true",
                help="with --group: its files without a thumbnail and why (status, error code, "
                "message)",
            ),
        ),
    ),
    Command(
        "queues",
        cmd_queues,
        "queue depth, in flight, oldest message, dead letters, jobs by status, bucket, alerts",
        "Read-only: never creates or changes a schema.",
        env=(ENV_DATABASE,),
    ),
    Command(
        "watch",
        cmd_watch,
        "follow a group's progress, a line per change, until it is done",
        "Over Supabase Realtime when configured, else by polling the API (the one a `thumbq "
        "up` of this THUMBQ_HOME serves, or THUMBQ_API_URL). Read-only.",
        env=(
            {
                "THUMBQ_API_URL": "the API to poll (default: this home's `thumbq up`, else "
                "http://127.0.0.1:8000)",
                "THUMBQ_CRON_SECRET": "the admin secret; default: the one `thumbq up` keeps in "
                "THUMBQ_HOME",
                "THUMBQ_HOME": ENV_DATABASE["THUMBQ_HOME"],
                "THUMBQ_USER_JWT": "a user's access token (RLS decides what it sees)",
                "SUPABASE_URL, SUPABASE_ANON_KEY": "follow the group over Supabase Realtime",
            },
        ),
        args=(
            Arg("group", metavar="GROUP", help="the group id"),
            Arg("--api-url", default=None, help="the API to poll (default: see below)"),
            Arg("--token", default=None, help="a user's access token (THUMBQ_USER_JWT)"),
            Arg(
                "--timeout", type=spec.seconds, default=None, help="give up after this many seconds"
            ),
        ),
    ),
)
