"""Short-lived signed credentials derived from the admin secret, so that the secret itself never
goes into a URL.

- A *page token* (`tqp.1.<expires>.<signature>`) lets the progress page read progress, failures
  and thumbnails, and nothing else: it is refused wherever the admin secret is required.
  `thumbq up` prints a link with one in its fragment (never sent to a server, removed from the
  address bar by the page). It has four dot-separated parts, so the page never mistakes it for
  a JWT (three parts) and never hands it to Supabase.
- A *thumbnail signature* authorises one GET of one thumbnail key until it expires: an <img>
  cannot send an Authorization header, so the gallery hands out signed URLs (file storage)
  the way S3 hands out presigned ones.

Each use has its own key, HMAC-SHA256(secret, purpose), so a signature made for one purpose is
worthless for the other, and changing the secret revokes everything signed with the old one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

PAGE_TOKEN_PREFIX = "tqp.1."  # noqa: S105 (a prefix, not a secret)
# A working day: long enough to leave a tab open, short enough that a link copied out of a
# terminal's scrollback stops working by the next day.
PAGE_TOKEN_TTL_S = 12 * 3600
# How long a gallery URL works; the page asks for fresh ones whenever it refreshes the grid.
THUMBNAIL_URL_TTL_S = 3600


def _key(secret: str, purpose: str) -> bytes:
    return hmac.new(
        secret.encode("utf-8", "surrogatepass"), f"thumbq:{purpose}".encode(), hashlib.sha256
    ).digest()


def _sign(secret: str, purpose: str, message: str) -> str:
    mac = hmac.new(_key(secret, purpose), message.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


def page_token(secret: str, *, ttl_s: int = PAGE_TOKEN_TTL_S, now: float | None = None) -> str:
    """A read-only token for the progress page, valid for `ttl_s` seconds."""
    expires = int((time.time() if now is None else now) + ttl_s)
    message = f"{PAGE_TOKEN_PREFIX}{expires}"
    return f"{message}.{_sign(secret, 'page', message)}"


def is_page_token(token: str) -> bool:
    """Whether `token` has the shape of a page token (it may still be forged or expired)."""
    return token.startswith(PAGE_TOKEN_PREFIX)


def page_token_expired(token: str, secret: str, *, now: float | None = None) -> bool | None:
    """None when `token` is not a genuine page token; else whether it has expired."""
    message, _, signature = token.rpartition(".")
    expires = message[len(PAGE_TOKEN_PREFIX) :]
    if not is_page_token(token) or not expires.isascii() or not expires.isdigit():
        return None
    if len(expires) > 12 or not signature.isascii():
        return None
    if not hmac.compare_digest(signature, _sign(secret, "page", message)):
        return None
    return int(expires) <= (time.time() if now is None else now)


def thumbnail_signature(secret: str, key: str, expires: int) -> str:
    """The signature that lets one GET of thumbnail `key` through until `expires` (epoch s)."""
    return _sign(secret, "thumbnail", f"{expires}\x00{key}")


def thumbnail_signature_ok(
    secret: str, key: str, expires: int, signature: str, *, now: float | None = None
) -> bool:
    """Whether `signature` was made by `thumbnail_signature` for this key and has not expired."""
    if expires <= (time.time() if now is None else now) or not signature.isascii():
        return False
    return hmac.compare_digest(signature, thumbnail_signature(secret, key, expires))
