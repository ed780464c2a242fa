"""A fault-injecting HTTP/1.1 proxy on loopback, for putting between boto3 and moto's S3 server.

It forwards each request to the upstream server and, on a seeded random share of requests,
injects one fault instead:

- `http_500`, `http_503`: an S3-style XML error answered by the proxy, upstream never sees it;
- `timeout`: the connection is held, silent, for `hold_s` (longer than the client's read
  timeout), then closed;
- `reset`: the connection is reset (RST) before anything is forwarded;
- `reset_after`: the request is forwarded and done upstream, then the client's connection is
  reset instead of answered (a write that happened but was never acknowledged);
- `truncated`: the upstream response is sent with its full Content-Length but only half its
  body, then the connection is closed (a download cut off mid-body);
- `cut_upload`: for a request with a body, only half of it is forwarded upstream before both
  connections are reset (an upload cut off mid-body); other requests get `reset` instead;
- `drip`: the request is forwarded and the response sent at once up to its body, which then
  arrives `drip_bytes` every `drip_every_s` (a slow link: no single read waits long, so no
  per-read timeout trips). Not in the default mix.

`only` restricts faults to the requests it accepts (say, GETs of sources); `enabled = False`
stops all faults at once (the storage recovers).

Keep-alive connections are served one request at a time, each on its own thread, so boto3's
connection pool behaves as it would against a real endpoint. Every decision is counted.
"""

from __future__ import annotations

import contextlib
import http.client
import random
import socket
import socketserver
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

FAULT_KINDS: tuple[str, ...] = (
    "http_500",
    "http_503",
    "timeout",
    "reset",
    "reset_after",
    "truncated",
    "cut_upload",
)
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}
_MAX_HEADER_BYTES = 64 * 1024


@dataclass
class Request:
    """One parsed client request."""

    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


@dataclass
class FaultLog:
    """What the proxy did, per fault kind and per HTTP method; safe to read while it runs."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    forwarded: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    by_method: Counter[str] = field(default_factory=Counter)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "forwarded": self.forwarded,
                "faults": dict(sorted(self.faults.items())),
                "faults_total": sum(self.faults.values()),
                "faults_by_method": dict(sorted(self.by_method.items())),
            }


class FaultProxy:
    """A threaded proxy on 127.0.0.1 in front of `upstream` (`http://host:port`)."""

    def __init__(
        self,
        upstream: str,
        *,
        fault_rate: float = 0.3,
        seed: int = 0,
        kinds: Sequence[str] = FAULT_KINDS,
        hold_s: float = 1.0,
        drip_bytes: int = 256,
        drip_every_s: float = 0.2,
        only: Callable[[Request], bool] | None = None,
    ) -> None:
        host, _, port = upstream.removeprefix("http://").rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self.fault_rate = fault_rate
        self.kinds = tuple(kinds)
        self.hold_s = hold_s
        self.drip_bytes = drip_bytes
        self.drip_every_s = drip_every_s
        self.only = only
        self.log = FaultLog()
        self.enabled = True
        # One generator behind a lock: the sequence of decisions is fixed by the seed (which
        # request gets which one depends on thread timing, the share and mix do not).
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._closing = threading.Event()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting; held connections end at once."""
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    # -- decisions --------------------------------------------------------------------------

    def _choose(self, req: Request) -> str | None:
        with self._rng_lock:
            roll = self._rng.random()
            kind = self._rng.choice(self.kinds)
        if not self.enabled or roll >= self.fault_rate:
            return None
        if self.only is not None and not self.only(req):
            return None
        if kind == "cut_upload" and not req.body:
            kind = "reset"
        return kind

    def _count(self, req: Request, kind: str | None) -> None:
        with self.log.lock:
            self.log.requests += 1
            if kind is None:
                self.log.forwarded += 1
            else:
                self.log.faults[kind] += 1
                self.log.by_method[req.method] += 1

    # -- serving ----------------------------------------------------------------------------

    def _serve_connection(self, client: socket.socket) -> None:
        upstream: http.client.HTTPConnection | None = None
        reader = client.makefile("rb")
        try:
            while not self._closing.is_set():
                req = _read_request(reader, client)
                if req is None:
                    return
                kind = self._choose(req)
                self._count(req, kind)
                if kind in ("http_500", "http_503"):
                    _send_error(client, 500 if kind == "http_500" else 503)
                    continue
                if kind == "timeout":
                    self._closing.wait(self.hold_s)
                    return
                if kind == "reset":
                    _reset(client)
                    return
                if kind == "cut_upload":
                    _cut_upload(self.upstream, req)
                    _reset(client)
                    return
                if upstream is None:
                    upstream = http.client.HTTPConnection(*self.upstream, timeout=30)
                status, reason, headers, body = _forward(upstream, req)
                if kind == "reset_after":
                    _reset(client)
                    return
                if kind == "drip":
                    _send_response(client, req, status, reason, headers, b"", False, len(body))
                    self._drip(client, body)
                    continue
                _send_response(client, req, status, reason, headers, body, kind == "truncated")
                if kind == "truncated":
                    return
        except (OSError, http.client.HTTPException, ValueError):
            return
        finally:
            if upstream is not None:
                upstream.close()
            with contextlib.suppress(OSError):
                reader.close()
                client.close()

    def _drip(self, client: socket.socket, body: bytes) -> None:
        for i in range(0, len(body), self.drip_bytes):
            if self._closing.wait(self.drip_every_s):
                return
            client.sendall(body[i : i + self.drip_bytes])


