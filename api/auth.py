"""Who is calling: the operator (the cron secret) or a Supabase user (a JWT).

Admin routes need `Authorization: Bearer <THUMBQ_CRON_SECRET>` (Vercel Cron sends
`Bearer $CRON_SECRET`, which Config reads as a fallback). Without a configured secret they refuse
with 503 `not_configured`: the server, not the caller, has to be fixed, and nothing is open.
Reading routes (progress, failures, the gallery) also take a page token made from that secret
(worker/app/signing.py: read-only, short-lived; the link `thumbq up` prints) and a Supabase user JWT
(`aud` "authenticated", `exp` and `sub` required): signed with the project's asymmetric keys
(ES256/RS256, published as JWKS at `$SUPABASE_URL/auth/v1/.well-known/jwks.json`, or
THUMBQ_JWKS_URL), or with the legacy shared secret THUMBQ_JWT_SECRET (HS256). RLS then decides
which groups the user sees.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flask import request

from api.errors import ApiError
from worker.app.signing import is_page_token, page_token_expired
from worker.engine.config import Config

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
    link): the operator's read access."""
    if not config.cron_secret:
        return False
    if is_page_token(token):
        return page_token_expired(token, config.cron_secret) is False
    return secret_matches(token, config.cron_secret)


def require_reader(auth: Authenticator) -> Principal:
    """Let the operator (admin secret or page token) or a user with a valid JWT through."""
    if not auth.cron_secret and not auth.takes_jwts:
        raise _nothing_reads()
    who = auth.reader(bearer_token())
    assert who is not None
    return who


def _nothing_reads() -> ApiError:
    return _not_configured(
        "neither THUMBQ_CRON_SECRET nor THUMBQ_JWT_SECRET (nor SUPABASE_URL or THUMBQ_JWKS_URL "
        "for the project's signing keys) is set, so progress is not readable"
    )


class Authenticator:
    """The one place that decides who a reader's bearer token is: the admin secret or a page
    token made from it, or a user JWT, HS256 with THUMBQ_JWT_SECRET or ES256/RS256 with a key of
    the project's JWKS.

    The progress route and the fast path before Flask (api/fastpath.py) both ask `reader`; the
    fast path with `cached_only`, so that it answers only tokens verified before and never
    waits for a key fetch."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.cron_secret = config.cron_secret
        self.jwt_secret = config.jwt_secret
        self.verified = VerifiedTokens()
        self.jwks = (
            JwksKeys(config.jwks_url, on_removed=self.verified.forget_keys)
            if config.jwks_url
            else None
        )

    @property
    def takes_jwts(self) -> bool:
        return bool(self.jwt_secret or self.jwks)

    def reader(self, token: str, *, cached_only: bool = False) -> Principal | None:
        """The operator or a user; with `cached_only`, None for a token not verified before
        (or expired since); otherwise 401/503 (ApiError) for a token that is neither."""
        if operator_may_read(token, self.config):
            return ADMIN
        if self.cron_secret and is_page_token(token):
            if cached_only:
                return None
            if page_token_expired(token, self.cron_secret):
                raise _unauthorized(
                    "this page link has expired: open the link a new `thumbq up` prints, or "
                    "enter the admin secret"
                )
            raise _unauthorized("the page token is not valid for this server's admin secret")
        if not self.takes_jwts:
            if cached_only:
                return None
            if not self.cron_secret:
                raise _nothing_reads()
            raise _unauthorized("the bearer token is not the admin secret")
        known = self.verified.get(token)
        if known is not None or cached_only:
            return known
        claims, kid = self.verify(token)
        return self.verified.put(token, claims, kid)

    def verify(self, token: str) -> tuple[dict[str, Any], str | None]:
        """The claims of a valid user JWT and the `kid` of the key that signed it (None for
        HS256), else 401 saying what is wrong with it."""
        import jwt  # only the user path pays for PyJWT's import

        try:
            header = jwt.get_unverified_header(token)
        except jwt.InvalidTokenError:
            raise _unauthorized(
                "the bearer token is neither the admin secret nor a valid JWT"
            ) from None
        alg = header.get("alg")
        kid = header.get("kid")
        # The algorithm is chosen by which key thumbq holds, never by the token: HS256 only
        # with the shared secret, ES256/RS256 only with a JWKS key of that type. An HS256
        # token "signed" with a public key, or alg none, never meets a key it could pass.
        key: Any
        if alg == "HS256" and self.jwt_secret:
            key, kid = self.jwt_secret, None
        elif alg in ASYMMETRIC_ALGS and self.jwks is not None:
            if not isinstance(kid, str) or not kid:
                raise _unauthorized("the JWT has no `kid` header naming its signing key")
            key = self.jwks.key(kid, alg)
        else:
            raise _unauthorized(f"the JWT must be signed with {' or '.join(self._algs())}")
        claims = _decode(token, key, alg)
        return claims, kid

    def _algs(self) -> list[str]:
        return (["HS256"] if self.jwt_secret else []) + (list(ASYMMETRIC_ALGS) if self.jwks else [])


ASYMMETRIC_ALGS = ("ES256", "RS256")
# What a JWKS key must be for each algorithm (RFC 7518): key type and, for EC, the curve.
_KEY_TYPES = {"ES256": ("EC", "P-256"), "RS256": ("RSA", None)}


def _decode(token: str, key: Any, alg: str) -> dict[str, Any]:
    import jwt

    try:
        claims = jwt.decode(
            token,
            key,
            algorithms=[alg],
            audience=JWT_AUDIENCE,
            options={"require": ["exp", "sub", "aud"]},
        )
    except jwt.ExpiredSignatureError:
        raise _unauthorized("the JWT has expired") from None
    except jwt.InvalidAudienceError:
        raise _unauthorized(f"the JWT's audience is not {JWT_AUDIENCE!r}") from None
    except jwt.MissingRequiredClaimError as exc:
        raise _unauthorized(f"the JWT lacks the {exc.claim!r} claim") from None
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


class VerifiedTokens:
    """JWTs that passed verification, until their `exp`: a page polling ten times a second
    sends the same token each time, and verifying it costs about 35 us (HS256) or more (ES256,
    RS256) against under 2 for a lookup here. Keyed by SHA-256 of the token, so a lookup
    compares digests, never the token itself; each app has its own, so a token is only known
    to the verifier that checked it. Failures are never kept: a bad token is judged afresh
    each time. A token signed by a key the JWKS no longer lists is forgotten with the key."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[float, Principal, str | None]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(token: str) -> bytes:
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()

    def get(self, token: str) -> Principal | None:
        entry = self._entries.get(self._key(token))
        if entry is None or entry[0] <= time.time():
            return None  # unknown, or expired since: verification says why
        return entry[1]

    def put(self, token: str, claims: dict[str, Any], kid: str | None = None) -> Principal:
        who = Principal(claims=claims, claims_json=json.dumps(claims, sort_keys=True))
        now = time.time()
        with self._lock:
            if len(self._entries) >= self.max_entries:
                live = {k: e for k, e in self._entries.items() if e[0] > now}
                self._entries = live if len(live) < self.max_entries else {}
            self._entries[self._key(token)] = (float(claims["exp"]), who, kid)
        return who

    def forget_keys(self, kids: set[str]) -> None:
        """Drop tokens signed by keys that are gone (rotated out and revoked)."""
        if not kids:
            return
        with self._lock:
            self._entries = {k: e for k, e in self._entries.items() if e[2] not in kids}


