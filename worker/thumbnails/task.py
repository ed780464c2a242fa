"""The built-in thumbnail task, registered with the engine like any task (worker.engine.tasks).

A thumbnail job names a file in storage: the task fetches it, renders every configured size in
the engine's process pool (a RenderPool: render/process.py), uploads each size under its own key
and records the job with its thumbnails' keys and placeholders. It runs on the worker's thread
(`Task.runner`), with the invocation's storage, pool and recorder, and hands its uploads to the
executor's writer thread so that its render process does not wait for storage.

Imported by every render process's zygote (the built-in tasks are): what it imports at the top
stays light (no database driver, no renderer), so that a cold process starts fast.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from worker.engine.budget import RECORD_MS, size_class
from worker.engine.errors import INTERNAL, ThumbqError
from worker.engine.states import Outcome
from worker.engine.tasks import REGISTRY, THUMBNAIL, PermanentError, Task, TaskContext
from worker.thumbnails.render.formats import PRIOR_MS, kind_of

if TYPE_CHECKING:
    from worker.engine.config import Config
    from worker.engine.execution import Executor
    from worker.engine.queue import ClaimedJob
    from worker.thumbnails.render import RenderOptions, Thumbnail
    from worker.thumbnails.render.process import RenderPool

# A render still running after this share of its window is stopped, and a cheaper (degraded) one
# gets the rest, rather than the item failing `render_timeout` (items that started late get no
# such fallback: they are released and get a whole window next time).
DEGRADE_AT = 0.75


def thumbnail_key(source_key: str, etag: str, size: int, ext: str, page: int | None = None) -> str:
    """`thumbnails/<source key>/<etag>-<size>.<ext>`, the etag made safe for a key; a document's
    further pages (RenderOptions.pages) add theirs: `<etag>-p<page>-<size>.<ext>`."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in etag) or "noetag"
    if page is not None:
        safe = f"{safe}-p{page}"
    return f"thumbnails/{source_key}/{safe}-{size}.{ext}"


def render_options(config: Config) -> RenderOptions:
    """The renderer's options from the configuration."""
    from worker.thumbnails.render import RenderOptions

    sizes = config.all_thumb_sizes
    return RenderOptions(
        size=max(sizes),
        sizes=sizes,
        soffice=config.soffice,
        format=config.thumb_format,
        pdf_page=config.pdf_page,
        fit=config.thumb_fit,
        pages=config.pages,
        max_pixels=config.max_pixels,
        max_pages=config.max_pages,
        max_bytes=config.max_bytes,
        tasks=config.tasks,
    )


def render_pool(config: Config) -> RenderPool:
    """The invocation's process pool: render children that run tasks' handlers too."""
    from worker.thumbnails.render.process import RenderPool

    return RenderPool(render_options(config), config.concurrency, config.render_memory_mb)


def job_kind(job: ClaimedJob) -> tuple[str, int]:
    """What the predictor knows a thumbnail job by: its file's kind and size class."""
    return kind_of(job.content_type, job.source_key), size_class(job.source_bytes)


def _render_pool(executor: Executor) -> RenderPool:
    # Whatever renders (a RenderPool; the benchmarks' no-op renderer): it has `render`.
    pool = executor.pool
    if not callable(getattr(pool, "render", None)):
        raise ThumbqError(INTERNAL, "the thumbnail task needs a process pool that renders")
    return pool  # type: ignore[return-value]


