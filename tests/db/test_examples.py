"""The examples (examples/) end to end, each against the real thing: docgen against a local
HTTP API that enforces its quota, segments under concurrent invocations that get killed, and
an export of a 1 000 000-row table over many short invocations."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest

from examples import docgen, export, segments
from tests.support.httpstub import HttpStub, Request
from worker.engine import db, ratelimit
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.engine.queue import Queue
from worker.storage import open_storage
from worker.tasks import PermanentError
from worker.thumbnails.render.process import RenderPool
from worker.thumbnails.task import render_options

ROOT = Path(__file__).resolve().parents[2]

# Invocations in a process of their own, one after another with one render pool (as the API
# keeps one), until no job of the database waits or runs, or `EXAMPLE_LOOP_S` has passed.
LOOP = """
import os, time
from worker.engine import db
from worker.engine.batch import run_batch
from worker.thumbnails.task import render_options
from worker.engine.config import Config
from worker.thumbnails.render.process import RenderPool
from worker.storage import open_storage

config = Config.from_env()
pool = RenderPool(render_options(config), config.concurrency, config.render_memory_mb)
end = time.monotonic() + float(os.environ["EXAMPLE_LOOP_S"])
with db.connect(config.database_url) as conn:
    while time.monotonic() < end:
        r = run_batch(config, conn, open_storage(config), pool)
        left = conn.execute(
            "select count(*) as n from thumbq.jobs where status in ('pending', 'processing')"
        ).fetchone()["n"]
        if not left:
            break
        if not r.processed:
            time.sleep(0.1)
pool.close()
"""


def env_for(config: Config, **extra: str) -> dict[str, str]:
    """The environment of a thumbq process on the test's database and storage."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THUMBQ_", "DOCGEN_"))}
    env.update(
        DATABASE_URL=config.database_url or "",
        THUMBQ_HOME=str(config.home),
        THUMBQ_STORAGE_URL=config.storage_url,
        THUMBQ_CONCURRENCY=str(config.concurrency),
    )
    env.update(extra)
    return env


def start_loops(n: int, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen([sys.executable, "-c", LOOP], cwd=ROOT, env=env, start_new_session=True)
        for _ in range(n)
    ]


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for p in procs:
        p.wait(max(end - time.monotonic(), 1))
        assert p.returncode == 0


def jobs(conn: db.Conn, task: str) -> list[dict]:
    return conn.execute("select * from thumbq.jobs where task = %s order by id", [task]).fetchall()


@pytest.fixture
def in_env(config: Config, monkeypatch: pytest.MonkeyPatch) -> Config:
    """This process's environment names the test's database and storage (a handler in a thread
    reads its configuration from it, as under `thumbq up`)."""
    for name, value in env_for(config).items():
        if name.startswith(("THUMBQ_", "DATABASE_URL")):
            monkeypatch.setenv(name, value)
    return config


# -- docgen ----------------------------------------------------------------------------------


class QuotaApi:
    """The external document API: at most `limit` calls in any `window_s` seconds (a sliding
    window), the rest answered 429. Records when each call came and what it asked."""

    def __init__(self, limit: int, window_s: float, fail: dict[str, list[int]] | None = None):
        self.limit = limit
        self.window_s = window_s
        self.fail = fail or {}
        self.served: list[tuple[float, Request]] = []
        self.refused = 0
        self.lock = threading.Lock()
        self.stub = HttpStub(self.answer)

    def answer(self, req: Request) -> tuple[int, dict[str, str], bytes]:
        now = time.monotonic()
        with self.lock:
            recent = [t for t, _ in self.served if t > now - self.window_s]
            if len(recent) >= self.limit:
                self.refused += 1
                return 429, {"Retry-After": "1"}, b"quota exceeded"
            self.served.append((now, req))
            template = json.loads(req.body)["template"]
            if self.fail.get(template):
                status = self.fail[template].pop(0)
                return status, {}, f"template {template} answered {status}".encode()
        body = b"%PDF-1.4 document for " + req.body
        return 200, {"Content-Type": "application/pdf"}, body

    def most_in_any_window(self) -> int:
        times = sorted(t for t, _ in self.served)
        return max(
            (sum(1 for u in times[i:] if u < t + self.window_s) for i, t in enumerate(times)),
            default=0,
        )


