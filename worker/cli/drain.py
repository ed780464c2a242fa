"""Running batches here until a group is done (`thumbq demo`, `enqueue --now`, `backfill --now`),
with a progress bar, and the outcome of each file and each run."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from worker.cli.errors import say
from worker.cli.hints import next_batch
from worker.cli.runtime import Runtime, queue_of
from worker.engine import db, stopping
from worker.local.terminal import ProgressBar, print_table

if TYPE_CHECKING:
    from worker.storage import Storage

# How long `--now` and the demo wait for work that waits out a retry's backoff.
DEFAULT_DRAIN_S = 300.0


@contextmanager
def quiet_logs_on_a_terminal(rt: Runtime, stream: TextIO) -> Iterator[Path | None]:
    """On a terminal, the batches' JSON log lines go to a file (named in the summary) so that
    they do not cut through the progress bar; elsewhere they stay on stderr."""
    from worker.engine.log import redirected

    if not stream.isatty():
        yield None
        return
    logs = rt.config.home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / f"{rt.command}.log"
    with path.open("a", encoding="utf-8") as f, redirected(f):
        yield path


def drain(
    rt: Runtime,
    conn: db.Conn,
    storage: Storage,
    group: str,
    *,
    max_seconds: float,
    stream: TextIO | None = None,
) -> list[dict[str, Any]]:
    """Run batches here until the group has nothing pending or processing (retries wait out
    their backoff, so the bound is time); a progress bar on stderr meanwhile. The runs'
    answers."""
    from worker.engine.batch import run_batch
    from worker.thumbnails.render.process import RenderPool
    from worker.thumbnails.task import render_options

    config = rt.config
    stream = stream or sys.stderr
    bar = ProgressBar(stream)
    queue = queue_of(rt, conn)
    runs: list[dict[str, Any]] = []
    stop = threading.Event()

    def follow() -> None:
        # Its own connection: the batch holds `conn` for its whole run.
        with db.connect(rt.database_url()) as own:
            q = queue_of(rt, own)
            while True:
                p = q.progress(group)
                if p:
                    bar.update(p)
                if stop.wait(0.2):
                    return

    bar.update(queue.progress(group) or {})
    watcher = threading.Thread(target=follow, name="thumbq-bar", daemon=True)
    with quiet_logs_on_a_terminal(rt, stream) as log_path, stopping.on_signals() as signalled:
        watcher.start()
        try:
            with RenderPool(
                render_options(config), config.concurrency, config.render_memory_mb
            ) as pool:
                give_up = time.monotonic() + max_seconds
                while time.monotonic() < give_up and not signalled.is_set():
                    result = run_batch(
                        config, conn, storage, pool, on_item=bar.item_done, stop=signalled
                    )
                    runs.append(result.response())
                    p = queue.progress(group) or {}
                    if p.get("pending", 0) + p.get("processing", 0) == 0:
                        break
                    if result.stopped_reason == "rate_limited" and result.retry_after_ms:
                        nap(signalled, result.retry_after_ms / 1000)
                    elif result.stopped_reason == "drained":
                        # Only retries waiting out their backoff are left.
                        nap(signalled, 1)
        finally:
            stop.set()
            watcher.join()
            bar.update(queue.progress(group) or {})
            bar.close()
    if log_path is not None:
        say(f"the batches' log lines are in {log_path}")
    if signalled.is_set():
        p = queue.progress(group) or {}
        left = int(p.get("pending") or 0) + int(p.get("processing") or 0)
        raise stopping.Interrupted(
            signalled,
            f"what finished is recorded; {left} job(s) of group {group!r} wait for a batch: "
            f"{next_batch(rt, conn)}",
        )
    return runs


def nap(stop: stopping.Stop, seconds: float) -> None:
    """Sleep on the main thread until `seconds` pass or a signal asks to stop."""
    until = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < until:
        time.sleep(min(0.1, max(until - time.monotonic(), 0.0)))


def print_outcome(
    rt: Runtime, conn: db.Conn, group: str, runs: list[dict[str, Any]], prefix: str = ""
) -> None:
    """The group's counts, each file's outcome and each run's figures."""
    out = sys.stdout
    p = queue_of(rt, conn).progress(group) or {}
    print(file=out)
    print(f"Group {group}: {float(p.get('progress_percentage') or 0):.1f}% done", file=out)
    print_table(
        [
            {"status": s, "jobs": p.get(s, 0)}
            for s in ("completed", "failed", "unsupported", "cancelled", "pending", "processing")
        ],
        ["status", "jobs"],
        out,
    )
    print(file=out)
    jobs = db.run(conn, "jobs_of_group", {"group_id": group, "limit": 200})
    print_table(
        [{**j, "source_key": j["source_key"].removeprefix(prefix)} for j in jobs],
        ["source_key", "status", "error_code", "width", "height", "duration_ms"],
        out,
    )
    print(file=out)
    print_table(
        runs,
        [
            "run_id",
            "processed",
            "succeeded",
            "failed",
            "unsupported",
            "missing",
            "retried",
            "remaining",
            "stopped_reason",
            "duration_ms",
        ],
        out,
    )
    left = int(p.get("pending") or 0) + int(p.get("processing") or 0)
    if left:
        say(f"{left} job(s) still wait (retries after a transient error): {next_batch(rt, conn)}")
