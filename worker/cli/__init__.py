"""The `thumbq` command line.

Manners (DESIGN.md, "CLI manners"): read-only commands (`status`, `queues`, `watch`) never create
or change a schema; every error is one line on stderr naming what to do, exit code 1 (2 for a
usage error), no traceback unless THUMBQ_DEBUG=1; input is checked by the same rules as the HTTP
API (worker/app/validation.py); every command of one THUMBQ_HOME shares its database, storage and
admin secret, and the embedded Postgres stops when the last command using it ends.

One module per group of commands, each declaring its commands beside their handlers
(`worker/cli/spec.py` says how): up, demo, work (enqueue, backfill, run-batch, retry-failed,
cancel, cleanup-stale), reading (status, queues, watch), serve (serve, scheduler, down), jobs,
database (db init, db export-migration). Shared: runtime (the command's database, storage and
queue), errors (one-line errors), hints (what happens next), drain (batches run here).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from worker.cli.errors import describe_error, say
from worker.cli.parser import build_parser, parse
from worker.cli.runtime import Runtime
from worker.cli.up import ensure_cron_secret
from worker.engine import stopping
from worker.engine.config import Config, check_task_modules

__all__ = ["build_parser", "describe_error", "ensure_cron_secret", "main"]

# The commands that run (or enqueue) jobs: they check THUMBQ_TASKS's modules before anything.
RUNS_TASKS = frozenset({"up", "serve", "run-batch", "demo", "enqueue", "backfill", "jobs"})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `thumbq` console script: the command's exit code."""
    args = parse(argv)
    debug = os.environ.get("THUMBQ_DEBUG", "").lower() in ("1", "true", "yes", "on")
    rt: Runtime | None = None
    try:
        config = Config.from_env()
        debug = config.debug
        if args.command in RUNS_TASKS:
            check_task_modules(config.tasks)  # a typo, said before anything starts or is written
        rt = Runtime(config, args.command)
        try:
            return int(args.func(rt, args))
        finally:
            rt.close()
    except stopping.Interrupted as exc:
        say(str(exc))
        return exc.code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        say("interrupted")
        return 130
    except Exception as exc:
        if debug:
            import traceback

            traceback.print_exc()
        say(describe_error(exc))
        return 1