@pytest.fixture
def api() -> Iterator[QuotaApi]:
    made = QuotaApi(limit=20, window_s=1.0)
    yield made
    made.stub.close()


def test_docgen_never_exceeds_the_quota_with_four_concurrent_invocations(
    config: Config, conn: db.Conn, api: QuotaApi
) -> None:
    """The API allows 20 calls in any second. Four invocations run side by side (processes,
    two workers each, 2 s budgets) over 60 requests, 48 of them distinct: the bucket keeps
    every second under 20, and each distinct request is one call and one document."""
    work_s = 1.5
    capacity, refill = docgen.bucket_for_quota(20, 1.0, late_s=work_s)
    ratelimit.set_limit(conn, docgen.BUCKET, capacity, refill)
    requests = [{"template": "letter", "data": {"to": f"c{i % 48}"}} for i in range(60)]
    rows = Queue(conn).enqueue_jobs(docgen.jobs_for(requests), "letters")
    assert len({r["job_id"] for r in rows}) == 48

    env = env_for(
        config,
        THUMBQ_TASKS="examples.docgen",
        THUMBQ_BUDGET_MS="2000",
        THUMBQ_BUFFER_MS=str(2000 - int(work_s * 1000)),
        DOCGEN_API_URL=api.stub.url,
        EXAMPLE_LOOP_S="60",
    )
    started = time.monotonic()
    wait_all(start_loops(4, env), 90)
    took = time.monotonic() - started

    assert api.refused == 0
    assert api.most_in_any_window() <= 20
    done = jobs(conn, "docgen")
    assert [j["status"] for j in done] == ["completed"] * 48
    # One call per distinct request, with its hash as the Idempotency-Key.
    keys = [r.headers["Idempotency-Key"] for _, r in api.served]
    assert len(keys) == len(set(keys)) == 48
    assert all(
        r.headers["Idempotency-Key"] == docgen.request_hash(json.loads(r.body))
        for _, r in api.served
    )
    storage = open_storage(config)
    for j in done:
        data, _ = storage.get(j["result"]["key"])
        assert data == b"%PDF-1.4 document for " + json.dumps(j["payload"]).encode()
        assert j["result"]["request_hash"] == j["idempotency_key"]
    # The bucket, not the API, set the pace: 48 calls at 4 + 6.4 a second take 7 s or more.
    assert took >= (48 - capacity) / refill - 0.5


