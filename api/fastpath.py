"""Progress polls answered from memory, before Flask.

An open progress page asks again and again, mostly within the cache interval, with the same
credentials: the admin secret, or the user's access token. When the answer for that group and
caller is already in the progress cache, building a Flask request context, routing and a
werkzeug Response cost about 80 us per poll here, many times the work of the answer itself
(bench/load.py). This WSGI middleware answers those polls directly, with the same bytes and
headers the route would send. Who the caller is comes from the route's own Authenticator
(api/auth.py), asked for tokens it has already verified: a user's poll qualifies only with a
token the route has verified and that has not expired, whose claims RLS let see the group within
THUMBQ_ACCESS_CACHE_MS. Everything else goes to Flask untouched: other paths and methods, unknown or
expired tokens, wrong secrets (the route's 401), anything unusual in the query string, and
misses (the route reads the database and fills the cache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from api.auth import MAX_TOKEN_LENGTH
from api.cache import MISS
from api.validation import GROUP_ID_RE

if TYPE_CHECKING:
    from api.state import AppState

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

PATH = "/api/thumbnails/progress"


class ProgressFastPath:
    """Wraps the Flask app's `wsgi_app`."""

    def __init__(self, app: WSGIApp, state: AppState) -> None:
        self.app = app
        self.state = state

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == PATH and environ.get("REQUEST_METHOD") == "GET":
            answer = self._cached_answer(environ)
            if answer is not None:
                if answer.matches(environ.get("HTTP_IF_NONE_MATCH")):
                    start_response("304 NOT MODIFIED", list(answer.headers))
                    return []
                start_response(
                    "200 OK",
                    [
                        *answer.headers,
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(answer.body))),
                    ],
                )
                return [answer.body]
        return self.app(environ, start_response)

    def _cached_answer(self, environ: dict[str, Any]) -> Any:
        """The cached answer for this caller's poll of one group, else None (ask Flask)."""
        query = environ.get("QUERY_STRING", "")
        if not query.startswith("group_id="):
            return None
        group_id = query[9:]
        # Only a value that needs no decoding and is valid as it stands; the route judges the rest.
        if "%" in group_id or "+" in group_id or not GROUP_ID_RE.fullmatch(group_id):
            return None
        scheme, _, token = environ.get("HTTP_AUTHORIZATION", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_LENGTH:
            return None
        # The admin, or a token the route verified before and that has not expired since,
        # whose claims RLS let see this group within the access cache's time.
        who = self.state.auth.reader(token, cached_only=True)
        if who is None:
            return None  # unknown token: the route decides
        if (
            not who.is_admin
            and self.state.access_cache.peek((group_id, who.claims_json)) is not True
        ):
            return None  # no fresh "may see" from RLS: the route reads it
        answer = self.state.progress_cache.peek((group_id, None))
        return None if answer is MISS else answer
