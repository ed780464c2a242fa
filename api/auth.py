"""Who is calling: the operator (the cron secret) or a Supabase user (a JWT).

Admin routes need `Authorization: Bearer <THUMBQ_CRON_SECRET>` (Vercel Cron sends
`Bearer $CRON_SECRET`, which Config reads as a fallback). Without a configured secret they refuse
with 503 `not_configured`: the server, not the caller, has to be fixed, and nothing is open.
Reading routes (progress, failures, the gallery) also take a page token made from that secret
(worker/signing.py: read-only, short-lived; the link `thumbq up` prints) and a user JWT signed
with THUMBQ_JWT_SECRET (HS256, `aud` "authenticated", `exp` and `sub` required); RLS then
decides which groups the user sees.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from flask import request

from api.errors import ApiError
from worker.config import Config
from worker.signing import is_page_token, page_token_expired

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="thumbq"'}
JWT_AUDIENCE = "authenticated"
# Bearer tokens longer than this are refused before any work is done on them.
MAX_TOKEN_LENGTH = 8192


@dataclass(frozen=True)
class Principal:
    """The caller: the operator (`claims` is None) or a user with the JWT's claims (and the same
    claims as canonical JSON: what the database is given, and the user's cache key)."""

    claims: dict[str, Any] | None = None
    claims_json: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.claims is None


ADMIN = Principal()


def _unauthorized(message: str, error: str = "invalid_token") -> ApiError:
    return ApiError(
        401,
        "unauthorized",
        message,
        {"WWW-Authenticate": f'Bearer realm="thumbq", error="{error}"'},
    )


def _not_configured(message: str) -> ApiError:
    return ApiError(503, "not_configured", message)


def bearer_token() -> str:
    """The token of `Authorization: Bearer <token>`; 401 when missing or malformed."""
    header = request.headers.get("Authorization", "")
    if not header:
        raise ApiError(
            401, "unauthorized", "missing `Authorization: Bearer <token>` header", _CHALLENGE
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise _unauthorized("the Authorization header must be `Bearer <token>`", "invalid_request")
    if len(token) > MAX_TOKEN_LENGTH:
        raise _unauthorized("the bearer token is too long")
    return token


def secret_matches(token: str, secret: str) -> bool:
    """Constant-time comparison that leaks neither content nor length: both sides are hashed
    to equal-length digests and every byte is compared."""
    a = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
    b = hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()
    return hmac.compare_digest(a, b)


def require_admin(config: Config) -> Principal:
    """Let the operator through, or raise 401 (wrong or missing token) / 503 (no secret)."""
    if not config.cron_secret:
        raise _not_configured("THUMBQ_CRON_SECRET is not set, so admin routes are disabled")
    if not secret_matches(bearer_token(), config.cron_secret):
        raise _unauthorized("the bearer token is not the admin secret")
    return ADMIN


def operator_may_read(token: str, config: Config) -> bool:
    """Whether `token` is the admin secret or a live page token made from it (`thumbq up`'s
    link): the operator's read access, checked here for the routes and the fast path alike."""
    if not config.cron_secret:
        return False
    if is_page_token(token):
        return page_token_expired(token, config.cron_secret) is False
    return secret_matches(token, config.cron_secret)


def require_reader(config: Config) -> Principal:
    """Let the operator (admin secret or page token) or a user with a valid JWT through."""
    if not config.cron_secret and not config.jwt_secret:
        raise _not_configured(
            "neither THUMBQ_CRON_SECRET nor THUMBQ_JWT_SECRET is set, so progress is not readable"
        )
    token = bearer_token()
    if operator_may_read(token, config):
        return ADMIN
    if config.cron_secret and is_page_token(token):
        if page_token_expired(token, config.cron_secret):
            raise _unauthorized(
                "this page link has expired: open the link a new `thumbq up` prints, or enter "
                "the admin secret"
            )
        raise _unauthorized("the page token is not valid for this server's admin secret")
    if not config.jwt_secret:
        raise _unauthorized("the bearer token is not the admin secret")
    known = VERIFIED.get(token, config.jwt_secret)
    if known is not None:
        return known
    claims = verify_jwt(token, config.jwt_secret)
    return VERIFIED.put(token, config.jwt_secret, claims)


class VerifiedTokens:
    """JWTs that passed `verify_jwt`, until their `exp`: a page polling ten times a second sends
    the same token each time, and verifying it costs about 35 us (PyJWT, HS256) against under 2
    for a lookup here. Keyed by SHA-256 of the secret and of the token, so that a lookup compares
    digests, never the token itself, and a token is only ever known under the secret that
    verified it. Failures are never kept: a bad token is judged afresh each time."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[float, Principal]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(token: str, secret: str) -> bytes:
        h = hashlib.sha256(secret.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
        h.update(token.encode("utf-8", "surrogatepass"))
        return h.digest()

    def get(self, token: str, secret: str) -> Principal | None:
        entry = self._entries.get(self._key(token, secret))
        if entry is None or entry[0] <= time.time():
            return None  # unknown, or expired since: verify_jwt says why
        return entry[1]

    def put(self, token: str, secret: str, claims: dict[str, Any]) -> Principal:
        who = Principal(claims=claims, claims_json=json.dumps(claims, sort_keys=True))
        now = time.time()
        with self._lock:
            if len(self._entries) >= self.max_entries:
                live = {k: e for k, e in self._entries.items() if e[0] > now}
                self._entries = live if len(live) < self.max_entries else {}
            self._entries[self._key(token, secret)] = (float(claims["exp"]), who)
        return who


VERIFIED = VerifiedTokens()


def verify_jwt(token: str, secret: str) -> dict[str, Any]:
    """The claims of a valid Supabase user JWT, else 401 saying what is wrong with it."""
    import jwt  # only the user path pays for PyJWT's import

    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=["HS256"],
            audience=JWT_AUDIENCE,
            options={"require": ["exp", "sub", "aud"]},
        )
    except jwt.ExpiredSignatureError:
        raise _unauthorized("the JWT has expired") from None
    except jwt.InvalidAudienceError:
        raise _unauthorized(f"the JWT's audience is not {JWT_AUDIENCE!r}") from None
    except jwt.MissingRequiredClaimError as exc:
        raise _unauthorized(f"the JWT lacks the {exc.claim!r} claim") from None
    except jwt.InvalidAlgorithmError:
        raise _unauthorized("the JWT must be signed with HS256") from None
    except jwt.InvalidSignatureError:
        raise _unauthorized("the JWT's signature is not valid") from None
    except jwt.InvalidTokenError:
        raise _unauthorized(
            "the bearer token is neither the admin secret nor a valid JWT"
        ) from None
    if not isinstance(claims.get("sub"), str) or not claims["sub"]:
        raise _unauthorized("the JWT's `sub` claim must be a non-empty string")
    # RFC 7519 NumericDates are JSON numbers; PyJWT converts strings with int() and lets them by.
    for name in ("exp", "nbf", "iat"):
        value = claims.get(name)
        if name in claims and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise _unauthorized(f"the JWT's `{name}` claim must be a number of seconds")
    return dict(claims)
