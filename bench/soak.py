"""Soak: every promise about tasks at once, under three invocations, cancels, re-enqueues, mixed
posts and a SIGKILL a minute (issue 20).

Three invocations share one database: `thumbq serve`, whose POST /api/thumbnails/batch-generate
a thread calls in a loop (and which runs the interactive `wait_ms` posts), and two loops that
start `thumbq run-batch` one after another. Meanwhile a driver keeps `--keys` (20) ordering keys
of `--segments` (10) sequences of the `soak_step` task (bench/soak_tasks.py: each run logs its
start and end) going, a key being replaced by a fresh one when all of its jobs have ended; it
posts sequences mostly in order and sometimes ahead of order, in mixed POST /api/jobs requests
(thumbnail items, unordered task items and an ordered one together), posts some alone with
`wait_ms`, cancels random jobs, re-enqueues random items (a cancelled one too), and SIGKILLs the
run-batch in flight of a random loop every `--kill-every-s` (60). After `--minutes` (10) it stops
acting, lets the invocations drain every job, and checks:

- every key's runs are strictly in sequence order (a sequence runs again only after a run of it
  was killed) and never overlap, and no job runs twice at once (a run killed with its
  invocation ends at the kill; one with no end line otherwise ends at its deadline);
- every job is terminal, and none failed (the handler never fails, every file is a valid PNG,
  and one kill a minute cannot take three 23 s leases of one job);
- no deadlock is reported: none in the answers, none in the run-batch output, and no `deadlock
  detected` error of this database in the Postgres server's log in the window (a deadlock
  retried inside a transition is counted apart, from pg_stat_database, as `deadlocks_retried`);
- no answer 5xx and no run-batch that ended in an error.

    .venv/bin/python -m bench.soak [--minutes 10] [--keys 20] [--segments 10] [--kill-every-s 60]
                                   [--database-url URL] [--server-log PATH] [--seed 20]

The database is --database-url, else a scratch database on BENCH_DATABASE_URL,
TEST_DATABASE_URL or DATABASE_URL (else embedded). Results: bench/results/soak.json (the short
run of tests/db/test_soak.py writes elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from bench.common import scratch_database, write_result
from bench.corpus import tiny_png
from bench.soak_tasks import INVOCATION_ENV
from worker.engine import db
from worker.engine.states import FINAL_STATUSES
from worker.storage.file import FileStorage

ROOT = Path(__file__).resolve().parent.parent
SECRET = "soak-secret-0123456789abcdef"
GROUP = "soak"
# A killed run's render process dies with its invocation (PDEATHSIG), a moment after the kill.
KILL_SLACK_S = 0.5
# Between two calls of batch-generate.
BATCH_PAUSE_S = 2.0


@dataclass
class Options:
    minutes: float = 10.0
    keys: int = 20
    segments: int = 10
    kill_every_s: float = 60.0
    database_url: str | None = None
    server_log: str | None = None
    seed: int = 20
    budget_ms: int = 3000
    buffer_ms: int = 1000
    tick_s: float = 0.25
    drain_s: float = 120.0
    work_dir: str | None = None


@dataclass
class Key:
    name: str
    items: dict[int, dict[str, Any]]
    posted: dict[int, int] = field(default_factory=dict)  # sequence -> job id
    refused: set[int] = field(default_factory=set)  # sequences answered sequence_conflict

    def unposted(self) -> list[int]:
        return sorted(s for s in self.items if s not in self.posted and s not in self.refused)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thumbq_exe() -> str:
    return str(Path(sys.executable).parent / "thumbq")


class Api:
    """HTTP calls to the served API; counts every answer and keeps the errors."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.Lock()
        self.answers: Counter[str] = Counter()
        self.errors: list[dict[str, Any]] = []

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"},
        )
        route = path.split("?")[0]
        route = "/api/jobs/<id>/cancel" if route.endswith("/cancel") else route
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        except OSError as exc:  # refused, reset, timed out: an answer nobody got
            status, raw = 0, str(exc).encode()
        try:
            answer = json.loads(raw) if raw else None
        except ValueError:
            answer = raw.decode(errors="replace")
        with self.lock:
            self.answers[f"{method} {route} {status}"] += 1
            if status >= 500 or status == 0 or "deadlock" in str(answer).lower():
                self.errors.append({"route": route, "status": status, "answer": str(answer)[:500]})
        return status, answer


