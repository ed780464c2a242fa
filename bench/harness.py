"""The hostile-run harness: bench/hostile.py and the fault tests (tests/system/test_faults.py) drive
worker processes with it.

- `LoggingStorage`: the real file storage, which also appends one line per `get` (when it starts)
  and per `put` (when it has finished) to a log file, so that renders can be timed per source key
  from the storage side, across processes that are killed at any moment.
- `python -m bench.harness drive ...`: a worker process that calls `run_batch` in a loop, one
  JSON line per run on stdout; the fault tests kill and restart it.
- `TreeSampler`: peak resident memory of a process and all its descendants (render children).
- `hostile_run`: a worker process drains a mix of good files and the bad-input corpus.

The corpus is imported where it is used, not here: the driver process, whose memory is measured,
never loads it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.storage import ObjectInfo
from worker.storage.file import FileStorage

REPO_ROOT = Path(__file__).resolve().parent.parent


# -- observing storage ------------------------------------------------------------------------


class LoggingStorage(FileStorage):
    """FileStorage that logs `get` starts and `put` ends (key, pid, wall time) to `log_path`.

    Each line is written with one `write` on an O_APPEND descriptor: lines from concurrent
    processes never interleave, and a line is either in the file whole or not at all when its
    writer is SIGKILLed.
    """

    def __init__(
        self, root: str | os.PathLike[str], log_path: str | os.PathLike[str], *, fsync: bool = True
    ) -> None:
        super().__init__(root, fsync=fsync)
        self.log_path = Path(log_path)
        self._log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, op: str, key: str, **extra: Any) -> None:
        """Append one event line."""
        line = json.dumps({"op": op, "key": key, "pid": os.getpid(), "t": time.time(), **extra})
        os.write(self._log_fd, (line + "\n").encode())

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        self.log("get", key)
        return super().get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        info = super().put(key, data, content_type)
        self.log("put", key)
        return info


# -- hostile mix ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """A file written for a scenario and the terminal outcome its job must reach."""

    key: str
    content_type: str | None
    status: str
    error_code: str | None
    max_attempts: int | None = None  # None: the configured default


def write_hostile_mix(
    storage: FileStorage, total: int, *, slow: int = 1, hogs: int = 0
) -> list[Planned]:
    """Write `total` files: a third cycled from the corpus (every sample but the minutes-long
    PDF, whose place is taken by `slow` copies of it enqueued with max_attempts 1 so that each
    costs one render window, not three), the rest small good images and PDFs; then `hogs`
    legal 8000x8000 RGBA PNGs (under the pixel limit) that need about 530 MB each to render:
    more than the default share of a render process at concurrency 2, so refused too_large."""
    from bench.corpus import CORPUS, memory_hog_png, tiny_png, vector_pdf

    samples = [s for name, s in CORPUS.items() if name != "slow_pdf"]
    n_bad = total // 3
    plan: list[Planned] = []
    for i in range(slow):
        s = CORPUS["slow_pdf"]
        plan.append(Planned(f"bad/{i:04d}-{s.name}", s.declared_type, s.status, s.error_code, 1))
    for i in range(slow, n_bad):
        s = samples[i % len(samples)]
        plan.append(Planned(f"bad/{i:04d}-{s.name}", s.declared_type, s.status, s.error_code))
    for i in range(total - n_bad):
        if i % 2:
            plan.append(Planned(f"good/{i:04d}.png", "image/png", "completed", None))
        else:
            plan.append(Planned(f"good/{i:04d}.pdf", "application/pdf", "completed", None))
    for p in plan:
        if p.key.startswith("good/"):
            data = (
                tiny_png(int(p.key[5:9]), (320, 240))
                if p.key.endswith(".png")
                else (vector_pdf(int(p.key[5:9]), draws=5))
            )
        else:
            data = CORPUS[p.key.split("-", 1)[1]].data
        storage.put(p.key, data, p.content_type or "application/octet-stream")
    for i in range(hogs):
        key = f"hog/{i:04d}.png"
        storage.put(key, memory_hog_png(), "image/png")
        plan.append(Planned(key, "image/png", "failed", "too_large"))
    return plan


def enqueue_plan(
    conn: Any, storage: FileStorage, config: Any, plan: Sequence[Planned], group: str
) -> None:
    """Enqueue a plan, the items with their own max_attempts separately."""
    from worker.thumbnails.files import enqueue_keys

    for attempts in {p.max_attempts for p in plan}:
        cfg = config if attempts is None else config.with_(max_attempts=attempts)
        items = [
            {"source_key": p.key, "content_type": p.content_type}
            for p in plan
            if p.max_attempts == attempts
        ]
        enqueue_keys(conn, storage, cfg, items, group)


# -- memory -----------------------------------------------------------------------------------


class TreeSampler:
    """Samples the resident memory of a process and its descendants in a thread.

    `peak_total_mb` sums RSS over the tree at each sample (pages shared between the zygote and
    its forked children are counted in each, so it over-states); `peak_single_mb` is the largest
    single process seen.
    """

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid = pid
        self.every_s = every_s
        self.peak_total_mb = 0.0
        self.peak_single_mb = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                self.peak_single_mb = max(self.peak_single_mb, rss / 2**20)
            self.peak_total_mb = max(self.peak_total_mb, total / 2**20)
            self.samples += 1
            self._stop.wait(self.every_s)


# -- the worker driver ------------------------------------------------------------------------


def driver_command(
    storage_root: Path, log_path: Path, *, until_drained: bool, fsync: bool = True
) -> list[str]:
    """argv of a worker process (configuration from THUMBQ_* and DATABASE_URL)."""
    argv = [sys.executable, "-m", "bench.harness", "drive", str(storage_root), str(log_path)]
    if until_drained:
        argv.append("--until-drained")
    if not fsync:
        argv.append("--no-fsync")
    return argv


def driver_env(db_url: str, marker_dir: Path, **settings: str | int) -> dict[str, str]:
    """Environment of a worker process. `marker_dir` goes first on its (and so its render
    processes') sys.path: their command lines carry it, which finds leftovers after a kill."""
    repo = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("THUMBQ_")}
    env.update(
        {
            "DATABASE_URL": db_url,
            "THUMBQ_HOME": str(marker_dir),
            "PYTHONPATH": os.pathsep.join([str(marker_dir), repo]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({f"THUMBQ_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def _drive(args: argparse.Namespace) -> int:
    """Run batches until killed, or (`--until-drained`) until no job is pending or processing."""
    from worker.engine import db
    from worker.engine.batch import run_batch
    from worker.engine.config import Config
    from worker.thumbnails.render.process import RenderPool
    from worker.thumbnails.task import render_options

    config = Config.from_env()
    storage = LoggingStorage(args.storage_root, args.log_path, fsync=not args.no_fsync)
    assert config.database_url
    conn = db.connect(config.database_url)
    with RenderPool(render_options(config), config.concurrency, config.render_memory_mb) as pool:
        storage.log("ready", "")
        print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
        while True:
            storage.log("run_start", "")
            started = time.monotonic()
            result = run_batch(config, conn, storage, pool)
            wall_ms = round((time.monotonic() - started) * 1000)
            storage.log("run_end", "")
            print(json.dumps({**result.response(), "wall_ms": wall_ms}), flush=True)
            if result.stopped_reason == "rate_limited":
                time.sleep(min(result.retry_after_ms or 100, 1000) / 1000)
            elif result.processed == 0 and result.stopped_reason == "drained":
                left = conn.execute(
                    "select count(*) as n from thumbq.jobs"
                    " where status in ('pending', 'processing')"
                ).fetchone()
                if args.until_drained and left is not None and left["n"] == 0:
                    return 0
                # Only invisible messages remain (leases of killed runs, backoffs): wait a bit.
                time.sleep(0.2)


class Worker:
    """A worker process (`python -m bench.harness drive`) with its output in a file."""

    def __init__(self, argv: list[str], env: dict[str, str], out: Path) -> None:
        self.out = out
        with open(out, "ab") as f:
            self.proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=f, stderr=f)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> float:
        """SIGKILL; returns the time by which it is certainly dead."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        return time.time()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def thumbnails_match(conn: Any, storage: FileStorage) -> int:
    """Every completed job's thumbnail is at the key for its etag, decodes, and has the size the
    job row says. Returns how many were checked."""
    from PIL import Image

    from worker.thumbnails.task import thumbnail_key

    rows = conn.execute("select * from thumbq.jobs where status = 'completed'").fetchall()
    for job in rows:
        key = thumbnail_key(job["source_key"], job["source_etag"], 512, "webp")
        assert job["thumbnail_key"] == key
        assert storage.head(job["source_key"]).etag == job["source_etag"]
        path = storage.root / key
        with Image.open(path) as img:
            img.load()
            assert img.format == "WEBP" and img.size == (job["width"], job["height"]), key
    return len(rows)


def hostile_run(
    work: Path, db_url: str, total: int, *, budget_ms: int, buffer_ms: int, hogs: int = 0
) -> dict[str, Any]:
    """A worker process drains `total` files, a third of them from the bad-input corpus (and
    `hogs` legal 8000x8000 RGBA PNGs that need about 256 MB each to decode), while the memory of
    it and its render processes is sampled. Returns the figures, with any wrong outcome."""
    from worker.engine import db
    from worker.engine.config import Config

    root, log = work / "storage", work / "storage.log"
    marker = work / f"marker-{uuid.uuid4().hex}"
    marker.mkdir(parents=True)
    storage = FileStorage(root, fsync=False)
    plan = write_hostile_mix(storage, total, hogs=hogs)
    config = Config.from_env({"THUMBQ_HOME": str(work), "DATABASE_URL": db_url})
    with db.connect(db_url) as conn:
        enqueue_plan(conn, storage, config, plan, "hostile")
    env = driver_env(db_url, marker, budget_ms=budget_ms, buffer_ms=buffer_ms, concurrency=2)
    started = time.time()
    argv = driver_command(root, log, until_drained=True, fsync=False)
    w = Worker(argv, env, work / "worker.out")
    try:
        with TreeSampler(w.pid) as mem:
            code = w.proc.wait(1800)
    finally:
        w.stop()
    assert code == 0, w.out.read_text()[-3000:]
    wall_s = time.time() - started
    runs = list(run_lines(w.out.read_text()))
    with db.connect(db_url) as conn:
        jobs = {r["source_key"]: r for r in conn.execute("select * from thumbq.jobs")}
        checked = thumbnails_match(conn, storage)
    wrong = [
        (p.key, (p.status, p.error_code), (jobs[p.key]["status"], jobs[p.key]["error_code"]))
        for p in plan
        if (jobs[p.key]["status"], jobs[p.key]["error_code"]) != (p.status, p.error_code)
    ]
    return {
        "files": total + hogs,
        "from_corpus": sum(1 for p in plan if p.key.startswith("bad/")),
        "hogs": hogs,
        "expected_not_completed": sum(1 for p in plan if p.status != "completed"),
        "thumbnails_checked": checked,
        "budget_ms": budget_ms,
        "buffer_ms": buffer_ms,
        "runs": len(runs),
        "durations_ms": sorted(r["duration_ms"] for r in runs),
        "max_duration_ms": max(r["duration_ms"] for r in runs),
        "max_wall_ms": max(r["wall_ms"] for r in runs),
        "peak_rss_tree_mb": round(mem.peak_total_mb),
        "peak_rss_one_process_mb": round(mem.peak_single_mb),
        "memory_samples": mem.samples,
        "wall_s": round(wall_s, 1),
        "wrong_outcomes": wrong,
        "statuses": dict(Counter(j["status"] for j in jobs.values())),
    }


def run_lines(stdout: str) -> Iterator[dict[str, Any]]:
    """The per-run JSON objects a driver printed."""
    for line in stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "run_id" in d and "wall_ms" in d:  # not the engine's own log line
                yield d


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.harness")
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive", help="run batches in a loop (a worker for the fault tests)")
    d.add_argument("storage_root")
    d.add_argument("log_path")
    d.add_argument("--until-drained", action="store_true")
    d.add_argument("--no-fsync", action="store_true")
    args = parser.parse_args(argv)
    # The test harness stops a driver with SIGTERM when it is done with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return _drive(args)


if __name__ == "__main__":
    raise SystemExit(main())
