"""GET /thumbnails/<key>: one thumbnail for a signed URL of a job answer (THUMBQ_SIGNED_URL_TTL_S,
worker/app/urls.py), with no credentials: an <img> or a CDN cannot send the admin secret.

A URL whose signature does not match is refused with 403 `signature_invalid`, one past its
expiry with 403 `url_expired`. Only keys under thumbnails/ with an image extension are served,
and storage refuses any key that would leave its root (`..`, absolute paths, symlinks out),
signature or not.
"""

from __future__ import annotations

import time

from flask import Blueprint, Response, request
from msgspec import Struct

from api.contract import Answer, Error, Op, describe, image
from api.errors import ApiError
from api.thumbnails import state
from worker.app import urls
from worker.engine.errors import InvalidKey
from worker.storage import NotFound

bp = Blueprint("signed", __name__)


class SignedPath(Struct):
    name: str


class SignedQuery(Struct):
    expires: str
    signature: str


@bp.get("/thumbnails/<path:name>")
@describe(
    Op(
        "getSignedThumbnail",
        "One thumbnail (thumbnails/<name>) for a signed URL of a job answer, no credentials: "
        "403 signature_invalid or url_expired otherwise.",
        {
            200: image("The image.", urls.IMAGE_TYPES.values()),
            400: "BadRequest",
            403: Answer("signature_invalid, or url_expired.", Error),
            404: "NotFound",
        },
        path=SignedPath,
        query=SignedQuery,
    )
)
def thumbnail(name: str) -> Response:
    """The thumbnail `thumbnails/<name>`, for a genuine signed URL that has not expired."""
    st = state()
    key = urls.PREFIX + name
    ext = key.rsplit(".", 1)[-1].lower() if "." in key else ""
    try:
        if ext not in urls.IMAGE_TYPES:
            raise urls.Refused("signature_invalid", "this thumbnail link is not valid")
        expires = urls.check(
            st.config.cron_secret,
            key,
            request.args.get("expires", ""),
            request.args.get("signature", ""),
        )
    except urls.Refused as refused:
        raise ApiError(403, refused.code, refused.message) from None
    try:
        data, _info = st.storage().get(key, max_bytes=st.config.max_bytes)
    except NotFound:
        raise ApiError(404, "not_found", "this thumbnail no longer exists") from None
    except InvalidKey as exc:
        raise ApiError(400, "invalid_key", f"key: {exc}") from None
    max_age = max(0, expires - int(time.time()))
    return Response(
        data,
        200,
        mimetype=urls.IMAGE_TYPES[ext],
        headers={
            "Cache-Control": f"private, max-age={max_age}",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'none'; sandbox",
        },
    )


def signer() -> urls.UrlSigner | None:
    """The URL signer of this request's job answers (None when THUMBQ_SIGNED_URL_TTL_S is
    unset): local files' URLs point at the origin the request came to."""
    st = state()
    if st.config.signed_url_ttl_s is None:
        return None
    return urls.UrlSigner.for_config(st.config, st.storage(), request.url_root)
