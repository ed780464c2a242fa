"""The `thumbq` command line.

Manners (DESIGN.md, "CLI manners"): read-only commands (`status`, `queues`, `watch`) never create
or change a schema; every error is one line on stderr naming what to do, exit code 1 (2 for a
usage error), no traceback unless THUMBQ_DEBUG=1; input is checked by the same rules as the HTTP
API (worker/app/validation.py); every command of one THUMBQ_HOME shares its database, storage and
admin secret, and the embedded Postgres stops when the last command using it ends.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

from worker.app import validation
from worker.app.signing import PAGE_TOKEN_TTL_S
from worker.engine import db, stopping
from worker.engine.config import (
    SECRET_FILE,
    Config,
    ConfigError,
    check_task_modules,
    read_secret_file,
)
from worker.engine.queue import Queue
from worker.local.terminal import ProgressBar, print_json, print_table

if TYPE_CHECKING:
    from worker.local.embedded import EmbeddedLease
    from worker.local.server import ServerThread
    from worker.storage import Storage

DEFAULT_API_URL = "http://127.0.0.1:8000"
# How long `--now` and the demo wait for work that waits out a retry's backoff.
DEFAULT_DRAIN_S = 300.0
# The commands that run (or enqueue) jobs: they check THUMBQ_TASKS's modules before anything.
RUNS_TASKS = frozenset({"up", "serve", "run-batch", "demo", "enqueue", "backfill", "jobs"})


class CliError(Exception):
    """A problem the user can fix, said in one line; exit code 1."""


def say(message: str) -> None:
    """One line for the user on stderr (stdout stays for the command's answer)."""
    if message:
        print(f"thumbq: {message}", file=sys.stderr, flush=True)


# -- the command's runtime: database, home registry ------------------------------------------


class Runtime:
    """What one command holds while it runs: its configuration, the database (the home's
    embedded Postgres is joined or started on first use and given back at the end, stopped
    unless another command still uses it) and its entry in the home's registry."""

    def __init__(self, config: Config, command: str) -> None:
        self.config = config
        self.command = command
        self.embedded = not config.database_url
        self.lease: EmbeddedLease | None = None
        self.registered = False

    @property
    def where(self) -> str:
        """The database, in words."""
        if self.embedded:
            return f"the embedded Postgres in {self.config.home}"
        return f"the database {_url_summary(self.config.database_url or '')} (DATABASE_URL)"

    def database_url(self, *, create: bool = True) -> str:
        """DATABASE_URL, or the home's embedded Postgres (started if needed; never created
        when `create` is false)."""
        if self.config.database_url:
            return self.config.database_url
        from worker.local.embedded import EmbeddedLease

        if self.lease is None:
            self.lease = EmbeddedLease(self.config.home, self.command)
        url = self.lease.acquire(create=create)
        if self.lease.started:
            say(
                f"started the embedded Postgres in {self.config.home}; it stops when the last "
                "thumbq command using it ends"
            )
        return url

    def announce(self, **fields: Any) -> None:
        """Tell the home's other commands what this one does (its schedule, its API)."""
        from worker.local import home

        if self.lease is not None and self.lease.url is not None:
            self.lease.update(**fields)
            return
        with home.locked(self.config.home):
            home.register(
                self.config.home,
                command=self.command,
                embedded=False,
                database=home.database_fingerprint(self.database_url()),
                **fields,
            )
        self.registered = True

    def close(self) -> None:
        """Give the embedded Postgres back (saying whether it stopped) and unregister."""
        if self.lease is not None:
            lease, self.lease = self.lease, None
            say(lease.release())
        if self.registered:
            from worker.local import home

            with home.locked(self.config.home):
                home.unregister(self.config.home)
            self.registered = False


def _url_summary(url: str) -> str:
    """host:port/dbname of a connection string, never its password."""
    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(url)
    host = info.get("host") or "localhost"
    port = f":{info['port']}" if info.get("port") else ""
    return f"{host}{port}/{info.get('dbname') or info.get('user') or ''}"


def _connect(rt: Runtime, *, readonly: bool = False) -> db.Conn:
    """A connection to the command's database. A database without thumbq's schema gets it,
    unless the command only reads: then it is an error that says how to create it."""
    import psycopg

    url = rt.database_url(create=not readonly)
    try:
        conn = db.connect(url)
    except psycopg.OperationalError as exc:
        raise CliError(_connect_error(exc, rt, url)) from None
    row = conn.execute("select to_regclass('thumbq.jobs') is not null as ready").fetchone()
    if not (row and row["ready"]):
        if readonly:
            conn.close()
            raise CliError(
                f"{rt.where} has no thumbq schema yet; create it with `thumbq db init` "
                "(or `thumbq up`, which does)"
            )
        result = db.init_schema(conn)
        say(f"created the thumbq schema in {rt.where} ({', '.join(result['applied'])})")
    return conn


@contextmanager
def _read_only(conn: db.Conn) -> Iterator[None]:
    """A read-only transaction: whatever a read runs, Postgres refuses to write."""
    with conn.transaction():
        conn.execute("set transaction read only")
        yield


def _connect_error(exc: Exception, rt: Runtime, url: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    text = " ".join(str(exc).split())
    info = conninfo_to_dict(url)
    where = rt.where
    low = text.lower()
    if "does not exist" in low and "database" in low:
        name = info.get("dbname") or info.get("user") or ""
        return (
            f'{where}: database "{name}" does not exist; create it (createdb {name}) '
            "or set DATABASE_URL to an existing database"
        )
    if "password authentication failed" in low or "no password supplied" in low:
        return (
            f"{where} refused the login of user {info.get('user') or '?'}: check the user and "
            "password in DATABASE_URL"
        )
    for clue, why in (
        ("connection refused", "connection refused"),
        ("timeout expired", "no answer within 5 s"),
        ("could not translate host name", "unknown host"),
        ("name or service not known", "unknown host"),
        ("no such file or directory", "no server at that socket"),
    ):
        if clue in low:
            return f"cannot reach {where} ({why}): start Postgres there or fix DATABASE_URL"
    return f"cannot connect to {where}: {text}; check DATABASE_URL"


def _storage(rt: Runtime) -> Storage:
    from worker.storage import open_storage

    return open_storage(rt.config)


def _queue(rt: Runtime, conn: db.Conn) -> Queue:
    return Queue(conn, bucket=rt.config.rate_bucket, max_attempts=rt.config.max_attempts)


def _checked(check: Callable[[], Any]) -> Any:
    """Run one of the API's validators, turning its refusal into the CLI's one-line error."""
    try:
        return check()
    except validation.ValidationError as exc:
        raise CliError(exc.message) from None


def _unknown_group(group: str) -> CliError:
    return CliError(f"no group {group!r}; `thumbq status` lists the groups")


# -- schema ---------------------------------------------------------------------------------


def cmd_db_init(rt: Runtime, args: argparse.Namespace) -> int:
    import psycopg

    url = rt.database_url()
    try:
        conn = db.connect(url)
    except psycopg.OperationalError as exc:
        raise CliError(_connect_error(exc, rt, url)) from None
    with conn:
        print_json(db.init_schema(conn))
    return 0


def cmd_db_export_migration(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.engine.migrations import export

    for path in export(Path(args.out)):
        print(path)
    return 0


# -- work: run-batch, enqueue, backfill, retry-failed, cancel, cleanup-stale -------------------


def cmd_run_batch(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.engine.batch import run_batch

    budget_ms, max_items = _checked(
        lambda: validation.batch_options(
            rt.config, args.budget_ms, args.max_items, where=("--budget-ms", "--max-items")
        )
    )
    with stopping.on_signals() as stop, _connect(rt) as conn:
        result = run_batch(
            rt.config, conn, _storage(rt), budget_ms=budget_ms, max_items=max_items, stop=stop
        )
    print_json(result.response())
    if stop.is_set():
        raise stopping.Interrupted(stop, f"{result.released} unstarted job(s) handed back")
    return 0


def cmd_enqueue(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.thumbnails.files import enqueue_keys as enqueue

    group = _checked(lambda: validation.group_id(args.group, "--group"))
    etag = args.etag and _checked(lambda: validation.etag(args.etag, "--etag"))
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
    with _connect(rt) as conn:
        storage = _storage(rt)
        result = enqueue(conn, storage, rt.config, items, group)
        print_json({"group_id": group, **result})
        _after_enqueue(rt, args, conn, storage, group, result)
    return 0


def cmd_backfill(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.thumbnails.files import backfill

    prefix = _checked(lambda: validation.key_prefix(args.prefix, "--prefix"))
    group = _checked(lambda: validation.group_id(args.group, "--group"))
    with _connect(rt) as conn:
        storage = _storage(rt)
        result = backfill(conn, storage, rt.config, prefix, group)
        print_json(result)
        _after_enqueue(rt, args, conn, storage, group, result)
    return 0


def _after_enqueue(
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
    progress = _queue(rt, conn).progress(group) or {}
    waiting = int(progress.get("pending") or 0) + int(progress.get("processing") or 0)
    if waiting and args.now:
        runs = _drain(rt, conn, storage, group, max_seconds=args.max_seconds)
        _print_outcome(rt, conn, group, runs)
    elif waiting:
        say(f"{waiting} job(s) of group {group!r} wait for a batch: {_next_batch(rt, conn)}")
    _page_note(rt, group)


def _local_up(rt: Runtime) -> Any:
    """The registration of a `thumbq up` of this home that serves this database, if any."""
    from worker.local import home

    me = home.database_fingerprint(rt.database_url())
    for reg in home.running(rt.config.home):
        if reg.command == "up" and reg.api_url and reg.database == me:
            return reg
    return None


def _page_note(rt: Runtime, group: str) -> None:
    """Where to follow a group in a browser, when a `thumbq up` of this home serves the page."""
    up = _local_up(rt)
    if up is not None and rt.config.cron_secret:
        link = page_link(up.api_url, rt.config.cron_secret, [{"group_id": group}])
        say(f"follow group {group!r} in a browser: {link}")


def _next_batch(rt: Runtime, conn: db.Conn) -> str:
    """When the next batch is due for this database, as far as this machine can know: a
    `thumbq up`/`scheduler` of the same home, or pg_cron in the database."""
    from worker.local import home
    from worker.local.cron import cron_trigger

    now = datetime.now(UTC)
    me = home.database_fingerprint(rt.database_url())
    hint = "or add --now to run batches here until they are done"
    for reg in home.running(rt.config.home):
        if reg.schedule and reg.database == me:
            return f"{_next_fire(cron_trigger(reg.schedule), now)} by {reg.name}; {hint}"
    cron = _pg_cron_schedule(conn)
    if cron:
        return f"{_next_fire(cron_trigger(cron), now)} by pg_cron (thumbq-batch, {cron}); {hint}"
    return (
        "no batch is scheduled from here: start `thumbq up` (it serves the API and runs a "
        f"batch every 5 minutes), run `thumbq run-batch`, {hint}"
    )


def _next_fire(trigger: Any, now: datetime) -> str:
    nxt = trigger.get_next_fire_time(None, now)
    if nxt is None:
        return "no batch will come"
    seconds = max(0, round((nxt - now).total_seconds()))
    wait = f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60} s"
    return f"the next batch is due at {nxt.strftime('%H:%M:%S')} UTC (in {wait})"


def _pg_cron_schedule(conn: db.Conn) -> str | None:
    """The schedule of pg_cron's thumbq-batch job where pg_cron exists and it is active."""
    import psycopg

    try:
        with conn.transaction():
            row = conn.execute("select to_regclass('cron.job') is not null as has_cron").fetchone()
            if not (row and row["has_cron"]):
                return None
            row = conn.execute(
                "select schedule from cron.job where jobname = 'thumbq-batch' and active"
            ).fetchone()
    except psycopg.Error:
        return None  # no permission to read cron.job: nothing to say
    return str(row["schedule"]) if row else None


def cmd_retry_failed(rt: Runtime, args: argparse.Namespace) -> int:
    group = _checked(lambda: validation.group_id(args.group, "GROUP"))
    with _connect(rt) as conn:
        queue = _queue(rt, conn)
        n = queue.retry_failed(group)
        if n == 0 and queue.progress(group) is None:
            raise _unknown_group(group)
        print_json({"requeued": n})
        if n:
            say(f"{n} job(s) of group {group!r} wait for a batch: {_next_batch(rt, conn)}")
    return 0


def cmd_cancel(rt: Runtime, args: argparse.Namespace) -> int:
    group = _checked(lambda: validation.group_id(args.group, "GROUP"))
    with _connect(rt) as conn:
        queue = _queue(rt, conn)
        n = queue.cancel(group)
        if n == 0 and queue.progress(group) is None:
            raise _unknown_group(group)
    print_json({"cancelled": n})
    return 0


def cmd_cleanup_stale(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.thumbnails.files import cleanup_stale

    with _connect(rt) as conn:
        print_json(cleanup_stale(conn, rt.config, storage=_storage(rt)))
    return 0


# -- reading: status, queues, watch -----------------------------------------------------------


def cmd_status(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.engine.progress import progress_body

    group = args.group and _checked(lambda: validation.group_id(args.group, "--group"))
    with _connect(rt, readonly=True) as conn, _read_only(conn):
        if group:
            row = _queue(rt, conn).progress(group)
            if row is None:
                raise _unknown_group(group)
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
    with _connect(rt, readonly=True) as conn, _read_only(conn):
        print_json(_queue(rt, conn).overview())
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
    group = _checked(lambda: validation.group_id(args.group, "GROUP"))
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


# -- the demo, and draining a group here (--now) ----------------------------------------------


@contextmanager
def _quiet_logs_on_a_terminal(rt: Runtime, stream: TextIO) -> Iterator[Path | None]:
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


def _drain(
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
    queue = _queue(rt, conn)
    runs: list[dict[str, Any]] = []
    stop = threading.Event()

    def follow() -> None:
        # Its own connection: the batch holds `conn` for its whole run.
        with db.connect(rt.database_url()) as own:
            q = _queue(rt, own)
            while True:
                p = q.progress(group)
                if p:
                    bar.update(p)
                if stop.wait(0.2):
                    return

    bar.update(queue.progress(group) or {})
    watcher = threading.Thread(target=follow, name="thumbq-bar", daemon=True)
    with _quiet_logs_on_a_terminal(rt, stream) as log_path, stopping.on_signals() as signalled:
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
                        _nap(signalled, result.retry_after_ms / 1000)
                    elif result.stopped_reason == "drained":
                        # Only retries waiting out their backoff are left.
                        _nap(signalled, 1)
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
            f"{_next_batch(rt, conn)}",
        )
    return runs


def _nap(stop: stopping.Stop, seconds: float) -> None:
    """Sleep on the main thread until `seconds` pass or a signal asks to stop."""
    until = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < until:
        time.sleep(min(0.1, max(until - time.monotonic(), 0.0)))


def _print_outcome(
    rt: Runtime, conn: db.Conn, group: str, runs: list[dict[str, Any]], prefix: str = ""
) -> None:
    """The group's counts, each file's outcome and each run's figures."""
    out = sys.stdout
    p = _queue(rt, conn).progress(group) or {}
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
        say(f"{left} job(s) still wait (retries after a transient error): {_next_batch(rt, conn)}")


def cmd_demo(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.local.samples import demo_files
    from worker.thumbnails.files import enqueue_keys as enqueue

    out = sys.stdout
    storage = _storage(rt)
    group = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    conn = _connect(rt)
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
    enqueue(conn, storage, rt.config, [{"source_key": prefix + n} for n in files], group)
    with conn:
        runs = _drain(rt, conn, storage, group, max_seconds=args.max_seconds)
        _print_outcome(rt, conn, group, runs, prefix)
    print(file=out)
    print(f"Thumbnails: {storage.url}/thumbnails/{prefix}", file=out)
    up = _local_up(rt)
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


# -- serving: serve, scheduler, up, down ------------------------------------------------------


def _default_port() -> int:
    # $PORT is the platform's convention (Heroku, Render, Cloud Run), read only here.
    raw = os.environ.get("PORT", "")
    return int(raw) if raw.isdigit() and int(raw) <= 65535 else 8000


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


def _server_threads(config: Config, threads: int) -> int:
    """The server's threads: `threads` for requests, and one more for each progress stream the
    app may hold open (THUMBQ_MAX_STREAMS), since a stream keeps its thread for as long as it is
    open: streams never take the threads that answer polls, batches and enqueues."""
    return threads + config.max_streams


def _listen(app: Any, host: str, port: int, threads: int) -> ServerThread:
    """The started server, or a one-line error when the address cannot be used."""
    from worker.local.server import ServerThread

    try:
        return ServerThread(app, host, port, threads=threads).start()
    except OSError as exc:
        raise CliError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port"
        ) from None


def _close_app(app: Any) -> None:
    """Close the app's connection pool and render processes now rather than at exit."""
    state = app.extensions.get("thumbq")
    if state is not None:
        state.close()


def _admin_secret_note(config: Config) -> None:
    if not config.cron_secret:
        say(
            "no admin secret: THUMBQ_CRON_SECRET is not set and no `thumbq up` has made one in "
            f"{config.home}, so admin routes answer 503 not_configured"
        )


def _granian_installed() -> bool:
    try:
        import granian  # noqa: F401
    except ImportError:
        return False
    return True


def cmd_serve(rt: Runtime, args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else _default_port()
    server_name = args.server or ("granian" if _granian_installed() else "waitress")
    if server_name == "granian" and not _granian_installed():
        raise CliError(
            "granian is not installed: pip install 'thumbq[granian]', or --server waitress"
        )
    url = rt.database_url()  # first: without a database, that is the one line to say
    _admin_secret_note(rt.config)
    config = rt.config.with_(database_url=url)
    if server_name == "granian":
        return _serve_granian(config, args.host, port, _server_threads(config, args.threads))
    from api import create_app

    app = create_app(config)
    with stopping.on_signals() as stop:
        server = _listen(app, args.host, port, _server_threads(config, args.threads))
        rt.announce(api_url=server.url)
        print(
            f"thumbq: serving on {server.url} with waitress (Ctrl-C to stop)",
            file=sys.stderr,
            flush=True,
        )
        sig = stopping.wait_for(stop)
        print(f"thumbq: {sig}, stopping", file=sys.stderr, flush=True)
        # A batch in flight sees the same stop and ends within its grace (worker.engine.stopping).
        server.close(stopping.SERVER_WAIT_S)
        _close_app(app)
    print("thumbq: stopped", file=sys.stderr, flush=True)
    return stop.exit_code(server=True)


def _serve_granian(config: Config, host: str, port: int, threads: int) -> int:
    """Serve with granian: HTTP in Rust, keep-alive after a 304 (waitress closes the connection
    after every 304, so each ETag poll paid for a new connection), and less CPU per request
    (bench/load.py). The app is built in granian's worker process from the environment."""
    import socket

    from granian import Granian
    from granian.constants import Interfaces

    # Probe the address first, so that a taken port is one clear line, as with waitress.
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as exc:
        raise CliError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port"
        ) from None
    # The worker reads its configuration from the environment: hand it the database this
    # process resolved (the embedded Postgres is started once, here, not in every worker).
    assert config.database_url is not None
    os.environ["DATABASE_URL"] = config.database_url
    url_host = f"[{host}]" if ":" in host else host
    print(
        f"thumbq: serving on http://{url_host}:{port} with granian (Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )
    server = Granian(
        "worker.cli:granian_app",
        factory=True,
        address=host,
        port=port,
        interface=Interfaces.WSGI,
        workers=1,
        # Request handlers block on Postgres, and a batch holds one for its whole budget.
        blocking_threads=threads,
        backlog=2048,
        websockets=False,
        log_access=False,
    )
    # granian keeps SIGINT and SIGTERM for itself: pass the stop on to its worker first, so
    # that a batch in flight there ends within its grace, and only then let granian stop the
    # worker. Not both at once: two signals in a row can land on a thread other than the one
    # that runs Python's handlers, and then neither runs (seen: the worker served on, 30 s).
    interrupt = server.signal_handler_interrupt
    relayed: list[bool] = []

    def stop_worker_then_granian(*args: Any, **kwargs: Any) -> None:
        import contextlib
        import multiprocessing
        import signal

        if relayed:  # a second signal: granian's own stop at once
            interrupt(*args, **kwargs)
            return
        relayed.append(True)
        for child in multiprocessing.active_children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid or 0, signal.SIGUSR1)
        threading.Timer(stopping.GRACE_S + 0.5, interrupt, args, kwargs).start()

    server.signal_handler_interrupt = stop_worker_then_granian  # type: ignore[method-assign]
    server.serve()
    print("thumbq: stopped", file=sys.stderr, flush=True)
    return 0


def granian_app() -> Any:
    """The app in granian's worker process, where SIGUSR1 (from `thumbq serve`) is the stop."""
    import signal

    from api import create_app

    signal.signal(signal.SIGUSR1, lambda signum, frame: stopping.requested().request("SIGUSR1"))
    return create_app()


def cmd_scheduler(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.local.cron import CronScheduler as Scheduler
    from worker.local.cron import cron_trigger

    config = rt.config
    _checked(lambda: _schedule_ok(config.schedule, cron_trigger))
    if not config.cron_secret:
        say(
            "no admin secret (THUMBQ_CRON_SECRET, or one `thumbq up` keeps in "
            f"{config.home}): the API will refuse the scheduler's calls"
        )
    sched = Scheduler(config)
    with stopping.on_signals() as stop:
        sched.start(run_now=args.now)
        sig = stopping.wait_for(stop)
        print(f"thumbq: {sig}, stopping after the current call", file=sys.stderr, flush=True)
        # The API records its batch whether or not anyone waits for the answer.
        sched.shutdown(timeout_s=stopping.CALL_WAIT_S)
    return stop.exit_code(server=True)


def _schedule_ok(schedule: str, cron_trigger: Callable[[str], Any]) -> None:
    try:
        cron_trigger(schedule)
    except ValueError as exc:
        raise validation.ValidationError(f"THUMBQ_SCHEDULE: {exc}") from None


def page_link(api_url: str, secret: str, latest: Sequence[dict[str, Any]] = ()) -> str:
    """The progress page of the latest group (or its group form), signed in for reading with a
    page token in the fragment: browsers never send a fragment, and the page moves it out of
    the address bar at once."""
    from urllib.parse import quote

    from worker.app.signing import page_token

    query = f"?group_id={quote(latest[0]['group_id'], safe='')}" if latest else ""
    return f"{api_url}/progress{query}#key={page_token(secret)}"


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
    from worker.local.cron import CronScheduler as Scheduler
    from worker.local.cron import cron_trigger

    out = sys.stdout
    config = rt.config
    _checked(lambda: _schedule_ok(config.schedule, cron_trigger))
    url = rt.database_url()
    import psycopg

    try:
        conn = db.connect(url)
    except psycopg.OperationalError as exc:
        raise CliError(_connect_error(exc, rt, url)) from None
    with conn:
        if not rt.embedded and not args.yes:
            _ask_before_writing(conn, rt)
        schema = db.init_schema(conn)
        latest = db.run(conn, "groups", {"limit": 1})
    secret, secret_from = ensure_cron_secret(config)
    config = config.with_(database_url=url, cron_secret=secret)

    port = args.port if args.port is not None else _default_port()
    app = create_app(config)
    try:
        server = _listen(app, args.host, port, _server_threads(config, args.threads))
    except CliError:
        _close_app(app)
        raise
    rt.announce(api_url=server.url, schedule=config.schedule)
    sched = Scheduler(config, api_url=server.url)
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
            _close_app(app)
    print("thumbq: stopped", file=sys.stderr, flush=True)
    return stop.exit_code(server=True)


def cmd_down(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.local import home
    from worker.local.embedded import EmbeddedPostgres

    server = EmbeddedPostgres(rt.config.home)
    with home.locked(rt.config.home):
        if server.pid() is None:
            print(f"The embedded Postgres in {rt.config.home} is not running.")
            return 0
        users = [r for r in home.running(rt.config.home) if r.embedded]
        if users and not args.force:
            names = ", ".join(r.name for r in users)
            raise CliError(
                f"the embedded Postgres in {rt.config.home} is in use by {names}: stop that "
                "first (Ctrl-C), or run `thumbq down --force`"
            )
        server.stop()
    print(f"Stopped the embedded Postgres in {rt.config.home}.")
    return 0


# -- jobs of any task: enqueue, show, cancel ------------------------------------------------------


def _option(field: str) -> str:
    """A job field as the option (or argument) that sets it: `ordering_key` -> `--ordering-key`."""
    return {"task": "TASK", "group_id": "--group"}.get(field, "--" + field.replace("_", "-"))


def cmd_jobs_enqueue(rt: Runtime, args: argparse.Namespace) -> int:
    import json

    from worker.app.jobs import SequenceConflict, view
    from worker.app.jobs import submit as enqueue

    item: dict[str, Any] = {"task": args.task, "group_id": args.group}
    if args.payload is not None:
        try:
            item["payload"] = json.loads(args.payload)
        except ValueError as exc:
            raise CliError(f"--payload is not JSON: {exc}") from None
    for field in ("priority", "ordering_key", "sequence", "idempotency_key", "max_attempts"):
        if getattr(args, field) is not None:
            item[field] = getattr(args, field)
    clean = _checked(lambda: validation.job_item(item, "", name_of=_option))
    wait_ms = None
    if args.wait_ms is not None:
        wait_ms = _checked(lambda: validation.wait_ms(rt.config, args.wait_ms, "--wait-ms"))
    with _connect(rt) as conn:
        storage = _storage(rt)
        try:
            [row] = enqueue(conn, storage, rt.config, [clean])
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
    with _connect(rt, readonly=True) as conn, _read_only(conn):
        job = get(conn, args.job_id, signer)
    if job is None:
        raise CliError(f"no job {args.job_id}")
    print_json(job)
    return 0


def cmd_jobs_cancel(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.app.jobs import cancel

    with _connect(rt) as conn:
        result = cancel(conn, args.job_id)
    if result is None:
        raise CliError(f"no job {args.job_id}")
    print_json(result)
    if not result["cancelled"]:
        say(f"job {args.job_id} had already ended ({result['status']}): nothing to cancel")
    return 0


# -- the parser -------------------------------------------------------------------------------

Handler = Callable[[Runtime, argparse.Namespace], int]

# Which environment each kind of command reads (its --help lists them).
ENV_DATABASE = {
    "DATABASE_URL": "Postgres to use; unset: the embedded Postgres in THUMBQ_HOME",
    "THUMBQ_HOME": "the per-user data directory (embedded database, storage, admin secret); "
    "default ~/.local/share/thumbq on Linux",
}
ENV_STORAGE = {
    "THUMBQ_STORAGE_URL": "file:///abs/dir or s3://bucket[/prefix]; default THUMBQ_HOME/storage",
    "THUMBQ_S3_ENDPOINT_URL": "S3-compatible endpoint (R2, Supabase Storage, MinIO)",
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION": "S3 credentials",
}
ENV_BATCH = {
    "THUMBQ_BUDGET_MS / THUMBQ_BUFFER_MS": "a batch's budget and safety buffer (10000 / 2000)",
    "THUMBQ_BATCH_SIZE": "most jobs one batch claims",
    "THUMBQ_CONCURRENCY": "parallel renders (CPU count)",
    "THUMBQ_MAX_ATTEMPTS": "attempts before the dead-letter queue (3)",
    "THUMBQ_THUMB_SIZE, THUMBQ_THUMB_SIZES, THUMBQ_THUMB_FORMAT": "thumbnail box(es) and format "
    "(512, webp)",
    "THUMBQ_PDF_PAGE, THUMBQ_MAX_PIXELS, THUMBQ_MAX_PAGES, THUMBQ_MAX_BYTES, "
    "THUMBQ_RENDER_MEMORY_MB, THUMBQ_RATE_BUCKET, THUMBQ_SOFFICE": "limits and tools: see the "
    "README's configuration table",
    "THUMBQ_TASKS, THUMBQ_PRIORITY_AGEING_S": "modules with more tasks; priority ageing (60 s)",
}
ENV_API = {
    "THUMBQ_CRON_SECRET": "the admin secret; default: the one `thumbq up` keeps in THUMBQ_HOME",
    "THUMBQ_JWT_SECRET, THUMBQ_JWKS_URL": "how users' Supabase tokens are verified (legacy "
    "HS256 secret; JWKS, default from SUPABASE_URL)",
    "THUMBQ_PROGRESS_CACHE_MS, THUMBQ_ACCESS_CACHE_MS": "progress and access caches",
    "THUMBQ_MAX_STREAMS": "progress streams (Server-Sent Events) open at once (32; 0: none)",
    "SUPABASE_URL, SUPABASE_ANON_KEY, THUMBQ_SUPABASE_JS_URL": "Realtime on the progress page",
}
ENV_SCHEDULE = {
    "THUMBQ_SCHEDULE": "cron schedule of the batch calls, UTC (*/5 * * * *)",
}
ENV_ALWAYS = {"THUMBQ_DEBUG": "1: print a traceback with an error"}


def _epilog(*groups: dict[str, str]) -> str:
    lines = ["environment:"]
    for group in (*groups, ENV_ALWAYS):
        for name, meaning in group.items():
            lines.append(f"  {name}\n      {meaning}")
    return "\n".join(lines)


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def _threads(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"must be 1 to 256, got {text!r}")
    return int(text)


def _job_id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"must be a job id (a positive integer), got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `thumbq` parser: every command, option and the environment each reads."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        here = version("thumbq")
    except PackageNotFoundError:  # run from a source tree that is not installed
        here = "unknown"
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(
        prog="thumbq",
        description="Background thumbnails for files in object storage: pgmq queues in "
        "Postgres, short time-budgeted batches, a progress page. Start with `thumbq demo` "
        "(a tour on sample files) or `thumbq up` (API, schedule and progress page).",
        epilog=_epilog(ENV_DATABASE, ENV_STORAGE)
        + "\n\n`thumbq COMMAND --help` describes a command and the environment it reads.",
        formatter_class=fmt,
    )
    p.add_argument("--version", action="version", version=f"thumbq {here}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str,
        func: Handler,
        summary: str,
        details: str,
        *env: dict[str, str],
        group: Any = sub,
    ) -> argparse.ArgumentParser:
        """A command of `group` (the top level, or `thumbq jobs`), described with its
        environment."""
        sp = group.add_parser(
            name,
            help=summary,
            description=f"{summary}. {details}".strip(),
            epilog=_epilog(*env),
            formatter_class=fmt,
        )
        sp.set_defaults(func=func)
        return sp

    # -- the main jobs
    def serving_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
        sp.add_argument(
            "--port",
            type=_port,
            default=None,
            help="port to listen on (default: $PORT, else 8000; 0: any free port)",
        )
        sp.add_argument(
            "--threads",
            type=_threads,
            default=4,
            metavar="N",
            help="request threads (default 4); progress streams get THUMBQ_MAX_STREAMS more",
        )

    sp = add(
        "up",
        cmd_up,
        "the main job: database, schema, API server, schedule and progress page in one command",
        "Applies the schema, serves the HTTP API (waitress, in this process), calls the batch "
        "endpoint on THUMBQ_SCHEDULE (and once at start), and prints a link that opens the "
        "progress page signed in, read-only. Ctrl-C stops it.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_API,
        ENV_SCHEDULE,
        ENV_BATCH,
        {"PORT": "default port"},
    )
    serving_args(sp)
    sp.add_argument(
        "--yes",
        action="store_true",
        help="apply the schema to a DATABASE_URL that holds other schemas and no thumbq yet "
        "(asked otherwise)",
    )

    sp = add(
        "demo",
        cmd_demo,
        "a tour: sample files, enqueue them, drain with a progress bar, show the outcome",
        "Writes slides, reports, photos and two broken files to storage, enqueues them as one "
        "group, runs batches here until the group is done and prints every file's outcome.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_BATCH,
    )
    sp.add_argument(
        "--max-seconds",
        type=_seconds,
        default=DEFAULT_DRAIN_S,
        help=f"give up waiting for retries after this long (default {DEFAULT_DRAIN_S:.0f})",
    )

    def now_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--now",
            action="store_true",
            help="run batches here until the group has nothing left to do, with a progress bar "
            "(otherwise the next scheduled batch takes the work)",
        )
        sp.add_argument(
            "--max-seconds",
            type=_seconds,
            default=DEFAULT_DRAIN_S,
            help="with --now: stop waiting for retries after this long "
            f"(default {DEFAULT_DRAIN_S:.0f})",
        )

    # -- work
    sp = add(
        "enqueue",
        cmd_enqueue,
        "enqueue files (storage keys) for thumbnails",
        "Each key's version (etag) and type are asked of storage; a file that is not there is "
        "reported as missing. Says when the next batch will run, or use --now.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_SCHEDULE,
    )
    sp.add_argument("keys", nargs="+", metavar="KEY", help="a key inside THUMBQ_STORAGE_URL")
    sp.add_argument("--group", default="default", help="the group to add them to (default)")
    sp.add_argument("--etag", default=None, help="the version to enqueue (default: ask storage)")
    now_args(sp)

    sp = add(
        "backfill",
        cmd_backfill,
        "enqueue every file under a prefix that has no thumbnail yet",
        "Lists storage under --prefix and enqueues each file lacking a thumbnail for its "
        "current version (retroactive generation). --prefix '' lists the whole storage.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_SCHEDULE,
    )
    sp.add_argument(
        "--prefix", required=True, help="key prefix to list, e.g. uploads/ ('' for everything)"
    )
    sp.add_argument("--group", default="backfill", help="the group to add them to (backfill)")
    now_args(sp)

    sp = add(
        "run-batch",
        cmd_run_batch,
        "run one time-budgeted batch here and print its summary",
        "What the scheduler's call to POST /api/thumbnails/batch-generate does.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_BATCH,
    )
    sp.add_argument(
        "--budget-ms",
        type=int,
        default=None,
        help="a shorter budget for this batch, 1000 up to THUMBQ_BUDGET_MS",
    )
    sp.add_argument(
        "--max-items",
        type=int,
        default=None,
        help="at most this many items, up to THUMBQ_BATCH_SIZE",
    )

    sp = add(
        "retry-failed",
        cmd_retry_failed,
        "queue a group's failed jobs again, with fresh attempts",
        "Their dead letters are removed. Permanent failures (corrupt_input, ...) fail again.",
        ENV_DATABASE,
    )
    sp.add_argument("group", metavar="GROUP", help="the group id")
    sp = add(
        "cancel",
        cmd_cancel,
        "cancel a group's pending and processing jobs",
        "",
        ENV_DATABASE,
    )
    sp.add_argument("group", metavar="GROUP", help="the group id")
    add(
        "cleanup-stale",
        cmd_cleanup_stale,
        "reset processing jobs whose lease expired (their batch was killed), prune old history",
        "Finished jobs, batch runs and pgmq archives older than THUMBQ_RETENTION_DAYS are "
        "pruned in bounded chunks; group summaries stay. Temporary files that writes killed "
        "mid-way left in local file storage are removed once 15 minutes old.",
        ENV_DATABASE,
        {"THUMBQ_RETENTION_DAYS": "keep finished jobs this many days (30; 0 keeps everything)"},
    )

    # -- reading
    sp = add(
        "status",
        cmd_status,
        "the latest groups and their counts, or one group's progress as JSON",
        "Read-only: never creates or changes a schema.",
        ENV_DATABASE,
    )
    sp.add_argument("--group", default=None, help="one group's progress, in the API's JSON shape")
    sp.add_argument(
        "--failures",
        action="store_true",
        help="with --group: its files without a thumbnail and why (status, error code, message)",
    )
    add(
        "queues",
        cmd_queues,
        "queue depth, in flight, oldest message, dead letters, jobs by status, bucket, alerts",
        "Read-only: never creates or changes a schema.",
        ENV_DATABASE,
    )
    sp = add(
        "watch",
        cmd_watch,
        "follow a group's progress, a line per change, until it is done",
        "Over Supabase Realtime when configured, else by polling the API (the one a `thumbq "
        "up` of this THUMBQ_HOME serves, or THUMBQ_API_URL). Read-only.",
        {
            "THUMBQ_API_URL": "the API to poll (default: this home's `thumbq up`, else "
            "http://127.0.0.1:8000)",
            "THUMBQ_CRON_SECRET": "the admin secret; default: the one `thumbq up` keeps in "
            "THUMBQ_HOME",
            "THUMBQ_HOME": ENV_DATABASE["THUMBQ_HOME"],
            "THUMBQ_USER_JWT": "a user's access token (RLS decides what it sees)",
            "SUPABASE_URL, SUPABASE_ANON_KEY": "follow the group over Supabase Realtime",
        },
    )
    sp.add_argument("group", metavar="GROUP", help="the group id")
    sp.add_argument("--api-url", default=None, help="the API to poll (default: see below)")
    sp.add_argument("--token", default=None, help="a user's access token (THUMBQ_USER_JWT)")
    sp.add_argument(
        "--timeout", type=_seconds, default=None, help="give up after this many seconds"
    )

    # -- serving and schema
    sp = add(
        "serve",
        cmd_serve,
        "serve the HTTP API alone",
        "With granian when installed (pip install 'thumbq[granian]': keep-alive after a 304, "
        "about a third of waitress's CPU per poll), else waitress.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_API,
        ENV_BATCH,
        {"PORT": "default port"},
    )
    serving_args(sp)
    sp.add_argument(
        "--server",
        choices=("granian", "waitress"),
        default=None,
        help="HTTP server (default: granian if installed, else waitress)",
    )
    sp = add(
        "scheduler",
        cmd_scheduler,
        "call the batch endpoint on THUMBQ_SCHEDULE, chaining while work remains",
        "For an API served elsewhere (`thumbq serve`, a platform).",
        {"THUMBQ_API_URL": "the API to call (http://127.0.0.1:8000)"},
        ENV_SCHEDULE,
        {"THUMBQ_CRON_SECRET": ENV_API["THUMBQ_CRON_SECRET"]},
    )
    sp.add_argument("--now", action="store_true", help="make the first call at once")
    sp = add(
        "down",
        cmd_down,
        "stop this home's embedded Postgres",
        "Commands stop it themselves when the last one using it ends; this is for one left "
        "behind (a killed command). Refuses while a thumbq command still uses it.",
        {"THUMBQ_HOME": ENV_DATABASE["THUMBQ_HOME"]},
    )
    sp.add_argument("--force", action="store_true", help="stop it even while commands use it")

    jobs = sub.add_parser(
        "jobs",
        help="jobs of any task: enqueue, show, cancel",
        description="Jobs of any task (THUMBQ_TASKS modules; `thumbnail` is built in), as "
        "POST /api/jobs, GET /api/jobs/<id> and POST /api/jobs/<id>/cancel do them.",
        formatter_class=fmt,
    )
    jobsub = jobs.add_subparsers(dest="jobs_command", required=True, metavar="COMMAND")

    def add_job(name: str, func: Handler, summary: str, details: str, *env: dict[str, str]) -> Any:
        return add(name, func, summary, details, *env, group=jobsub)

    sp = add_job(
        "enqueue",
        cmd_jobs_enqueue,
        "enqueue one job of a task and print its id and status",
        "Checked as POST /api/jobs checks it. The same --idempotency-key (per task), or "
        "--ordering-key and --sequence, names the existing job instead of making another. A "
        'thumbnail job\'s payload is {"source_key", "etag"?, "content_type"?}. With '
        "--wait-ms the job runs here at once (under the same rate limit and lease as a batch) "
        "and the answer carries its result, or says why it still waits.",
        ENV_DATABASE,
        ENV_STORAGE,
        ENV_BATCH,
    )
    sp.add_argument("task", metavar="TASK", help="the task's name (thumbnail, or a registered one)")
    sp.add_argument(
        "--payload", default=None, metavar="JSON", help="the job's input, as JSON (default null)"
    )
    sp.add_argument("--group", default="default", help="the group to add it to (default)")
    sp.add_argument(
        "--priority", type=int, default=None, metavar="0-9", help="higher runs first (default 0)"
    )
    sp.add_argument(
        "--ordering-key",
        default=None,
        metavar="KEY",
        help="jobs sharing it run one at a time, in --sequence order",
    )
    sp.add_argument(
        "--sequence",
        type=int,
        default=None,
        metavar="N",
        help="its place among its ordering key's jobs (default: after the last)",
    )
    sp.add_argument(
        "--idempotency-key",
        default=None,
        metavar="KEY",
        help="enqueueing the same key (per task) again returns the existing job",
    )
    sp.add_argument(
        "--max-attempts",
        type=int,
        default=None,
        metavar="N",
        help="attempts before the dead-letter queue, 1-100 (default: the task's, else "
        "THUMBQ_MAX_ATTEMPTS)",
    )
    sp.add_argument(
        "--wait-ms",
        type=int,
        default=None,
        metavar="MS",
        help="run it here now and wait up to this long for its result, 100 up to "
        "THUMBQ_BUDGET_MS - THUMBQ_BUFFER_MS",
    )
    sp = add_job(
        "show",
        cmd_jobs_show,
        "one job: status, payload, result or error, attempts, ordering, progress, times",
        "Read-only: never creates or changes a schema.",
        ENV_DATABASE,
    )
    sp.add_argument("job_id", type=_job_id, metavar="ID", help="the job's id")
    sp = add_job(
        "cancel",
        cmd_jobs_cancel,
        "cancel a job that waits or runs",
        "A running handler sees ctx.cancelled() at its next check; the next job of its "
        "ordering key goes.",
        ENV_DATABASE,
    )
    sp.add_argument("job_id", type=_job_id, metavar="ID", help="the job's id")

    dbp = sub.add_parser(
        "db",
        help="schema management: init, export-migration",
        description="Schema management.",
        formatter_class=fmt,
    )
    dbsub = dbp.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    init = dbsub.add_parser(
        "init",
        help="install pgmq and the thumbq schema (safe to re-run)",
        description="Install pgmq (the extension where offered, else the pgmq package's SQL) "
        "and apply the schema files not yet applied. Safe to run again and again.",
        epilog=_epilog(ENV_DATABASE),
        formatter_class=fmt,
    )
    init.set_defaults(func=cmd_db_init)
    export = dbsub.add_parser(
        "export-migration",
        help="write Supabase CLI migrations generated from sql/",
        description="Write supabase/migrations/ from sql/ (new files only; shipped ones are "
        "never rewritten).",
        epilog=_epilog(),
        formatter_class=fmt,
    )
    export.add_argument(
        "--out", default="supabase/migrations", help="where (default supabase/migrations)"
    )
    export.set_defaults(func=cmd_db_export_migration)
    return p


# -- main -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `thumbq` console script: the command's exit code."""
    args = build_parser().parse_args(argv)
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


def describe_error(exc: BaseException) -> str:
    """One line that says what went wrong and what to do about it."""
    import psycopg

    from worker.engine.errors import InvalidKey, ThumbqError
    from worker.local.embedded import EmbeddedError, EmbeddedUnavailable

    if isinstance(
        exc,
        CliError | ConfigError | EmbeddedError | EmbeddedUnavailable | InvalidKey,
    ):
        text = str(exc)
    elif isinstance(exc, validation.ValidationError):
        text = exc.message
    elif isinstance(exc, db.SchemaChainError):
        text = str(exc)
    elif isinstance(
        exc,
        psycopg.errors.UndefinedTable
        | psycopg.errors.UndefinedFunction
        | psycopg.errors.InvalidSchemaName,
    ):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        text = f"the database lacks part of the thumbq schema ({first}): run `thumbq db init`"
    elif isinstance(exc, psycopg.OperationalError):
        text = (
            f"lost the database ({' '.join(str(exc).split())[:200]}): check that it is running "
            "and try again"
        )
    elif isinstance(exc, psycopg.Error):
        text = f"the database refused: {' '.join(str(exc).split())[:300]}"
    elif isinstance(exc, ThumbqError) and exc.code == "storage_error":
        text = f"storage: {exc.message}; check THUMBQ_STORAGE_URL and its credentials"
    elif isinstance(exc, ThumbqError):
        text = exc.message
    elif isinstance(exc, RuntimeError) and str(exc).startswith("thumbq: "):
        text = str(exc)
    elif isinstance(exc, PermissionError | FileNotFoundError | IsADirectoryError):
        text = f"{exc.strerror}: {exc.filename}"
    elif isinstance(exc, ValueError) and "THUMBQ_" in str(exc):
        text = str(exc)
    else:
        text = (
            f"unexpected error: {type(exc).__name__}: {exc} (THUMBQ_DEBUG=1 shows where; "
            "please report it)"
        )
    text = " ".join(text.split())
    return text.removeprefix("thumbq: ")


if __name__ == "__main__":
    sys.exit(main())
