"""`thumbq jobs enqueue|show|cancel`: jobs of any task, as the HTTP API's /api/jobs routes do
them."""

from __future__ import annotations

import argparse
from typing import Any

from worker.app import validation
from worker.cli import spec
from worker.cli.errors import CliError, checked, say
from worker.cli.runtime import Runtime, connect, read_only, storage_of
from worker.cli.spec import ENV_BATCH, ENV_DATABASE, ENV_STORAGE, Arg, Command, Group
from worker.local.terminal import print_json


def _option(field: str) -> str:
    """A job field as the option (or argument) that sets it: `ordering_key` -> `--ordering-key`."""
    return {"task": "TASK", "group_id": "--group"}.get(field, "--" + field.replace("_", "-"))


def cmd_jobs_enqueue(rt: Runtime, args: argparse.Namespace) -> int:
    import json

    from worker.app.jobs import SequenceConflict, submit, view

    item: dict[str, Any] = {"task": args.task, "group_id": args.group}
    if args.payload is not None:
        try:
            item["payload"] = json.loads(args.payload)
        except ValueError as exc:
            raise CliError(f"--payload is not JSON: {exc}") from None
    for field in ("priority", "ordering_key", "sequence", "idempotency_key", "max_attempts"):
        if getattr(args, field) is not None:
            item[field] = getattr(args, field)
    clean = checked(lambda: validation.job_item(item, "", name_of=_option))
    wait_ms = None
    if args.wait_ms is not None:
        wait_ms = checked(lambda: validation.wait_ms(rt.config, args.wait_ms, "--wait-ms"))
    with connect(rt) as conn:
        storage = storage_of(rt)
        try:
            [row] = submit(conn, storage, rt.config, [clean])
        except SequenceConflict as exc:
            raise CliError(f"{exc.message}: give a later --sequence, or none") from None
        if wait_ms is None:
            print_json(row)
            return 0
        from worker.engine.interactive import run_job
        from worker.thumbnails.render.process import RenderPool
        from worker.thumbnails.task import render_options

        pool = RenderPool(
            render_options(rt.config), rt.config.concurrency, rt.config.render_memory_mb
        )
        try:
            run = run_job(
                rt.config, conn, storage, pool, int(row["job_id"]), wait_ms, task=clean["task"]
            )
        finally:
            pool.close()
    job = None if run.row is None else view(run.row)
    print_json({**row, "status": (job or row)["status"], "wait": run.summary(), "job": job})
    if not run.finished:
        say(f"job {row['job_id']} still waits ({run.reason}): {run.message}")
    return 0


def cmd_jobs_show(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.app.jobs import get
    from worker.app.urls import UrlSigner
    from worker.storage import open_storage

    # With THUMBQ_SIGNED_URL_TTL_S, the same thumbnail URLs as GET /api/jobs/<id>.
    signer = UrlSigner.for_config(rt.config, open_storage(rt.config), rt.config.api_url)
    with connect(rt, readonly=True) as conn, read_only(conn):
        job = get(conn, args.job_id, signer)
    if job is None:
        raise CliError(f"no job {args.job_id}")
    print_json(job)
    return 0


def cmd_jobs_cancel(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.app.jobs import cancel

    with connect(rt) as conn:
        result = cancel(conn, args.job_id)
    if result is None:
        raise CliError(f"no job {args.job_id}")
    print_json(result)
    if not result["cancelled"]:
        say(f"job {args.job_id} had already ended ({result['status']}): nothing to cancel")
    return 0


JOB_ID_ARG = Arg("job_id", type=spec.job_id, metavar="ID", help="the job's id")

COMMANDS = (
    Group(
        "jobs",
        summary="jobs of any task: enqueue, show, cancel",
        description="Jobs of any task (THUMBQ_TASKS modules; `thumbnail` is built in), as "
        "POST /api/jobs, GET /api/jobs/<id> and POST /api/jobs/<id>/cancel do them.",
        dest="jobs_command",
        commands=(
            Command(
                "enqueue",
                cmd_jobs_enqueue,
                "enqueue one job of a task and print its id and status",
                "Checked as POST /api/jobs checks it. The same --idempotency-key (per task), or "
                "--ordering-key and --sequence, names the existing job instead of making another. "
                'A thumbnail job\'s payload is {"source_key", "etag"?, "content_type"?}. With '
                "--wait-ms the job runs here at once (under the same rate limit and lease as a "
                "batch) and the answer carries its result, or says why it still waits.",
                env=(ENV_DATABASE, ENV_STORAGE, ENV_BATCH),
                args=(
                    Arg(
                        "task",
                        metavar="TASK",
                        help="the task's name (thumbnail, or a registered one)",
                    ),
                    Arg(
                        "--payload",
                        default=None,
                        metavar="JSON",
                        help="the job's input, as JSON (default null)",
                    ),
                    Arg("--group", default="default", help="the group to add it to (default)"),
                    Arg(
                        "--priority",
                        type=int,
                        default=None,
                        metavar="0-9",
                        help="higher runs first (default 0)",
                    ),
                    Arg(
                        "--ordering-key",
                        default=None,
                        metavar="KEY",
                        help="jobs sharing it run one at a time, in --sequence order",
                    ),
                    Arg(
                        "--sequence",
                        type=int,
                        default=None,
                        metavar="N",
                        help="its place among its ordering key's jobs (default: after the last)",
                    ),
                    Arg(
                        "--idempotency-key",
                        default=None,
                        metavar="KEY",
                        help="enqueueing the same key (per task) again returns the existing job",
                    ),
                    Arg(
                        "--max-attempts",
                        type=int,
                        default=None,
                        metavar="N",
                        help="attempts before the dead-letter queue, 1-100 (default: the task's, "
                        "else THUMBQ_MAX_ATTEMPTS)",
                    ),
                    Arg(
                        "--wait-ms",
                        type=int,
                        default=None,
                        metavar="MS",
                        help="run it here now and wait up to this long for its result, 100 up "
                        "to THUMBQ_BUDGET_MS - THUMBQ_BUFFER_MS",
                    ),
                ),
            ),
            Command(
                "show",
                cmd_jobs_show,
                "one job: status, payload, result or error, attempts, ordering, progress, times",
                "Read-only: never creates or changes a schema.",
                env=(ENV_DATABASE,),
                args=(JOB_ID_ARG,),
            ),
            Command(
                "cancel",
                cmd_jobs_cancel,
                "cancel a job that waits or runs",
                "A running handler sees ctx.cancelled() at its next check; the next job of its "
                "ordering key goes.",
                env=(ENV_DATABASE,),
                args=(JOB_ID_ARG,),
            ),
        ),
    ),
)
