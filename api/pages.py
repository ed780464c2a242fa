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
from functools import cache
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Response, current_app, request

from api import validation as v
from api.auth import require_reader
from api.errors import ApiError, json_response
from api.state import AppState
from worker import db
from worker.errors import PERMANENT_CODES

bp = Blueprint("pages", __name__, static_folder="static", static_url_path="/progress/static")

FAILURES_DEFAULT_LIMIT = 20
FAILURES_MAX_LIMIT = 100
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


def _csp(settings: dict[str, Any]) -> str:
    scripts = ["'self'"]
    connect = ["'self'"]
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
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


@bp.get("/progress")
def progress_page() -> Response:
    """The progress page; which group it shows is read from the query string by its script."""
    settings = page_settings()
    slot = f'<script id="thumbq-config" type="application/json">{_script_json(settings)}</script>'
    html = _page_template().replace(_CONFIG_SLOT, slot, 1)
    return Response(
        html,
        mimetype="text/html",
        headers={
            "Content-Security-Policy": _csp(settings),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )


def _limit() -> int:
    raw = request.args.get("limit")
    if raw is None or raw == "":
        return FAILURES_DEFAULT_LIMIT
    # ASCII digits only and few of them: int() refuses superscripts that isdigit() accepts,
    # and raises past 4 300 digits.
    if (
        not (raw.isascii() and raw.isdigit())
        or len(raw) > 9
        or not 1 <= int(raw) <= FAILURES_MAX_LIMIT
    ):
        raise ApiError(
            400, "invalid_request", f"limit must be an integer from 1 to {FAILURES_MAX_LIMIT}"
        )
    return int(raw)


@bp.get("/api/thumbnails/failures")
def failures() -> Response:
    """A group's files without a thumbnail and why: failed, unsupported, missing from storage,
    or retrying after an error; newest first."""
    st = _state()
    who = require_reader(st.config)
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
