"""The `thumbq` command line."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from worker import db
from worker.config import Config, ConfigError
from worker.queue import Queue
from worker.signing import PAGE_TOKEN_TTL_S

if TYPE_CHECKING:
    from worker.serving import ServerThread

Handler = Callable[[Config, argparse.Namespace], int]


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


def _connect(config: Config) -> db.Conn:
    """Connect, creating the schema first if this database has none yet."""
    conn = db.connect(db.database_url(config))
    row = conn.execute("select to_regclass('thumbq.jobs') is not null as ready").fetchone()
    if not (row and row["ready"]):
        result = db.init_schema(conn)
        print(f"thumbq: schema created ({', '.join(result['applied'])})", file=sys.stderr)
    return conn


def _storage(config: Config) -> Any:
    from worker.storage import open_storage

    return open_storage(config)


def _queue(config: Config, conn: db.Conn) -> Queue:
    return Queue(conn, bucket=config.rate_bucket, max_attempts=config.max_attempts)


# -- commands ---------------------------------------------------------------------------------


def cmd_db_init(config: Config, args: argparse.Namespace) -> int:
    with db.connect(db.database_url(config)) as conn:
        _print_json(db.init_schema(conn))
    return 0


def cmd_db_export_migration(config: Config, args: argparse.Namespace) -> int:
    from worker.migrations import export

    for path in export(Path(args.out)):
        print(path)
    return 0


def cmd_run_batch(config: Config, args: argparse.Namespace) -> int:
    from worker.batch import run_batch

    with _connect(config) as conn:
        result = run_batch(
            config, conn, _storage(config), budget_ms=args.budget_ms, max_items=args.max_items
        )
    _print_json(result.response())
    return 0


def cmd_enqueue(config: Config, args: argparse.Namespace) -> int:
    from worker.service import enqueue

    items = [{"source_key": k} | ({"etag": args.etag} if args.etag else {}) for k in args.keys]
    with _connect(config) as conn:
        result = enqueue(conn, _storage(config), config, items, args.group)
    _print_json({"group_id": args.group, **result})
    return 0


def cmd_backfill(config: Config, args: argparse.Namespace) -> int:
    from worker.service import backfill

    with _connect(config) as conn:
        _print_json(backfill(conn, _storage(config), config, args.prefix, args.group))
    return 0


def cmd_status(config: Config, args: argparse.Namespace) -> int:
    with _connect(config) as conn:
        if args.group:
            progress = _queue(config, conn).progress(args.group)
            if progress is None:
                print(f"thumbq: no group {args.group!r}", file=sys.stderr)
                return 1
            _print_json(progress)
        else:
            _print_table(
                db.run(conn, "groups", {"limit": 50}),
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


def cmd_queues(config: Config, args: argparse.Namespace) -> int:
    with _connect(config) as conn:
        _print_json(_queue(config, conn).overview())
    return 0


def cmd_retry_failed(config: Config, args: argparse.Namespace) -> int:
    with _connect(config) as conn:
        _print_json({"requeued": _queue(config, conn).retry_failed(args.group)})
    return 0


def cmd_cancel(config: Config, args: argparse.Namespace) -> int:
    with _connect(config) as conn:
        _print_json({"cancelled": _queue(config, conn).cancel(args.group)})
    return 0


def cmd_cleanup_stale(config: Config, args: argparse.Namespace) -> int:
    with _connect(config) as conn:
        from worker.service import cleanup_stale

        _print_json(cleanup_stale(conn, config))
    return 0


def cmd_demo(config: Config, args: argparse.Namespace) -> int:
    from worker.batch import render_options, run_batch
    from worker.render.process import RenderPool
    from worker.samples import demo_files
    from worker.service import enqueue

    out = sys.stdout
    storage = _storage(config)
    group = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    where = "DATABASE_URL" if config.database_url else f"embedded Postgres under {config.home}"
    print(f"thumbq demo: database: {where}", file=out)
    conn = _connect(config)
    files = demo_files()
    prefix = f"samples/{group}/"
    for name, (data, content_type) in files.items():
        storage.put(prefix + name, data, content_type)
    print(
        f"thumbq demo: {len(files)} sample files written to {storage.url}/{prefix} "
        "(two are broken on purpose)",
        file=out,
    )
    enqueue(conn, storage, config, [{"source_key": prefix + n} for n in files], group)

    runs: list[dict[str, Any]] = []
    stop = threading.Event()
    watcher = threading.Thread(
        target=_watch_progress, args=(config, group, stop, sys.stderr), daemon=True
    )
    watcher.start()
    try:
        with RenderPool(
            render_options(config), config.concurrency, config.render_memory_mb
        ) as pool:
            # Until drained: a retry after a transient failure waits out its backoff (15 to
            # 30 s for the first), so the bound is time, not a number of runs.
            give_up = time.monotonic() + args.max_seconds
            while time.monotonic() < give_up:
                result = run_batch(config, conn, storage, pool)
                runs.append(result.response())
                progress = _queue(config, conn).progress(group) or {}
                if progress.get("pending", 0) + progress.get("processing", 0) == 0:
                    break
                if result.stopped_reason == "rate_limited" and result.retry_after_ms:
                    time.sleep(result.retry_after_ms / 1000)
                elif result.stopped_reason == "drained":
                    # Only retries waiting out their backoff are left.
                    time.sleep(1)
    finally:
        stop.set()
        watcher.join()

    progress = _queue(config, conn).progress(group) or {}
    print(file=out)
    print(f"Group {group}: {progress.get('progress_percentage')}% done", file=out)
    _print_table(
        [
            {"status": s, "jobs": progress.get(s, 0)}
            for s in ("completed", "failed", "unsupported", "cancelled", "pending", "processing")
        ],
        ["status", "jobs"],
        out,
    )
    print(file=out)
    jobs = conn.execute(
        "select source_key, status, error_code, thumbnail_key, width, height, duration_ms"
        " from thumbq.jobs where group_id = %s order by source_key",
        [group],
    ).fetchall()
    _print_table(
        [{**j, "source_key": j["source_key"].removeprefix(prefix)} for j in jobs],
        ["source_key", "status", "error_code", "width", "height", "duration_ms"],
        out,
    )
    print(file=out)
    _print_table(
        runs,
        [
            "run_id",
            "processed",
            "succeeded",
            "failed",
            "retried",
            "remaining",
            "stopped_reason",
            "duration_ms",
        ],
        out,
    )
    print(file=out)
    print(f"Thumbnails: {storage.url}/thumbnails/{prefix}", file=out)
    conn.close()
    return 0


def _watch_progress(config: Config, group: str, stop: threading.Event, stream: TextIO) -> None:
    """Draw the group's progress bar until `stop`, from its own connection."""
    tty = stream.isatty()
    last = None
    with db.connect(db.database_url(config)) as conn:
        q = _queue(config, conn)
        while True:
            p = q.progress(group)
            if p:
                line = _bar(p)
                if tty:
                    print("\r" + line, end="", file=stream, flush=True)
                elif line != last:
                    print(line, file=stream, flush=True)
                last = line
            if stop.wait(0.2):
                break
    if tty:
        print(file=stream)