def test_docgen_retries_what_may_pass_later_and_fails_a_refused_request_at_once(
    in_env: Config, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = QuotaApi(limit=100, window_s=1.0, fail={"flaky": [503, 429], "bad": [422]})
    try:
        monkeypatch.setenv(docgen.API_URL_ENV, api.stub.url)
        requests = [
            {"template": "flaky", "data": {}},
            {"template": "bad", "data": {"x": 1}},
            {"template": "letter", "data": {}},
        ]
        Queue(conn).enqueue_jobs(docgen.jobs_for(requests), "g")
        config = in_env.with_(tasks=("examples.docgen",))
        for expected in ("docgen_unavailable", "docgen_unavailable"):
            run_batch(config, conn, open_storage(config))
            flaky, bad, letter = jobs(conn, "docgen")
            assert (flaky["status"], flaky["error_code"]) == ("pending", expected)
            # Exponential backoff with jitter from 30 s: not before 15 s.
            wait = conn.execute(
                "select extract(epoch from next_attempt_at - now()) as s from thumbq.jobs"
                " where id = %s",
                [flaky["id"]],
            ).fetchone()["s"]
            assert wait >= 14
            conn.execute("select pgmq.set_vt('thumbq_jobs', %s, 0)", [flaky["msg_id"]])
        assert (bad["status"], bad["error_code"]) == ("failed", "docgen_rejected")
        assert bad["last_error"] == "the document API answered 422: template bad answered 422"
        assert bad["attempts"] == 1
        assert letter["status"] == "completed"
        run_batch(config, conn, open_storage(config))
        flaky = jobs(conn, "docgen")[0]
        assert (flaky["status"], flaky["attempts"]) == ("completed", 3)
        calls = [json.loads(r.body)["template"] for _, r in api.served]
        assert sorted(calls) == ["bad", "flaky", "flaky", "flaky", "letter"]
    finally:
        api.stub.close()


def test_docgen_a_run_cut_short_by_the_task_bucket_says_rate_limited_and_when_to_return(
    in_env: Config, conn: db.Conn, api: QuotaApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Regression: a claim whose jobs the task's own bucket refused looked drained, so the run
    # said `drained` and the scheduler waited for its next tick (5 minutes) with work left.
    monkeypatch.setenv(docgen.API_URL_ENV, api.stub.url)
    ratelimit.set_limit(conn, docgen.BUCKET, 2, 0.5)
    requests = [{"template": "letter", "data": {"n": i}} for i in range(6)]
    Queue(conn).enqueue_jobs(docgen.jobs_for(requests), "g")
    config = in_env.with_(tasks=("examples.docgen",))
    result = run_batch(config, conn, open_storage(config))
    assert result.succeeded == 2
    assert result.stopped_reason == "rate_limited"
    assert result.retry_after_ms is not None and 1000 <= result.retry_after_ms <= 3000
    assert result.remaining == 4


# -- segments --------------------------------------------------------------------------------


def read_journal(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_segments_run_in_order_each_once_and_resume_after_a_sigkill(
    in_env: Config, conn: db.Conn, tmp_path: Path
) -> None:
    """Three files of four segments. One invocation is SIGKILLed in the middle of a segment;
    then four run side by side. Per file, segment N starts only after N-1 is done, no chunk
    is processed twice, the killed segment goes on from its last checkpoint, and every result
    equals one pass over the whole file."""
    files, per_file, samples, chunk = 3, 4, 80_000, 10_000
    journal = tmp_path / "journal.jsonl"
    items = []
    for i in range(files):
        source = f"signals/s{i}.f64"
        segments.make_file(source, per_file, samples, seed=i)
        items += segments.jobs_for(source, per_file, samples, chunk=chunk, pace_ms=40)
    Queue(conn).enqueue_jobs(items, "signals")

    env = env_for(
        in_env,
        THUMBQ_TASKS="examples.segments",
        THUMBQ_CONCURRENCY="1",
        SEGMENTS_JOURNAL=str(journal),
        EXAMPLE_LOOP_S="60",
    )
    (victim,) = start_loops(1, {**env, "THUMBQ_BUDGET_MS": "60000"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
        e["event"] == "chunk" and e["pos"] == 2 * chunk for e in read_journal(journal)
    ):
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)  # its render child follows it (PDEATHSIG)
    victim.wait()
    time.sleep(0.5)
    cut = next(e for e in reversed(read_journal(journal)) if e["event"] == "chunk")
    # What the killed invocation held (its running segment, and heads it had claimed): their
    # leases are lost, an attempt each.
    held = {r["id"] for r in conn.execute("select id from thumbq.jobs where status = 'processing'")}
    # As if its lease had run out (budget + 20 s), without waiting for it.
    conn.execute("update thumbq.jobs set lease_expires_at = now() - interval '1 second'")
    conn.execute(
        "select pgmq.set_vt('thumbq_jobs', msg_id, 0) from thumbq.jobs where msg_id is not null"
    )
    # No retry's backoff is skipped: a segment cut at a deadline after its checkpoints is
    # handed back like a checkpoint (no attempt, no backoff), so the loops finish on their own.
    loops = start_loops(4, {**env, "THUMBQ_BUDGET_MS": "2000", "THUMBQ_BUFFER_MS": "500"})
    wait_all(loops, 90)

    rows = jobs(conn, segments.TASK)
    assert [r["status"] for r in rows] == ["completed"] * files * per_file, [
        (r["sequence"], r["status"], r["attempts"], r["error_code"], r["last_error"]) for r in rows
    ]
    events = read_journal(journal)
    storage = open_storage(in_env)
    for i in range(files):
        source = f"signals/s{i}.f64"
        mine = [e for e in events if e["source"] == source]
        done_at = {e["segment"]: e["t"] for e in mine if e["event"] == "done"}
        assert sorted(done_at) == list(range(1, per_file + 1))
        for n in range(2, per_file + 1):
            first_start = min(e["t"] for e in mine if e["segment"] == n)
            assert first_start > done_at[n - 1], (source, n)
        for n in range(1, per_file + 1):
            chunks = [e["pos"] for e in mine if e["segment"] == n and e["event"] == "chunk"]
            assert chunks == list(range(chunk, samples + 1, chunk)), (source, n, chunks)
        # Every segment's numbers are those of one pass over the file.
        data, _ = storage.get(source)
        values = array("d")
        values.frombytes(data)
        carry = segments.start_carry()
        for n in range(1, per_file + 1):
            whole = segments.summarize(values[(n - 1) * samples : n * samples], carry)
            out = json.loads(storage.get(segments.output_key(source, n))[0])
            lo, hi = whole.pop("min"), whole.pop("max")
            assert (out["min"], out["max"], out["carry"]) == (lo, hi, whole)
            carry = whole
    # The killed segment went on from its last checkpoint, in a later invocation.
    resumed = [
        e
        for e in events
        if e["event"] == "start" and (e["source"], e["segment"]) == (cut["source"], cut["segment"])
    ]
    # (Later starts, if the rest took more than one window, go on from later checkpoints: each
    # from a new one, never back; a run with no time for a chunk does not start it.)
    starts = [e["pos"] for e in resumed]
    assert starts[:2] == [0, cut["pos"]] and starts == sorted(set(starts)), starts
    killed = next(
        r
        for r in rows
        if r["payload"]["source"] == cut["source"] and r["sequence"] == cut["segment"]
    )
    # The lost lease counts, once for each job the killed invocation held; checkpoints gave
    # theirs back, and so did a deadline that cut a segment after its checkpoints, and a run
    # whose render process took its window to start.
    assert killed["id"] in held and killed["attempts"] == 2
    attempts = [(r["ordering_key"], r["sequence"], r["attempts"]) for r in rows]
    assert attempts == [
        (k, n, 1 + (r["id"] in held)) for (k, n, _), r in zip(attempts, rows, strict=True)
    ], attempts


def test_an_invocation_goes_on_down_each_ordering_key_while_it_has_time(
    in_env: Config, conn: db.Conn
) -> None:
    # Regression: an invocation claimed each file's first segment, found none of the others
    # (a key's next job gets its message when the one before completes) and ended `drained`:
    # one segment per file per scheduler tick, every 5 minutes.
    items = []
    for i in range(2):
        source = f"signals/s{i}.f64"
        segments.make_file(source, 4, 20_000, seed=i)
        items += segments.jobs_for(source, 4, 20_000)
    Queue(conn).enqueue_jobs(items, "signals")
    config = in_env.with_(tasks=("examples.segments",), budget_ms=10_000)
    result = run_batch(config, conn, open_storage(config))
    assert (result.succeeded, result.remaining, result.stopped_reason) == (8, 0, "drained")
    done = conn.execute(
        "select ordering_key, sequence from thumbq.jobs order by completed_at, id"
    ).fetchall()
    for key in {r["ordering_key"] for r in done}:
        assert [r["sequence"] for r in done if r["ordering_key"] == key] == [1, 2, 3, 4]


# -- export ----------------------------------------------------------------------------------

MILLION = 1_000_000


def export_config(config: Config, budget_ms: int = 3000, buffer_ms: int = 500) -> Config:
    # 2.5 s windows: each invocation starts its render process inside its window, as a cold
    # serverless one does, which on a busy 2-core machine takes most of a second.
    return config.with_(tasks=("examples.export",), budget_ms=budget_ms, buffer_ms=buffer_ms)


def storage_root(config: Config) -> Path:
    return Path(config.storage_url.removeprefix("file://"))


def partials(config: Config) -> list[str]:
    folder = storage_root(config) / export.PREFIX / export.PARTIAL_DIR
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def file_sha256(path: Path) -> tuple[str, int]:
    digest, lines = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            lines += block.count(b"\n")
    return digest.hexdigest(), lines


def test_export_of_a_million_rows_over_many_short_invocations_is_complete_with_progress(
    in_env: Config, conn: db.Conn, db_url: str
) -> None:
    export.make_demo_table(conn, MILLION, "public.export_demo")
    payload = {"table": "public.export_demo", "part_bytes": 4 << 20}
    (job,) = Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "exports")
    seen: list[tuple[int, int]] = []
    stop = threading.Event()

    def watch() -> None:
        with db.connect(db_url) as other:
            while not stop.is_set():
                row = Queue(other).progress("exports")
                seen.append((row["progress_done"], row["progress_total"]))
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    config = export_config(in_env)
    runs = []
    try:
        for _ in range(40):
            runs.append(run_batch(config, conn, open_storage(config)))
            if runs[-1].succeeded:
                break
    finally:
        stop.set()
        watcher.join()

    (row,) = jobs(conn, export.TASK)
    assert row["status"] == "completed" and row["attempts"] == 1
    # Several invocations (two to four on a 2-core machine), each within its budget, each but
    # the last handing the job back for time: a scheduler chains the next call at once (it
    # waits for its next tick on `drained`).
    assert len(runs) >= 2
    assert all(r.duration_ms <= config.budget_ms - config.buffer_ms + 300 for r in runs)
    # (A run whose cold render process took its window hands the job back unstarted: released,
    # no attempt used.)
    assert [(r.checkpointed + r.released, r.stopped_reason) for r in runs[:-1]] == [
        (1, "time_budget")
    ] * (len(runs) - 1)
    result = row["result"]
    assert result["key"] == f"exports/{job['job_id']}/export_demo.csv"
    assert result["rows"] == MILLION
    path = storage_root(config).joinpath(*result["key"].split("/"))
    digest, lines = file_sha256(path)
    assert lines == MILLION + 1  # the header and every row, once
    assert digest == export.csv_sha256(conn, export.Spec.parse(payload))
    assert result["bytes"] == path.stat().st_size
    assert partials(config) == []
    # The group's row followed the export as it went, and ends complete.
    assert any(0 < done < MILLION and total == MILLION for done, total in seen)
    final = Queue(conn).progress("exports")
    assert (final["progress_done"], final["progress_total"]) == (MILLION, MILLION)


def test_cancelling_a_running_export_stops_it_in_that_invocation_and_removes_its_output(
    in_env: Config, conn: db.Conn, db_url: str
) -> None:
    export.make_demo_table(conn, MILLION, "public.export_demo")
    payload = {"table": "public.export_demo", "part_bytes": 1 << 20}
    (job,) = Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "exports")
    config = export_config(in_env, budget_ms=10_000, buffer_ms=2000)
    results = []
    runner = threading.Thread(
        target=lambda: results.append(run_batch(config, conn, open_storage(config)))
    )
    runner.start()
    with db.connect(db_url) as other:
        while not (Queue(other).job(job["job_id"]) or {}).get("progress_done"):
            time.sleep(0.01)
        assert partials(config) != []  # a part is out there
        cancelled_at = time.monotonic()
        assert Queue(other).cancel_jobs([job["job_id"]]) == 1
    runner.join(20)
    stopped_s = time.monotonic() - cancelled_at
    (run,) = results
    assert stopped_s < 2.0 and run.duration_ms < 8000  # it stopped, not the deadline
    row = Queue(conn).job(job["job_id"])
    assert (row["status"], row["error_code"]) == ("cancelled", "cancelled")
    assert row["progress_done"] < MILLION
    assert partials(config) == []
    assert not any(open_storage(config).list(f"exports/{job['job_id']}/"))


def test_an_export_killed_between_checkpoints_resumes_to_the_same_file(
    in_env: Config, conn: db.Conn
) -> None:
    """SIGKILL in the middle of the export, and a half-written part after its last checkpoint:
    the part is cut off, and the export goes on from the checkpoint to the very file one COPY
    gives."""
    export.make_demo_table(conn, 300_000, "public.export_demo")
    payload = {"table": "public.export_demo", "part_bytes": 256 << 10, "chunk_rows": 2000}
    (job,) = Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "exports")
    env = env_for(in_env, THUMBQ_TASKS="examples.export", THUMBQ_BUDGET_MS="60000")
    (victim,) = start_loops(1, {**env, "EXAMPLE_LOOP_S": "60"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = Queue(conn).job(job["job_id"])["state"]
        if state and state["rows"] >= 60_000:
            break
        time.sleep(0.005)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    time.sleep(0.5)
    saved = Queue(conn).job(job["job_id"])
    assert saved["status"] == "processing" and 0 < saved["state"]["rows"] < 300_000
    # Whatever the kill interrupted, a write beyond the last checkpoint is there now.
    (partial,) = partials(in_env)
    with open(storage_root(in_env) / export.PREFIX / export.PARTIAL_DIR / partial, "ab") as f:
        f.write(b"half a part,written by an invocation that was killed\n" * 1000)
    conn.execute("update thumbq.jobs set lease_expires_at = now() - interval '1 second'")
    conn.execute("select pgmq.set_vt('thumbq_jobs', msg_id, 0) from thumbq.jobs")
    config = export_config(in_env)
    runs = []
    for _ in range(20):
        runs.append(run_batch(config, conn, open_storage(config)))
        if runs[-1].succeeded:
            break
    row = Queue(conn).job(job["job_id"])
    assert row["status"] == "completed" and row["result"]["rows"] == 300_000, (row, runs)
    path = storage_root(config).joinpath(*row["result"]["key"].split("/"))
    assert file_sha256(path)[0] == export.csv_sha256(conn, export.Spec.parse(payload))
    assert partials(config) == []


def test_an_export_cancelled_while_it_waits_leaves_output_that_the_next_export_sweeps(
    in_env: Config, conn: db.Conn
) -> None:
    # A million rows, and invocations whose render process is already running, with 0.7 s
    # windows: an export of them takes about 1.2 s of work here, so the first invocation hands
    # it back with a partial file (with 200 000 rows and cold 2.5 s windows a fast machine
    # finished it at once, and nothing was left to sweep).
    export.make_demo_table(conn, MILLION, "public.export_demo")
    payload = {"table": "public.export_demo", "part_bytes": 256 << 10, "chunk_rows": 2000}
    (first,) = Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "a")
    config = export_config(in_env, budget_ms=1200, buffer_ms=500)
    with RenderPool(render_options(config), 1, config.render_memory_mb) as pool:
        pool.start()
        run = run_batch(config, conn, open_storage(config), pool)
        assert run.checkpointed == 1, [
            (j["error_code"], j["last_error"]) for j in jobs(conn, export.TASK)
        ]
        assert partials(config) == [f"{first['job_id']}-export_demo.csv"]
        # Cancelled between two invocations: no handler of it runs again to clean up.
        assert Queue(conn).cancel_jobs([first["job_id"]]) == 1
        Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "b")
        (second,) = [j for j in jobs(conn, export.TASK) if j["id"] != first["job_id"]]
        again = run_batch(config, conn, open_storage(config), pool)
    # The second export's start swept the first one's partial file. Its own is there while it
    # runs; a machine fast enough to finish it in one window leaves its result instead.
    (done,) = [j for j in jobs(conn, export.TASK) if j["id"] == second["id"]]
    if again.checkpointed:
        assert partials(config) == [f"{second['id']}-export_demo.csv"]
    else:
        assert (done["status"], done["result"]["rows"], partials(config)) == (
            "completed",
            MILLION,
            [],
        )


