"""`thumbq scheduler`: call the batch endpoint on a cron schedule, chaining while work remains.

Every tick (default `*/5 * * * *`, UTC) posts to `/api/thumbnails/batch-generate`. While a run
stops on `time_budget`/`max_items` with work remaining, the next call follows at once; on
`rate_limited` it follows after `retry_after_ms`. A chain stops early enough that its last call
ends before the next tick is due, so ticks never overlap. `cleanup-stale` runs every 15 minutes.
One JSON log line per HTTP call. The API being down is logged and retried on the next tick.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from worker.engine.log import log_event
from worker.engine.states import StopReason

if TYPE_CHECKING:
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.base import BaseTrigger

    from worker.engine.config import Config

BATCH_PATH = "/api/thumbnails/batch-generate"
CLEANUP_PATH = "/api/thumbnails/cleanup-stale"
CLEANUP_EVERY_S = 15 * 60
# A chain never makes more calls than this in one tick, whatever the clock says.
MAX_CALLS_PER_TICK = 100
# Room for HTTP and connection set-up on top of a run's budget when deciding whether one more
# call ends before the next tick.
CHAIN_SLACK_S = 0.5
# The HTTP timeout is the budget plus this: the server stops itself at the budget, so a call
# that takes much longer than that is stuck, not busy.
TIMEOUT_MARGIN_S = 15.0
# Bounds on a rate-limit wait: not a busy loop, and never an unbounded sleep.
MIN_RATE_WAIT_S = 0.05
DEFAULT_RATE_WAIT_S = 1.0
# After these the tick calls again at once: work remains that a new invocation can take.
CHAIN_REASONS = frozenset({StopReason.TIME_BUDGET, StopReason.MAX_ITEMS})
# How often a tick waiting for its call's answer checks whether a shutdown gave up on it.
ABANDON_POLL_S = 0.05

_DOW_NAMES = ("sun", "mon", "tue", "wed", "thu", "fri", "sat", "sun")


@dataclass(frozen=True)
class HttpResponse:
    """What one call returned: a status and JSON body, or an error when there was no answer."""

    status: int | None
    body: dict[str, Any] | None
    duration_ms: int
    error: str | None = None


HttpCaller = Callable[[str, str | None, float], HttpResponse]


def post_json(url: str, secret: str | None, timeout_s: float) -> HttpResponse:
    """POST `{}` to `url` with the bearer secret; never raises for HTTP or network errors."""
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"the API URL must be http(s), got {url!r}")
    req = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")  # noqa: S310
    started = time.monotonic()
    status: int | None = None
    raw = b""
    error: str | None = None
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (http(s) URL from config)
            status = resp.status
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        status = exc.code
        raw = exc.read()
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        error = f"{type(reason).__name__}: {reason}"
    duration_ms = round((time.monotonic() - started) * 1000)
    body: dict[str, Any] | None = None
    if raw:
        try:
            parsed = json.loads(raw)
            body = parsed if isinstance(parsed, dict) else None
        except ValueError:
            body = None
    if status is not None and status >= 400 and error is None:
        err = (body or {}).get("error") or {}
        error = f"{err.get('code', 'http_error')}: {err.get('message', f'HTTP {status}')}"
    return HttpResponse(status, body, duration_ms, error)


@dataclass(frozen=True)
class Step:
    """What to do after a call: `chain` now, `wait` then call, or `stop` until the next tick."""

    action: str
    delay_s: float = 0.0
    why: str = ""


def next_step(
    resp: HttpResponse,
    *,
    now: float,
    next_tick: float,
    budget_s: float,
    calls: int,
    max_calls: int = MAX_CALLS_PER_TICK,
    slack_s: float = CHAIN_SLACK_S,
) -> Step:
    """Decide whether the tick makes another call, from the last answer and the clock.

    `now` and `next_tick` are on the same clock (seconds). Another call is made only if it can
    start after its wait and still end, budget and slack included, before the next tick.
    """
    body = resp.body
    if resp.status != 200 or body is None:
        return Step("stop", why="error")
    reason = body.get("stopped_reason")
    remaining = int(body.get("remaining") or 0)
    if remaining <= 0:
        return Step("stop", why="nothing_remaining")
    if reason in CHAIN_REASONS:
        if not body.get("processed"):
            # Nothing fitted in a whole budget: calling again at once would do the same.
            return Step("stop", why="no_progress")
        delay = 0.0
        action = "chain"
    elif reason == StopReason.RATE_LIMITED:
        ms = body.get("retry_after_ms")
        delay = max(MIN_RATE_WAIT_S, ms / 1000) if ms is not None else DEFAULT_RATE_WAIT_S
        action = "wait"
    else:
        # `drained` with work remaining: only retries waiting out their backoff are left.
        return Step("stop", why=str(reason))
    if calls >= max_calls:
        return Step("stop", why="max_calls")
    if now + delay + budget_s + slack_s > next_tick:
        return Step("stop", why="next_tick_due")
    return Step(action, delay, why=str(reason))


def cron_trigger(expr: str) -> BaseTrigger:
    """A UTC cron trigger from 5 fields (crontab) or 6 (seconds first, for fast schedules).

    Day-of-week numbers follow crontab (0 and 7 are Sunday), not APScheduler 3's own
    numbering (0 is Monday), so `0 3 * * 0` means Sunday as everywhere else.
    """
    from apscheduler.triggers.cron import CronTrigger

    fields = expr.split()
    if len(fields) == 5:
        fields = ["0", *fields]
    if len(fields) != 6:
        raise ValueError(
            f"THUMBQ_SCHEDULE must have 5 cron fields (or 6 with seconds first), got {expr!r}"
        )
    second, minute, hour, day, month, dow = fields
    dow = re.sub(r"(?<![/\d])([0-7])(?!\d)", lambda m: _DOW_NAMES[int(m.group(1))], dow.lower())
    return CronTrigger(
        second=second,
        minute=minute,
        hour=hour,
        day=day,
        month=month,
        day_of_week=dow,
        timezone=UTC,
    )


@dataclass
class TickSummary:
    """What one tick did: its calls, items processed, and why it stopped."""

    calls: int = 0
    processed: int = 0
    stopped: str = ""
    remaining: int | None = None


class CronScheduler:
    """Calls the batch endpoint on a trigger, one tick at a time, and cleanup-stale on another.

    `http`, `clock` and `now` are injectable so that the chaining can be driven by a test, but
    the default is real HTTP against a running API.
    """

    def __init__(
        self,
        config: Config,
        *,
        api_url: str | None = None,
        trigger: BaseTrigger | None = None,
        cleanup_every_s: float = CLEANUP_EVERY_S,
        http: HttpCaller = post_json,
        max_calls: int = MAX_CALLS_PER_TICK,
        clock: Callable[[], float] = time.monotonic,
        now: Callable[[], datetime] | None = None,
    ) -> None:
        self.api_url = (api_url or config.api_url).rstrip("/")
        self.secret = config.cron_secret
        self.trigger = trigger or cron_trigger(config.schedule)
        self.cleanup_every_s = cleanup_every_s
        self.http = http
        self.max_calls = max_calls
        self.clock = clock
        self.now = now or (lambda: datetime.now(UTC))
        self.budget_s = config.budget_ms / 1000
        self.ticks: list[TickSummary] = []
        self.cleanups: list[HttpResponse] = []
        self._stopping = threading.Event()
        # Set while no tick runs; a shutdown waits for it, then gives up on the call in flight.
        self._idle = threading.Event()
        self._idle.set()
        self._abandon = threading.Event()
        self._scheduler: BackgroundScheduler | None = None

    @property
    def timeout_s(self) -> float:
        return self.budget_s + TIMEOUT_MARGIN_S

    def _next_tick(self) -> float:
        """When the trigger fires next, on `clock`'s scale (inf when it never does)."""
        wall = self.now()
        # Passing `wall` as the previous fire time asks for a fire time strictly after it.
        nxt = self.trigger.get_next_fire_time(wall, wall)
        if nxt is None:
            return float("inf")
        return self.clock() + (nxt - wall) / timedelta(seconds=1)

    def tick(self) -> TickSummary:
        """One scheduled tick: a batch call, then chained calls while the rules allow."""
        self._idle.clear()
        try:
            return self._tick()
        finally:
            self._idle.set()

    def _tick(self) -> TickSummary:
        summary = TickSummary()
        next_tick = self._next_tick()
        url = self.api_url + BATCH_PATH
        while not self._stopping.is_set():
            resp = self._call(url)
            if resp is None:
                log_event("scheduler_call", job="batch", url=url, abandoned=True, why="shutdown")
                break
            summary.calls += 1
            body = resp.body or {}
            if resp.status == 200 and body.get("budget_ms"):
                # The server's own budget is what bounds its next call.
                self.budget_s = float(body["budget_ms"]) / 1000
            if resp.status == 200:
                summary.processed += int(body.get("processed") or 0)
                summary.remaining = body.get("remaining")
            step = next_step(
                resp,
                now=self.clock(),
                next_tick=next_tick,
                budget_s=self.budget_s,
                calls=summary.calls,
                max_calls=self.max_calls,
            )
            log_event(
                "scheduler_call",
                job="batch",
                url=url,
                status=resp.status,
                duration_ms=resp.duration_ms,
                stopped_reason=body.get("stopped_reason") if resp.status == 200 else None,
                processed=body.get("processed") if resp.status == 200 else None,
                remaining=summary.remaining if resp.status == 200 else None,
                run_id=body.get("run_id") if resp.status == 200 else None,
                call=summary.calls,
                chained=summary.calls > 1,
                next=step.action,
                why=step.why,
                wait_ms=round(step.delay_s * 1000) if step.action == "wait" else None,
                error=resp.error,
            )
            if step.action == "stop":
                summary.stopped = step.why
                break
            if step.delay_s:
                self._stopping.wait(step.delay_s)
        if not summary.stopped:
            summary.stopped = "shutdown"
        self.ticks.append(summary)
        return summary

    def _call(self, url: str) -> HttpResponse | None:
        """`http` on a thread of its own, so that a shutdown can stop waiting for its answer
        (None then): the API records its batch whether or not anyone reads the answer."""
        box: list[HttpResponse | Exception] = []
        done = threading.Event()

        def call() -> None:
            try:
                box.append(self.http(url, self.secret, self.timeout_s))
            except Exception as exc:  # raised on the tick's thread, as before
                box.append(exc)
            finally:
                done.set()

        threading.Thread(target=call, name="thumbq-scheduler-call", daemon=True).start()
        while not done.wait(ABANDON_POLL_S):
            if self._abandon.is_set():
                return None
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def cleanup(self) -> HttpResponse:
        """Reset expired `processing` leases through the API."""
        url = self.api_url + CLEANUP_PATH
        resp = self.http(url, self.secret, self.timeout_s)
        log_event(
            "scheduler_call",
            job="cleanup",
            url=url,
            status=resp.status,
            duration_ms=resp.duration_ms,
            reset_count=(resp.body or {}).get("reset_count") if resp.status == 200 else None,
            error=resp.error,
        )
        self.cleanups.append(resp)
        return resp

    def start(self, *, run_now: bool = False) -> None:
        """Start in a background thread; `run_now` adds a first tick at once (unless the next
        scheduled one is due within a budget anyway)."""
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.interval import IntervalTrigger

        sched = BackgroundScheduler(
            timezone=UTC,
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
        )
        # An extra tick now only if its call ends before the scheduled one is due; otherwise it
        # would hold the single instance slot and make the scheduler skip that tick.
        run_now = run_now and self._next_tick() - self.clock() > self.budget_s + CHAIN_SLACK_S
        first: dict[str, Any] = {"next_run_time": self.now()} if run_now else {}
        sched.add_job(self._safe(self.tick), self.trigger, id="batch", name="batch", **first)
        sched.add_job(
            self._safe(self.cleanup),
            IntervalTrigger(seconds=self.cleanup_every_s, timezone=UTC),
            id="cleanup",
            name="cleanup-stale",
        )
        self._stopping.clear()
        self._abandon.clear()
        sched.start()
        self._scheduler = sched
        log_event(
            "scheduler_started",
            url=self.api_url,
            trigger=str(self.trigger),
            cleanup_every_s=self.cleanup_every_s,
            run_now=run_now,
            secret_set=bool(self.secret),
        )

    def shutdown(self, *, wait: bool = True, timeout_s: float | None = None) -> None:
        """Stop ticking; no further call is chained and a running call is waited for (at most
        `timeout_s`, then left to end on its own: its batch is recorded by the API)."""
        self._stopping.set()
        if timeout_s is not None and not self._idle.wait(timeout_s):
            self._abandon.set()
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=wait)
            self._scheduler = None
            log_event("scheduler_stopped", ticks=len(self.ticks))

    @staticmethod
    def _safe(func: Callable[[], object]) -> Callable[[], None]:
        """Run `func`, logging what it raises, so that one bad tick never stops the schedule."""

        def run() -> None:
            try:
                func()
            except Exception as exc:  # the next tick tries again
                log_event("scheduler_error", error=f"{type(exc).__name__}: {exc}")

        run.__name__ = getattr(func, "__name__", "job")
        return run
