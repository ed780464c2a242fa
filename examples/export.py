"""An export of a large table to one CSV file in storage, over many invocations (seed system 004).

A job names a table; its handler streams the rows in key order with `COPY ... TO STDOUT`, a
part of a few MiB at a time, and checkpoints after each part how far it got. An invocation
that runs out of time hands the job back (`ctx.checkpoint`): the next one goes on from there,
so an export of any size finishes across 10 s invocations. What the example shows:

- Resumable without waste or duplicates: the checkpoint holds the last key exported and what
  the output holds so far. On S3 the parts are those of a multipart upload; on local storage
  they are appended to one partial file. A crash between two checkpoints leaves at most a part
  that no checkpoint names: S3 replaces it when the part number is uploaded again, and the
  partial file is cut back to the checkpointed length before anything is appended.
- The final object appears exactly once, complete: S3 assembles it when the upload completes
  (one call), a local file is renamed into place (atomic). Its key, `exports/<job id>/<name>`,
  belongs to this job alone, so a job that finds it there after a crash knows it is done.
- Consistent bounds: the export covers the rows whose key was at most the table's largest key
  when it started, counted then for the progress bar.
- Only the tables `EXPORT_TABLES` names (`schema.table` or `schema.*`, comma-separated; by
  default `public.export_demo`) can be exported: the worker's database role reads much more
  than anyone should get as a file.
- Progress: `ctx.progress(rows, total)` after each part; the job row and its group's row (and
  so the progress endpoint, the SSE stream and Realtime) follow it.
- Cancellation: `POST /api/jobs/<id>/cancel` (or the group's cancel) reaches the running
  handler at its next part: it removes the partial output (aborts the upload, deletes the
  partial file) and stops. An export cancelled while it waited for its next invocation has no
  handler running: `sweep` removes what such exports left (the handler sweeps at each start;
  on S3 a lifecycle rule that aborts incomplete multipart uploads is the backstop).

Run it:

    THUMBQ_TASKS=examples.export thumbq up
    python -m examples.export demo-table --rows 1000000   # public.export_demo, 1 000 000 rows
    python -m examples.export enqueue public.export_demo --group exports

`thumbq up` runs it a batch (10 s) at a time until done; the file is in storage under
`exports/<job id>/export_demo.csv` and in the job's result. Over HTTP:
`POST /api/jobs {"task": "export_csv", "payload": {"table": "public.export_demo"}}`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples import common
from worker.engine import db
from worker.engine.queue import Queue
from worker.storage import Storage
from worker.tasks import PermanentError, TaskContext, TransientError, task

TASK = "export_csv"
# Rows read per COPY statement (about 3.5 MB of the demo table), and bytes per part (S3 wants
# 5 MiB or more but for the last).
CHUNK_ROWS = 50_000
PART_BYTES = 8 * 1024 * 1024
MIN_PART_BYTES = 5 * 1024 * 1024
# Time checks: a chunk is read only if STOP_MS (a checkpoint, and room for a busy machine) is
# left besides the predicted read, and a part is uploaded only if STOP_MS is left besides its
# predicted upload (its size times the upload rate); otherwise the job is checkpointed and what
# was read but not uploaded is read again next time. The predictions come from this export's
# own reads and uploads, kept in its checkpoint so that every invocation starts from what the
# export has seen (a rate that went down is followed halfway at each observation, one that went
# up at once); before anything was seen, a read counts as FIRST_CHUNK_MS and an upload as its
# sink's first guess per MiB (`first_ms_per_mib`).
STOP_MS = 150.0
FIRST_CHUNK_MS = 150.0
MIB = 1024 * 1024
# An invocation that uploaded nothing because the predicted upload did not fit lowers the rate
# by this factor: a slow moment seen once must not hold the export back for ever.
RATE_DECAY = 0.8
# Where the jobs' files go: exports/<job id>/<name>.
PREFIX = "exports"
PARTIAL_DIR = ".partial"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]{0,62}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# Which tables may be exported: EXPORT_TABLES, comma-separated `schema.table` or `schema.*`; by
# default the demo's table alone. The worker's database role reads far more than anyone should
# get as a file (auth.users, thumbq's own tables), and a job's payload is only a request.
TABLES_ENV = "EXPORT_TABLES"
DEFAULT_TABLES = "public.export_demo"
# Jobs in these states run no more: what they left in storage can go.
ENDED = ("completed", "failed", "unsupported", "cancelled")


@dataclass(frozen=True)
class Spec:
    """What to export, validated: a table (schema-qualified or not), its unique key column,
    the columns (all when empty), and the file's name."""

    table: tuple[str, ...]
    key: str
    columns: tuple[str, ...]
    name: str
    part_bytes: int
    chunk_rows: int

    @classmethod
    def parse(cls, payload: Any) -> Spec:
        """Validate a job's payload: `{"table", "key"?, "columns"?, "name"?, "part_bytes"?,
        "chunk_rows"?}`; a bad one fails the job at once (`bad_payload`)."""
        if not isinstance(payload, dict) or not isinstance(payload.get("table"), str):
            raise PermanentError(
                'an export payload is {"table": "schema.table", ...}', "bad_payload"
            )
        table = tuple(payload["table"].split("."))
        if len(table) == 1:
            table = ("public", *table)
        key = payload.get("key", "id")
        columns = payload.get("columns") or []
        idents = [*table, key, *columns] if isinstance(columns, list) else []
        if (
            len(table) != 2
            or not idents
            or not all(isinstance(i, str) and _IDENT.fullmatch(i) for i in idents)
        ):
            raise PermanentError(
                "table, key and columns must be plain SQL names (letters, digits, _)",
                "bad_payload",
            )
        if not allowed(table):
            raise PermanentError(
                f"{'.'.join(table)} is not one of the tables {TABLES_ENV} lets export",
                "table_not_allowed",
            )
        name = payload.get("name") or f"{table[-1]}.csv"
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise PermanentError("name must be a plain file name", "bad_payload")
        try:
            part_bytes = int(payload.get("part_bytes") or PART_BYTES)
            chunk_rows = int(payload.get("chunk_rows") or CHUNK_ROWS)
        except (TypeError, ValueError):
            part_bytes = chunk_rows = 0
        if part_bytes < 1024 or not 1 <= chunk_rows <= 1_000_000:
            raise PermanentError(
                "part_bytes must be 1024 or more, chunk_rows 1-1000000", "bad_payload"
            )
        return cls(table, key, tuple(columns), name, part_bytes, chunk_rows)


