"""The suite in three rooms, each with its own fixtures:

- tests/unit: no Postgres and no servers. The database fixtures are not defined there, so a unit
  test that asks for one errors ("fixture 'db_url' not found") instead of reaching a server.
- tests/db: SQL and the engine against Postgres (tests/support/postgres.py, one database per test).
- tests/system: servers, `thumbq` subprocesses, the browser, S3 (moto), pgbouncer, extensions.

Helpers the rooms share live in tests/support/.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import scheduling
from tests.support.pgtools import SUPABASE_LIVE_VARS


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Every other missing thing fails in CI (`pgtools.require`); a live Supabase project cannot
    # be had there, so the tests that need one are skipped by their marker, never by a tool check.
    if item.get_closest_marker("supabase") and not all(
        os.environ.get(v) for v in SUPABASE_LIVE_VARS
    ):
        pytest.skip(
            "needs a live Supabase project with thumbq's migrations pushed: set "
            + ", ".join(SUPABASE_LIVE_VARS)
            + " (THUMBQ_USER_JWT: a signed-in user's access token; SUPABASE_DB_URL: its database)"
        )


@pytest.fixture(autouse=True)
def _ordinary_scheduling() -> Iterator[None]:
    """A test that leaves its process real-time fails, and the process is put back: everything
    the xdist worker starts later would inherit the policy and starve the machine's two cores
    (tests/support/scheduling.py)."""
    saved = scheduling.policy()
    yield
    if scheduling.policy() != saved:
        left = scheduling.policy()
        scheduling.restore(saved)
        pytest.fail(f"the test left its process with scheduling policy {left}, not {saved}")
