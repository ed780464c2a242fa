"""Signed thumbnail URLs: links that fetch a job's thumbnails with no credentials until they
expire (THUMBQ_SIGNED_URL_TTL_S), for private buckets and for local files alike.

- S3 (AWS, R2, MinIO, Supabase Storage's S3 endpoint): the storage's own presigned GET.
- Local files: `<API>/thumbnails/<rest of the key>?expires=<epoch s>&signature=<HMAC>`, which
  `thumbq serve` answers (api/signed.py). The signature is HMAC-SHA256 with a key derived from
  the admin secret for this one purpose (worker/app/signing.py): the secret itself never appears in
  a URL, and changing it revokes every link.

A URL's path is the thumbnail's key, so the key a job records and the URL that serves it are
the same text.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from worker.app.signing import thumbnail_signature
from worker.engine.states import JobStatus

if TYPE_CHECKING:
    from worker.engine.config import Config
    from worker.storage import Storage

PREFIX = "thumbnails/"
# What the local route serves, by extension (thumbq writes WebP, JPEG or AVIF).
IMAGE_TYPES = {
    "webp": "image/webp",
    "jpg": "image/jpeg",
    "jpeg": "image/jpeg",
    "avif": "image/avif",
    "png": "image/png",
}


@dataclass(frozen=True)
class UrlSigner:
    """Makes the thumbnail URLs of job answers."""

    storage: Storage
    ttl_s: int
    # The admin secret (local files only); None: local files get no URL.
    secret: str | None
    # Where `thumbq serve` answers, for local files' URLs (the request's own origin in the API,
    # THUMBQ_API_URL in the CLI).
    base_url: str

    @classmethod
    def for_config(cls, config: Config, storage: Storage, base_url: str) -> UrlSigner | None:
        """A signer when THUMBQ_SIGNED_URL_TTL_S is set, else None (answers carry no URLs)."""
        if config.signed_url_ttl_s is None:
            return None
        return cls(storage, config.signed_url_ttl_s, config.cron_secret, base_url.rstrip("/"))

    def url(self, key: str, *, now: float | None = None) -> str | None:
        """A URL that GETs `key` until the TTL has passed, or None where none can be made."""
        presigned = self.storage.presigned_get_url(key, self.ttl_s)
        if presigned:
            return presigned
        if self.secret is None or not key.startswith(PREFIX):
            return None
        expires = int(time.time() if now is None else now) + self.ttl_s
        query = urlencode(
            {"expires": expires, "signature": thumbnail_signature(self.secret, key, expires)}
        )
        return f"{self.base_url}/{quote(key, safe='/')}?{query}"

    def fields(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """`thumbnail_url` (the largest size) and `thumbnail_urls` (size -> URL, shaped as the
        job's `thumbnails`, with `pages` when it has them) of a completed job; None otherwise."""
        key = row.get("thumbnail_key")
        if row.get("status") != JobStatus.COMPLETED or not key:
            return {"thumbnail_url": None, "thumbnail_urls": None}
        keys = row.get("thumbnails") or {}
        urls: dict[str, Any] = {}
        for size, value in keys.items():
            if size == "pages" and isinstance(value, list):
                urls["pages"] = [
                    {"page": p.get("page"), "thumbnails": self._each(p.get("thumbnails") or {})}
                    for p in value
                ]
            elif isinstance(value, str):
                urls[size] = self.url(value)
        return {"thumbnail_url": self.url(key), "thumbnail_urls": urls}

    def _each(self, keys: Mapping[str, Any]) -> dict[str, str | None]:
        return {size: self.url(k) for size, k in keys.items() if isinstance(k, str)}


class Refused(Exception):
    """A signed URL that does not open: `code` is `signature_invalid` or `url_expired`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def check(
    secret: str | None, key: str, expires: str, signature: str, *, now: float | None = None
) -> int:
    """The expiry (epoch s) of a genuine, live signed URL for `key`; raises Refused otherwise.
    The signature is compared in constant time before the expiry is looked at, so a forged
    link learns nothing from which of the two refused it."""
    if (
        secret is None
        or not key.startswith(PREFIX)
        or not (expires.isascii() and expires.isdigit() and len(expires) <= 12)
        or not signature.isascii()
    ):
        raise Refused("signature_invalid", "this thumbnail link is not valid")
    if not hmac.compare_digest(signature, thumbnail_signature(secret, key, int(expires))):
        raise Refused("signature_invalid", "this thumbnail link is not valid")
    if int(expires) <= (time.time() if now is None else now):
        raise Refused("url_expired", "this thumbnail link has expired; ask for the job again")
    return int(expires)