def allowed(table: tuple[str, ...]) -> bool:
    """Whether EXPORT_TABLES (default: public.export_demo) lets `(schema, table)` be exported."""
    names = os.environ.get(TABLES_ENV, DEFAULT_TABLES).split(",")
    patterns = {n.strip() for n in names if n.strip()}
    return ".".join(table) in patterns or f"{table[0]}.*" in patterns


def output_key(job_id: int, name: str) -> str:
    """Where job `job_id`'s file appears when it is complete."""
    return f"{PREFIX}/{job_id}/{name}"


# -- reading the table -----------------------------------------------------------------------


def _sql(spec: Spec) -> tuple[Any, Any, Any]:
    from psycopg import sql

    table = sql.SQL(".").join(sql.Identifier(p) for p in spec.table)
    key = sql.Identifier(spec.key)
    cols = (
        sql.SQL(", ").join(sql.Identifier(c) for c in spec.columns)
        if spec.columns
        else sql.SQL("*")
    )
    return table, key, cols


def bounds(conn: db.Conn, spec: Spec) -> tuple[Any, int]:
    """The largest key now, and how many rows the export will hold (for progress)."""
    from psycopg import errors, sql

    table, key, _ = _sql(spec)
    try:
        row = conn.execute(
            sql.SQL("select max({k}) as upto, count(*) as n from {t}").format(k=key, t=table)
        ).fetchone()
    except (errors.UndefinedTable, errors.UndefinedColumn, errors.InsufficientPrivilege) as exc:
        raise PermanentError(f"cannot export {'.'.join(spec.table)}: {exc}", "bad_table") from None
    assert row is not None
    if row["upto"] is not None and not isinstance(row["upto"], int | str):
        raise PermanentError(f"the key {spec.key!r} must be an integer or text column", "bad_key")
    return row["upto"], int(row["n"])


