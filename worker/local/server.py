"""A WSGI app served by waitress on a background thread, started and stopped on demand.

Used by `thumbq serve` and `thumbq up` (which run the scheduler next to it) and by tests that
need a real server on a loopback port.
"""

from __future__ import annotations

import threading
from typing import Any

DEFAULT_THREADS = 8
# Open connections waitress keeps; past this it stops accepting. Every open progress page holds a
# keep-alive connection, and waitress's default of 100 left the 101st poller waiting in the
# accept queue until it timed out (measured with bench/load.py).
DEFAULT_CONNECTION_LIMIT = 1000
# Keep reading a connection while its request runs (one request ahead), so that a client that
# goes away is noticed at once: a progress stream then ends at its next poll instead of after
# up to three heartbeats (waitress otherwise learns of it only from failed writes).
CHANNEL_REQUEST_LOOKAHEAD = 1


class ServerThread:
    """waitress listening on `host:port` (port 0: a free one), run on a daemon thread."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        threads: int = DEFAULT_THREADS,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,
    ) -> None:
        from waitress.server import create_server

        self.app = app
        # Binds and listens here, so the port is known (and taken) before start().
        self.server: Any = create_server(
            app,
            host=host,
            port=port,
            threads=threads,
            connection_limit=connection_limit,
            channel_request_lookahead=CHANNEL_REQUEST_LOOKAHEAD,
            ident="thumbq",
            clear_untrusted_proxy_headers=True,
        )
        self.host = str(self.server.effective_host)
        self.port = int(self.server.effective_port)
        self._thread = threading.Thread(target=self.server.run, name="thumbq-http", daemon=True)

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the server (loopback for a wildcard bind)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)  # noqa: S104
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let running requests finish (up to `timeout_s`), close the rest.

        Sockets are closed on the loop's own thread (through waitress's trigger), never while
        it sits in select() on them, which would fail there with EBADF.
        """
        from waitress import wasyncore

        srv = self.server
        if self._thread.ident is None:  # never started: no loop to ask
            srv.task_dispatcher.shutdown(timeout=timeout_s)
            wasyncore.close_all(srv._map)
            return
        self._pull(lambda: wasyncore.dispatcher.close(srv))
        srv.task_dispatcher.shutdown(cancel_pending=True, timeout=timeout_s)
        # Open keep-alive connections keep the loop alive; closing everything ends it.
        if not self._pull(lambda: wasyncore.close_all(srv._map)):
            # The trigger is closed already, so the loop has closed its map itself: it is ending.
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                wasyncore.close_all(srv._map)
        self._thread.join(timeout_s)

    def _pull(self, thunk: Any) -> bool:
        """Run `thunk` on the loop's thread; False when the loop's trigger is already closed
        (seen once in a run of the suite: EBADF from the trigger's pipe)."""
        try:
            self.server.trigger.pull_trigger(thunk)
        except OSError:
            return False
        return True

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