def _bar(p: dict[str, Any], width: int = 30) -> str:
    pct = float(p["progress_percentage"] or 0)
    filled = round(width * pct / 100)
    done = p["total"] - p["pending"] - p["processing"]
    eta = p.get("estimated_time_remaining_seconds")
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}%  {done}/{p['total']}"
        f"  ok {p['completed']}  failed {p['failed']}  unsupported {p['unsupported']}"
        + (f"  eta {eta}s" if eta else "")
    )


def _print_table(
    rows: Sequence[dict[str, Any]], columns: list[str], stream: TextIO | None = None
) -> None:
    stream = stream or sys.stdout
    cells = [[("" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)), file=stream)
    print("  ".join("-" * w for w in widths), file=stream)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)), file=stream)


def cmd_watch(config: Config, args: argparse.Namespace) -> int:
    import os

    from worker.watch import WatchOptions, watch

    # A user's access token is a per-person credential, not service configuration: read here,
    # for this command only.
    user_jwt = args.token or os.environ.get("THUMBQ_USER_JWT") or None
    opts = WatchOptions(
        api_url=(args.api_url or config.api_url).rstrip("/"),
        # The user's token first: it sees what that user may see, and no more.
        api_token=user_jwt or config.cron_secret,
        supabase_url=config.supabase_url,
        supabase_anon_key=config.supabase_anon_key,
        user_jwt=user_jwt,
        timeout_s=args.timeout,
    )
    try:
        return watch(opts, args.group, sys.stdout, sys.stderr)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


# -- serving: serve, scheduler, up --------------------------------------------------------------

SECRET_FILE = "cron_secret"  # noqa: S105 (a file name)


def _wait_for_signal() -> str:
    """Block until SIGINT or SIGTERM; return the signal's name."""
    import signal

    got: list[str] = []
    done = threading.Event()

    def handler(signum: int, frame: object) -> None:
        got.append(signal.Signals(signum).name)
        done.set()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        # A timed wait, so that the handler gets to run promptly on every platform.
        while not done.wait(0.5):
            pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return got[0]


def _default_port() -> int:
    # $PORT is the platform's convention (Heroku, Render, Cloud Run), read only here.
    import os

    raw = os.environ.get("PORT", "")
    return int(raw) if raw.isdigit() else 8000


