"""`thumbq demo`: a tour on sample files, drained here with a progress bar."""

from __future__ import annotations

import argparse
import sys
import time

from worker.cli import spec
from worker.cli.drain import DEFAULT_DRAIN_S, drain, print_outcome
from worker.cli.hints import local_up, page_link
from worker.cli.runtime import Runtime, connect, storage_of
from worker.cli.spec import ENV_BATCH, ENV_DATABASE, ENV_STORAGE, Arg, Command


def cmd_demo(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.local.samples import demo_files
    from worker.thumbnails.files import enqueue_keys

    out = sys.stdout
    storage = storage_of(rt)
    group = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    conn = connect(rt)
    print(f"thumbq demo: database: {rt.where}", file=out)
    files = demo_files()
    prefix = f"samples/{group}/"
    for name, (data, content_type) in files.items():
        storage.put(prefix + name, data, content_type)
    print(
        f"thumbq demo: {len(files)} sample files written to {storage.url}/{prefix} "
        "(two are broken on purpose)",
        file=out,
        flush=True,
    )
    enqueue_keys(conn, storage, rt.config, [{"source_key": prefix + n} for n in files], group)
    with conn:
        runs = drain(rt, conn, storage, group, max_seconds=args.max_seconds)
        print_outcome(rt, conn, group, runs, prefix)
    print(file=out)
    print(f"Thumbnails: {storage.url}/thumbnails/{prefix}", file=out)
    up = local_up(rt)
    if up is not None and rt.config.cron_secret:
        link = page_link(up.api_url, rt.config.cron_secret, [{"group_id": group}])
        print(f"See them in a browser: {link}", file=out)
    else:
        print(
            f"See them in a browser: start `thumbq up`, open the page link it prints and enter "
            f"the group {group}.",
            file=out,
        )
    return 0


COMMANDS = (
    Command(
        "demo",
        cmd_demo,
        "a tour: sample files, enqueue them, drain with a progress bar, show the outcome",
        "Writes slides, reports, photos and two broken files to storage, enqueues them as one "
        "group, runs batches here until the group is done and prints every file's outcome.",
        env=(ENV_DATABASE, ENV_STORAGE, ENV_BATCH),
        args=(
            Arg(
                "--max-seconds",
                type=spec.seconds,
                default=DEFAULT_DRAIN_S,
                help=f"give up waiting for retries after this long (default {DEFAULT_DRAIN_S:.0f})",
            ),
        ),
    ),
)
