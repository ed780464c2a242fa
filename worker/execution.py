"""Running one claimed job: the built-in thumbnail task, or a registered task's handler.

Thumbnails: fetch the source, render it in a child process (a cheaper, degraded render when the
first overruns its share of the window), store every size, record the job. Tasks: the handler
runs in a child process (killed at the deadline, like a render) or in the calling worker thread
(`runs_in="thread"`), with a TaskContext whose checkpoints, progress and cancellation checks go
to the database.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from worker import tasks
from worker.budget import RECORD_MS, Budget, Predictor
from worker.claiming import job_kind
from worker.errors import UNSUPPORTED_TASK, ThumbqError
from worker.queue import ClaimedJob, Queue
from worker.recording import FAIR_SHARE, Recorder, bound
from worker.retry import Failure

if TYPE_CHECKING:
    from worker.config import Config
    from worker.render import Thumbnail
    from worker.render.process import RenderPool
    from worker.storage import Storage

# A render still running after this share of its window is stopped, and a cheaper (degraded) one
# gets the rest, rather than the item failing `render_timeout` (items that started late get no
# such fallback: they are released and get a whole window next time).
DEGRADE_AT = 0.75


def thumbnail_key(source_key: str, etag: str, size: int, ext: str) -> str:
    """`thumbnails/<source key>/<etag>-<size>.<ext>`; the etag made safe for a key."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in etag) or "noetag"
    return f"thumbnails/{source_key}/{safe}-{size}.{ext}"


class _ThreadBackend:
    """A thread task's context backend: saves and cancellation checks through the recorder."""

    def __init__(self, recorder: Recorder, job: ClaimedJob) -> None:
        self.recorder = recorder
        self.job = job
        self._gone = False

    def save(self, state: Any | None, done: int | None, total: int | None) -> None:
        if not self.recorder.save(self.job, state, done, total):
            self._gone = True

    def cancelled(self) -> bool:
        return self._gone or self.recorder.is_cancelled(self.job)


