"""Object storage behind one small protocol: local folder (`file://`) or S3-compatible (`s3://`)."""

from __future__ import annotations

import contextvars
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from worker.engine.errors import SOURCE_MISSING, STORAGE_ERROR, STORAGE_TIMEOUT, ThumbqError

if TYPE_CHECKING:
    from worker.engine.config import Config


@dataclass(frozen=True)
class ObjectInfo:
    """What storage says of one object."""

    key: str
    etag: str  # without surrounding quotes
    size: int
    content_type: str | None = None


class NotFound(ThumbqError):
    """The object does not exist (permanent for a job: `source_missing`)."""

    def __init__(self, key: str) -> None:
        super().__init__(SOURCE_MISSING, f"object {key!r} does not exist in storage")
        self.key = key


class StorageError(ThumbqError):
    """Storage could not be reached or answered with an error (transient: `storage_error`)."""

    def __init__(self, message: str) -> None:
        super().__init__(STORAGE_ERROR, message)


class StorageTimeout(StorageError):
    """A storage call did not finish in the time it had (transient: `storage_timeout`)."""

    def __init__(self, message: str) -> None:
        ThumbqError.__init__(self, STORAGE_TIMEOUT, message)


class Storage(Protocol):
    """The few operations thumbq needs. Every method validates its key (`validate_key`)."""

    url: str

    def head(self, key: str) -> ObjectInfo:
        """Metadata of `key`; raises `NotFound`."""
        ...

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """Bytes and metadata of `key`; raises `NotFound`, or `ThumbqError(too_large)` past max."""
        ...

    def put(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        """Write `key` atomically: readers see the old object or the whole new one, never part."""
        ...

    def exists(self, key: str) -> bool:
        """Whether `key` exists."""
        ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in key order."""
        ...

    def presigned_get_url(self, key: str, expires_s: int) -> str | None:
        """A URL anyone may GET `key` from for `expires_s` seconds, or None when this storage
        has no URLs of its own (local files: the API serves them)."""
        ...


def open_storage(config: Config) -> Storage:
    """The storage named by `config.storage_url` (`file:///abs/dir` or `s3://bucket[/prefix]`)."""
    url = config.storage_url
    if url.startswith("file://"):
        from worker.storage.file import FileStorage

        return FileStorage.from_url(url)
    if url.startswith("s3://"):
        from worker.storage.s3 import S3Storage

        return S3Storage.from_url(url, endpoint_url=config.s3_endpoint_url, region=config.s3_region)
    raise ValueError(f"THUMBQ_STORAGE_URL must start with file:// or s3://, got {url!r}")


# -- calls bounded by a deadline ---------------------------------------------------------------

T = TypeVar("T")

# The monotonic time by which the current bounded call must end (None outside one). A call that
# outlives its caller's wait goes on in its helper thread; storage backends read this to stop
# such a call at the next chance (no new attempt, no more body) instead of finishing it for no one.
_CALL_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "thumbq_storage_call_deadline", default=None
)


def call_deadline() -> float | None:
    """The `time.monotonic()` by which the storage call running in this thread must end."""
    return _CALL_DEADLINE.get()


class _Helper:
    """A thread that makes storage calls for one caller thread, one at a time.

    Handing a call to a waiting thread costs 15-20 us; starting a thread per call cost 85 us."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[tuple[float, Callable[[], Any]] | None] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="thumbq-storage-call", daemon=True).start()

    def _serve(self) -> None:
        while (job := self.inbox.get()) is not None:
            deadline, fn = job
            _CALL_DEADLINE.set(deadline)
            try:
                self.outbox.put((True, fn()))
            except BaseException as exc:  # handed to the waiting caller
                self.outbox.put((False, exc))

    def call(self, timeout_s: float, fn: Callable[[], T]) -> tuple[bool, Any] | None:
        """`fn`'s outcome as (ok, value), or None if it did not come within `timeout_s` (then
        this helper stops after that call and must not be used again)."""
        self.inbox.put((time.monotonic() + timeout_s, fn))
        try:
            return self.outbox.get(timeout=timeout_s)
        except queue.Empty:
            self.inbox.put(None)
            return None

    def stop(self) -> None:
        self.inbox.put(None)


class BoundedStorage:
    """A `Storage` each of whose calls ends by the time `time_left_s()` gives when it starts,
    whatever the call is doing: a stalled connection, a slow drip, a hung network filesystem.

    What the batch uses, so that every GET, HEAD and PUT of an invocation ends by its deadline
    (`StorageTimeout`). A timeout per socket read (boto3's `read_timeout`) never trips on a slow
    drip, and a read from a hung filesystem cannot be interrupted at all: only not waiting for it
    bounds it. So each call runs in a helper thread (one per calling thread, reused) and the
    caller waits for it at most that long; an abandoned call ends on its own in its daemon thread
    (S3Storage stops it at its next attempt or body read). `close()` ends the helpers.

    The hand-over costs about 20-30 us a call (bench/deadlines.py), nothing next to a real GET or
    PUT. A storage that cannot stall (one in memory, a benchmark's no-op) says so with a
    `may_stall = False` attribute and is called directly.
    """

    def __init__(self, storage: Storage, time_left_s: Callable[[], float]) -> None:
        self.inner = storage
        self.url = storage.url
        self.time_left_s = time_left_s
        self.direct = getattr(storage, "may_stall", True) is False
        self._mine = threading.local()
        self._lock = threading.Lock()
        self._helpers: list[_Helper] = []

    def __repr__(self) -> str:
        return f"BoundedStorage({self.inner!r})"

    def close(self) -> None:
        """Stop the helper threads (a busy one after its call)."""
        with self._lock:
            helpers, self._helpers = self._helpers, []
        for helper in helpers:
            helper.stop()

    def _call(self, op: str, key: str, fn: Callable[[], T]) -> T:
        what = f"storage {op} {key!r}"
        timeout_s = self.time_left_s()
        if timeout_s <= 0:
            raise StorageTimeout(f"{what}: no time was left in the invocation's budget")
        if self.direct:
            return fn()
        helper: _Helper | None = getattr(self._mine, "helper", None)
        if helper is None:
            helper = self._mine.helper = _Helper()
            with self._lock:
                self._helpers.append(helper)
        outcome = helper.call(timeout_s, fn)
        if outcome is None:
            self._mine.helper = None
            with self._lock:
                self._helpers.remove(helper)
            raise StorageTimeout(f"{what} did not finish within the {timeout_s:.1f} s left")
        ok, value = outcome
        if ok:
            return value
        raise value

    def head(self, key: str) -> ObjectInfo:
        """Metadata of `key`, bounded."""
        return self._call("HEAD", key, lambda: self.inner.head(key))

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """Bytes and metadata of `key`, bounded."""
        return self._call("GET", key, lambda: self.inner.get(key, max_bytes=max_bytes))

    def put(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        """Write `key`, bounded. After a timeout the write may still land, or not; never in part
        (S3 PUTs and file renames are atomic), and a retry writes the same bytes."""
        return self._call("PUT", key, lambda: self.inner.put(key, data, content_type))

    def exists(self, key: str) -> bool:
        """Whether `key` exists, bounded."""
        return self._call("HEAD", key, lambda: self.inner.exists(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Not bounded: listing is for backfill, which runs outside a batch."""
        return self.inner.list(prefix)

    def presigned_get_url(self, key: str, expires_s: int) -> str | None:
        """Not bounded: signing a URL is local work, no request."""
        return self.inner.presigned_get_url(key, expires_s)
