"""The progress page (`GET /progress?group_id=`) and the recent failures it lists.

The page is static HTML, JS and CSS (no build step); the server only fills in a JSON block with
the Supabase settings, so the same files also work from a static host (they then poll).
`GET /api/thumbnails/failures?group_id=&limit=` lists a group's recent failures with the same
auth as the progress endpoint: the admin secret, or a user JWT under which RLS decides.

Realtime (SUPABASE_URL and SUPABASE_ANON_KEY set) loads supabase-js from THUMBQ_SUPABASE_JS_URL
(a Flask setting; default esm.sh) and subscribes to the group's row; only a live Supabase project
exercises that path. The tests cover its fallback: supabase-js cannot load, the page polls.
"""

from __future__ import annotations

import json
import math
import time
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Annotated, Any
from urllib.parse import urlencode, urlsplit

from flask import Blueprint, Response, current_app, request
from msgspec import UNSET, Meta, Struct

from api import validation as v
from api.auth import require_reader
from api.contract import (
    ADMIN_ERRORS,
    READER,
    Absent,
    Answer,
    Error,
    GroupId,
    Key,
    Op,
    describe,
    html,
    image,
)
from api.errors import ApiError, json_response
from api.state import AppState
from api.thumbnails import Job
from worker.app.signing import THUMBNAIL_URL_TTL_S, thumbnail_signature, thumbnail_signature_ok
from worker.engine import db
from worker.engine.errors import PERMANENT_CODES, InvalidKey
from worker.storage import NotFound

bp = Blueprint("pages", __name__, static_folder="static", static_url_path="/progress/static")

FAILURES_DEFAULT_LIMIT = 20
FAILURES_MAX_LIMIT = 100
GALLERY_DEFAULT_LIMIT = 48
GALLERY_MAX_LIMIT = 200
MAX_JOB_ID = 2**63 - 1
# Signed thumbnail URLs expire on a 15-minute grid, so that the gallery's refreshes hand out
# the same URLs for a while and the browser's cache keeps working.
URL_EXPIRY_STEP_S = 900
THUMBNAIL_PREFIX = "thumbnails/"
IMAGE_TYPES = {
    "webp": "image/webp",
    "jpg": "image/jpeg",
    "jpeg": "image/jpeg",
    "png": "image/png",
    "avif": "image/avif",
}

# -- requests and answers ---------------------------------------------------------------------


class PageQuery(Struct):
    group_id: GroupId | Absent = UNSET


class FailuresQuery(Struct, kw_only=True):
    group_id: GroupId
    limit: Annotated[int, Meta(ge=1, le=FAILURES_MAX_LIMIT)] = FAILURES_DEFAULT_LIMIT


class GalleryQuery(Struct, kw_only=True):
    group_id: GroupId
    limit: Annotated[int, Meta(ge=1, le=GALLERY_MAX_LIMIT)] = GALLERY_DEFAULT_LIMIT
    before: (
        Annotated[
            int,
            Meta(
                ge=1, description="Only jobs with a smaller id (the previous page's next_before)."
            ),
        ]
        | Absent
    ) = UNSET


class ImageQuery(Struct):
    key: Key
    expires: int
    sig: str


class Failure(Job, kw_only=True):
    permanent: Annotated[
        bool,
        Meta(
            description="The error is permanent (the input itself is the problem): no retry "
            "will come, and retrying by hand fails the same way."
        ),
    ]


class Failures(Struct):
    group_id: str
    failures: list[Failure]


class PageUrl(Struct):
    page: int
    url: str


class GalleryItem(Struct, kw_only=True):
    job_id: int
    source_key: str
    url: Annotated[
        str, Meta(description="Absolute (presigned S3) or relative to the API (local files).")
    ]
    width: int | None
    height: int | None
    content_type: str | Absent | None = UNSET
    completed_at: datetime | Absent | None = UNSET
    dominant_color: (
        Annotated[
            str | None, Meta(description="#rrggbb to show while the image loads, where recorded.")
        ]
        | Absent
    ) = UNSET
    thumbhash: (
        Annotated[str | None, Meta(description="A ThumbHash (base64) placeholder, where recorded.")]
        | Absent
    ) = UNSET
    pages: (
        Annotated[
            list[PageUrl],
            Meta(
                description="A document's pages in order (THUMBQ_PAGES above 1), each at its "
                "smallest size; empty for a single page."
            ),
        ]
        | Absent
    ) = UNSET


class Gallery(Struct):
    group_id: str
    thumbnails: list[GalleryItem]
    next_before: Annotated[
        int | None, Meta(description="Pass as `before` for the next page; null at the end.")
    ]


_READ_ERRORS: dict[int, Answer | str] = {400: "BadRequest", 404: "NotFound", **ADMIN_ERRORS}

_CONFIG_SLOT = '<script id="thumbq-config" type="application/json">{}</script>'


@cache
def _page_template() -> str:
    text = resources.files("api").joinpath("static/progress.html").read_text(encoding="utf-8")
    if _CONFIG_SLOT not in text:
        raise RuntimeError("progress.html lost its configuration slot")
    return text


