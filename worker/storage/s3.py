"""S3-compatible storage (`s3://bucket[/prefix]`): AWS S3, Cloudflare R2, Supabase Storage, MinIO.

boto3 is imported when an `S3Storage` is built, never at module import, so that processes that
only serve progress do not pay for it.

Timeouts and retries have to fit in a 10 s invocation: by default a TCP connect may take 1 s, a
socket read 2 s, and a call makes at most 3 attempts (botocore's standard retry mode, whose
backoff for connection errors is a few tens of milliseconds). A refused connection therefore fails
in well under a second, a black-holed host in about 3 s, and a server that accepts and never
answers in about 6 s. Those are per attempt and per socket read; a batch bounds each whole call by
its deadline (`worker.storage.bounded_call`), and a call that outlives it stops at its next
attempt or body read here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from worker.engine.errors import TOO_LARGE, InvalidKey, ThumbqError, validate_key
from worker.storage import NotFound, ObjectInfo, StorageError, StorageTimeout, call_deadline

if TYPE_CHECKING:
    from botocore.exceptions import ClientError
    from mypy_boto3_s3 import S3Client

# Thumbnail keys contain the source's ETag, so a key's content never changes: cache it for a year.
IMMUTABLE_CACHE_CONTROL = "public, max-age=31536000, immutable"

# Bodies below this go out without waiting for "100 Continue" (see _no_expect_for_small_bodies).
SMALL_BODY = 1024 * 1024
# A GET body is read in pieces of at most this, so that a call past its deadline stops reading.
READ_PIECE = 256 * 1024

_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def default_region(endpoint_url: str | None) -> str:
    """Region to sign for when none is configured: `auto` for Cloudflare R2, else `us-east-1`."""
    host = (urlsplit(endpoint_url).hostname or "") if endpoint_url else ""
    if host == "r2.cloudflarestorage.com" or host.endswith(".r2.cloudflarestorage.com"):
        return "auto"
    return "us-east-1"


def _etag(raw: str | None) -> str:
    return (raw or "").strip('"')


class S3Storage:
    """Objects in one bucket, optionally under a key prefix, through one shared boto3 client."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        connect_timeout: float = 1.0,
        read_timeout: float = 2.0,
        max_attempts: int = 3,
        max_pool_connections: int = 32,
        cache_control: str | None = IMMUTABLE_CACHE_CONTROL,
    ) -> None:
        """Build the client now (not per call); `prefix` is prepended to every key."""
        if len(bucket) < 3 or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
            prefix += "/"
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint_url = endpoint_url
        self.region = region or default_region(endpoint_url)
        self.cache_control = cache_control
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        # Set once a HEAD on the bucket has succeeded; see _missing_bucket.
        self._bucket_seen = False

        import boto3.session
        from botocore.config import Config as BotoConfig

        config = BotoConfig(
            region_name=self.region,
            signature_version="s3v4",
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"mode": "standard", "max_attempts": max_attempts},
            max_pool_connections=max_pool_connections,
            # R2, Supabase Storage and older MinIO reject the CRC checksums botocore >= 1.36
            # sends by default; only send them where an operation demands one.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # Custom endpoints (MinIO, Supabase, moto) do not resolve bucket subdomains.
            s3={"addressing_style": "path"} if endpoint_url else {},
        )
        # A private session: the default one is shared process-wide and sessions are not
        # thread-safe. The client built here is, and all threads share it.
        session = boto3.session.Session()
        self.client: S3Client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self.client.meta.events.register("before-send.s3.PutObject", _no_expect_for_small_bodies)
        self.client.meta.events.register("before-send.s3", _not_past_the_deadline)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        **options: Any,
    ) -> S3Storage:
        """Open `s3://bucket[/prefix]`; `options` go to the constructor (timeouts, retries)."""
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
            raise ValueError(f"S3 storage URL must be s3://bucket[/prefix], got {url!r}")
        return cls(parts.netloc, parts.path, endpoint_url=endpoint_url, region=region, **options)

    def __repr__(self) -> str:
        where = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"S3Storage({self.url!r}{where})"

    # -- errors -----------------------------------------------------------------------------

    def _where(self, key: str) -> str:
        at = f" at {self.endpoint_url}" if self.endpoint_url else ""
        return f"s3://{self.bucket}/{self.prefix}{key}{at}"

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as exc:
            raise self._client_error(op, key, exc) from exc
        except BotoCoreError as exc:
            raise StorageError(f"S3 {op} {self._where(key)} failed: {exc}") from exc

    def _client_error(self, op: str, key: str, exc: ClientError) -> ThumbqError:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        # NoSuchBucket is a 404 too, but it is a configuration problem: reporting it as a
        # missing source would cancel every job in the queue for good.
        if code != "NoSuchBucket" and (code in _NOT_FOUND_CODES or status == 404):
            if code == "404" and op == "HEAD" and self._missing_bucket():
                return StorageError(
                    f"S3 {op} {self._where(key)} failed: bucket {self.bucket!r} does not exist"
                )
            return NotFound(key)
        message = error.get("Message") or ""
        detail = f"HTTP {status} {code}" + (f": {message}" if message else "")
        return StorageError(f"S3 {op} {self._where(key)} failed: {detail}")

    def _missing_bucket(self) -> bool:
        # A HEAD response has no body, so a missing key and a missing bucket both arrive as a bare
        # 404. Ask about the bucket itself (once it has been seen, never again) to tell them apart.
        if self._bucket_seen:
            return False
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError as exc:
            return exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404
        except BotoCoreError:
            return False
        self._bucket_seen = True
        return False

    # -- the protocol -----------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        """Metadata of `key` (one HEAD request); raises `NotFound` or `StorageError`."""
        validate_key(key)
        with self._errors("HEAD", key):
            resp = self.client.head_object(Bucket=self.bucket, Key=self.prefix + key)
        return ObjectInfo(
            key=key,
            etag=_etag(resp.get("ETag")),
            size=resp.get("ContentLength", 0),
            content_type=resp.get("ContentType"),
        )

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """Bytes and metadata of `key` in one GET; the body is not read when it is over max."""
        validate_key(key)
        with self._errors("GET", key):
            resp = self.client.get_object(Bucket=self.bucket, Key=self.prefix + key)
        body = resp["Body"]
        try:
            size = resp.get("ContentLength")
            if max_bytes is not None and size is not None and size > max_bytes:
                raise _too_large(key, size, max_bytes)
            with self._errors("GET", key):
                data = _read_body(body, key, None if max_bytes is None else max_bytes + 1)
        finally:
            # Closing an unread body drops the connection instead of draining it.
            body.close()
        if max_bytes is not None and len(data) > max_bytes:
            raise _too_large(key, len(data), max_bytes)
        if size is not None and len(data) != size:
            # A bounded read() returns what arrived before the connection dropped without
            # checking the length (only an unbounded one does): a cut-off body must not pass
            # for the whole file, which would render (or fail as corrupt) a fraction of it.
            raise StorageError(
                f"S3 GET {self._where(key)} failed: the connection closed after "
                f"{len(data)} of {size} bytes"
            )
        info = ObjectInfo(
            key=key,
            etag=_etag(resp.get("ETag")),
            size=len(data),
            content_type=resp.get("ContentType"),
        )
        return data, info

    def put(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        """Write `key` in one PUT (atomic on S3) with its content type and an immutable cache."""
        validate_key(key)
        extra: dict[str, Any] = {"CacheControl": self.cache_control} if self.cache_control else {}
        with self._errors("PUT", key):
            resp = self.client.put_object(
                Bucket=self.bucket,
                Key=self.prefix + key,
                Body=data,
                ContentType=content_type,
                **extra,
            )
        return ObjectInfo(
            key=key, etag=_etag(resp.get("ETag")), size=len(data), content_type=content_type
        )

    def exists(self, key: str) -> bool:
        """Whether `key` exists (one HEAD request)."""
        try:
            self.head(key)
        except NotFound:
            return False
        return True

    def presigned_get_url(self, key: str, expires_s: int) -> str:
        """A presigned GET URL for `key`, valid `expires_s` seconds (signed here, no request)."""
        validate_key(key)
        return str(
            self.client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self.prefix + key},
                ExpiresIn=expires_s,
            )
        )

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object under `prefix` in key order, 1000 per request, with the storage prefix
        stripped; folder markers (keys ending in '/') and keys thumbq cannot use are skipped.
        `content_type` is None: listing does not return it."""
        if prefix:
            validate_key(prefix)
        return self._list(prefix)

    def _list(self, prefix: str) -> Iterator[ObjectInfo]:
        paginator = self.client.get_paginator("list_objects_v2")
        strip = len(self.prefix)
        with self._errors("LIST", prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for obj in page.get("Contents", []):
                    key = obj["Key"][strip:]
                    if key.endswith("/"):
                        continue
                    try:
                        validate_key(key)
                    except InvalidKey:
                        continue
                    yield ObjectInfo(key=key, etag=_etag(obj.get("ETag")), size=obj.get("Size", 0))


def _not_past_the_deadline(request: Any, **_: Any) -> None:
    # Raised before the request goes out, so botocore makes no further attempt of a call whose
    # caller has stopped waiting for it (see worker.storage.bounded_call).
    deadline = call_deadline()
    if deadline is not None and time.monotonic() >= deadline:
        raise StorageTimeout(f"S3 {request.method} {request.url}: the call's deadline has passed")


def _read_body(body: Any, key: str, limit: int | None) -> bytes:
    """Read up to `limit` bytes (all when None), stopping at the call's deadline if it has one.

    botocore's read(n) waits until n bytes have come, which a slow drip can stretch for minutes
    without tripping the per-read timeout; urllib3's read1 returns what has arrived, so the
    deadline is checked between arrivals.
    """
    deadline = call_deadline()
    read1 = getattr(getattr(body, "_raw_stream", None), "read1", None)
    if deadline is None or read1 is None:
        return bytes(body.read() if limit is None else body.read(limit))
    out = bytearray()
    while limit is None or len(out) < limit:
        if time.monotonic() >= deadline:
            raise StorageTimeout(f"S3 GET {key!r}: body still arriving at the call's deadline")
        want = READ_PIECE if limit is None else min(READ_PIECE, limit - len(out))
        try:
            piece = read1(want)
        except Exception as exc:  # urllib3's errors: botocore's read() would wrap them
            raise StorageError(f"S3 GET {key!r}: reading the body failed: {exc}") from exc
        if not piece:
            break
        out += piece
    return bytes(out)


def _no_expect_for_small_bodies(request: Any, **_: Any) -> None:
    # botocore sends every PutObject with "Expect: 100-continue", which costs a round trip before
    # the body goes out, and a full second when an endpoint ignores the header. For a thumbnail
    # that is pure delay. The header is not signed, so it can go after signing.
    if int(request.headers.get("Content-Length") or 0) < SMALL_BODY:
        del request.headers["Expect"]


def _too_large(key: str, size: int, max_bytes: int) -> ThumbqError:
    return ThumbqError(TOO_LARGE, f"object {key!r} is {size} bytes, over the {max_bytes} limit")