def read_chunk(
    conn: db.Conn, spec: Spec, after: Any, upto: Any, *, header: bool
) -> tuple[bytes, Any, int]:
    """The CSV of up to `spec.chunk_rows` rows after key `after` (None: from the first) up to
    key `upto`, in one COPY (with the header line first when `header`); returns (bytes, last
    key, rows)."""
    from psycopg import sql

    table, key, cols = _sql(spec)
    options = sql.SQL(", header" if header else "")
    if after == upto:  # nothing (left) to read: an empty table's file is its header
        query = sql.SQL("select {c} from {t} where false").format(c=cols, t=table)
        params: dict[str, Any] = {}
        last = upto
    else:
        where = sql.SQL("{k} <= %(upto)s").format(k=key)
        if after is not None:
            where = sql.SQL("{k} > %(after)s and {w}").format(k=key, w=where)
        params = {"after": after, "upto": upto, "skip": spec.chunk_rows - 1}
        row = conn.execute(
            sql.SQL(
                "select {k} as last from {t} where {w} order by {k} offset %(skip)s limit 1"
            ).format(k=key, t=table, w=where),
            params,
        ).fetchone()
        last = upto if row is None else row["last"]
        params["last"] = last
        query = sql.SQL("select {c} from {t} where {w} and {k} <= %(last)s order by {k}").format(
            c=cols, t=table, w=where, k=key
        )
    out = bytearray()
    with conn.cursor() as cur:
        copy = sql.SQL("copy ({q}) to stdout with (format csv{o})").format(q=query, o=options)
        with cur.copy(copy, params) as stream:
            for data in stream:
                out += data
        rows = max(cur.rowcount, 0)
    return bytes(out), last, rows


# -- where the file goes ---------------------------------------------------------------------


class FileSink:
    """Local storage: parts are appended to one partial file, which is renamed into place when
    complete. The checkpoint holds the partial file's length: what lies beyond it (a part a
    crash interrupted) is cut off before the next append. Partial files wait in one folder,
    `exports/.partial/`, so that finding leftovers never walks the finished exports."""

    min_part = 1
    first_ms_per_mib = 50.0  # a write and an fsync on a loaded disk

    def __init__(self, root: Path, key: str) -> None:
        self.final = root.joinpath(*key.split("/"))
        job, name = key.split("/")[-2:]
        self.partial = root.joinpath(PREFIX, PARTIAL_DIR, f"{job}-{name}")

    def start(self) -> dict[str, Any]:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with open(self.partial, "wb"):
            pass
        return {"bytes": 0, "parts": 0}

    def resumable(self, state: dict[str, Any]) -> bool:
        """Whether the partial file still holds what the checkpoint says (a sweep of a job
        that was failed and retried may have removed it)."""
        try:
            return self.partial.stat().st_size >= int(state["bytes"])
        except FileNotFoundError:
            return False

    def write(self, state: dict[str, Any], data: bytes) -> dict[str, Any]:
        try:
            with open(self.partial, "r+b") as f:
                f.truncate(state["bytes"])
                f.seek(state["bytes"])
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise TransientError(
                f"cannot write {self.partial}: {exc.strerror}", "storage_error"
            ) from None
        return {"bytes": state["bytes"] + len(data), "parts": state["parts"] + 1}

    def publish(self, state: dict[str, Any]) -> None:
        with open(self.partial, "r+b") as f:
            f.truncate(state["bytes"])
            os.fsync(f.fileno())
        os.replace(self.partial, self.final)
        fd = os.open(self.final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def published(self) -> bool:
        return self.final.exists()

    def abort(self, state: dict[str, Any] | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.partial.unlink()

    def unpublish(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.final.unlink()


class S3Sink:
    """S3 (and R2, Supabase Storage, MinIO): the parts of one multipart upload, completed in one
    call (S3 assembles the object; it appears at once, whole). A part uploaded again under the
    same number replaces the first, so a part a crash interrupted costs nothing but its bytes."""

    min_part = MIN_PART_BYTES
    first_ms_per_mib = 250.0  # an upload to a nearby S3 (or moto's server) on a loaded machine

    def __init__(self, storage: Any, key: str) -> None:
        self.client = storage.client
        self.bucket = storage.bucket
        self.prefix = storage.prefix
        self.key = storage.prefix + key

    def start(self) -> dict[str, Any]:
        made = self.client.create_multipart_upload(
            Bucket=self.bucket, Key=self.key, ContentType="text/csv"
        )
        return {"bytes": 0, "parts": 0, "upload_id": made["UploadId"], "etags": []}

    def resumable(self, state: dict[str, Any]) -> bool:
        from botocore.exceptions import ClientError

        if not state.get("upload_id"):
            return False
        try:
            self.client.list_parts(Bucket=self.bucket, Key=self.key, UploadId=state["upload_id"])
        except ClientError:
            return False
        return True

    def write(self, state: dict[str, Any], data: bytes) -> dict[str, Any]:
        from botocore.exceptions import BotoCoreError, ClientError

        n = state["parts"] + 1
        try:
            part = self.client.upload_part(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=state["upload_id"],
                PartNumber=n,
                Body=data,
            )
        except (BotoCoreError, ClientError) as exc:
            raise TransientError(
                f"cannot upload part {n} of {self.key}: {exc}", "storage_error"
            ) from None
        return {
            **state,
            "bytes": state["bytes"] + len(data),
            "parts": n,
            "etags": [*state["etags"], part["ETag"]],
        }

    def publish(self, state: dict[str, Any]) -> None:
        parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(state["etags"])]
        self.client.complete_multipart_upload(
            Bucket=self.bucket,
            Key=self.key,
            UploadId=state["upload_id"],
            MultipartUpload={"Parts": parts},
        )

    def published(self) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key)
        except ClientError:
            return False
        return True

    def abort(self, state: dict[str, Any] | None) -> None:
        from botocore.exceptions import ClientError

        if state and state.get("upload_id"):
            with contextlib.suppress(ClientError):
                self.client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self.key, UploadId=state["upload_id"]
                )

    def unpublish(self) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key)


