"""What the CLI tells a person about what happens next: when the next batch takes new work (a
`thumbq up` or `scheduler` of this home, or pg_cron), and where to follow a group in a browser."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from worker.cli.errors import say
from worker.cli.runtime import Runtime
from worker.engine import db


def local_up(rt: Runtime) -> Any:
    """The registration of a `thumbq up` of this home that serves this database, if any."""
    from worker.local import home

    me = home.database_fingerprint(rt.database_url())
    for reg in home.running(rt.config.home):
        if reg.command == "up" and reg.api_url and reg.database == me:
            return reg
    return None


def page_link(api_url: str, secret: str, latest: Sequence[dict[str, Any]] = ()) -> str:
    """The progress page of the latest group (or its group form), signed in for reading with a
    page token in the fragment: browsers never send a fragment, and the page moves it out of
    the address bar at once."""
    from urllib.parse import quote

    from worker.app.signing import page_token

    query = f"?group_id={quote(latest[0]['group_id'], safe='')}" if latest else ""
    return f"{api_url}/progress{query}#key={page_token(secret)}"


def page_note(rt: Runtime, group: str) -> None:
    """Where to follow a group in a browser, when a `thumbq up` of this home serves the page."""
    up = local_up(rt)
    if up is not None and rt.config.cron_secret:
        link = page_link(up.api_url, rt.config.cron_secret, [{"group_id": group}])
        say(f"follow group {group!r} in a browser: {link}")


def next_batch(rt: Runtime, conn: db.Conn) -> str:
    """When the next batch is due for this database, as far as this machine can know: a
    `thumbq up`/`scheduler` of the same home, or pg_cron in the database."""
    from worker.local import home
    from worker.local.cron import cron_trigger

    now = datetime.now(UTC)
    me = home.database_fingerprint(rt.database_url())
    hint = "or add --now to run batches here until they are done"
    for reg in home.running(rt.config.home):
        if reg.schedule and reg.database == me:
            return f"{next_fire(cron_trigger(reg.schedule), now)} by {reg.name}; {hint}"
    cron = pg_cron_schedule(conn)
    if cron:
        return f"{next_fire(cron_trigger(cron), now)} by pg_cron (thumbq-batch, {cron}); {hint}"
    return (
        "no batch is scheduled from here: start `thumbq up` (it serves the API and runs a "
        f"batch every 5 minutes), run `thumbq run-batch`, {hint}"
    )


def next_fire(trigger: Any, now: datetime) -> str:
    nxt = trigger.get_next_fire_time(None, now)
    if nxt is None:
        return "no batch will come"
    seconds = max(0, round((nxt - now).total_seconds()))
    wait = f"{seconds} s" if seconds < 120 else f"{seconds // 60} min {seconds % 60} s"
    return f"the next batch is due at {nxt.strftime('%H:%M:%S')} UTC (in {wait})"


def pg_cron_schedule(conn: db.Conn) -> str | None:
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