class Loop:
    """Starts `thumbq run-batch` one after another until stopped; one of them can be killed."""

    def __init__(self, name: str, env: dict[str, str], stop: threading.Event) -> None:
        self.name = name
        self.env = env
        self.stop = stop
        self.lock = threading.Lock()
        self.current: tuple[str, subprocess.Popen[bytes]] | None = None
        self.killed: dict[str, float] = {}
        self.runs = 0
        self.processed = 0
        self.errors: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            inv = f"{self.name}-{n}"
            proc = subprocess.Popen(
                [thumbq_exe(), "run-batch"],
                env={**self.env, INVOCATION_ENV: inv},
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            with self.lock:
                self.current = (inv, proc)
            out, err = proc.communicate()
            with self.lock:
                self.current = None
                killed = inv in self.killed
            self.runs += 1
            if killed:
                continue
            text = err.decode(errors="replace")
            if proc.returncode != 0 or "deadlock" in text.lower():
                self.errors.append({"inv": inv, "rc": proc.returncode, "stderr": text[-800:]})
                continue
            try:
                self.processed += int(json.loads(out)["processed"])
            except (ValueError, KeyError, TypeError):
                self.errors.append({"inv": inv, "rc": 0, "stdout": out.decode()[-800:]})

    def kill(self) -> str | None:
        """SIGKILL the run-batch in flight; returns its invocation id."""
        with self.lock:
            if self.current is None or self.current[1].poll() is not None:
                return None
            inv, proc = self.current
            self.killed[inv] = time.time()
            proc.send_signal(signal.SIGKILL)
            return inv


def server_log_path(conn: db.Conn, given: str | None) -> Path | None:
    """The server's log file: --server-log, pg_current_logfile(), else Debian's place."""
    if given:
        return Path(given)
    row = conn.execute(
        "select pg_current_logfile() as f, current_setting('data_directory') as d,"
        " current_setting('server_version_num')::int / 10000 as v"
    ).fetchone()
    assert row is not None
    if row["f"]:
        path = Path(row["f"])
        return path if path.is_absolute() else Path(row["d"]) / path
    debian = Path(f"/var/log/postgresql/postgresql-{row['v']}-main.log")
    return debian if debian.exists() else None


def log_size(path: Path | None) -> int | None:
    try:
        return path.stat().st_size if path else None
    except OSError:
        return None


def deadlock_lines(path: Path | None, offset: int | None, dbname: str | None) -> list[str] | None:
    """The server log's `deadlock detected` errors of this database (of any, when `dbname` is
    None: the log's lines do not name theirs) since `offset`; None when it cannot be read."""
    if path is None or offset is None:
        return None
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return [
        line
        for line in text.splitlines()
        if "deadlock detected" in line
        and "ERROR" in line
        and (dbname is None or f"@{dbname} " in line)
    ]


def deadlocks_counted(conn: db.Conn) -> int:
    conn.execute("select pg_stat_clear_snapshot()")
    row = conn.execute(
        "select deadlocks from pg_stat_database where datname = current_database()"
    ).fetchone()
    return int(row["deadlocks"]) if row else 0


# -- the driver ---------------------------------------------------------------------------------


class Driver:
    """Posts, cancels and re-enqueues over HTTP, keeping `keys` ordering keys going."""

    def __init__(
        self, opts: Options, api: Api, storage: FileStorage, log: Path, rng: random.Random
    ) -> None:
        self.opts = opts
        self.api = api
        self.storage = storage
        self.log = str(log)
        self.rng = rng
        self.keys: list[Key] = []
        self.retired: list[Key] = []
        self.made = 0
        self.files = 0
        self.loose = 0
        self.posted: dict[int, dict[str, Any]] = {}  # job id -> the item that made it
        self.items: list[dict[str, Any]] = []  # every item accepted once, to post again
        self.counts: Counter[str] = Counter()
        self.actions = log.parent / "actions.jsonl"  # what the driver did, for a post-mortem

    def note(self, **record: Any) -> None:
        with self.actions.open("a") as f:
            f.write(json.dumps({"t": time.time(), **record}, default=str) + "\n")

    def new_key(self) -> Key:
        self.made += 1
        name = f"key-{self.made:03d}"
        task = "soak_step_thread" if self.made % 4 == 0 else "soak_step"
        items = {
            s: {
                "task": task,
                "group_id": GROUP,
                "ordering_key": name,
                "sequence": s,
                "idempotency_key": f"{name}:{s}",
                "payload": {
                    "log": self.log,
                    "key": name,
                    "seq": s,
                    "ms": self.rng.randint(50, 300),
                    "poll": self.rng.random() < 0.5,
                },
            }
            for s in range(1, self.opts.segments + 1)
        }
        return Key(name, items)

    def thumbnail_item(self) -> dict[str, Any]:
        if self.files and self.rng.random() < 0.2:  # the same file again: the same job
            n = self.rng.randint(1, self.files)
        else:
            self.files += 1
            n = self.files
            self.storage.put(f"soak/{n:05d}.png", tiny_png(n), "image/png")
        return {
            "task": "thumbnail",
            "group_id": GROUP,
            "payload": {"source_key": f"soak/{n:05d}.png"},
        }

    def loose_item(self) -> dict[str, Any]:
        self.loose += 1
        return {
            "task": self.rng.choice(["soak_step", "soak_step_thread"]),
            "group_id": GROUP,
            "idempotency_key": f"loose:{self.loose}",
            "payload": {"log": self.log, "ms": self.rng.randint(50, 200), "poll": True},
        }

    def post(self, items: list[dict[str, Any]], wait_ms: int | None = None) -> int:
        """POST /api/jobs: alone (optionally with wait_ms) or as items; records what was made."""
        if len(items) == 1:
            body = dict(items[0]) | ({"wait_ms": wait_ms} if wait_ms else {})
            status, answer = self.api.call("POST", "/api/jobs", body)
            rows = [answer] if status in (200, 202) and isinstance(answer, dict) else []
        else:
            status, answer = self.api.call("POST", "/api/jobs", {"items": items})
            rows = answer["jobs"] if status == 202 and isinstance(answer, dict) else []
        self.note(
            act="post",
            status=status,
            wait_ms=wait_ms,
            items=[(i.get("ordering_key"), i.get("sequence"), i["task"]) for i in items],
            jobs=[(r.get("job_id") or r.get("id"), r.get("status")) for r in rows],
        )
        for item, row in zip(items, rows, strict=False):
            job_id = row.get("job_id") or row.get("id")
            if job_id is None:
                continue
            self.posted[int(job_id)] = item
            self.items.append(item)
            if item.get("ordering_key"):
                key = next((k for k in self.keys if k.name == item["ordering_key"]), None)
                if key is not None:
                    key.posted[item["sequence"]] = int(job_id)
        return int(status)

    def post_ordered(self, key: Key, seq: int, mixed: bool, wait_ms: int | None) -> None:
        item = key.items[seq]
        if not mixed:
            status = self.post([item], wait_ms)
            self.counts[f"ordered_alone_{status}"] += 1
            if status == 409:
                key.refused.add(seq)
            return
        items = [item]
        items += [self.thumbnail_item() for _ in range(self.rng.randint(1, 2))]
        items += [self.loose_item() for _ in range(self.rng.randint(0, 2))]
        self.rng.shuffle(items)
        status = self.post(items)
        self.counts[f"mixed_{status}"] += 1
        if status == 409:  # all or nothing: the rest again without it, it alone
            self.post([i for i in items if i is not item])
            if self.post([item]) == 409:
                key.refused.add(seq)

    def act(self, conn: db.Conn) -> None:
        r = self.rng.random()
        open_keys = [k for k in self.keys if k.unposted()]
        if r < 0.6 and open_keys:
            key = self.rng.choice(open_keys)
            todo = key.unposted()
            if self.rng.random() < 0.9 or len(todo) == 1:  # in order, in a mixed request
                self.post_ordered(key, todo[0], mixed=True, wait_ms=None)
            else:  # ahead of order, alone, sometimes run at once
                seq = self.rng.choice(todo[1:4])
                self.counts["ahead_of_order"] += 1
                wait = 1500 if self.rng.random() < 0.5 else None
                self.post_ordered(key, seq, mixed=False, wait_ms=wait)
        elif r < 0.7 and open_keys:  # the next in order, alone, run at once where it can be
            key = self.rng.choice(open_keys)
            self.counts["interactive"] += 1
            self.post_ordered(key, key.unposted()[0], mixed=False, wait_ms=1500)
        elif r < 0.82 and self.posted:
            # Mostly a job that waits or runs (a running head too), sometimes any.
            row = conn.execute(
                "select id, status from thumbq.jobs where status in ('pending', 'processing')"
                " and task <> 'thumbnail' order by random() limit 1"
            ).fetchone()
            job_id = row["id"] if row and self.rng.random() < 0.8 else None
            if job_id is None:
                job_id = self.rng.choice(list(self.posted))
            status, answer = self.api.call("POST", f"/api/jobs/{job_id}/cancel", {})
            was = row["status"] if row and row["id"] == job_id else "any"
            self.note(act="cancel", job=job_id, was=was, status=status, answer=answer)
            self.counts[f"cancel_{was}_{status}"] += 1
        elif self.items:
            item = self.rng.choice(self.items)
            status = self.post([item])
            self.counts[f"reenqueue_{status}"] += 1

    def rotate(self, conn: db.Conn, keep_going: bool) -> None:
        """Retire keys whose every sequence is posted (or refused) and ended; add fresh ones."""
        for key in list(self.keys):
            if key.unposted():
                continue
            ids = list(key.posted.values())
            row = conn.execute(
                "select count(*) as n from thumbq.jobs where id = any(%s)"
                " and status in ('pending', 'processing')",
                [ids],
            ).fetchone()
            if row and row["n"] == 0:
                self.keys.remove(key)
                self.retired.append(key)
        while keep_going and len(self.keys) < self.opts.keys:
            self.keys.append(self.new_key())


# -- checks ---------------------------------------------------------------------------------------


def open_invocations(log: Path) -> set[str]:
    """The invocations that have a run started and not ended."""
    open_runs: dict[str, str] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec["ev"] == "start":
                open_runs[rec["run"]] = rec["inv"]
            else:
                open_runs.pop(rec["run"], None)
    return set(open_runs.values())


def read_runs(log: Path, killed: dict[str, float]) -> list[dict[str, Any]]:
    """Each run from its start line to its end line; a run without one ends when its invocation
    was killed (+ slack), else at its deadline."""
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            (starts if rec["ev"] == "start" else ends)[rec["run"]] = rec
    runs = []
    for run_id, s in starts.items():
        e = ends.get(run_id)
        if e is not None:
            end, how = e["t"], "cancelled" if e.get("cancelled") else "ended"
        elif s["inv"] in killed and killed[s["inv"]] >= s["t"]:
            end, how = min(killed[s["inv"]] + KILL_SLACK_S, s["deadline"]), "killed"
        else:
            end, how = s["deadline"], "cut_at_deadline"
        runs.append({**s, "end": end, "how": how})
    return sorted(runs, key=lambda r: r["t"])


def overlaps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pairs of runs (sorted by start) where one starts before an earlier one ended."""
    found = []
    latest: dict[str, Any] | None = None
    for r in runs:
        if latest is not None and r["t"] < latest["end"]:
            found.append({"first": _brief(latest), "second": _brief(r)})
        if latest is None or r["end"] > latest["end"]:
            latest = r
    return found


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r[k] for k in ("job", "key", "seq", "inv", "pid", "t", "end", "how")}


def check(runs: list[dict[str, Any]], conn: db.Conn) -> dict[str, Any]:
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    by_job: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        by_job[r["job"]].append(r)
        if r["key"]:
            by_key[r["key"]].append(r)
    out_of_order = []
    for key, rs in by_key.items():
        for a, b in itertools.pairwise(rs):
            # A sequence may run again (a run of it was killed, or its completion was lost with
            # its invocation), never after a later one has started.
            if b["seq"] < a["seq"]:
                out_of_order.append({"key": key, "first": _brief(a), "second": _brief(b)})
    key_overlaps = [o for rs in by_key.values() for o in overlaps(rs)]
    job_overlaps = [o for rs in by_job.values() for o in overlaps(rs)]
    statuses = {
        r["status"]: r["n"]
        for r in conn.execute("select status, count(*) as n from thumbq.jobs group by 1")
    }
    stuck = conn.execute(
        "select id, task, status, ordering_key, sequence, attempts, lease_expires_at"
        " from thumbq.jobs where status not in ('completed', 'failed', 'unsupported', 'cancelled')"
        " order by id limit 20"
    ).fetchall()
    stuck_keys = conn.execute(
        "select id, ordering_key, sequence, status, msg_id, attempts, error_code, worker_id"
        " from thumbq.jobs where ordering_key in (select ordering_key from thumbq.jobs"
        " where status in ('pending', 'processing')) order by ordering_key, sequence"
    ).fetchall()
    failed = conn.execute(
        "select error_code, count(*) as n from thumbq.jobs where status = 'failed' group by 1"
    ).fetchall()
    failed_jobs = conn.execute(
        "select id, task, ordering_key, sequence, error_code, left(last_error, 200) as last_error,"
        " attempts, worker_id from thumbq.jobs where status = 'failed' order by id limit 10"
    ).fetchall()
    # The database's view of each key: completions follow the sequence.
    db_order = conn.execute(
        "select ordering_key, array_agg(sequence order by completed_at, id) as seqs"
        " from thumbq.jobs where status = 'completed' and ordering_key is not null group by 1"
    ).fetchall()
    db_out_of_order = [
        {"key": r["ordering_key"], "completed": r["seqs"]}
        for r in db_order
        if list(r["seqs"]) != sorted(r["seqs"])
    ]
    return {
        "runs": len(runs),
        "runs_by_end": dict(Counter(r["how"] for r in runs)),
        "keys_run": len(by_key),
        "jobs_run": len(by_job),
        "jobs_run_more_than_once": sum(1 for rs in by_job.values() if len(rs) > 1),
        "statuses": statuses,
        "failed_by_code": {r["error_code"]: r["n"] for r in failed},
        "failed_jobs": [dict(r) for r in failed_jobs],
        "out_of_order": out_of_order[:10],
        "out_of_order_count": len(out_of_order),
        "completed_out_of_order_in_db": db_out_of_order[:10],
        "overlaps_within_a_key": key_overlaps[:10],
        "overlaps_within_a_key_count": len(key_overlaps),
        "jobs_run_twice_at_once": job_overlaps[:10],
        "jobs_run_twice_at_once_count": len(job_overlaps),
        "not_terminal": [dict(r) for r in stuck],
        "keys_not_terminal": [dict(r) for r in stuck_keys[:40]],
        "not_terminal_count": sum(n for s, n in statuses.items() if s not in FINAL_STATUSES),
    }


# -- the soak -------------------------------------------------------------------------------------


def soak(opts: Options) -> dict[str, Any]:
    """Run the soak; returns its figures, `invariants` (name: held) and `held` (all of them)."""
    rng = random.Random(opts.seed)
    url = opts.database_url or scratch_database("thumbq_bench_soak")
    dbname = str(conninfo_to_dict(url).get("dbname"))
    work = Path(opts.work_dir or tempfile.mkdtemp(prefix="thumbq-soak-"))
    home = work / "home"
    home.mkdir(parents=True, exist_ok=True)
    log = work / "runs.jsonl"
    storage = FileStorage(home / "storage")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("THUMBQ_")}
    env.update(
        DATABASE_URL=url,
        THUMBQ_HOME=str(home),
        THUMBQ_STORAGE_URL=(home / "storage").as_uri(),
        THUMBQ_TASKS="bench.soak_tasks",
        THUMBQ_BUDGET_MS=str(opts.budget_ms),
        THUMBQ_BUFFER_MS=str(opts.buffer_ms),
        THUMBQ_CRON_SECRET=SECRET,
        THUMBQ_CONCURRENCY="2",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    conn = db.connect(url)
    log_path = server_log_path(conn, opts.server_log)
    log_from = log_size(log_path)
    deadlocks_before = deadlocks_counted(conn)
    serve_out = (work / "serve.err").open("wb")
    serve = subprocess.Popen(
        [thumbq_exe(), "serve", "--host", "127.0.0.1", "--port", str(port)],
        env={**env, INVOCATION_ENV: "serve"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=serve_out,
    )
    api = Api(f"http://127.0.0.1:{port}")
    stop_loops = threading.Event()
    stop_calls = threading.Event()
    loops = [Loop(f"rb{i}", env, stop_loops) for i in (1, 2)]
    batch_calls: Counter[int] = Counter()

    def call_batches() -> None:
        # A pause between calls, as a scheduler chaining runs would leave: back to back, the
        # served invocation took nearly every job (49 of ~2 500 went to the run-batch loops in
        # 10 minutes) and the kills found no run to cut.
        while not stop_calls.is_set():
            status, _ = api.call("POST", "/api/thumbnails/batch-generate", {})
            batch_calls[status] += 1
            stop_calls.wait(BATCH_PAUSE_S)

    started = time.time()
    kills: list[dict[str, Any]] = []
    driver = Driver(opts, api, storage, log, rng)
    caller = threading.Thread(target=call_batches, daemon=True)
    try:
        deadline = time.monotonic() + 60
        while api.call("GET", "/healthz", timeout=2)[0] != 200:
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"thumbq serve did not start: {serve.returncode}")
            time.sleep(0.3)
        api.answers.clear()
        api.errors.clear()
        for loop in loops:
            loop.thread.start()
        caller.start()
        chaos_end = time.monotonic() + opts.minutes * 60
        next_kill = time.monotonic() + opts.kill_every_s
        next_rotate = 0.0
        while time.monotonic() < chaos_end:
            if time.monotonic() >= next_rotate:
                driver.rotate(conn, keep_going=True)
                next_rotate = time.monotonic() + 2
            driver.act(conn)
            if time.monotonic() >= next_kill:
                # A run-batch with a handler running, so that the kill cuts a run; after 10 s
                # without one, any run-batch in flight.
                running = open_invocations(log)
                busy = [x for x in loops if x.current and x.current[0] in running]
                late = time.monotonic() >= next_kill + 10
                pick = busy or (loops if late else [])
                inv = rng.choice(pick).kill() if pick else None
                if inv:
                    kills.append(
                        {"inv": inv, "t": round(time.time() - started, 1), "cut_a_run": bool(busy)}
                    )
                    next_kill += opts.kill_every_s
            time.sleep(opts.tick_s)
        chaos_s = time.time() - started
        drain_end = time.monotonic() + opts.drain_s
        left = None
        while time.monotonic() < drain_end:
            row = conn.execute(
                "select count(*) as n from thumbq.jobs where status in ('pending', 'processing')"
            ).fetchone()
            left = row["n"] if row else None
            if left == 0:
                break
            time.sleep(1)
        drained_s = time.time() - started
    finally:
        stop_loops.set()
        stop_calls.set()
        for loop in loops:
            loop.thread.join(opts.budget_ms / 1000 + 30)
        caller.join(opts.budget_ms / 1000 + 30)
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(20)
        except subprocess.TimeoutExpired:
            serve.kill()
        serve_out.close()
    killed = {inv: t for loop in loops for inv, t in loop.killed.items()}
    runs = read_runs(log, killed)
    checked = check(runs, conn)
    time.sleep(1.0)  # the backends that ended have flushed their statistics
    retried = deadlocks_counted(conn) - deadlocks_before
    prefix = conn.execute("show log_line_prefix").fetchone()
    names_db = prefix is not None and "%d" in prefix["log_line_prefix"]
    in_log = deadlock_lines(log_path, log_from, dbname if names_db else None)
    conn.close()
    runner_errors = [e for loop in loops for e in loop.errors]
    deadlocks_reported = (
        len(in_log or [])
        + sum("deadlock" in e["answer"].lower() for e in api.errors)
        + sum("deadlock" in json.dumps(e).lower() for e in runner_errors)
    )
    invariants = {
        "every_key_in_sequence_order": checked["out_of_order_count"] == 0
        and not checked["completed_out_of_order_in_db"],
        "no_overlap_within_a_key": checked["overlaps_within_a_key_count"] == 0,
        "no_job_run_twice_at_once": checked["jobs_run_twice_at_once_count"] == 0,
        "every_job_terminal": checked["not_terminal_count"] == 0,
        # Nothing lost: the handler never fails and every file is a valid PNG; a kill a minute
        # cannot take three 23 s leases of one job.
        "no_job_failed": not checked["failed_by_code"],
        "no_deadlock_reported": deadlocks_reported == 0,
        "no_errors_answered": not api.errors and not runner_errors,
    }
    return {
        "minutes": opts.minutes,
        "keys_at_once": opts.keys,
        "segments": opts.segments,
        "budget_ms": opts.budget_ms,
        "buffer_ms": opts.buffer_ms,
        "seed": opts.seed,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "chaos_s": round(chaos_s, 1),
        "drained_after_s": round(drained_s, 1),
        "left_unfinished_at_drain_end": left,
        "keys_made": driver.made,
        "ordered_jobs_posted": sum(len(k.posted) for k in driver.keys + driver.retired),
        "sequences_refused_out_of_order": sum(len(k.refused) for k in driver.keys + driver.retired),
        "thumbnail_files": driver.files,
        "loose_task_jobs": driver.loose,
        "driver": dict(driver.counts),
        "kills": kills,
        "run_batch_invocations": sum(loop.runs for loop in loops),
        "run_batch_processed": sum(loop.processed for loop in loops),
        "batch_generate_answers": dict(batch_calls),
        "answers": dict(api.answers),
        "errors_answered": api.errors[:10],
        "run_batch_errors": runner_errors[:10],
        "server_log": str(log_path) if in_log is not None else None,
        "deadlocks_in_server_log": None if in_log is None else len(in_log),
        "deadlock_lines": (in_log or [])[:5],
        "deadlocks_reported": deadlocks_reported,
        "deadlocks_retried": retried,
        **checked,
        "invariants": invariants,
        "held": all(invariants.values()),
        "work_dir": str(work),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--keys", type=int, default=20)
    p.add_argument("--segments", type=int, default=10)
    p.add_argument("--kill-every-s", type=float, default=60.0)
    p.add_argument("--database-url", default=None)
    p.add_argument("--server-log", default=None)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--out", default="soak", help="result name under bench/results/ (soak)")
    args = p.parse_args(argv)
    opts = Options(
        minutes=args.minutes,
        keys=args.keys,
        segments=args.segments,
        kill_every_s=args.kill_every_s,
        database_url=args.database_url,
        server_log=args.server_log,
        seed=args.seed,
    )
    result = soak(opts)
    write_result(args.out, result)
    return 0 if result["held"] else 1


if __name__ == "__main__":
    sys.exit(main())
