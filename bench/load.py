"""Load: many clients polling the progress endpoint (with ETag) while batches run, against batches
with nobody polling, in the same run.

Processes, so that no one of them steals another's interpreter lock:
- this process: sets up a scratch database and a queue of small PDFs, and reports;
- the server: `thumbq serve --server <kind>` on 127.0.0.1, as an operator runs it (granian, the
  default, and waitress side by side);
- a batch process (`python -m bench.load batches ...`): `run_batch` in a loop for a fixed time,
  counting thumbnails;
- client processes (`python -m bench.load clients ...`): asyncio (uvloop where installed), one
  keep-alive connection per client, each sending `GET /api/thumbnails/progress` with
  `If-None-Match` at a fixed rate.

Phases, each `--seconds` long: batches alone, then for each server and rate batches with the
clients, followed by batches alone again (the baselines bracket the loaded phases, so drift on a
shared machine shows). Latency is measured from when a request was due, not when it could be
sent, so a server that falls behind shows up in the figures instead of slowing the clients down.
The CPU the server and the clients used is reported beside it: on one machine, every CPU-second
they take is one the batches' renders do not get.

    .venv/bin/python -m bench.load [--clients 200] [--rates 10] [--seconds 60]
                                   [--servers granian,waitress] [--generators python,users,wrk]
    .venv/bin/python -m bench.load --generators metrics --rates 15 --result load_metrics
        (a Prometheus scrape of GET /metrics every 15 s instead of the pollers)
                                   [--result load]

All traffic goes to 127.0.0.1, bounded in count and time. The database server is
BENCH_DATABASE_URL, TEST_DATABASE_URL or DATABASE_URL (else embedded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

SECRET = "bench-load-secret"
JWT_SECRET = "bench-load-jwt-secret-" + "j" * 32
USERS = 1000  # members of GROUP, u000..u999, for the `users` generator
GROUP = "load"
CLIENT_PROCESSES = 2
REQUEST_TIMEOUT_S = 5.0
SLOW_S = 0.05  # answers slower than this are listed with when they were due


# -- setup ------------------------------------------------------------------------------------


def _env(url: str, home: Path) -> dict[str, str]:
    return {
        "DATABASE_URL": url,
        "THUMBQ_HOME": str(home),
        "THUMBQ_STORAGE_URL": (home / "storage").as_uri(),
        "THUMBQ_CRON_SECRET": SECRET,
        "THUMBQ_JWT_SECRET": JWT_SECRET,
        "THUMBQ_BUDGET_MS": "10000",
        "THUMBQ_BUFFER_MS": "2000",
        "THUMBQ_CONCURRENCY": "2",
    }


def _config(url: str, home: Path) -> Any:
    from worker.engine.config import Config

    return Config.from_env(_env(url, home))


def _slide(seed: int) -> bytes:
    """A slide-like vector PDF of about 50 ms to render (nested drawing, a few KB)."""
    from bench.corpus import vector_pdf

    return vector_pdf(seed, draws=35)


def fill(config: Any, files: int) -> None:
    """Write `files` images (a handful of distinct ones, copied) and enqueue them in GROUP."""
    from worker.engine import db
    from worker.engine.queue import Queue
    from worker.storage import open_storage

    storage = open_storage(config)
    blobs = [_slide(i) for i in range(8)]
    items = []
    for i in range(files):
        key = f"load/{i:06d}.pdf"
        info = storage.put(key, blobs[i % len(blobs)], "application/pdf")
        items.append(
            {
                "source_key": key,
                "etag": info.etag,
                "content_type": "application/pdf",
                "bytes": info.size,
            }
        )
    with db.connect(config.database_url) as conn:
        queue = Queue(conn)
        for start in range(0, len(items), 1000):
            queue.enqueue_files(items[start : start + 1000], GROUP)
        conn.execute(
            "insert into thumbq.group_members select %s, 'u' || lpad(n::text, 3, '0')"
            " from generate_series(0, %s) n",
            (GROUP, USERS - 1),
        )
        conn.execute("analyze thumbq.jobs")


# -- the batch process ----------------------------------------------------------------------------


def run_batches(url: str, home: Path, seconds: float) -> dict[str, Any]:
    """Call run_batch back to back for `seconds` (each run capped to what is left)."""
    from worker.engine import db
    from worker.engine.batch import run_batch
    from worker.storage import open_storage
    from worker.thumbnails.render.process import RenderPool
    from worker.thumbnails.task import render_options

    config = _config(url, home)
    storage = open_storage(config)
    succeeded = runs = 0
    with (
        db.connect(url) as conn,
        RenderPool(render_options(config), config.concurrency, config.render_memory_mb) as pool,
    ):
        started = time.monotonic()
        while (left_ms := (seconds - (time.monotonic() - started)) * 1000) >= 1000:
            result = run_batch(config, conn, storage, pool, budget_ms=int(min(10_000, left_ms)))
            succeeded += result.succeeded
            runs += 1
            if result.remaining == 0:
                break
        elapsed = time.monotonic() - started
    return {
        "thumbnails": succeeded,
        "runs": runs,
        "seconds": round(elapsed, 2),
        "thumbnails_per_s": round(succeeded / elapsed, 2),
    }


# -- the client processes ---------------------------------------------------------------------


class _Poller(asyncio.Protocol):
    """One client: a keep-alive connection, one progress request every 1/rate s, If-None-Match
    with the last ETag. A protocol, not streams: the clients share two cores with the server and
    the batches they measure, so every microsecond they spend is taken from what they measure."""

    def __init__(
        self, port: int, rate: float, start: float, until: float, out: _Tally, request: bytes
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.port = port
        self.request = request
        self.interval = 1 / rate
        self.start = start
        self.due = start + random.random() * self.interval  # spread over the first interval
        self.until = until
        self.out = out
        self.etag = b""
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.sent = 0.0  # perf_counter() when the request went out
        self.late = 0.0  # how long after it was due the request went out
        self.waiting = False
        self.timer: asyncio.TimerHandle | None = None
        self.done = self.loop.create_future()

    # -- sending --------------------------------------------------------------------------------

    def schedule(self) -> None:
        if self.due >= self.until:
            if not self.done.done():
                self.done.set_result(None)
            if self.transport is not None:
                self.transport.close()
            return
        self.timer = self.loop.call_at(self.due, self.send)

    def send(self) -> None:
        if self.transport is None:
            self.loop.create_task(self.connect())
            return
        self.buf.clear()
        # uvloop's clock has millisecond resolution: it schedules, perf_counter() times.
        self.late = max(0.0, self.loop.time() - self.due)
        self.sent = time.perf_counter()
        self.waiting = True
        self.timer = self.loop.call_later(REQUEST_TIMEOUT_S, self.timed_out)
        self.transport.write(
            self.request + (b"If-None-Match: " + self.etag + b"\r\n\r\n" if self.etag else b"\r\n")
        )

    async def connect(self) -> None:
        try:
            await asyncio.wait_for(
                self.loop.create_connection(lambda: self, "127.0.0.1", self.port),
                REQUEST_TIMEOUT_S,
            )
        except (OSError, TimeoutError) as exc:
            self.fail(type(exc).__name__)
            return
        self.send()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    # -- receiving ------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or not self.waiting:
            return
        head = bytes(self.buf[:end]).lower()
        length = 0
        i = head.find(b"\r\ncontent-length:")
        if i >= 0:
            stop = head.find(b"\r\n", i + 2)
            length = int(head[i + 17 : stop if stop >= 0 else None])
        if len(self.buf) < end + 4 + length:
            return  # the body is still coming
        status = int(head[9:12])
        i = head.find(b"\r\netag:")
        if i >= 0:
            stop = head.find(b"\r\n", i + 2)
            self.etag = bytes(self.buf[i + 7 : stop if stop >= 0 else end]).strip()
        close = b"\r\nconnection: close" in head
        self.answered(status, close)

    def answered(self, status: int, close: bool) -> None:
        took = time.perf_counter() - self.sent
        self.waiting = False
        if self.timer is not None:
            self.timer.cancel()
        out = self.out
        out.from_due.append((self.late + took) * 1000)
        out.from_send.append(took * 1000)
        if self.late + took > SLOW_S:
            out.slow.append((round(self.due - self.start, 2), round((self.late + took) * 1000)))
        out.statuses[status] = out.statuses.get(status, 0) + 1
        if status not in (200, 304):
            out.errors.append(f"HTTP {status}")
        if close:
            # Counted: a server that closes after a response makes every poll a new connection.
            out.reconnects += 1
            self.drop()
        self.next()

    def timed_out(self) -> None:
        self.fail("TimeoutError")

    def fail(self, kind: str) -> None:
        self.waiting = False
        self.out.errors.append(kind)
        self.drop()
        self.next()

    def drop(self) -> None:
        if self.transport is not None:
            transport, self.transport = self.transport, None
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:  # the server closed it
            self.transport = None
            if self.waiting:
                self.fail("ConnectionClosed")

    def next(self) -> None:
        self.due += self.interval
        # A client that fell more than a whole interval behind skips to now, as a browser's timer
        # would; the late requests it skipped count as errors.
        now = self.loop.time()
        while self.due < now - self.interval:
            self.out.skipped += 1
            self.due += self.interval
        self.schedule()


class _Tally:
    def __init__(self) -> None:
        self.slow: list[tuple[float, int]] = []  # (s into the phase, ms) of slow answers
        self.from_due: list[float] = []
        self.from_send: list[float] = []
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self.skipped = 0
        self.reconnects = 0


def _request(token: str) -> bytes:
    return (
        f"GET /api/thumbnails/progress?group_id={GROUP} HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
    ).encode()


def _user_token(n: int) -> str:
    """A Supabase-style access token of user u<n>, a member of GROUP, valid for an hour."""
    import jwt

    claims = {"sub": f"u{n:03d}", "aud": "authenticated", "role": "authenticated"}
    return jwt.encode({**claims, "exp": int(time.time()) + 3600}, JWT_SECRET, algorithm="HS256")


async def _clients(
    port: int, n: int, rate: float, seconds: float, first_user: int | None
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    out = _Tally()
    start = loop.time() + 0.2
    until = start + seconds
    requests = [
        _request(SECRET if first_user is None else _user_token(first_user + i)) for i in range(n)
    ]
    pollers = [_Poller(port, rate, start, until, out, requests[i]) for i in range(n)]
    for p in pollers:
        p.schedule()
    await asyncio.wait_for(
        asyncio.gather(*(p.done for p in pollers)), seconds + 2 * REQUEST_TIMEOUT_S + 5
    )
    return {
        "from_due_ms": out.from_due,
        "from_send_ms": out.from_send,
        "statuses": {str(k): v for k, v in out.statuses.items()},
        "errors": out.errors,
        "skipped": out.skipped,
        "slow": out.slow,
        "reconnects": out.reconnects,
    }


def run_clients(
    port: int, n: int, rate: float, seconds: float, first_user: int | None = None
) -> dict[str, Any]:
    """`n` pollers at `rate` requests/s each for `seconds`; raw latencies and errors, and the CPU
    time this process used (to tell whether the clients could keep up). With the admin secret,
    or each as its own user (u<first_user>, u<first_user + 1>, ...) with a JWT."""
    clients = _clients(port, n, rate, seconds, first_user)
    try:
        import uvloop  # about half the CPU per request of asyncio's own loop, here
    except ImportError:
        out = asyncio.run(clients)
    else:
        out = uvloop.run(clients)
    out["cpu_s"] = time.process_time()
    return out


# wrk (C, `apt-get install wrk`) as a second load generator: the same load for a tenth of the
# CPU, so that less of what the batches lose is the measurement's own cost. Each connection waits
# a random 50-150 ms (mean 100: 10 requests/s) after each answer and sends the last ETag it saw.
WRK_SCRIPT = """
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args)
  statuses = {}
  etag = nil
  math.randomseed(os.time() + math.floor(os.clock() * 1000000))
