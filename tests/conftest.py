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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """How the workers share the suite (`--dist loadgroup`, pyproject.toml). A module is one unit
    of work, as under `--dist loadfile`, so that its module fixtures are made once; but a
    `pgmq_versions` module is one unit per pgmq install, so that its three runs share the
    workers. Units holding `slow` tests go first, then the largest: a long unit dealt last would
    keep one worker busy while the others idle."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        group = item.nodeid.split("::")[0]
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "pgmq_install" in callspec.params:
            group += f"[{callspec.params['pgmq_install']}]"
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)

    def weight(unit: list[pytest.Item]) -> tuple[int, int]:
        return (sum(1 for i in unit if i.get_closest_marker("slow")), len(unit))

    items[:] = [i for unit in sorted(groups.values(), key=weight, reverse=True) for i in unit]


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
