"""Where the Python runs (docs/deploy.md): the Vercel entry point, loaded the way Vercel's Python
runtime loads it, served by a real WSGI server in a process of its own, called over HTTP.

Vercel's runtime imports the function's file (`api/index.py`, named in vercel.json) with the
project root on sys.path, takes its WSGI `app`, and hands it each request; Vercel Cron calls
the cron paths with GET and `Authorization: Bearer $CRON_SECRET`. Only a live deployment shows
the platform itself (bundle size, cold start, the cron firing).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.liveapp import call, put_samples, wait_listening
from tests.support.pgbouncer import free_port
from worker.engine.config import Config
from worker.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]

# What Vercel's Python runtime does with api/index.py, in a fresh interpreter: the project root
# first on sys.path, the file imported by its path (as module `index`, not `api.index`), its
# `app` served over HTTP, here by the standard library's WSGI server.
VERCEL_LIKE_LOADER = """
import importlib.util, sys
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
from socketserver import ThreadingMixIn
root, port = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, root)
spec = importlib.util.spec_from_file_location("index", root + "/api/index.py")
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
class Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass
make_server("127.0.0.1", port, module.app, server_class=Server, handler_class=Quiet).serve_forever()
"""


@pytest.fixture
def vercel_function(db_url: str, tmp_path: Path) -> Iterator[tuple[str, Config]]:
    """api/index.py served as Vercel would, with the environment a Vercel project sets."""
    port = free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "DATABASE_URL": db_url,
        "CRON_SECRET": "vercel-cron-secret-0123456789",  # the name Vercel Cron uses
        "THUMBQ_STORAGE_URL": (tmp_path / "storage").as_uri(),
        "THUMBQ_HOME": str(tmp_path / "home"),
        "THUMBQ_BUDGET_MS": "8000",
        "THUMBQ_BUFFER_MS": "2000",
        "THUMBQ_CONCURRENCY": "2",
    }
    proc = subprocess.Popen(
        [sys.executable, "-I", "-c", VERCEL_LIKE_LOADER, str(ROOT), str(port)],
        cwd=tmp_path,  # not the checkout: nothing found by accident from the working directory
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_listening(proc, port)
        yield f"http://127.0.0.1:{port}", Config.from_env(env)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert "Traceback" not in err, err


def test_the_vercel_entry_point_serves_the_api_and_its_cron_runs_a_batch(
    vercel_function: tuple[str, Config],
) -> None:
    url, config = vercel_function
    secret = config.cron_secret
    assert secret == "vercel-cron-secret-0123456789"
    status, body, _ = call("GET", url + "/healthz")
    assert status == 200, body
    items = put_samples(open_storage(config), "vercel/", good=3)
    status, body, _ = call("POST", url + "/api/thumbnails/enqueue", secret, {"items": items})
    assert status == 202, body
    # Vercel Cron: GET on the path in vercel.json, with the project's CRON_SECRET.
    crons = json.loads((ROOT / "vercel.json").read_text(encoding="utf-8"))["crons"]
    batch_path = next(c["path"] for c in crons if "batch-generate" in c["path"])
    assert call("GET", url + batch_path)[0] == 401
    status, report, _ = call("GET", url + batch_path, secret)
    assert status == 200, report
    assert report is not None and report["succeeded"] == 3
    assert report["duration_ms"] <= config.budget_ms
    status, progress, _ = call("GET", url + "/api/thumbnails/progress?group_id=default", secret)
    assert status == 200 and progress is not None and progress["completed"] == 3
    status, _, headers = call("GET", url + "/progress?group_id=default")
    assert status == 200 and headers["Content-Type"].startswith("text/html")


def test_vercel_json_gives_the_function_more_time_than_a_batch_takes() -> None:
    cfg = json.loads((ROOT / "vercel.json").read_text(encoding="utf-8"))
    max_duration_s = cfg["functions"]["api/index.py"]["maxDuration"]
    default = Config.from_env({})
    # The batch answers by budget - buffer; the function needs the budget plus a cold start.
    assert max_duration_s * 1000 >= default.budget_ms + 10_000
    crons = {c["path"]: c["schedule"] for c in cfg["crons"]}
    assert crons["/api/thumbnails/batch-generate"] == "*/5 * * * *"
    assert crons["/api/thumbnails/cleanup-stale"] == "*/15 * * * *"
    # Every request reaches the one function (the page, the API, the crons).
    assert cfg["rewrites"] == [{"source": "/(.*)", "destination": "/api/index"}]