def ensure_cron_secret(config: Config) -> tuple[str, Path | None]:
    """The admin secret and the file that keeps it (None: it came from THUMBQ_CRON_SECRET).

    Without THUMBQ_CRON_SECRET, a random secret is made once and kept in THUMBQ_HOME (mode 0600)
    so that the scheduler, bookmarks and scripts keep working across restarts.
    """
    import os
    import secrets

    if config.cron_secret:
        return config.cron_secret, None
    path = config.home / SECRET_FILE
    config.home.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
        secret = path.read_text(encoding="utf-8").strip()
        if len(secret) >= 16:
            return secret, path
        # An empty or truncated file (a crash while writing) is replaced, not trusted.
        path.unlink()
        return ensure_cron_secret(config)
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    return secret, path


def _listen(app: Any, host: str, port: int, threads: int) -> ServerThread | None:
    """The started server, or None (with a message) when the address cannot be used."""
    from worker.serving import ServerThread

    try:
        return ServerThread(app, host, port, threads=threads).start()
    except OSError as exc:
        print(f"thumbq: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return None


def _close_app(app: Any) -> None:
    """Close the app's connection pool and render processes now rather than at exit."""
    state = app.extensions.get("thumbq")
    if state is not None:
        state.close()


def cmd_serve(config: Config, args: argparse.Namespace) -> int:
    port = args.port if args.port is not None else _default_port()
    if args.server == "granian":
        return _serve_granian(config, args.host, port, args.threads)
    from api import create_app

    app = create_app(config)
    server = _listen(app, args.host, port, args.threads)
    if server is None:
        return 1
    print(f"thumbq: serving on {server.url} (Ctrl-C to stop)", file=sys.stderr, flush=True)
    sig = _wait_for_signal()
    print(f"thumbq: {sig}, stopping", file=sys.stderr, flush=True)
    server.close()
    _close_app(app)
    return 0


def _serve_granian(config: Config, host: str, port: int, threads: int) -> int:
    """Serve with granian: HTTP in Rust, keep-alive after a 304 (waitress closes the connection
    after every 304, so each ETag poll paid for a new connection), and less CPU per request
    (bench/load.py). The app is built in granian's worker process from the environment."""
    import os
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
        print(f"thumbq: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    # The worker reads its configuration from the environment: hand it the database this
    # process resolved (starting the embedded Postgres once, here, not in every worker).
    os.environ["DATABASE_URL"] = db.database_url(config)
    url_host = f"[{host}]" if ":" in host else host
    print(
        f"thumbq: serving on http://{url_host}:{port} with granian (Ctrl-C to stop)",
        file=sys.stderr,
        flush=True,
    )
    Granian(
        "api:create_app",
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
    ).serve()
    print("thumbq: stopped", file=sys.stderr, flush=True)
    return 0


def cmd_scheduler(config: Config, args: argparse.Namespace) -> int:
    from worker.scheduler import Scheduler

    if not config.cron_secret:
        print(
            "thumbq: THUMBQ_CRON_SECRET is not set; the API will refuse the scheduler's calls",
            file=sys.stderr,
        )
    sched = Scheduler(config)
    sched.start(run_now=args.now)
    sig = _wait_for_signal()
    print(f"thumbq: {sig}, stopping after the current call", file=sys.stderr, flush=True)
    sched.shutdown()
    return 0


def page_link(api_url: str, secret: str, latest: Sequence[dict[str, Any]] = ()) -> str:
    """The progress page of the latest group (or its group form), signed in for reading with a
    page token in the fragment: browsers never send a fragment, and the page moves it out of
    the address bar at once."""
    from urllib.parse import quote

    from worker.signing import page_token

    query = f"?group_id={quote(latest[0]['group_id'], safe='')}" if latest else ""
    return f"{api_url}/progress{query}#key={page_token(secret)}"


def cmd_up(config: Config, args: argparse.Namespace) -> int:
    from api import create_app
    from worker.scheduler import Scheduler

    out = sys.stdout
    if config.database_url:
        from psycopg.conninfo import conninfo_to_dict

        info = conninfo_to_dict(config.database_url)
        where = f"DATABASE_URL ({info.get('host') or 'local socket'}/{info.get('dbname', '')})"
    else:
        where = f"embedded Postgres under {config.home}"
    url = db.database_url(config)  # starts the embedded server once, here
    with db.connect(url) as conn:
        schema = db.init_schema(conn)
        latest = db.run(conn, "groups", {"limit": 1})
    secret, secret_from = ensure_cron_secret(config)
    config = config.with_(database_url=url, cron_secret=secret)

    port = args.port if args.port is not None else _default_port()
    app = create_app(config)
    server = _listen(app, args.host, port, args.threads)
    if server is None:
        return 1
    sched = Scheduler(config, api_url=server.url)
    print("thumbq up", file=out)
    print(f"  database:      {where}", file=out)
    if schema["applied"]:
        print(f"  schema:        applied {', '.join(schema['applied'])}", file=out)
    print(f"  API:           {server.url}", file=out)
    print(f"  progress page: {page_link(server.url, secret, latest)}", file=out)
    print(
        f"                 (opens signed in, read-only, for {PAGE_TOKEN_TTL_S // 3600} h;"
        " the admin secret is not in the link)",
        file=out,
    )
    if secret_from is None:
        print("  admin secret:  from THUMBQ_CRON_SECRET", file=out)
    else:
        print(f"  admin secret:  kept in {secret_from} (mode 0600)", file=out)
    print(f"  schedule:      {config.schedule} (UTC), and a first batch at start", file=out)
    print("Press Ctrl-C to stop.", file=out, flush=True)
    sched.start(run_now=True)
    try:
        sig = _wait_for_signal()
        print(f"thumbq: {sig}, stopping", file=sys.stderr, flush=True)
    finally:
        # Scheduler first: its running call needs the server to answer.
        sched.shutdown()
        server.close()
        _close_app(app)
    print("thumbq: stopped", file=sys.stderr, flush=True)
    return 0


# -- parser -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="thumbq", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, func: Handler, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(func=func)
        return sp

    dbp = sub.add_parser("db", help="schema management")
    dbsub = dbp.add_subparsers(dest="db_command", required=True)
    init = dbsub.add_parser("init", help="install pgmq and the thumbq schema (safe to re-run)")
    init.set_defaults(func=cmd_db_init)
    export = dbsub.add_parser(
        "export-migration", help="write Supabase CLI migrations generated from sql/"
    )
    export.add_argument("--out", default="supabase/migrations")
    export.set_defaults(func=cmd_db_export_migration)

    sp = add("run-batch", cmd_run_batch, "run one time-budgeted batch and print its summary")
    sp.add_argument("--budget-ms", type=int, default=None)
    sp.add_argument("--max-items", type=int, default=None)

    sp = add("enqueue", cmd_enqueue, "enqueue storage keys for thumbnails")
    sp.add_argument("keys", nargs="+")
    sp.add_argument("--group", default="default")
    sp.add_argument("--etag", default=None, help="the etag of the version (default: ask storage)")

    sp = add("backfill", cmd_backfill, "enqueue every file under a prefix lacking a thumbnail")
    sp.add_argument("--prefix", default="")
    sp.add_argument("--group", default="backfill")

    sp = add("status", cmd_status, "groups and their progress")
    sp.add_argument("--group", default=None)

    add("queues", cmd_queues, "queue depth, in flight, DLQ, jobs by status, bucket, alerts")

    sp = add("retry-failed", cmd_retry_failed, "queue a group's failed jobs again")
    sp.add_argument("group")
    sp = add("cancel", cmd_cancel, "cancel a group's pending and processing jobs")
    sp.add_argument("group")
    add("cleanup-stale", cmd_cleanup_stale, "reset processing jobs whose lease expired")

    sp = add(
        "watch", cmd_watch, "follow a group's progress (Supabase Realtime or polling) until done"
    )
    sp.add_argument("group")
    sp.add_argument("--api-url", default=None, help="default: THUMBQ_API_URL")
    sp.add_argument("--token", default=None, help="default: THUMBQ_USER_JWT")
    sp.add_argument("--timeout", type=float, default=None, help="give up after this many s")

    sp = add("demo", cmd_demo, "make sample files, enqueue them, drain with a progress bar")
    sp.add_argument("--max-seconds", type=float, default=300)

    def serving_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--host", default="127.0.0.1")
        sp.add_argument("--port", type=int, default=None, help="default: $PORT or 8000")
        sp.add_argument("--threads", type=int, default=4, help="request threads (default 4)")

    sp = add("serve", cmd_serve, "serve the HTTP API (granian; --server waitress also works)")
    serving_args(sp)
    sp.add_argument("--server", choices=("granian", "waitress"), default="granian")
    sp = add("scheduler", cmd_scheduler, "call the batch endpoint on THUMBQ_SCHEDULE, chaining")
    sp.add_argument("--now", action="store_true", help="make the first call at once")
    sp = add("up", cmd_up, "database, schema, API server and scheduler in one command")
    serving_args(sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `thumbq` console script."""
    args = build_parser().parse_args(argv)
    try:
        config = Config.from_env()
    except ConfigError as exc:
        print(f"thumbq: {exc}", file=sys.stderr)
        return 2
    from worker.embedded import EmbeddedUnavailable

    try:
        return int(args.func(config, args))
    except EmbeddedUnavailable as exc:
        print(f"thumbq: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
