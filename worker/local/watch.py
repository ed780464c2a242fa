"""`thumbq watch GROUP`: follow one group's progress until nothing is left to do.

Two ways to hear about changes:

- Supabase Realtime, when `SUPABASE_URL`, `SUPABASE_ANON_KEY` and a user's access token
  (`THUMBQ_USER_JWT`) are set: the private broadcast topic `thumbq:group:<id>` that
  sql/006_realtime.sql feeds on every change of the group's summary row. A private topic, not
  postgres_changes, because it is authorised per topic by the membership policy on
  realtime.messages, costs one message per change instead of every subscriber decoding the WAL,
  and the anon key alone could see nothing either way (anon reads no thumbq table). Needs the
  optional `supabase` package (`pip install 'thumbq[supabase]'`), imported only here.
- Polling the API (`THUMBQ_API_URL` + /api/thumbnails/progress) with the user's token or the
  admin secret, waiting `poll_after_ms` between requests and sending If-None-Match, so that an
  unchanged group costs a 304 and prints nothing. Used when Realtime is not configured, cannot
  be imported, or its subscription fails.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

# Exit codes: the group is done; it does not exist (or the caller may not see it); the watch
# cannot work as configured (no credentials, refused token) or gave up. Errors exit 1, as every
# thumbq command's do (2 is for a usage error).
DONE, NOT_FOUND, UNUSABLE = 0, 1, 1
# Bounds on the wait between polls, whatever the server suggests or the network does.
MIN_POLL_MS, MAX_POLL_MS = 100, 30_000
SUBSCRIBE_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class WatchOptions:
    """Where to read progress from, and with which credentials."""

    api_url: str
    api_token: str | None = None
    supabase_url: str | None = None
    supabase_anon_key: str | None = None
    user_jwt: str | None = None
    # Give up after this long (None: until done or Ctrl-C).
    timeout_s: float | None = None

    @property
    def realtime_configured(self) -> bool:
        return bool(self.supabase_url and self.supabase_anon_key and self.user_jwt)


def from_group_row(row: dict[str, Any]) -> dict[str, Any]:
    """Progress fields from a thumbq.groups row, as Realtime delivers it (no percentage there)."""
    total = int(row.get("total") or 0)
    left = int(row.get("pending") or 0) + int(row.get("processing") or 0)
    pct = 0.0 if total == 0 else round(100.0 * (total - left) / total, 1)
    return {**row, "progress_percentage": pct}


def is_done(p: dict[str, Any]) -> bool:
    """Nothing waiting or running in a group that has jobs."""
    return (
        int(p.get("total") or 0) > 0
        and int(p.get("pending") or 0) + int(p.get("processing") or 0) == 0
    )


def progress_line(p: dict[str, Any], width: int = 30) -> str:
    """One line: a bar, the percentage, done of total, the outcome counts and the ETA."""
    pct = float(p.get("progress_percentage") or 0.0)
    filled = round(width * pct / 100)
    total = int(p.get("total") or 0)
    done = total - int(p.get("pending") or 0) - int(p.get("processing") or 0)
    eta = p.get("estimated_time_remaining_seconds")
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {pct:5.1f}%  {done}/{total}"
        f"  completed {p.get('completed', 0)}  failed {p.get('failed', 0)}"
        f"  unsupported {p.get('unsupported', 0)}  cancelled {p.get('cancelled', 0)}"
        + (f"  eta {eta}s" if eta else "")
    )


class _Printer:
    """Prints a line only when it differs from the last one."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.last: str | None = None

    def show(self, p: dict[str, Any]) -> None:
        line = progress_line(p)
        if line != self.last:
            print(line, file=self.out, flush=True)
            self.last = line


# -- polling ----------------------------------------------------------------------------------


@dataclass
class PollAnswer:
    """One answer of the progress endpoint."""

    status: int
    body: dict[str, Any] | None
    poll_after_ms: int