def _read_request(reader: Any, client: socket.socket) -> Request | None:
    """The next request on a keep-alive connection, or None at EOF."""
    line = reader.readline(_MAX_HEADER_BYTES)
    if not line:
        return None
    method, target, version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        raw = reader.readline(_MAX_HEADER_BYTES)
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    req = Request(method, target, version, headers, b"")
    if (req.header("expect") or "").lower() == "100-continue":
        # The client waits for this before sending the body; the proxy answers for upstream
        # and forwards the request without the header.
        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        req.headers = [(k, v) for k, v in headers if k.lower() != "expect"]
    length = int(req.header("content-length") or 0)
    if (req.header("transfer-encoding") or "").lower() == "chunked":
        req.body = _read_chunked(reader)
        req.headers = [(k, v) for k, v in req.headers if k.lower() != "transfer-encoding"]
        req.headers.append(("Content-Length", str(len(req.body))))
    elif length:
        req.body = reader.read(length)
        if len(req.body) != length:
            return None
    return req


def _read_chunked(reader: Any) -> bytes:
    out = bytearray()
    while True:
        size = int(reader.readline(1024).split(b";")[0].strip(), 16)
        if size == 0:
            while reader.readline(1024) not in (b"\r\n", b"\n", b""):
                pass
            return bytes(out)
        out += reader.read(size)
        reader.readline(16)


def _forward(
    upstream: http.client.HTTPConnection, req: Request
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    upstream.putrequest(req.method, req.target, skip_host=True, skip_accept_encoding=True)
    for name, value in req.headers:
        if name.lower() not in _HOP_BY_HOP:
            upstream.putheader(name, value)
    upstream.endheaders(req.body or None)
    resp = upstream.getresponse()
    body = resp.read()
    return resp.status, resp.reason, list(resp.getheaders()), body


def _send_response(
    client: socket.socket,
    req: Request,
    status: int,
    reason: str,
    headers: list[tuple[str, str]],
    body: bytes,
    truncate: bool,
    length: int | None = None,
) -> None:
    """Send a response; with `length`, only its head, announcing a body of that length."""
    lines = [f"HTTP/1.1 {status} {reason}"]
    has_length = False
    for name, value in headers:
        lower = name.lower()
        if lower in _HOP_BY_HOP:
            continue
        if lower == "content-length":
            if req.method == "HEAD":  # a HEAD's length describes the object, not this body
                has_length = True
                lines.append(f"{name}: {value}")
            continue
        lines.append(f"{name}: {value}")
    if req.method != "HEAD":
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    elif not has_length:
        lines.append("Content-Length: 0")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    if req.method == "HEAD":
        body = b""
    if truncate and body:
        client.sendall(head + body[: len(body) // 2])
        return
    client.sendall(head + body)


def _send_error(client: socket.socket, status: int) -> None:
    code, reason = {
        500: ("InternalError", "Internal Server Error"),
        503: ("SlowDown", "Service Unavailable"),
    }[status]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>injected by the fault proxy</Message></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    client.sendall(head + body)


def _reset(sock: socket.socket) -> None:
    """Close with SO_LINGER 0, so the peer gets a RST instead of an orderly FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def _cut_upload(upstream: tuple[str, int], req: Request) -> None:
    """Send the request upstream with its full Content-Length but half its body, then reset."""
    sock = socket.create_connection(upstream, timeout=5)
    try:
        lines = [f"{req.method} {req.target} {req.version}"]
        lines += [f"{k}: {v}" for k, v in req.headers if k.lower() not in _HOP_BY_HOP]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        sock.sendall(head + req.body[: len(req.body) // 2])
        # Give the server time to start reading the body before the connection dies under it.
        time.sleep(0.05)
    finally:
        _reset(sock)
