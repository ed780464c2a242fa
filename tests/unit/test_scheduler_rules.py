"""The scheduler's chaining rules, its cron fields and its secret, without a server."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from worker.cli import ensure_cron_secret
from worker.engine.config import Config
from worker.local.cron import HttpResponse, cron_trigger, next_step


def _ok(**body: object) -> HttpResponse:
    return HttpResponse(200, {"processed": 5, "remaining": 10, **body}, 100)


def test_chains_at_once_while_a_run_stops_on_its_budget_with_work_left() -> None:
    step = next_step(_ok(stopped_reason="time_budget"), now=0, next_tick=300, budget_s=10, calls=1)
    assert (step.action, step.delay_s) == ("chain", 0)
    step = next_step(_ok(stopped_reason="max_items"), now=0, next_tick=300, budget_s=10, calls=1)
    assert step.action == "chain"


def test_never_chains_a_call_that_could_still_run_when_the_next_tick_is_due() -> None:
    resp = _ok(stopped_reason="time_budget")
    assert next_step(resp, now=289, next_tick=300, budget_s=10, calls=3).action == "chain"
    step = next_step(resp, now=290, next_tick=300, budget_s=10, calls=3)
    assert (step.action, step.why) == ("stop", "next_tick_due")


def test_waits_out_the_rate_limit_but_only_within_the_tick() -> None:
    resp = _ok(stopped_reason="rate_limited", retry_after_ms=2500)
    step = next_step(resp, now=0, next_tick=300, budget_s=10, calls=1)
    assert (step.action, step.delay_s) == ("wait", 2.5)
    assert next_step(resp, now=288, next_tick=300, budget_s=10, calls=1).action == "stop"


def test_stops_when_drained_idle_failing_or_making_no_progress() -> None:
    kw = {"now": 0, "next_tick": 300, "budget_s": 10, "calls": 1}
    assert next_step(_ok(stopped_reason="drained"), **kw).why == "drained"
    assert next_step(_ok(stopped_reason="time_budget", remaining=0), **kw).action == "stop"
    assert next_step(HttpResponse(None, None, 5, "refused"), **kw).why == "error"
    assert next_step(HttpResponse(503, {"error": {}}, 5, "down"), **kw).why == "error"
    stuck = _ok(stopped_reason="time_budget", processed=0)
    assert next_step(stuck, **kw).why == "no_progress"
    busy = _ok(stopped_reason="time_budget")
    assert next_step(busy, now=0, next_tick=300, budget_s=1, calls=100).why == "max_calls"


def test_cron_fields_are_crontab_ones_with_optional_seconds() -> None:
    start = datetime(2026, 1, 1, 12, 3, 20, tzinfo=UTC)  # a Thursday
    every5 = cron_trigger("*/5 * * * *")
    assert every5.get_next_fire_time(None, start) == datetime(2026, 1, 1, 12, 5, tzinfo=UTC)
    every2s = cron_trigger("*/2 * * * * *")
    assert every2s.get_next_fire_time(None, start) == datetime(2026, 1, 1, 12, 3, 20, tzinfo=UTC)
    # crontab's 0 is Sunday (APScheduler 3's own numbering would say Monday).
    sunday = cron_trigger("0 3 * * 0").get_next_fire_time(None, start)
    assert sunday == datetime(2026, 1, 4, 3, 0, tzinfo=UTC)
    assert sunday.weekday() == 6
    with pytest.raises(ValueError, match="5 cron fields"):
        cron_trigger("* * *")


def test_cron_secret_is_generated_once_kept_private_and_reused(tmp_path: Path) -> None:
    config = Config.from_env({"THUMBQ_HOME": str(tmp_path / "home")})
    secret, path = ensure_cron_secret(config)
    assert path is not None and path.stat().st_mode & 0o777 == 0o600
    assert len(secret) >= 32
    assert ensure_cron_secret(config) == (secret, path)
    given = config.with_(cron_secret="from-the-environment")
    assert ensure_cron_secret(given) == ("from-the-environment", None)
