"""Engine operations shared by the CLI and the HTTP API: enqueue with etags, backfill, cleanup."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from worker.engine.errors import validate_key
from worker.engine.queue import Queue
from worker.storage import NotFound
from worker.thumbnails.task import thumbnail_key

if TYPE_CHECKING:
    from worker.engine import db
    from worker.engine.config import Config
    from worker.storage import Storage

THUMBNAIL_PREFIX = "thumbnails/"
ENQUEUE_CHUNK = 1000
# Retention deletes in chunks this size, each its own short transaction.
PRUNE_CHUNK = 5000


def enqueue_keys(
    conn: db.Conn,
    storage: Storage,
    config: Config,
    items: Sequence[Mapping[str, Any]],
    group_id: str = "default",
) -> dict[str, Any]:
    """Enqueue items, asking storage for the etag (and size) of those given without one.

    An object that storage says does not exist is counted as `missing` (and marked in `jobs`),
    not as enqueued. It still gets a job (with an empty etag), which the next batch ends
    `cancelled` with `source_missing`, so the group lists it with its reason rather than
    nowhere.
    """
    todo, missing = resolve_versions(storage, items)
    queue = Queue(conn, bucket=config.rate_bucket, max_attempts=config.max_attempts)
    rows: list[dict[str, Any]] = []
    for i in range(0, len(todo), ENQUEUE_CHUNK):
        rows.extend(queue.enqueue_files(todo[i : i + ENQUEUE_CHUNK], group_id))
    found = [r for r in rows if r["source_key"] not in missing]
    created = sum(1 for r in found if r["created"])
    return {
        "enqueued": created,
        "existing": len(found) - created,
        "missing": len(rows) - len(found),
        "jobs": [
            {
                "job_id": r["job_id"],
                "source_key": r["source_key"],
                "created": r["created"],
                "status": r["status"],
                "missing": r["source_key"] in missing,
            }
            for r in rows
        ],
    }


def resolve_versions(
    storage: Storage, items: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]], set[str]]:
    """The items with the etag, size and type storage reports for those given without an etag
    (asked in parallel), and the keys storage does not have (their etag is left empty)."""
    for item in items:
        validate_key(str(item.get("source_key", "")))
    todo = [dict(i) for i in items]
    unknown = [i for i in todo if not i.get("etag")]
    missing: set[str] = set()
    if unknown:

        def head(item: dict[str, Any]) -> None:
            try:
                info = storage.head(item["source_key"])
            except NotFound:
                item["etag"] = ""
                missing.add(item["source_key"])
                return
            item["etag"] = info.etag
            item.setdefault("bytes", info.size)
            if not item.get("content_type"):
                item["content_type"] = info.content_type

        with ThreadPoolExecutor(max_workers=min(8, len(unknown))) as ex:
            list(ex.map(head, unknown))
    return todo, missing


def backfill(
    conn: db.Conn, storage: Storage, config: Config, prefix: str, group_id: str = "default"
) -> dict[str, Any]:
    """Enqueue every object under `prefix` that has no thumbnail yet (retroactive generation).

    Storage is listed once for the sources and once for their thumbnails; objects whose
    thumbnail for the current etag exists are left alone.
    """
    if prefix:
        validate_key(prefix.rstrip("/") or "x")
    sources = [o for o in storage.list(prefix) if not o.key.startswith(THUMBNAIL_PREFIX)]
    have = {o.key for o in storage.list(THUMBNAIL_PREFIX + prefix)}
    lacking = [
        o
        for o in sources
        if thumbnail_key(o.key, o.etag, config.thumb_size, config.thumb_ext) not in have
    ]
    items = [
        {"source_key": o.key, "etag": o.etag, "bytes": o.size, "content_type": o.content_type}
        for o in lacking
    ]
    result = (
        enqueue_keys(conn, storage, config, items, group_id)
        if items
        else {"enqueued": 0, "existing": 0, "missing": 0, "jobs": []}
    )
    return {
        "listed": len(sources),
        "have_thumbnail": len(sources) - len(lacking),
        "enqueued": result["enqueued"],
        "existing": result["existing"],
        "group_id": group_id,
    }


def cleanup_stale(
    conn: db.Conn,
    config: Config,
    *,
    storage: Storage | None = None,
    time_limit_ms: int | None = None,
) -> dict[str, Any]:
    """Reset expired leases and prune history past `THUMBQ_RETENTION_DAYS`, in bounded chunks;
    with `storage`, also remove the temporary files of writes killed mid-way (`temp_files_removed`).

    Stops pruning when `time_limit_ms` (default: the batch's work window) has passed; what is
    left is pruned by the next call."""
    queue = Queue(conn)
    limit_s = (time_limit_ms if time_limit_ms is not None else config.deadline_ms) / 1000
    started = time.monotonic()
    reset = 0
    while True:
        n = queue.reap_stale(PRUNE_CHUNK)
        reset += n
        if n < PRUNE_CHUNK or time.monotonic() - started >= limit_s:
            break
    pruned = {"jobs": 0, "batch_runs": 0, "archived": 0}
    while config.retention_days > 0 and time.monotonic() - started < limit_s:
        chunk = queue.prune(config.retention_days, PRUNE_CHUNK)
        for k in pruned:
            pruned[k] += chunk.get(k, 0)
        if max(chunk.values(), default=0) < PRUNE_CHUNK:
            break
    result: dict[str, Any] = {"reset_count": reset, "pruned": pruned}
    if storage is not None:
        result["temp_files_removed"] = sweep_temp_files(storage)
    return result


def sweep_temp_files(storage: Storage) -> int:
    """Remove what writes killed mid-way left in storage: the local folder's temporary files
    older than a live write can be (S3 PUTs are atomic and leave nothing). Returns how many."""
    sweep = getattr(storage, "sweep_temp_files", None)
    return int(sweep()) if sweep is not None else 0
