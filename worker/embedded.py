"""The embedded default: a Postgres from the `pgserver` wheel under `THUMBQ_HOME`.

Started on demand and left running (cleanup_mode=None), so that the next command, or the next
process, reuses it instead of paying a start-up each time.
"""

from __future__ import annotations

from pathlib import Path


def embedded_database_url(home: Path) -> str:
    """Start (or find) the embedded Postgres for `home` and return its connection URL."""
    import warnings

    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its fallback is fine.
        warnings.simplefilter("ignore")
        import pgserver

    home.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(home / "pgdata", cleanup_mode=None)
    return str(server.get_uri())