class Executor:
    """Runs the jobs one invocation claimed, each to an outcome the recorder counts."""

    def __init__(
        self,
        config: Config,
        queue: Queue,
        storage: Storage,
        pool: RenderPool,
        budget: Budget,
        predictor: Predictor,
        recorder: Recorder,
        registry: tasks.Registry = tasks.REGISTRY,
    ) -> None:
        self.config = config
        self.queue = queue
        self.storage = storage
        self.pool = pool
        self.budget = budget
        self.predictor = predictor
        self.recorder = recorder
        self.registry = registry
        # Write-behind: a worker hands a rendered item's uploads and completion to a writer
        # thread and starts its next item, so that its render process does not sit idle while
        # storage writes (a local file's fsyncs took 4.6 ms an item; an S3 PUT takes longer).
        # One pending write per worker: a worker whose last write has not ended waits for it.
        self.writer = ThreadPoolExecutor(
            max_workers=config.concurrency, thread_name_prefix="thumbq-writer"
        )
        self.write_slots = threading.Semaphore(config.concurrency)

    def run(self, job: ClaimedJob) -> str:
        """Run `job` to its outcome (`succeeded`, `failed`, `retried`, `checkpointed`, ...;
        `writing` while a writer thread stores its thumbnails and then ends it)."""
        window_ms = self.budget.remaining_ms()
        try:
            if job.task == tasks.THUMBNAIL:
                outcome = self._thumbnail(job, window_ms)
            else:
                outcome = self._task(job, window_ms)
        except Exception as exc:  # every failure is classified and recorded, none escapes
            outcome = self.recorder.failed(job, exc, window_ms)
        if outcome != "writing":
            self.recorder.item_ended(job, outcome)
        return outcome

    def close(self) -> None:
        """Wait for the last items' writes (bounded by the deadline like every storage call)."""
        self.writer.shutdown(wait=True)

    # -- the built-in thumbnail task --------------------------------------------------------

    def _thumbnail(self, job: ClaimedJob, window_ms: float) -> str:
        started = time.monotonic()
        kind, size_cls = job_kind(job)
        data, info = self.storage.get(job.source_key, max_bytes=self.config.max_bytes)
        if job.source_etag and info.etag != job.source_etag:
            # The object changed since it was enqueued: the new version supersedes this job.
            self.queue.enqueue(
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
                bound=bound(self.budget, RECORD_MS),
            )
            self.recorder.count("skipped")
            return "skipped"
        from worker.budget import size_class

        size_cls = size_class(info.size)
        timeout_s = self.budget.remaining_ms() / 1000
        fair = timeout_s * 1000 >= FAIR_SHARE * self.budget.work_ms
        thumb = self.pool.render(
            data,
            job.content_type or info.content_type,
            timeout_s=timeout_s,
            degrade_after_s=timeout_s * DEGRADE_AT if fair else None,
        )
        self.write_slots.acquire()
        try:
            self.writer.submit(
                self._record, job, info.etag, thumb, started, (kind, size_cls), window_ms
            )
        except BaseException:
            self.write_slots.release()
            raise
        return "writing"

    def _record(
        self,
        job: ClaimedJob,
        etag: str,
        thumb: Thumbnail,
        started: float,
        stat_key: tuple[str, int],
        window_ms: float,
    ) -> None:
        """Upload every size and queue the completion (on a writer thread); end the item."""
        outcome = "succeeded"
        try:
            keys = self._store(job.source_key, etag, thumb)
            ms = (time.monotonic() - started) * 1000
            if not thumb.degraded:
                # A degraded render says how long the cheap path took, not the real one.
                self.predictor.observe(*stat_key, ms)
            largest = str(max(keys, key=int))
            self.recorder.done(
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
            outcome = self.recorder.failed(job, exc, window_ms)
        finally:
            self.write_slots.release()
            self.recorder.item_ended(job, outcome)

    def _store(self, source_key: str, etag: str, thumb: Thumbnail) -> dict[str, str]:
        """Write every rendition under its own key; returns {"<size>": key}."""
        keys: dict[str, str] = {}
        renditions = thumb.renditions or ()
        if not renditions:
            from worker.render import Rendition

            renditions = (Rendition(self.config.thumb_size, thumb.data, thumb.width, thumb.height),)
        for rendition in renditions:
            key = thumbnail_key(source_key, etag, rendition.size, self.config.thumb_ext)
            self.storage.put(key, rendition.data, thumb.content_type)
            keys[str(rendition.size)] = key
        return keys

    # -- registered tasks -----------------------------------------------------------------

    def _task(self, job: ClaimedJob, window_ms: float) -> str:
        registered = self.registry.get(job.task)
        if registered is None:
            raise ThumbqError(
                UNSUPPORTED_TASK,
                f"no handler for task {job.task!r} here: set THUMBQ_TASKS to the module that "
                "defines it",
            )
        started = time.monotonic()
        self.recorder.started(job)
        try:
            if registered.runs_in == "thread":
                checkpoint, value, progress, error = self._in_thread(registered, job)
            else:
                checkpoint, value, progress, error = self._in_process(job)
        finally:
            self.recorder.ended(job)
        if error is not None:
            return self.recorder.failure(job, error)
        if checkpoint:
            return self.recorder.checkpointed(job, value, progress)
        ms = (time.monotonic() - started) * 1000
        self.predictor.observe(*job_kind(job), ms)
        self.recorder.done(
            {"job_id": job.id, "msg_id": job.msg_id, "result": value, "duration_ms": round(ms)}
        )
        return "succeeded"

    def _in_thread(
        self, registered: tasks.Task, job: ClaimedJob
    ) -> tuple[bool, Any, tuple[int, int | None] | None, Failure | None]:
        ctx = tasks.TaskContext(
            job.as_dict(),
            self.budget.deadline,
            _ThreadBackend(self.recorder, job),
            self.budget.clock,
        )
        try:
            value = registered.fn(ctx, job.payload)
        except tasks.PermanentError as exc:
            return False, None, None, Failure(exc.code, exc.message, True)
        except tasks.TransientError as exc:
            return False, None, None, Failure(exc.code, exc.message, False)
        if isinstance(value, tasks.Checkpoint):
            return True, value.state, ctx.last_progress(), None
        return False, value, ctx.last_progress(), None

    def _in_process(
        self, job: ClaimedJob
    ) -> tuple[bool, Any, tuple[int, int | None] | None, Failure | None]:
        backend = _ThreadBackend(self.recorder, job)
        reply = self.pool.run_task(
            job.task,
            job.as_dict(),
            timeout_s=self.budget.remaining_ms() / 1000,
            on_save=backend.save,
            is_cancelled=backend.cancelled,
        )
        if not reply.ok:
            failure = Failure(reply.code or "internal", reply.message or "", reply.permanent)
            return False, None, None, failure
        if reply.checkpoint:
            return True, reply.state, reply.progress, None
        return False, reply.result, reply.progress, None