class ProgressClient:
    """GET /api/thumbnails/progress with the bearer token and the last ETag."""

    def __init__(self, api_url: str, token: str | None, timeout_s: float = 10.0) -> None:
        if urllib.parse.urlsplit(api_url).scheme not in ("http", "https"):
            raise ValueError(f"the API URL must be http(s)://..., got {api_url!r}")
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self.etag: str | None = None

    def fetch(self, group_id: str) -> PollAnswer:
        """One request; network failures raise OSError (URLError is one)."""
        url = (
            f"{self.api_url}/api/thumbnails/progress?"
            f"{urllib.parse.urlencode({'group_id': group_id})}"
        )
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.etag:
            headers["If-None-Match"] = self.etag
        req = urllib.request.Request(url, headers=headers)  # noqa: S310 (scheme checked)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310 (scheme checked)
                status, raw, hdrs = resp.status, resp.read(), resp.headers
        except urllib.error.HTTPError as exc:
            status, raw, hdrs = exc.code, exc.read(), exc.headers
        body = None
        if raw and "json" in (hdrs.get("Content-Type") or ""):
            body = json.loads(raw)
        if status == 200 and hdrs.get("ETag"):
            self.etag = hdrs["ETag"]
        wait = hdrs.get("X-Poll-After-Ms") or (body or {}).get("poll_after_ms")
        if status == 503 and hdrs.get("Retry-After", "").isdigit():
            wait = int(hdrs["Retry-After"]) * 1000
        return PollAnswer(status, body, int(wait) if wait else 1000)


def _error_text(answer: PollAnswer) -> str:
    err = (answer.body or {}).get("error") or {}
    return str(err.get("message") or f"HTTP {answer.status}")