def test_an_export_reads_only_the_tables_export_tables_names(
    in_env: Config, conn: db.Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's role reads thumbq's own tables (and, on Supabase, auth.users): a payload
    # naming one is refused before anything is read.
    export.make_demo_table(conn, 10, "public.export_demo")
    export.make_demo_table(conn, 10, "public.secrets")
    items = [
        {"task": export.TASK, "payload": {"table": t}}
        for t in ("thumbq.jobs", "public.secrets", "export_demo")
    ]
    Queue(conn).enqueue_jobs(items, "exports")
    config = export_config(in_env)
    run_batch(config, conn, open_storage(config))
    refused, secret, demo = jobs(conn, export.TASK)
    for row in (refused, secret):
        assert (row["status"], row["error_code"], row["attempts"]) == (
            "failed",
            "table_not_allowed",
            1,
        )
    assert demo["status"] == "completed" and demo["result"]["rows"] == 10
    monkeypatch.setenv(export.TABLES_ENV, "public.*")
    assert export.Spec.parse({"table": "public.secrets"}).table == ("public", "secrets")
    with pytest.raises(PermanentError):
        export.Spec.parse({"table": "thumbq.jobs"})


def test_an_export_to_s3_is_one_multipart_upload_completed_once_and_a_cancel_aborts_it(
    config: Config, conn: db.Conn, s3_storage_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import boto3.session

    url, endpoint = s3_storage_url
    s3 = config.with_(storage_url=url, s3_endpoint_url=endpoint)
    for name, value in env_for(s3).items():
        if name.startswith(("THUMBQ_", "DATABASE_URL")):
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("THUMBQ_S3_ENDPOINT_URL", endpoint)
    export.make_demo_table(conn, 250_000, "public.export_demo")
    payload = {"table": "public.export_demo", "part_bytes": 1 << 20}  # raised to S3's 5 MiB
    (job,) = Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "exports")
    # A 5 MiB part starts only when its predicted upload fits (else the job is checkpointed),
    # so no part crosses a deadline and no attempt is spent. 5 s windows: each run starts a
    # cold render process whose first S3 client (boto3's import and client) takes 1.1-1.6 s
    # on a loaded 2-core machine, which with a 5 MiB part and its reads leaves a 2.5 s window
    # nothing to do (the job would wait, checkpointed, for a warm process).
    cfg = export_config(s3, budget_ms=6000, buffer_ms=1000)
    runs = []
    for _ in range(30):
        runs.append(run_batch(cfg, conn, open_storage(cfg)))
        if runs[-1].succeeded:
            break
    row = Queue(conn).job(job["job_id"])
    assert (row["status"], row["attempts"]) == ("completed", 1), (
        row["error_code"],
        row["last_error"],
        runs,
    )
    assert all(r.duration_ms <= cfg.budget_ms - cfg.buffer_ms + 300 for r in runs)
    result = row["result"]
    assert result["parts"] >= 3 and result["rows"] == 250_000
    client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = url.removeprefix("s3://")
    body = client.get_object(Bucket=bucket, Key=result["key"])["Body"].read()
    assert hashlib.sha256(body).hexdigest() == export.csv_sha256(conn, export.Spec.parse(payload))
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    # A second export, cancelled after its first part: its upload is aborted, no object.
    (other,) = Queue(conn).enqueue_jobs([{"task": export.TASK, "payload": payload}], "cancel")
    (job_row,) = [j for j in jobs(conn, export.TASK) if j["id"] == other["job_id"]]
    one = export_config(s3, budget_ms=10_000, buffer_ms=2000)
    runner = threading.Thread(target=lambda: run_batch(one, conn, open_storage(one)))
    runner.start()
    with db.connect(config.database_url or "") as watcher:
        while not (Queue(watcher).job(job_row["id"]) or {}).get("progress_done"):
            time.sleep(0.01)
        assert len(client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1
        Queue(watcher).cancel_jobs([job_row["id"]])
    runner.join(20)
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"exports/{job_row['id']}/")
    assert listed.get("KeyCount", 0) == 0
