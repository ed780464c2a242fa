"""Object storage behind one small protocol: local folder (`file://`) or S3-compatible (`s3://`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from worker.errors import SOURCE_MISSING, STORAGE_ERROR, ThumbqError

if TYPE_CHECKING:
    from worker.config import Config


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
