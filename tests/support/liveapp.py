"""A real thumbq app on a loopback port, and small sample files, for the serving tests."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from worker.engine.config import Config
from worker.local.server import ServerThread
from worker.storage import Storage


@contextlib.contextmanager
def live_app(config: Config, **kwargs: Any) -> Iterator[ServerThread]:
    """`api.create_app(config)` served by waitress on a free port; closed (with its pool and
    render processes) afterwards."""
    from api import create_app

    app = create_app(config, **kwargs)
    server = ServerThread(app, "127.0.0.1", 0, threads=8).start()
    try:
        yield server
    finally:
        server.close()
        app.extensions["thumbq"].close()


def jpeg(seed: int, size: tuple[int, int] = (320, 240)) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, ((seed * 40) % 256, 90, 160))
    ImageDraw.Draw(img).ellipse((20, 20, size[0] // 2, size[1] // 2), fill=(250, 210, 40))
    out = io.BytesIO()
    img.save(out, "JPEG", quality=80)
    return out.getvalue()


def pdf(seed: int) -> bytes:
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=400, height=300)
    page.insert_text((40, 60), f"Slide {seed}", fontsize=28)
    page.draw_rect(pymupdf.Rect(40, 100, 200, 220), color=(0.2, 0.3, 0.8), fill=(0.6, 0.7, 1))
    data = bytes(doc.tobytes())
    doc.close()
    return data


def put_samples(storage: Storage, prefix: str, good: int, broken: int = 0) -> list[dict[str, Any]]:
    """Write `good` small JPEGs and PDFs and `broken` cut-off JPEGs; return enqueue items."""
    items = []
    for i in range(good):
        if i % 2:
            key, data, ctype = f"{prefix}photo-{i}.jpg", jpeg(i), "image/jpeg"
        else:
            key, data, ctype = f"{prefix}slide-{i}.pdf", pdf(i), "application/pdf"
        info = storage.put(key, data, ctype)
        items.append({"source_key": key, "etag": info.etag, "content_type": ctype})
    for i in range(broken):
        key = f"{prefix}broken-{i}.jpg"
        info = storage.put(key, jpeg(100 + i, (640, 480))[:300], "image/jpeg")
        items.append({"source_key": key, "etag": info.etag, "content_type": "image/jpeg"})
    return items


def call(
    method: str, url: str, secret: str | None = None, body: Any = None, timeout: float = 30
) -> tuple[int, dict[str, Any] | None, dict[str, str]]:
    """One HTTP request; returns status, JSON body (or None) and headers."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if secret:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw, status, hdrs = resp.read(), resp.status, dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw, status, hdrs = exc.read(), exc.code, dict(exc.headers)
    is_json = "json" in hdrs.get("Content-Type", "")
    return status, (json.loads(raw) if raw and is_json else None), hdrs


def wait_until(cond: Callable[[], Any], timeout_s: float, every_s: float = 0.1) -> Any:
    """Poll `cond` until it returns something true; fail with its last value after the timeout."""
    deadline = time.monotonic() + timeout_s
    value = None
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s} s (last value: {value!r})")


def wait_listening(proc: subprocess.Popen[str], port: int, timeout_s: float = 30) -> None:
    """Wait until the process `proc` (a server being started) accepts connections on `port`
    of 127.0.0.1; fail with its stderr when it exits first."""

    def up() -> bool:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "it exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return False
        return True

    wait_until(up, timeout_s, 0.1)
