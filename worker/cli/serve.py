"""Serving: `thumbq serve` (the HTTP API alone, with granian or waitress), `thumbq scheduler`
(the schedule alone) and `thumbq down` (stops a home's embedded Postgres left behind)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from worker.app import validation
from worker.cli import spec
from worker.cli.errors import CliError, checked, say
from worker.cli.runtime import Runtime
from worker.cli.spec import (
    ENV_API,
    ENV_BATCH,
    ENV_DATABASE,
    ENV_SCHEDULE,
    ENV_STORAGE,
    Arg,
    Command,
)
from worker.engine import stopping
from worker.engine.config import Config

if TYPE_CHECKING:
    from worker.local.server import ServerThread


def default_port() -> int:
    # $PORT is the platform's convention (Heroku, Render, Cloud Run), read only here.
    raw = os.environ.get("PORT", "")
    return int(raw) if raw.isdigit() and int(raw) <= 65535 else 8000


def server_threads(config: Config, threads: int) -> int:
    """The server's threads: `threads` for requests, and one more for each progress stream the
    app may hold open (THUMBQ_MAX_STREAMS), since a stream keeps its thread for as long as it is
    open: streams never take the threads that answer polls, batches and enqueues."""
    return threads + config.max_streams


def listen(app: Any, host: str, port: int, threads: int) -> ServerThread:
    """The started server, or a one-line error when the address cannot be used."""
    from worker.local.server import ServerThread

    try:
        return ServerThread(app, host, port, threads=threads).start()
    except OSError as exc:
        raise CliError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): choose another --port"
        ) from None


def close_app(app: Any) -> None:
    """Close the app's connection pool and render processes now rather than at exit."""
    state = app.extensions.get("thumbq")
    if state is not None:
        state.close()


def admin_secret_note(config: Config) -> None:
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
    port = args.port if args.port is not None else default_port()
    server_name = args.server or ("granian" if _granian_installed() else "waitress")
    if server_name == "granian" and not _granian_installed():
        raise CliError(
            "granian is not installed: pip install 'thumbq[granian]', or --server waitress"
        )
    url = rt.database_url()  # first: without a database, that is the one line to say
    admin_secret_note(rt.config)
    config = rt.config.with_(database_url=url)
    if server_name == "granian":
        return _serve_granian(config, args.host, port, server_threads(config, args.threads))
    from api import create_app

    app = create_app(config)
    with stopping.on_signals() as stop:
        server = listen(app, args.host, port, server_threads(config, args.threads))
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
        close_app(app)
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
        "worker.cli.serve:granian_app",
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
    from worker.local.cron import CronScheduler, cron_trigger

    config = rt.config
    checked(lambda: schedule_ok(config.schedule, cron_trigger))
    if not config.cron_secret:
        say(
            "no admin secret (THUMBQ_CRON_SECRET, or one `thumbq up` keeps in "
            f"{config.home}): the API will refuse the scheduler's calls"
        )
    sched = CronScheduler(config)
    with stopping.on_signals() as stop:
        sched.start(run_now=args.now)
        sig = stopping.wait_for(stop)
        print(f"thumbq: {sig}, stopping after the current call", file=sys.stderr, flush=True)
        # The API records its batch whether or not anyone waits for the answer.
        sched.shutdown(timeout_s=stopping.CALL_WAIT_S)
    return stop.exit_code(server=True)


def schedule_ok(schedule: str, cron_trigger: Callable[[str], Any]) -> None:
    try:
        cron_trigger(schedule)
    except ValueError as exc:
        raise validation.ValidationError(f"THUMBQ_SCHEDULE: {exc}") from None


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


# `serve` and `up`: where and with how many threads to listen.
SERVING_ARGS = (
    Arg("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)"),
    Arg(
        "--port",
        type=spec.port,
        default=None,
        help="port to listen on (default: $PORT, else 8000; 0: any free port)",
    ),
    Arg(
        "--threads",
        type=spec.threads,
        default=4,
        metavar="N",
        help="request threads (default 4); progress streams get THUMBQ_MAX_STREAMS more",
    ),
)

COMMANDS = (
    Command(
        "serve",
        cmd_serve,
        "serve the HTTP API alone",
        "With granian when installed (pip install 'thumbq[granian]': keep-alive after a 304, "
        "about a third of waitress's CPU per poll), else waitress.",
        env=(ENV_DATABASE, ENV_STORAGE, ENV_API, ENV_BATCH, {"PORT": "default port"}),
        args=(
            *SERVING_ARGS,
            Arg(
                "--server",
                choices=("granian", "waitress"),
                default=None,
                help="HTTP server (default: granian if installed, else waitress)",
            ),
        ),
    ),
    Command(
        "scheduler",
        cmd_scheduler,
        "call the batch endpoint on THUMBQ_SCHEDULE, chaining while work remains",
        "For an API served elsewhere (`thumbq serve`, a platform).",
        env=(
            {"THUMBQ_API_URL": "the API to call (http://127.0.0.1:8000)"},
            ENV_SCHEDULE,
            {"THUMBQ_CRON_SECRET": ENV_API["THUMBQ_CRON_SECRET"]},
        ),
        args=(Arg("--now", action="store_true", help="make the first call at once"),),
    ),
    Command(
        "down",
        cmd_down,
        "stop this home's embedded Postgres",
        "Commands stop it themselves when the last one using it ends; this is for one left "
        "behind (a killed command). Refuses while a thumbq command still uses it.",
        env=({"THUMBQ_HOME": ENV_DATABASE["THUMBQ_HOME"]},),
        args=(Arg("--force", action="store_true", help="stop it even while commands use it"),),
    ),
)