class JwksKeys:
    """The signing keys of a Supabase project (`/auth/v1/.well-known/jwks.json`), by `kid`.

    Fetched on first use and kept; fetched again when a token names a `kid` not held (a new key
    after a rotation) and after `max_age_s` (a revoked key drops out), but never more often
    than once per `min_interval_s`, so that tokens with made-up kids cannot turn thumbq into a
    flood of requests to Auth. While a fetch fails, the keys held are used."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        min_interval_s: float = 10.0,
        max_age_s: float = 600.0,
        on_removed: Callable[[set[str]], None] | None = None,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self.max_age_s = max_age_s
        self.on_removed = on_removed
        self.fetches = 0
        self._keys: dict[str, Any] = {}
        self._fetched_at: float | None = None  # last successful fetch
        self._tried_at: float | None = None  # last attempt
        self._lock = threading.Lock()

    def key(self, kid: str, alg: str) -> Any:
        """The verification key for `kid`, checked to suit `alg`; 401 when the project has no
        such key, 503 when its JWKS cannot be read and no key is held."""
        now = time.monotonic()
        stale = self._fetched_at is None or now - self._fetched_at > self.max_age_s
        if kid not in self._keys or stale:
            self._refresh(now, must=self._fetched_at is None)
        held = self._keys.get(kid)
        if held is None:
            raise _unauthorized(f"the JWT's signing key {kid!r} is not in the project's JWKS")
        data, key = held
        kty, crv = _KEY_TYPES[alg]
        if data.get("kty") != kty or (crv and data.get("crv") != crv):
            raise _unauthorized(f"the JWT's signing key {kid!r} is not a key for {alg}")
        if data.get("alg", alg) != alg:
            raise _unauthorized(f"the JWT's signing key {kid!r} is for {data['alg']}, not {alg}")
        return key

    def _refresh(self, now: float, *, must: bool) -> None:
        with self._lock:
            if self._tried_at is not None and now - self._tried_at < self.min_interval_s:
                if must and not self._keys:
                    raise _jwks_unavailable(self.url, "fetched moments ago without success")
                return  # another request fetched (or failed to) moments ago
            self._tried_at = now
            try:
                keys = self._fetch()
            except (OSError, ValueError) as exc:
                if self._keys:
                    return  # keep the keys held; try again after min_interval_s
                raise _jwks_unavailable(self.url, str(exc)) from None
            removed = set(self._keys) - set(keys)
            self._keys = keys
            self._fetched_at = time.monotonic()
        if removed and self.on_removed is not None:
            self.on_removed(removed)

    def _fetch(self) -> dict[str, Any]:
        import urllib.request

        import jwt

        self.fetches += 1
        # http(s) only: Config refuses other schemes for THUMBQ_JWKS_URL and SUPABASE_URL.
        req = urllib.request.Request(self.url, headers={"Accept": "application/json"})  # noqa: S310
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:  # noqa: S310
            body = json.loads(resp.read(1_000_000))
        keys: dict[str, Any] = {}
        for data in body.get("keys", []) if isinstance(body, dict) else []:
            kid = data.get("kid") if isinstance(data, dict) else None
            # Signing keys only: "use" absent or "sig"; symmetric keys never come from here.
            if not isinstance(kid, str) or data.get("use", "sig") != "sig":
                continue
            if data.get("kty") not in ("EC", "RSA"):
                continue
            try:
                keys[kid] = (data, jwt.PyJWK(data).key)
            except jwt.PyJWKError:
                continue  # an algorithm or curve PyJWT does not know: not usable for thumbq
        if not keys:
            raise ValueError("it lists no EC or RSA signing key")
        return keys


def _jwks_unavailable(url: str, why: str) -> ApiError:
    return ApiError(
        503,
        "jwks_unavailable",
        f"cannot read the project's signing keys from {url} ({why}); try again shortly",
        {"Retry-After": "10"},
    )
