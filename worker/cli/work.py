"""The commands that put work in and take it out: enqueue, backfill, run-batch, retry-failed,
cancel, cleanup-stale."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from worker.app import validation
from worker.cli import spec
from worker.cli.drain import DEFAULT_DRAIN_S, drain, print_outcome
from worker.cli.errors import CliError, checked, say, unknown_group
from worker.cli.hints import next_batch, page_note
from worker.cli.runtime import Runtime, connect, queue_of, storage_of
from worker.cli.spec import ENV_BATCH, ENV_DATABASE, ENV_SCHEDULE, ENV_STORAGE, Arg, Command
from worker.engine import db, stopping
from worker.local.terminal import print_json

if TYPE_CHECKING:
    from worker.storage import Storage


def cmd_run_batch(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.engine.batch import run_batch

    budget_ms, max_items = checked(
        lambda: validation.batch_options(
            rt.config, args.budget_ms, args.max_items, where=("--budget-ms", "--max-items")
        )
    )
    with stopping.on_signals() as stop, connect(rt) as conn:
        result = run_batch(
            rt.config, conn, storage_of(rt), budget_ms=budget_ms, max_items=max_items, stop=stop
        )
    print_json(result.response())
    if stop.is_set():
        raise stopping.Interrupted(stop, f"{result.released} unstarted job(s) handed back")
    return 0


def cmd_enqueue(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.thumbnails.files import enqueue_keys

    group = checked(lambda: validation.group_id(args.group, "--group"))
    etag = args.etag and checked(lambda: validation.etag(args.etag, "--etag"))
    items = []
    for key in args.keys:
        try:
            validation.object_key(key, f"key {key!r}" if len(key) <= 80 else "a key")
        except validation.ValidationError as exc:
            raise CliError(
                f"{exc.message} (keys are paths inside {rt.config.storage_url}, "
                "e.g. uploads/deck.pdf)"
            ) from None
        items.append({"source_key": key} | ({"etag": etag} if etag else {}))
    with connect(rt) as conn:
        storage = storage_of(rt)
        result = enqueue_keys(conn, storage, rt.config, items, group)
        print_json({"group_id": group, **result})
        after_enqueue(rt, args, conn, storage, group, result)
    return 0


def cmd_backfill(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.thumbnails.files import backfill

    prefix = checked(lambda: validation.key_prefix(args.prefix, "--prefix"))
    group = checked(lambda: validation.group_id(args.group, "--group"))
    with connect(rt) as conn:
        storage = storage_of(rt)
        result = backfill(conn, storage, rt.config, prefix, group)
        print_json(result)
        after_enqueue(rt, args, conn, storage, group, result)
    return 0


def after_enqueue(
    rt: Runtime,
    args: argparse.Namespace,
    conn: db.Conn,
    storage: Storage,
    group: str,
    result: dict[str, Any],
) -> None:
    """Say what happens next: with --now, run batches here until the group is drained;
    otherwise when the next scheduled batch will take the new work, or that none will."""
    if result.get("missing"):
        keys = [j["source_key"] for j in result.get("jobs", []) if j.get("missing")]
        shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        say(
            f"{result['missing']} file(s) not found in {storage.url}: {shown}; they stay listed "
            "in the group, and the next batch ends them cancelled (source_missing)"
        )
    progress = queue_of(rt, conn).progress(group) or {}
    waiting = int(progress.get("pending") or 0) + int(progress.get("processing") or 0)
    if waiting and args.now:
        runs = drain(rt, conn, storage, group, max_seconds=args.max_seconds)
        print_outcome(rt, conn, group, runs)
    elif waiting:
        say(f"{waiting} job(s) of group {group!r} wait for a batch: {next_batch(rt, conn)}")
    page_note(rt, group)


def cmd_retry_failed(rt: Runtime, args: argparse.Namespace) -> int:
    group = checked(lambda: validation.group_id(args.group, "GROUP"))
    with connect(rt) as conn:
        queue = queue_of(rt, conn)
        n = queue.retry_failed(group)
        if n == 0 and queue.progress(group) is None:
            raise unknown_group(group)
        print_json({"requeued": n})
        if n:
            say(f"{n} job(s) of group {group!r} wait for a batch: {next_batch(rt, conn)}")
    return 0


def cmd_cancel(rt: Runtime, args: argparse.Namespace) -> int:
    group = checked(lambda: validation.group_id(args.group, "GROUP"))
    with connect(rt) as conn:
        queue = queue_of(rt, conn)
        n = queue.cancel(group)
        if n == 0 and queue.progress(group) is None:
            raise unknown_group(group)
    print_json({"cancelled": n})
    return 0


def cmd_cleanup_stale(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.thumbnails.files import cleanup_stale

    with connect(rt) as conn:
        print_json(cleanup_stale(conn, rt.config, storage=storage_of(rt)))
    return 0


# `enqueue` and `backfill`: run the new work here, or leave it to the schedule.
NOW_ARGS = (
    Arg(
        "--now",
        action="store_true",
        help="run batches here until the group has nothing left to do, with a progress bar "
        "(otherwise the next scheduled batch takes the work)",
    ),
    Arg(
        "--max-seconds",
        type=spec.seconds,
        default=DEFAULT_DRAIN_S,
        help="with --now: stop waiting for retries after this long "
        f"(default {DEFAULT_DRAIN_S:.0f})",
    ),
)
GROUP_ARG = Arg("group", metavar="GROUP", help="the group id")

COMMANDS = (
    Command(
        "enqueue",
        cmd_enqueue,
        "enqueue files (storage keys) for thumbnails",
        "Each key's version (etag) and type are asked of storage; a file that is not there is "
        "reported as missing. Says when the next batch will run, or use --now.",
        env=(ENV_DATABASE, ENV_STORAGE, ENV_SCHEDULE),
        args=(
            Arg("keys", nargs="+", metavar="KEY", help="a key inside THUMBQ_STORAGE_URL"),
            Arg("--group", default="default", help="the group to add them to (default)"),
            Arg("--etag", default=None, help="the version to enqueue (default: ask storage)"),
            *NOW_ARGS,
        ),
    ),
    Command(
        "backfill",
        cmd_backfill,
        "enqueue every file under a prefix that has no thumbnail yet",
        "Lists storage under --prefix and enqueues each file lacking a thumbnail for its "
        "current version (retroactive generation). --prefix '' lists the whole storage.",
        env=(ENV_DATABASE, ENV_STORAGE, ENV_SCHEDULE),
        args=(
            Arg(
                "--prefix",
                required=True,
                help="key prefix to list, e.g. uploads/ ('' for everything)",
            ),
            Arg("--group", default="backfill", help="the group to add them to (backfill)"),
            *NOW_ARGS,
        ),
    ),
    Command(
        "run-batch",
        cmd_run_batch,
        "run one time-budgeted batch here and print its summary",
        "What the scheduler's call to POST /api/thumbnails/batch-generate does.",
        env=(ENV_DATABASE, ENV_STORAGE, ENV_BATCH),
        args=(
            Arg(
                "--budget-ms",
                type=int,
                default=None,
                help="a shorter budget for this batch, 1000 up to THUMBQ_BUDGET_MS",
            ),
            Arg(
                "--max-items",
                type=int,
                default=None,
                help="at most this many items, up to THUMBQ_BATCH_SIZE",
            ),
        ),
    ),
    Command(
        "retry-failed",
        cmd_retry_failed,
        "queue a group's failed jobs again, with fresh attempts",
        "Their dead letters are removed. Permanent failures (corrupt_input, ...) fail again.",
        env=(ENV_DATABASE,),
        args=(GROUP_ARG,),
    ),
    Command(
        "cancel",
        cmd_cancel,
        "cancel a group's pending and processing jobs",
        env=(ENV_DATABASE,),
        args=(GROUP_ARG,),
    ),
    Command(
        "cleanup-stale",
        cmd_cleanup_stale,
        "reset processing jobs whose lease expired (their batch was killed), prune old history",
        "Finished jobs, batch runs and pgmq archives older than THUMBQ_RETENTION_DAYS are "
        "pruned in bounded chunks; group summaries stay. Temporary files that writes killed "
        "mid-way left in local file storage are removed once 15 minutes old.",
        env=(
            ENV_DATABASE,
            {"THUMBQ_RETENTION_DAYS": "keep finished jobs this many days (30; 0 keeps everything)"},
        ),
    ),
)