def _state() -> AppState:
    st: AppState = current_app.extensions["thumbq"]
    return st


def _origin(url: str | None) -> str | None:
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}"


def page_settings() -> dict[str, Any]:
    """What the page learns from the server: Realtime settings when both are configured."""
    config = _state().config
    settings: dict[str, Any] = {"api_base": ""}
    if config.supabase_url and config.supabase_anon_key:
        settings |= {
            "supabase_url": config.supabase_url,
            # The anon key is public by design (it ships in every Supabase frontend).
            "supabase_anon_key": config.supabase_anon_key,
            "supabase_js_url": current_app.config.get(
                "THUMBQ_SUPABASE_JS_URL", config.supabase_js_url
            ),
        }
    return settings


def _script_json(value: Any) -> str:
    # Inside <script>, "</script>" or "<!--" in a value would end the block: escape < > &.
    text = json.dumps(value, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _image_origin() -> str | None:
    """Where the gallery's images come from when storage presigns its own URLs (S3)."""
    try:
        return _origin(_state().storage().presigned_get_url(THUMBNAIL_PREFIX + "csp", 60))
    except Exception:  # storage misconfigured: the page still works, without the gallery
        return None


def _csp(settings: dict[str, Any], image_origin: str | None = None) -> str:
    scripts = ["'self'"]
    connect = ["'self'"]
    images = ["'self'", "data:"] + ([image_origin] if image_origin else [])
    if js := _origin(settings.get("supabase_js_url")):
        scripts.append(js)
        connect.append(js)
    if sb := _origin(settings.get("supabase_url")):
        connect.append(sb)
        connect.append(sb.replace("https://", "wss://", 1).replace("http://", "ws://", 1))
    return "; ".join(
        [
            "default-src 'none'",
            f"script-src {' '.join(scripts)}",
            f"connect-src {' '.join(connect)}",
            "style-src 'self'",
            f"img-src {' '.join(images)}",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


@bp.get("/progress")
@describe(
    Op(
        "progressPage",
        "The progress page: polls the progress endpoint, or follows Supabase Realtime.",
        {200: html("An HTML page.")},
        query=PageQuery,
    )
)
def progress_page() -> Response:
    """The progress page; which group it shows is read from the query string by its script."""
    settings = page_settings()
    slot = f'<script id="thumbq-config" type="application/json">{_script_json(settings)}</script>'
    html = _page_template().replace(_CONFIG_SLOT, slot, 1)
    return Response(
        html,
        mimetype="text/html",
        headers={
            "Content-Security-Policy": _csp(settings, _image_origin()),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )


def _int_arg(name: str, default: int, hi: int) -> int:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    # ASCII digits only and few of them: int() refuses superscripts that isdigit() accepts,
    # and raises past 4 300 digits.
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 19 or not 1 <= int(raw) <= hi:
        raise ApiError(400, "invalid_request", f"{name} must be an integer from 1 to {hi}")
    return int(raw)


def _limit() -> int:
    return _int_arg("limit", FAILURES_DEFAULT_LIMIT, FAILURES_MAX_LIMIT)


@bp.get("/api/thumbnails/failures")
@describe(
    Op(
        "getFailures",
        "A group's most recent failed, unsupported and retrying jobs with their errors (for the "
        "progress page).",
        {
            200: Answer(
                "The group's files without a thumbnail and why (failed, unsupported, missing "
                "from storage, or retrying after an error), newest first.",
                Failures,
            ),
            **_READ_ERRORS,
        },
        security=READER,
        query=FailuresQuery,
    )
)
def failures() -> Response:
    """A group's files without a thumbnail and why: failed, unsupported, missing from storage,
    or retrying after an error; newest first."""
    st = _state()
    who = require_reader(st.auth)
    group_id = v.query_group_id()
    limit = _limit()
    params = {"group_id": group_id, "limit": limit}
    with st.connection() as conn, conn.transaction():
        if not who.is_admin:
            db.one(conn, "act_as_user", {"claims": json.dumps(who.claims)})
        # The group row first: an unknown (or invisible) group is a 404, as for progress.
        group = db.one(conn, "progress", {"group_id": group_id})
        rows = db.run(conn, "recent_failures_of_group", params) if group else []
    if group is None:
        raise ApiError(404, "group_not_found", f"no group {group_id!r}")
    # Whether a retry can help: the page promises no retry for a permanent error.
    failures = [{**r, "permanent": r["error_code"] in PERMANENT_CODES} for r in rows]
    return json_response(
        {"group_id": group_id, "failures": failures},
        200,
        {"Cache-Control": "no-cache", "Vary": "Authorization"},
    )


def _signing_secret() -> str | None:
    config = _state().config
    return config.cron_secret or config.jwt_secret


def _thumbnail_url(key: str, expires: int) -> str:
    secret = _signing_secret()
    assert secret is not None  # require_reader refused the request otherwise
    return "/api/thumbnails/image?" + urlencode(
        {"key": key, "expires": expires, "sig": thumbnail_signature(secret, key, expires)}
    )


@bp.get("/api/thumbnails/gallery")
@describe(
    Op(
        "getGallery",
        "A page of a group's finished thumbnails, newest job first, with URLs an <img> can load "
        "without credentials: presigned by S3, or signed URLs of /api/thumbnails/image for "
        "local files (valid about an hour).",
        {200: Answer("Finished thumbnails.", Gallery), **_READ_ERRORS},
        security=READER,
        query=GalleryQuery,
    )
)
def gallery() -> Response:
    """A page of a group's finished thumbnails (newest job first) with URLs an <img> can load:
    presigned by S3, or signed for /api/thumbnails/image with local files."""
    st = _state()
    who = require_reader(st.auth)
    group_id = v.query_group_id()
    limit = _int_arg("limit", GALLERY_DEFAULT_LIMIT, GALLERY_MAX_LIMIT)
    before = _int_arg("before", MAX_JOB_ID, MAX_JOB_ID)
    params = {"group_id": group_id, "limit": limit, "before": before}
    with st.connection() as conn, conn.transaction():
        if not who.is_admin:
            db.one(conn, "act_as_user", {"claims": json.dumps(who.claims)})
        group = db.one(conn, "progress", {"group_id": group_id})
        rows = db.run(conn, "finished_of_group", params) if group else []
    if group is None:
        raise ApiError(404, "group_not_found", f"no group {group_id!r}")
    storage = st.storage() if rows else None
    expires = math.ceil((time.time() + THUMBNAIL_URL_TTL_S) / URL_EXPIRY_STEP_S) * URL_EXPIRY_STEP_S
    items = []
    for r in rows:
        assert storage is not None
        url = storage.presigned_get_url(r["thumbnail_key"], THUMBNAIL_URL_TTL_S)
        items.append(
            {
                "job_id": r["id"],
                "source_key": r["source_key"],
                "url": url or _thumbnail_url(r["thumbnail_key"], expires),
                "content_type": r["thumbnail_content_type"],
                "width": r["width"],
                "height": r["height"],
                "completed_at": r["completed_at"],
                # Placeholders while the image loads, where the jobs carry them.
                "dominant_color": r["dominant_color"],
                "thumbhash": r["thumbhash"],
                # A document's pages in order (THUMBQ_PAGES), each at its smallest size.
                "pages": [
                    {"page": p["page"], "url": _page_url(storage, p["thumbnails"], expires)}
                    for p in r.get("pages") or ()
                ],
            }
        )
    return json_response(
        {
            "group_id": group_id,
            "thumbnails": items,
            "next_before": rows[-1]["id"] if len(rows) == limit else None,
        },
        200,
        {"Cache-Control": "no-store", "Vary": "Authorization"},
    )


def _page_url(storage: Any, sizes: dict[str, str], expires: int) -> str:
    key = sizes[min(sizes, key=int)]
    return storage.presigned_get_url(key, THUMBNAIL_URL_TTL_S) or _thumbnail_url(key, expires)


def _forbidden() -> ApiError:
    return ApiError(
        403, "forbidden", "this thumbnail link is not valid or has expired; reload the page"
    )


@bp.get("/api/thumbnails/image")
@describe(
    Op(
        "getThumbnailImage",
        "One thumbnail from local storage, for a URL the gallery signed (no other credentials: "
        "an <img> sends none). Only keys under thumbnails/; never outside the storage root.",
        {
            200: image("The image.", IMAGE_TYPES.values()),
            400: "BadRequest",
            403: Answer("A signature that is wrong or expired (code forbidden).", Error),
            404: "NotFound",
        },
        query=ImageQuery,
    )
)
def thumbnail_image() -> Response:
    """One thumbnail from local storage, for a URL the gallery signed. Only keys under
    thumbnails/ with an image extension, and storage refuses any key that would leave its
    root (`..`, absolute paths, symlinks out), signature or not."""
    key = request.args.get("key", "")
    raw_expires = request.args.get("expires", "")
    signature = request.args.get("sig", "")
    secret = _signing_secret()
    ext = key.rsplit(".", 1)[-1].lower() if "." in key else ""
    if (
        secret is None
        or not key.startswith(THUMBNAIL_PREFIX)
        or ext not in IMAGE_TYPES
        or not (raw_expires.isascii() and raw_expires.isdigit() and len(raw_expires) <= 12)
    ):
        raise _forbidden()
    v.object_key(key, "key")
    expires = int(raw_expires)
    if not thumbnail_signature_ok(secret, key, expires, signature):
        raise _forbidden()
    st = _state()
    try:
        data, _info = st.storage().get(key, max_bytes=st.config.max_bytes)
    except NotFound:
        raise ApiError(404, "not_found", "this thumbnail no longer exists") from None
    except InvalidKey as exc:
        raise ApiError(400, "invalid_key", f"key: {exc}") from None
    max_age = max(0, min(expires - int(time.time()), THUMBNAIL_URL_TTL_S))
    return Response(
        data,
        200,
        mimetype=IMAGE_TYPES[ext],
        headers={
            "Cache-Control": f"private, max-age={max_age}",
            "X-Content-Type-Options": "nosniff",
            "Content-Security-Policy": "default-src 'none'; sandbox",
        },
    )