Sink = FileSink | S3Sink


def sink_for(storage: Storage, key: str) -> Sink:
    """The way to write `key` in this storage."""
    root = getattr(storage, "root", None)
    if isinstance(root, Path):
        return FileSink(root, key)
    if hasattr(storage, "client") and hasattr(storage, "bucket"):
        return S3Sink(storage, key)
    raise PermanentError(f"exports cannot write to {storage.url}", "unsupported_storage")


# -- the task --------------------------------------------------------------------------------


class _OutOfTime(Exception):
    """A part's upload did not finish in the time left: it is read and sent again next time."""


def _within(timeout_s: float, fn: Any, *args: Any) -> Any:
    """`fn(*args)` on a thread of its own, waited for at most `timeout_s` (_OutOfTime after).

    A part upload is the one step whose time only the network decides: a prediction that is
    wrong (a loaded machine, a slow store) must cost the part, not the attempt. An upload cut
    here may still finish behind the handler's back; the same part number sent again replaces
    it with the same bytes (the rows after the last checkpoint are read again)."""
    import threading

    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc

    worker = threading.Thread(target=run, name="export-upload", daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    if worker.is_alive():
        raise _OutOfTime
    if "error" in out:
        raise out["error"]
    return out["value"]


def _result(key: str, state: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "rows": state["rows"], "bytes": state["bytes"], "parts": state["parts"]}


@task(TASK, max_attempts=5)
def export_csv(ctx: TaskContext, payload: Any) -> Any:
    """Export the next chunks of the table, a part at a time, until done, out of time, or
    cancelled."""
    spec = Spec.parse(payload)
    if ctx.remaining_ms() < STOP_MS + FIRST_CHUNK_MS:
        return ctx.checkpoint(ctx.state)
    storage = common.storage()
    if ctx.remaining_ms() < STOP_MS + FIRST_CHUNK_MS:
        # A cold process's first storage client (boto3's import and client: 1.1-1.6 s on a
        # loaded 2-core machine) took the time: the next invocation has it ready.
        return ctx.checkpoint(ctx.state)
    key = output_key(ctx.job_id, spec.name)
    sink = sink_for(storage, key)
    state: dict[str, Any] | None = ctx.state
    if state is not None and sink.published():
        # Published by an invocation killed before it could record the job.
        sink.abort(state)
        return _result(key, state)
    with common.connect() as conn:
        with contextlib.suppress(Exception):  # tidying up after others never fails this job
            sweep(conn, storage, limit=20)
        if state is None or not sink.resumable(state):
            upto, total = bounds(conn, spec)
            state = {"after": None, "upto": upto, "rows": 0, "total": total, **sink.start()}
            ctx.progress(0, total)
            # Before any part: a crash must not lose the upload this state names.
            ctx.checkpoint(state)
        part_bytes = max(spec.part_bytes, sink.min_part)
        # The part being filled: its bytes, the last key in it and its rows.
        buf, after, rows = bytearray(), state["after"], 0
        timing = {
            "read_ms": float(state.get("read_ms") or FIRST_CHUNK_MS),
            "upload_ms_per_mib": float(state.get("upload_ms_per_mib") or sink.first_ms_per_mib),
        }
        uploaded = refused = False

        def upload_ms(size: int) -> float:
            # A part's fixed cost is counted as a MiB's at least.
            return timing["upload_ms_per_mib"] * max(size / MIB, 1.0)

        def learn(name: str, observed: float) -> None:
            timing[name] = max(observed, (timing[name] + observed) / 2)

        def flush(state: dict[str, Any], part: bytes, after: Any, rows: int) -> dict[str, Any]:
            """Write a part; the checkpoint then names it (and the rows in it)."""
            nonlocal uploaded
            started = time.monotonic()
            try:
                written = _within((ctx.remaining_ms() - STOP_MS) / 1000, sink.write, state, part)
            finally:
                # A cut upload teaches at least as much as a finished one: it took this long.
                learn(
                    "upload_ms_per_mib",
                    (time.monotonic() - started) * 1000 / max(len(part) / MIB, 1.0),
                )

            uploaded = True
            new = {**state, **written, **timing, "after": after}
            new["rows"] = state["rows"] + rows
            ctx.progress(new["rows"], new["total"])
            ctx.checkpoint(new)
            return new

        def fits(part: bytearray) -> bool:
            nonlocal refused
            if ctx.remaining_ms() >= STOP_MS + upload_ms(len(part)):
                return True
            refused = True
            return False

        def stop(state: dict[str, Any]) -> Any:
            """Hand the job back for time, with what this invocation learnt of the time things
            take; the part being filled is read again next time."""
            learnt = dict(timing)
            if refused and not uploaded:
                learnt["upload_ms_per_mib"] *= RATE_DECAY
            return ctx.checkpoint({**state, **learnt})

        while True:
            if ctx.cancelled():
                sink.abort(state)
                return {"cancelled": True, "rows": state["rows"]}
            finished = after == state["upto"] and (state["parts"] > 0 or len(buf) > 0)
            if finished:
                break
            if ctx.remaining_ms() < STOP_MS + timing["read_ms"]:
                # Out of time for a chunk: keep what is read if this storage takes a part that
                # small (S3 wants 5 MiB but for the last) and its upload fits.
                if buf and len(buf) >= sink.min_part and fits(buf):
                    with contextlib.suppress(_OutOfTime):
                        state = flush(state, bytes(buf), after, rows)
                return stop(state)
            started = time.monotonic()
            data, after, n = read_chunk(
                conn, spec, after, state["upto"], header=state["parts"] == 0 and not buf
            )
            learn("read_ms", (time.monotonic() - started) * 1000)
            buf += data
            rows += n
            if len(buf) >= part_bytes or after == state["upto"]:
                if not fits(buf):
                    return stop(state)
                try:
                    state = flush(state, bytes(buf), after, rows)
                except _OutOfTime:
                    return stop(state)
                buf, rows = bytearray(), 0
    if ctx.cancelled():
        sink.abort(state)
        return {"cancelled": True, "rows": state["rows"]}
    sink.publish(state)
    if ctx.cancelled():
        # Cancelled while it was being published: the user asked for no file.
        sink.unpublish()
        return {"cancelled": True, "rows": state["rows"]}
    return _result(key, state)


def sweep(conn: db.Conn, storage: Storage, *, limit: int = 1000) -> int:
    """Remove the partial output of exports that will not run again (cancelled while they
    waited, failed, or gone); returns how many were removed. Looks at what storage holds, so
    its cost follows the leftovers, not the history."""
    sink = sink_for(storage, output_key(0, "x.csv"))
    found: dict[int, list[Any]] = {}
    if isinstance(sink, FileSink):
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(os.scandir(sink.partial.parent), key=lambda e: e.name)[:limit]:
                job = entry.name.split("-", 1)[0]
                if job.isdigit():
                    found.setdefault(int(job), []).append(Path(entry.path))
    else:
        prefix = f"{sink.prefix}{PREFIX}/"
        answer = sink.client.list_multipart_uploads(
            Bucket=sink.bucket, Prefix=prefix, MaxUploads=limit
        )
        for upload in answer.get("Uploads", []):
            job = upload["Key"][len(prefix) :].split("/", 1)[0]
            if job.isdigit():
                found.setdefault(int(job), []).append(upload)
    if not found:
        return 0
    live = {
        int(r["id"])
        for r in conn.execute(
            "select id from thumbq.jobs where id = any(%s) and status <> all(%s)",
            [list(found), list(ENDED)],
        ).fetchall()
    }
    removed = 0
    for job_id, items in found.items():
        if job_id in live:
            continue
        for item in items:
            if isinstance(item, Path):
                with contextlib.suppress(FileNotFoundError):
                    item.unlink()
            else:
                assert isinstance(sink, S3Sink)
                sink.client.abort_multipart_upload(
                    Bucket=sink.bucket, Key=item["Key"], UploadId=item["UploadId"]
                )
            removed += 1
    return removed


# -- the demo's commands ---------------------------------------------------------------------


def make_demo_table(conn: db.Conn, rows: int, table: str = "public.export_demo") -> None:
    """A table of `rows` rows (id, label, amount, at) to export."""
    from psycopg import sql

    name = sql.SQL(".").join(sql.Identifier(p) for p in table.split("."))
    conn.execute(sql.SQL("drop table if exists {}").format(name))
    conn.execute(
        sql.SQL(
            "create table {} as select g as id, md5(g::text) as label,"
            " round((g %% 100000) / 100.0, 2) as amount,"
            " timestamptz '2026-01-01 00:00:00+00' + g * interval '1 second' as at"
            " from generate_series(1, %s) g"
        ).format(name),
        [rows],
    )
    conn.execute(sql.SQL("alter table {} add primary key (id)").format(name))


def csv_sha256(conn: db.Conn, spec: Spec) -> str:
    """The SHA-256 of the table's CSV as one COPY gives it (what the export must equal)."""
    from psycopg import sql

    table, key, cols = _sql(spec)
    digest = hashlib.sha256()
    with (
        conn.cursor() as cur,
        cur.copy(
            sql.SQL(
                "copy (select {} from {} order by {}) to stdout with (format csv, header)"
            ).format(cols, table, key)
        ) as stream,
    ):
        for data in stream:
            digest.update(data)
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m examples.export demo-table|enqueue|sweep`."""
    parser = argparse.ArgumentParser(prog="python -m examples.export", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo-table", help="create public.export_demo with --rows rows")
    demo.add_argument("--rows", type=int, default=1_000_000)
    enqueue = sub.add_parser("enqueue", help="export a table")
    enqueue.add_argument("table", help="schema.table")
    enqueue.add_argument("--key", default="id", help="its unique key column (default id)")
    enqueue.add_argument("--group", default="exports")
    sub.add_parser("sweep", help="remove the partial output of exports that ended")
    args = parser.parse_args(argv)
    with common.connect() as conn:
        if args.command == "demo-table":
            make_demo_table(conn, args.rows)
            print(f"public.export_demo: {args.rows} rows")
        elif args.command == "enqueue":
            payload = {"table": args.table, "key": args.key}
            Spec.parse(payload)
            rows = Queue(conn).enqueue_jobs([{"task": TASK, "payload": payload}], args.group)
            print(f"export job {rows[0]['job_id']} in group {args.group!r}")
        else:
            print(f"removed {sweep(conn, common.storage())} partial exports")
    return 0


if __name__ == "__main__":
    sys.exit(main())