end
function request()
  local headers = {["Authorization"] = "Bearer %(secret)s"}
  if etag then headers["If-None-Match"] = etag end
  return wrk.format("GET", "%(path)s", headers)
end
function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  for name, value in pairs(headers) do
    if string.lower(name) == "etag" then etag = value end
  end
end
function delay() return math.random(%(lo)d, %(hi)d) end
function done(summary, latency, requests)
  local counts = {}
  for _, t in ipairs(threads) do
    for status, n in pairs(t:get("statuses")) do
      counts[tostring(status)] = (counts[tostring(status)] or 0) + n
    end
  end
  local parts = {}
  for status, n in pairs(counts) do table.insert(parts, string.format('"%%s": %%d', status, n)) end
  local e = summary.errors
  io.write(string.format(
    'WRK {"requests": %%d, "statuses": {%%s}, "connect": %%d, "read": %%d, "write": %%d, '
    .. '"status": %%d, "timeout": %%d, "p50_us": %%d, "p99_us": %%d, "max_us": %%d}\\n',
    summary.requests, table.concat(parts, ", "), e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def run_wrk(port: int, n: int, rate: float, seconds: float) -> dict[str, Any]:
    """`n` wrk connections at about `rate` requests/s each for `seconds`; its figures, and the
    CPU it used (its rusage, as this process's only child)."""
    import resource

    mean_ms = 1000 / rate
    script = WRK_SCRIPT % {
        "secret": SECRET,
        "path": f"/api/thumbnails/progress?group_id={GROUP}",
        "lo": round(mean_ms / 2),
        "hi": round(mean_ms * 3 / 2),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".lua") as f:
        f.write(script)
        f.flush()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(
            [
                *("wrk", "-t", str(CLIENT_PROCESSES), "-c", str(n), "-d", f"{round(seconds)}s"),
                *("--timeout", f"{round(REQUEST_TIMEOUT_S)}s", "-s", f.name),
                f"http://127.0.0.1:{port}/",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next(x for x in out.stdout.splitlines() if x.startswith("WRK "))
    result: dict[str, Any] = json.loads(line[4:])
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


# -- orchestration ------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))], 2)


class _Scraper(threading.Thread):
    """GET /metrics every `every_s` for `seconds`, as a Prometheus server scrapes (the admin
    secret as its bearer token); records each scrape's time and status."""

    def __init__(self, port: int, every_s: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.port, self.every_s, self.seconds = port, every_s, seconds
        self.ms: list[float] = []
        self.statuses: Counter[int] = Counter()

    def run(self) -> None:
        import urllib.error
        import urllib.request

        end = time.monotonic() + self.seconds
        while (due := time.monotonic()) < end:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.port}/metrics",
                headers={"Authorization": f"Bearer {SECRET}"},
            )
            try:
                with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
                    resp.read()
                    self.statuses[resp.status] += 1
            except urllib.error.HTTPError as exc:
                self.statuses[exc.code] += 1
            self.ms.append((time.monotonic() - due) * 1000)
            time.sleep(max(0.0, due + self.every_s - time.monotonic()))

    def summary(self) -> dict[str, Any]:
        return {
            "count": len(self.ms),
            "statuses": {str(k): v for k, v in self.statuses.items()},
            "ms_p50": _pct(self.ms, 0.5),
            "ms_max": _pct(self.ms, 1.0),
        }


def _scrape_metrics(port: int, every_s: float, seconds: float) -> _Scraper:
    scraper = _Scraper(port, every_s, seconds)
    scraper.start()
    return scraper


def _spawn(args: list[str], out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.load", *args, "--out", str(out)],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.DEVNULL,
    )


def phase(
    url: str,
    home: Path,
    port: int,
    seconds: float,
    clients: int,
    rate: float,
    work: Path,
    generator: str = "python",
) -> dict[str, Any]:
    """Batches for `seconds`, with `clients` pollers at `rate` (none when 0) at the same time; the
    `metrics` generator is one Prometheus scraper, a scrape every `rate` seconds instead."""
    batch_out = work / f"batch-{rate}.json"
    procs = [_spawn(["batches", url, str(home), str(seconds)], batch_out)]
    if clients and generator == "metrics":
        scrapes = _scrape_metrics(port, rate, seconds)
        for proc in procs:
            if proc.wait(timeout=seconds + 120) != 0:
                raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        scrapes.join(seconds + 30)
        return {
            "clients": 0,
            "generator": "metrics",
            "scrape_every_s": rate,
            "batches": json.loads(batch_out.read_text()),
            "scrapes": scrapes.summary(),
        }
    client_outs = []
    wrk_out = work / f"wrk-{rate}.json"
    if clients and generator == "wrk":
        procs.append(_spawn(["wrk", str(port), str(clients), str(rate), str(seconds)], wrk_out))
    elif clients:
        per = [
            clients // CLIENT_PROCESSES + (i < clients % CLIENT_PROCESSES)
            for i in range(CLIENT_PROCESSES)
        ]
        for i, n in enumerate(per):
            path = work / f"clients-{rate}-{i}.json"
            client_outs.append(path)
            args = ["clients", str(port), str(n), str(rate), str(seconds)]
            if generator == "users":
                args += ["--first-user", str(sum(per[:i]))]
            procs.append(_spawn(args, path))
    for proc in procs:
        if proc.wait(timeout=seconds + 120) != 0:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
    result: dict[str, Any] = {"clients": clients, "rate_per_client": rate}
    result["batches"] = json.loads(batch_out.read_text())
    if clients and generator == "wrk":
        w = json.loads(wrk_out.read_text())
        errors = w["connect"] + w["read"] + w["write"] + w["status"] + w["timeout"]
        result["generator"] = "wrk"
        result["requests"] = {
            "offered": round(clients * rate * seconds),
            "answered": w["requests"],
            "per_s": round(w["requests"] / seconds, 1),
            "statuses": w["statuses"],
            "errors": errors,
            "error_kinds": {
                k: w[k] for k in ("connect", "read", "write", "status", "timeout") if w[k]
            },
            "client_cpu_share_of_one_core": round(w["cpu_s"] / seconds, 2),
        }
        result["latency_ms_from_send"] = {
            "p50": round(w["p50_us"] / 1000, 2),
            "p99": round(w["p99_us"] / 1000, 2),
            "max": round(w["max_us"] / 1000, 2),
        }
    elif clients:
        result["generator"] = generator
        due: list[float] = []
        sent: list[float] = []
        statuses: dict[str, int] = {}
        errors: list[str] = []
        skipped = reconnects = 0
        client_cpu = 0.0
        slow: Counter[int] = Counter()
        for path in client_outs:
            part = json.loads(path.read_text())
            slow.update(int(at) for at, _ in part["slow"])
            due += part["from_due_ms"]
            sent += part["from_send_ms"]
            errors += part["errors"]
            skipped += part["skipped"]
            reconnects += part["reconnects"]
            client_cpu += part["cpu_s"]
            for k, v in part["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        result["requests"] = {
            "offered": round(clients * rate * seconds),
            "answered": len(due),
            "per_s": round(len(due) / seconds, 1),
            "statuses": statuses,
            "errors": len(errors) + skipped,
            "error_kinds": {e: errors.count(e) for e in sorted(set(errors))},
            "skipped_late": skipped,
            "reconnects_after_close": reconnects,
            "client_cpu_share_of_one_core": round(client_cpu / seconds, 2),
            # When the slow answers (over SLOW_S from due) were due: second of the phase -> count.
            "slow_by_second": {str(k): v for k, v in sorted(slow.items())},
        }
        result["latency_ms_from_due"] = {
            "p50": _pct(due, 0.5),
            "p99": _pct(due, 0.99),
            "max": _pct(due, 1.0),
        }
        result["latency_ms_from_send"] = {
            "p50": _pct(sent, 0.5),
            "p99": _pct(sent, 0.99),
            "max": _pct(sent, 1.0),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    b = sub.add_parser("batches")
    b.add_argument("url")
    b.add_argument("home", type=Path)
    b.add_argument("seconds", type=float)
    b.add_argument("--out", type=Path, required=True)
    for role in ("clients", "wrk"):
        c = sub.add_parser(role)
        c.add_argument("port", type=int)
        c.add_argument("n", type=int)
        c.add_argument("rate", type=float)
        c.add_argument("seconds", type=float)
        c.add_argument("--out", type=Path, required=True)
        if role == "clients":
            c.add_argument("--first-user", type=int, default=None)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rates", default="10", help="requests/s per client, one phase each")
    parser.add_argument(
        "--servers", default="granian,waitress", help="`thumbq serve --server` kinds, in turn"
    )
    parser.add_argument(
        "--generators",
        default="python",
        help="load generators, in turn: python (asyncio clients, the admin secret), users (the "
        "same, each client a different user with a JWT: RLS and a cache entry per user), wrk "
        "(the admin secret; needs the wrk binary), metrics (one Prometheus scraper of GET "
        "/metrics, a scrape every RATE seconds)",
    )
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--files", type=int, default=0, help="queue size (default: enough)")
    parser.add_argument(
        "--result", default="load", help="bench/results/<name>.json to write (default: load)"
    )
    args = parser.parse_args(argv)

    if args.role == "batches":
        args.out.write_text(json.dumps(run_batches(args.url, args.home, args.seconds)))
        return 0
    if args.role == "clients":
        out = run_clients(args.port, args.n, args.rate, args.seconds, args.first_user)
        args.out.write_text(json.dumps(out))
        return 0
    if args.role == "wrk":
        args.out.write_text(json.dumps(run_wrk(args.port, args.n, args.rate, args.seconds)))
        return 0
    return orchestrate(args)


class Server:
    """`thumbq serve --server <kind>` in a process of its own, as an operator runs it."""

    def __init__(self, kind: str, url: str, home: Path) -> None:
        import os
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        env = dict(os.environ, **_env(url, home))
        self.kind = kind
        command = ["serve", "--port", str(self.port), "--server", kind]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", *command],
            cwd=Path(__file__).resolve().parent.parent,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 30) -> None:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/thumbnails/progress?group_id={GROUP}",
            headers={"Authorization": f"Bearer {SECRET}"},
        )
        until = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(req, timeout=2):
                    return
            except (OSError, urllib.error.URLError):
                if time.monotonic() > until or self.proc.poll() is not None:
                    raise RuntimeError(f"thumbq serve --server {self.kind} did not start") from None
                time.sleep(0.1)

    def cpu_s(self) -> float:
        """CPU seconds used so far by the server and its worker processes."""
        import psutil

        total = 0.0
        proc = psutil.Process(self.proc.pid)
        for p in [proc, *proc.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def orchestrate(args: argparse.Namespace) -> int:
    import shutil

    from bench.common import scratch_database, write_result

    rates = [float(r) for r in args.rates.split(",") if r]
    servers = [s for s in args.servers.split(",") if s]
    generators = [g for g in args.generators.split(",") if g]
    if "users" in generators and args.clients > USERS:
        raise SystemExit(f"bench.load: the users generator has {USERS} users")
    if "wrk" in generators and shutil.which("wrk") is None:
        print("bench.load: no wrk (apt-get install wrk): python clients only", file=sys.stderr)
        generators.remove("wrk")
    # Batches alone first, then each server with each generator at each rate, each followed by
    # batches alone again: the baselines bracket the loaded phases, so drift on a shared machine
    # shows.
    plan: list[tuple[str | None, str, float]] = [(None, "", 0.0)]
    for kind in servers:
        for generator in generators:
            for rate in rates:
                plan += [(kind, generator, rate), (None, "", 0.0)]
    # About 60 of these slides a second on two cores; a queue that outlasts every phase.
    files = args.files or int(len(plan) * args.seconds * 80)
    url = scratch_database("thumbq_bench_load")
    results = []
    with tempfile.TemporaryDirectory(prefix="thumbq-load-") as tmp:
        home = Path(tmp)
        t = time.monotonic()
        fill(_config(url, home), files)
        fill_s = time.monotonic() - t
        running: dict[str, Server] = {}
        try:
            for kind, generator, rate in plan:
                server = None
                if kind is not None:
                    server = running.get(kind) or running.setdefault(kind, Server(kind, url, home))
                cpu = server.cpu_s() if server else 0.0
                result = phase(
                    url,
                    home,
                    server.port if server else 0,
                    args.seconds,
                    args.clients if server else 0,
                    rate,
                    home,
                    generator,
                )
                result["server"] = kind
                if server is not None:
                    result["server_cpu_share_of_one_core"] = round(
                        (server.cpu_s() - cpu) / args.seconds, 2
                    )
                results.append(result)
                print(json.dumps(result), file=sys.stderr)
        finally:
            for server in running.values():
                server.close()
    baseline = statistics.mean(
        [r["batches"]["thumbnails_per_s"] for r in results if r["server"] is None]
    )
    for r in results:
        r["throughput_vs_baseline"] = round(r["batches"]["thumbnails_per_s"] / baseline, 3)
    write_result(
        args.result,
        {
            "method": "`thumbq serve --server <kind>` in its own process on 127.0.0.1; batches "
            "in their own process; 200 keep-alive connections sending If-None-Match with the "
            "last ETag, from asyncio (uvloop) clients in 2 processes (latency from when each "
            "request was due) or from wrk with 2 threads (latency from send; 50-150 ms pause "
            "after each answer); CPU of the server's processes and of the clients per phase",
            "files_queued": files,
            "fill_seconds": round(fill_s, 1),
            "seconds_per_phase": args.seconds,
            "baseline_thumbnails_per_s": round(baseline, 2),
            "phases": results,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
