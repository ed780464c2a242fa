"""A small HTTP server on loopback whose answers a test decides, recording what it was sent."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    """One request as the stub received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


# (status, headers, body) for a request.
Answer = tuple[int, dict[str, str], bytes]


@dataclass
class HttpStub:
    """Serves `answer(request)` on 127.0.0.1 until `close()`; `requests` lists what came in."""

    answer: Callable[[Request], Answer]
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                req = Request(self.command, self.path, dict(self.headers), body)
                stub.requests.append(req)
                status, headers, payload = stub.answer(req)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _serve

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
