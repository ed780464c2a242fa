"""The embedded default: a Postgres from the `pgserver` wheel under `THUMBQ_HOME`.

Started on demand and left running (cleanup_mode=None), so that the next command, or the next
process, reuses it instead of paying a start-up each time.

pgserver ships wheels for Linux x86_64 (glibc) and macOS only, so it is installed only there
(an environment marker in pyproject.toml); elsewhere thumbq needs `DATABASE_URL`.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path


class EmbeddedUnavailable(RuntimeError):
    """No embedded Postgres on this machine (pgserver is not installed): set DATABASE_URL."""


def embedded_database_url(home: Path) -> str:
    """Start (or find) the embedded Postgres for `home` and return its connection URL."""
    import warnings

    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its fallback is fine.
        warnings.simplefilter("ignore")
        try:
            import pgserver
        except ImportError:
            where = f"{sys.platform} {platform.machine()}"
            raise EmbeddedUnavailable(
                f"DATABASE_URL is not set and the embedded Postgres (pgserver, which has wheels "
                f"for Linux x86_64 and macOS only) is not installed here ({where}): set "
                "DATABASE_URL to a Postgres connection string, e.g. postgresql://user@host/db"
            ) from None

    home.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(home / "pgdata", cleanup_mode=None)
    return str(server.get_uri())