def poll(
    opts: WatchOptions,
    group_id: str,
    out: TextIO,
    err: TextIO,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Poll the progress endpoint until the group is done; return the exit code."""
    client = ProgressClient(opts.api_url, opts.api_token)
    printer = _Printer(out)
    deadline = None if opts.timeout_s is None else clock() + opts.timeout_s
    failures = 0
    while True:
        try:
            answer = client.fetch(group_id)
        except OSError as exc:
            failures += 1
            if failures == 1:
                print(f"thumbq watch: cannot reach {opts.api_url} ({exc}); retrying", file=err)
            # Back off on a dead API instead of hammering it.
            answer = PollAnswer(0, None, min(MAX_POLL_MS, 500 * 2 ** min(failures, 6)))
        else:
            failures = 0
        if answer.status == 200 and answer.body is not None:
            printer.show(answer.body)
            if is_done(answer.body):
                return DONE
        elif answer.status == 404:
            print(f"thumbq watch: {_error_text(answer)}", file=err)
            return NOT_FOUND
        elif answer.status in (401, 403) or (
            answer.status == 503
            and (answer.body or {}).get("error", {}).get("code") == "not_configured"
        ):
            print(f"thumbq watch: the API refused: {_error_text(answer)}", file=err)
            return UNUSABLE
        # 304 (nothing changed), 503 (database down) and network errors: wait and ask again.
        if deadline is not None and clock() >= deadline:
            print(f"thumbq watch: gave up after {opts.timeout_s} s", file=err)
            return UNUSABLE
        sleep(max(MIN_POLL_MS, min(MAX_POLL_MS, answer.poll_after_ms)) / 1000)


# -- Supabase Realtime ------------------------------------------------------------------------


def realtime_topic(group_id: str) -> str:
    """The private broadcast topic that sql/006_realtime.sql sends a group's changes to."""
    return f"thumbq:group:{group_id}"


async def _follow_realtime(
    opts: WatchOptions, group_id: str, out: TextIO, err: TextIO
) -> int | None:
    from supabase import AClientOptions, acreate_client

    assert opts.supabase_url and opts.supabase_anon_key and opts.user_jwt
    # Few, quick connection retries: a watcher that cannot connect should be polling within
    # seconds, not after the client's default backoff of about 15 s.
    client = await acreate_client(
        opts.supabase_url,
        opts.supabase_anon_key,
        AClientOptions(realtime={"max_retries": 3, "initial_backoff": 0.5}),
    )
    # The user's token authorises the private topic (RLS on realtime.messages).
    await client.realtime.set_auth(opts.user_jwt)
    events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def on_progress(message: Any) -> None:
        payload = message.get("payload") or {}
        events.put_nowait(("record", payload.get("record", payload)))

    def on_state(state: Any, error: Exception | None) -> None:
        events.put_nowait(("state", (getattr(state, "value", str(state)), error)))

    options: Any = {"config": {"private": True}}
    channel = client.channel(realtime_topic(group_id), options)
    channel.on_broadcast("progress", on_progress)
    try:
        await asyncio.wait_for(channel.subscribe(on_state), SUBSCRIBE_TIMEOUT_S)
        printer = _Printer(out)
        loop = asyncio.get_running_loop()
        deadline = None if opts.timeout_s is None else loop.time() + opts.timeout_s
        # A first snapshot: the broadcast only carries changes, and a finished group has none.
        if opts.api_token:
            snapshot = await asyncio.to_thread(_snapshot, opts, group_id)
            if snapshot is not None:
                printer.show(snapshot)
                if is_done(snapshot):
                    return DONE
        while True:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                kind, value = await asyncio.wait_for(events.get(), remaining)
            except TimeoutError:
                print(f"thumbq watch: gave up after {opts.timeout_s} s", file=err)
                return UNUSABLE
            if kind == "state":
                state, error = value
                if state == "SUBSCRIBED":
                    continue
                why = f"{state}{f': {error}' if error else ''}"
                print(
                    f"thumbq watch: Realtime channel {realtime_topic(group_id)} {why}; "
                    "polling the API instead",
                    file=err,
                )
                return None
            progress = from_group_row(value)
            printer.show(progress)
            if is_done(progress):
                return DONE
    finally:
        await client.realtime.remove_all_channels()
        await client.realtime.close()


def _snapshot(opts: WatchOptions, group_id: str) -> dict[str, Any] | None:
    try:
        answer = ProgressClient(opts.api_url, opts.api_token).fetch(group_id)
    except OSError:
        return None
    return answer.body if answer.status == 200 else None


def follow_realtime(opts: WatchOptions, group_id: str, out: TextIO, err: TextIO) -> int | None:
    """Follow the group's private broadcast topic; None when Realtime cannot be used."""
    try:
        import supabase  # noqa: F401
    except ImportError:
        print(
            "thumbq watch: SUPABASE_URL is set but the supabase package is not installed "
            "(pip install 'thumbq[supabase]'); polling the API instead",
            file=err,
        )
        return None
    try:
        return asyncio.run(_follow_realtime(opts, group_id, out, err))
    except Exception as exc:  # whatever breaks the optional path, polling still works
        print(
            f"thumbq watch: Realtime subscription failed ({exc!r}); polling the API instead",
            file=err,
        )
        return None


def watch(opts: WatchOptions, group_id: str, out: TextIO, err: TextIO) -> int:
    """Realtime when configured and working, else polling; the exit code."""
    if opts.supabase_url and opts.supabase_anon_key and not opts.user_jwt:
        print(
            "thumbq watch: Realtime needs a group member's access token in THUMBQ_USER_JWT "
            "(private topics are authorised per user); polling the API instead",
            file=err,
        )
    if opts.realtime_configured:
        code = follow_realtime(opts, group_id, out, err)
        if code is not None:
            return code
    if not opts.api_token:
        print(
            "thumbq watch: set THUMBQ_USER_JWT or THUMBQ_CRON_SECRET so the API lets you read "
            "progress",
            file=err,
        )
        return UNUSABLE
    return poll(opts, group_id, out, err)
