"""Load: many clients polling the progress endpoint (with ETag) while batches run, against batches
with nobody polling, in the same run.

Three kinds of process, so that no one of them steals the others' interpreter lock:
- this process: sets up a scratch database and a queue of small images, serves the real app
  with waitress on 127.0.0.1 (as `thumbq serve` does: `ServerThread`), and reports;
- a batch process (`python -m bench.load batches ...`): `run_batch` in a loop for a fixed time,
  counting thumbnails;
- client processes (`python -m bench.load clients ...`): asyncio, one keep-alive connection per
  client, each sending `GET /api/thumbnails/progress` with `If-None-Match` at a fixed rate.

Phases, each `--seconds` long: batches alone, batches with the clients at each `--rates`, and
batches alone again (the two baselines bracket the loaded phases, so drift on a shared machine
shows). Latency is measured from when a request was due, not when it could be sent, so a server
that falls behind shows up in the figures instead of slowing the clients down.

    .venv/bin/python -m bench.load [--clients 200] [--rates 10,1] [--seconds 60]

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
import time
from pathlib import Path
from typing import Any

SECRET = "bench-load-secret"
GROUP = "load"
CLIENT_PROCESSES = 2
REQUEST_TIMEOUT_S = 5.0


# -- setup ------------------------------------------------------------------------------------


def _config(url: str, home: Path) -> Any:
    from worker.config import Config

    return Config.from_env(
        {
            "DATABASE_URL": url,
            "THUMBQ_HOME": str(home),
            "THUMBQ_STORAGE_URL": (home / "storage").as_uri(),
            "THUMBQ_CRON_SECRET": SECRET,
            "THUMBQ_BUDGET_MS": "10000",
            "THUMBQ_BUFFER_MS": "2000",
            "THUMBQ_CONCURRENCY": "2",
        }
    )


def _slide(seed: int) -> bytes:
    """A slide-like vector PDF of about 50 ms to render (nested drawing, a few KB)."""
    from tests.faultkit import vector_pdf

    return vector_pdf(seed, draws=35)


def fill(config: Any, files: int) -> None:
    """Write `files` images (a handful of distinct ones, copied) and enqueue them in GROUP."""
    from worker import db
    from worker.queue import Queue
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
            queue.enqueue(items[start : start + 1000], GROUP)
        conn.execute("analyze thumbq.jobs")


# -- the batch process ----------------------------------------------------------------------------


def run_batches(url: str, home: Path, seconds: float) -> dict[str, Any]:
    """Call run_batch back to back for `seconds` (each run capped to what is left)."""
    from worker import db
    from worker.batch import render_options, run_batch
    from worker.render.process import RenderPool
    from worker.storage import open_storage

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


async def _poller(
    port: int,
    rate: float,
    start: float,
    until: float,
    out: dict[str, Any],
) -> None:
    """One client: a keep-alive connection, one progress request every 1/rate s."""
    loop = asyncio.get_running_loop()
    interval = 1 / rate
    due = start + random.random() * interval  # spread the clients over the first interval
    etag: str | None = None
    reader = writer = None
    while due < until:
        await asyncio.sleep(max(0.0, due - loop.time()))
        try:
            if writer is None:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), REQUEST_TIMEOUT_S
                )
            assert reader is not None
            request = (
                f"GET /api/thumbnails/progress?group_id={GROUP} HTTP/1.1\r\n"
                f"Host: 127.0.0.1\r\nAuthorization: Bearer {SECRET}\r\n"
                + (f"If-None-Match: {etag}\r\n" if etag else "")
                + "\r\n"
            )
            sent = loop.time()
            writer.write(request.encode())
            status, etag_seen, close = await asyncio.wait_for(
                _read_response(reader), REQUEST_TIMEOUT_S
            )
            done = loop.time()
            out["from_due_ms"].append((done - due) * 1000)
            out["from_send_ms"].append((done - sent) * 1000)
            out["statuses"][str(status)] = out["statuses"].get(str(status), 0) + 1
            if status not in (200, 304):
                out["errors"].append(f"HTTP {status}")
            etag = etag_seen or etag
            if close:
                # waitress closes the connection after every 304 (it sends no Content-Length
                # there, and closes any HTTP/1.1 response without one): reconnect, as a browser
                # does, and count it.
                out["reconnects"] += 1
                writer.close()
                reader = writer = None
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            out["errors"].append(type(exc).__name__)
            if writer is not None:
                writer.close()
            reader = writer = None
        due += interval
        # A client that fell more than a whole interval behind skips to now, as a browser's
        # timer would; the late requests it skipped count as errors.
        now = loop.time()
        while due < now - interval:
            out["skipped"] += 1
            due += interval
    if writer is not None:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, str | None, bool]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    length = 0
    etag = None
    close = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        lower = name.strip().lower()
        if lower == "content-length":
            length = int(value.strip())
        elif lower == "etag":
            etag = value.strip()
        elif lower == "connection":
            close = value.strip().lower() == "close"
    if length:
        await reader.readexactly(length)
    return status, etag, close


async def _clients(port: int, n: int, rate: float, seconds: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    out: dict[str, Any] = {
        "from_due_ms": [],
        "from_send_ms": [],
        "statuses": {},
        "errors": [],
        "skipped": 0,
        "reconnects": 0,
    }
    start = loop.time() + 0.2
    until = start + seconds
    await asyncio.gather(*(_poller(port, rate, start, until, out) for _ in range(n)))
    return out


def run_clients(port: int, n: int, rate: float, seconds: float) -> dict[str, Any]:
    """`n` pollers at `rate` requests/s each for `seconds`; raw latencies and errors, and the CPU
    time this process used (to tell whether the clients could keep up)."""
    out = asyncio.run(_clients(port, n, rate, seconds))
    out["cpu_s"] = time.process_time()
    return out


# -- orchestration ------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))], 2)


def _spawn(args: list[str], out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.load", *args, "--out", str(out)],
        cwd=Path(__file__).resolve().parent.parent,
        stdout=subprocess.DEVNULL,
    )


def phase(
    url: str, home: Path, port: int, seconds: float, clients: int, rate: float, work: Path
) -> dict[str, Any]:
    """Batches for `seconds`, with `clients` pollers at `rate` (none when 0) at the same time."""
    batch_out = work / f"batch-{rate}.json"
    procs = [_spawn(["batches", url, str(home), str(seconds)], batch_out)]
    client_outs = []
    if clients:
        per = [
            clients // CLIENT_PROCESSES + (i < clients % CLIENT_PROCESSES)
            for i in range(CLIENT_PROCESSES)
        ]
        for i, n in enumerate(per):
            path = work / f"clients-{rate}-{i}.json"
            client_outs.append(path)
            procs.append(_spawn(["clients", str(port), str(n), str(rate), str(seconds)], path))
    for proc in procs:
        if proc.wait(timeout=seconds + 120) != 0:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
    result: dict[str, Any] = {"clients": clients, "rate_per_client": rate}
    result["batches"] = json.loads(batch_out.read_text())
    if clients:
        due: list[float] = []
        sent: list[float] = []
        statuses: dict[str, int] = {}
        errors: list[str] = []
        skipped = reconnects = 0
        client_cpu = 0.0
        for path in client_outs:
            part = json.loads(path.read_text())
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
    c = sub.add_parser("clients")
    c.add_argument("port", type=int)
    c.add_argument("n", type=int)
    c.add_argument("rate", type=float)
    c.add_argument("seconds", type=float)
    c.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--rates", default="10,1", help="requests/s per client, one phase each")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--files", type=int, default=0, help="queue size (default: enough)")
    args = parser.parse_args(argv)

    if args.role == "batches":
        args.out.write_text(json.dumps(run_batches(args.url, args.home, args.seconds)))
        return 0
    if args.role == "clients":
        args.out.write_text(json.dumps(run_clients(args.port, args.n, args.rate, args.seconds)))
        return 0
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    from api import create_app
    from bench.common import scratch_database, write_result
    from worker.serving import ServerThread

    rates = [float(r) for r in args.rates.split(",") if r]
    phases = 2 + len(rates)
    # About 30 of these slides a second on two cores; a queue that outlasts every phase.
    files = args.files or int(phases * args.seconds * 50)
    url = scratch_database("thumbq_bench_load")
    with tempfile.TemporaryDirectory(prefix="thumbq-load-") as tmp:
        home = Path(tmp)
        config = _config(url, home)
        t = time.monotonic()
        fill(config, files)
        fill_s = time.monotonic() - t
        app = create_app(config)
        server = ServerThread(app, "127.0.0.1", 0).start()
        results = []
        try:
            plan = [0.0, *rates, 0.0]
            for rate in plan:
                clients = args.clients if rate else 0
                cpu = time.process_time()
                results.append(phase(url, home, server.port, args.seconds, clients, rate, home))
                # This process does nothing but serve HTTP while a phase runs.
                server_cpu = (time.process_time() - cpu) / args.seconds
                results[-1]["server_cpu_share_of_one_core"] = round(server_cpu, 2)
                print(json.dumps(results[-1]), file=sys.stderr)
        finally:
            server.close()
            app.extensions["thumbq"].close()
    baseline = statistics.mean(
        [r["batches"]["thumbnails_per_s"] for r in results if not r["clients"]]
    )
    for r in results:
        r["throughput_vs_baseline"] = round(r["batches"]["thumbnails_per_s"] / baseline, 3)
    write_result(
        "load",
        {
            "method": "real waitress server (ServerThread, as thumbq serve) on 127.0.0.1; batches "
            "in their own process; asyncio clients in 2 processes, one keep-alive connection each, "
            "If-None-Match with the last ETag; latency from when each request was due",
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