def run(executor: Executor, job: ClaimedJob, window_ms: float) -> Outcome:
    """Fetch the source, render it in a child process (a cheaper, degraded render when the first
    overruns its share of the window), and hand the uploads and the completion to a writer
    thread (`writing`); `skipped` when the source changed since it was enqueued."""
    from worker.engine.recording import FAIR_SHARE, deadline_bound

    pool = _render_pool(executor)
    started = time.monotonic()
    kind, size_cls = job_kind(job)
    data, info = executor.storage.get(job.source_key, max_bytes=executor.config.max_bytes)
    if job.source_etag and info.etag != job.source_etag:
        # The object changed since it was enqueued: the new version supersedes this job.
        executor.queue.enqueue_files(
            [
                {
                    "source_key": job.source_key,
                    "etag": info.etag,
                    "content_type": job.content_type,
                    "group_id": job.group_id,
                    "bytes": info.size,
                    "priority": job.priority,
                }
            ],
            bound=deadline_bound(executor.budget, RECORD_MS),
        )
        executor.recorder.count(Outcome.SKIPPED)
        return Outcome.SKIPPED
    size_cls = size_class(info.size)
    timeout_s = executor.budget.remaining_ms() / 1000
    fair = timeout_s * 1000 >= FAIR_SHARE * executor.budget.work_ms
    thumb = pool.render(
        data,
        job.content_type or info.content_type,
        timeout_s=timeout_s,
        degrade_after_s=timeout_s * DEGRADE_AT if fair else None,
    )
    executor.write_slots.acquire()
    try:
        executor.writer.submit(
            _record, executor, job, info.etag, thumb, started, (kind, size_cls), window_ms
        )
    except BaseException:
        executor.write_slots.release()
        raise
    return Outcome.WRITING


def _record(
    executor: Executor,
    job: ClaimedJob,
    etag: str,
    thumb: Thumbnail,
    started: float,
    stat_key: tuple[str, int],
    window_ms: float,
) -> None:
    """Upload every size and queue the completion (on a writer thread); end the item."""
    outcome = Outcome.SUCCEEDED
    try:
        keys = _store(executor, job.source_key, etag, thumb)
        ms = (time.monotonic() - started) * 1000
        if not thumb.degraded:
            # A degraded render says how long the cheap path took, not the real one.
            executor.predictor.observe(*stat_key, ms)
        largest = str(max((size for size in keys if size.isdigit()), key=int))
        executor.recorder.done(
            {
                "job_id": job.id,
                "msg_id": job.msg_id,
                "thumbnail_key": keys[largest],
                "thumbnail_content_type": thumb.content_type,
                "width": thumb.width,
                "height": thumb.height,
                "bytes": len(thumb.data),
                "duration_ms": round(ms),
                "source_type": thumb.source_type,
                "thumbnails": keys,
                "thumbhash": thumb.thumbhash,
                "dominant_color": thumb.dominant_color,
                "degraded": thumb.degraded,
            }
        )
    except Exception as exc:  # every failure is classified and recorded, none escapes
        outcome = executor.recorder.failed(job, exc, window_ms)
    finally:
        executor.write_slots.release()
        executor.recorder.item_ended(job, outcome)


def _store(executor: Executor, source_key: str, etag: str, thumb: Thumbnail) -> dict[str, Any]:
    """Write every rendition under its own key; returns the first page's {"<size>": key},
    with `"pages": [{"page", "thumbnails": {"<size>": key}}, ...]` in order beside them
    when a document gave more than one page (its first page keeps the plain keys)."""
    renditions = thumb.renditions or ()
    if not renditions:
        from worker.thumbnails.render import Rendition

        renditions = (Rendition(executor.config.thumb_size, thumb.data, thumb.width, thumb.height),)
    first = renditions[0].page
    pages: dict[int, dict[str, str]] = {}
    for rendition in renditions:
        page = None if rendition.page == first else rendition.page
        key = thumbnail_key(source_key, etag, rendition.size, executor.config.thumb_ext, page)
        executor.storage.put(key, rendition.data, thumb.content_type)
        pages.setdefault(rendition.page, {})[str(rendition.size)] = key
    listed = iter(pages.values())
    keys: dict[str, Any] = dict(next(listed))
    if len(pages) > 1:
        keys["pages"] = [{"page": n, "thumbnails": sizes} for n, sizes in pages.items()]
    return keys


def _not_a_handler(ctx: TaskContext, payload: Any) -> Any:
    raise PermanentError("the thumbnail task runs on the worker, never as a handler")


REGISTRY.add(
    Task(
        THUMBNAIL,
        _not_a_handler,
        runner=run,
        kind=job_kind,
        pool=render_pool,
        prior_ms=PRIOR_MS,
    )
)
