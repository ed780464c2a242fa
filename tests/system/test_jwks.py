"""Supabase user tokens signed with the project's asymmetric keys (ES256/RS256, published as
JWKS), verified against a real JWKS HTTP server on loopback whose keys the tests rotate.

Today's Supabase projects sign access tokens this way; before, thumbq knew only the legacy HS256
secret and every signed-in user got 401. The keys come from `$SUPABASE_URL/auth/v1/.well-known/
jwks.json` (THUMBQ_JWKS_URL overrides), are cached, and a token naming a `kid` not held fetches
them again (at most once per interval). A token that picks its own algorithm gets nothing.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from flask import Flask
from flask.testing import FlaskClient

from api import create_app
from tests.support.httpstub import Answer, HttpStub, Request
from tests.support.liveapp import call, live_app
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue

JWKS_PATH = "/auth/v1/.well-known/jwks.json"
URL = "/api/thumbnails/progress?group_id=alices-group"


class SigningKey:
    """A private key of the project and its public JWK."""

    def __init__(self, kid: str, alg: str) -> None:
        self.kid, self.alg = kid, alg
        if alg == "ES256":
            self.private: Any = ec.generate_private_key(ec.SECP256R1())
            self.jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(self.private.public_key()))
        else:
            self.private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
            self.jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.private.public_key()))
        self.jwk |= {"kid": kid, "alg": alg, "use": "sig", "key_ops": ["verify"]}

    def public_pem(self) -> bytes:
        return bytes(
            self.private.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )

    def token(self, sub: str = "alice", **overrides: Any) -> str:
        claims: dict[str, Any] = {
            "sub": sub,
            "aud": "authenticated",
            "role": "authenticated",
            "exp": int(time.time()) + 600,
            "iss": "http://127.0.0.1/auth/v1",
        } | overrides
        return jwt.encode(claims, self.private, algorithm=self.alg, headers={"kid": self.kid})


class JwksServer:
    """Serves `keys` as the project's JWKS over HTTP (503 while `down`), counting the fetches."""

    def __init__(self) -> None:
        self.keys: list[SigningKey] = []
        self.down = False
        self.http = HttpStub(self._answer)
        self.url = self.http.url

    def _answer(self, req: Request) -> Answer:
        if req.path != JWKS_PATH:
            return 404, {}, b""
        if self.down:
            return 503, {}, b""
        body = json.dumps({"keys": [k.jwk for k in self.keys]}).encode()
        return 200, {"Content-Type": "application/json"}, body

    @property
    def fetches(self) -> int:
        return sum(1 for r in self.http.requests if r.path == JWKS_PATH)

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def jwks() -> Iterator[JwksServer]:
    server = JwksServer()
    server.keys = [SigningKey("key-es", "ES256"), SigningKey("key-rs", "RS256")]
    yield server
    server.close()


@pytest.fixture
def alices_group(conn: db.Conn) -> None:
    Queue(conn).enqueue_files(
        [{"source_key": f"a/{i}.pdf", "etag": "e"} for i in range(2)], "alices-group"
    )
    conn.execute("insert into thumbq.group_members values ('alices-group', 'alice')")


def _config(config: Config, jwks: JwksServer, **changes: Any) -> Config:
    # SUPABASE_URL alone: the JWKS location is derived from it, as on a real project.
    env = {
        "THUMBQ_HOME": str(config.home),
        "DATABASE_URL": str(config.database_url),
        "THUMBQ_STORAGE_URL": config.storage_url,
        "THUMBQ_CRON_SECRET": "admin-secret-for-jwks-tests",
        "SUPABASE_URL": jwks.url + "/",
        "THUMBQ_PROGRESS_CACHE_MS": "0",
    }
    cfg = Config.from_env(env).with_(**changes)
    assert cfg.jwks_url == jwks.url + JWKS_PATH
    return cfg


def _app(config: Config, jwks: JwksServer, **changes: Any) -> Flask:
    return create_app(_config(config, jwks, **changes), db_timeout_s=2.0)


@pytest.fixture
def client(config: Config, jwks: JwksServer, alices_group: None) -> Iterator[FlaskClient]:
    app = _app(config, jwks)
    yield app.test_client()
    app.extensions["thumbq"].close()


def _get(client: FlaskClient, token: str) -> tuple[int, Any]:
    resp = client.get(URL, headers={"Authorization": f"Bearer {token}"})
    return resp.status_code, resp.get_json()


def _auth(client: FlaskClient) -> Any:
    return client.application.extensions["thumbq"].auth


# -- verified ---------------------------------------------------------------------------------


def test_es256_and_rs256_tokens_of_the_project_read_progress_through_rls(
    client: FlaskClient, jwks: JwksServer
) -> None:
    es, rs = jwks.keys
    for key in (es, rs):
        status, body = _get(client, key.token("alice"))
        assert (status, body["total"]) == (200, 2), key.alg
        # Bob's token is just as valid, but RLS shows him nothing of Alice's group.
        status, body = _get(client, key.token("bob"))
        assert (status, body["error"]["code"]) == (404, "group_not_found"), key.alg
    for _ in range(20):
        assert _get(client, es.token("alice"))[0] == 200  # new tokens, same key
    assert jwks.fetches == 1, "the keys are fetched once and kept"


def test_a_token_with_a_new_kid_fetches_the_rotated_keys(
    client: FlaskClient, jwks: JwksServer
) -> None:
    old = jwks.keys[0]
    assert _get(client, old.token())[0] == 200
    # Rotation: the project publishes a new key and signs with it.
    new = SigningKey("key-es-2", "ES256")
    jwks.keys = [old, new]
    _auth(client).jwks.min_interval_s = 0.0
    assert _get(client, new.token())[0] == 200
    assert jwks.fetches == 2
    assert _get(client, old.token())[0] == 200  # the previous key still verifies its tokens


def test_a_key_removed_from_the_jwks_stops_verifying_even_tokens_seen_before(
    client: FlaskClient, jwks: JwksServer
) -> None:
    old, _ = jwks.keys
    seen = old.token()
    assert _get(client, seen)[0] == 200
    new = SigningKey("key-es-2", "ES256")
    jwks.keys = [new]  # old revoked
    keys = _auth(client).jwks
    keys.min_interval_s, keys.max_age_s = 0.0, 0.0  # the periodic refresh is due
    assert _get(client, new.token())[0] == 200
    status, body = _get(client, seen)
    assert status == 401 and "'key-es' is not in the project's JWKS" in body["error"]["message"]


def test_made_up_kids_cannot_flood_the_jwks_endpoint(client: FlaskClient, jwks: JwksServer) -> None:
    es = jwks.keys[0]
    assert _get(client, es.token())[0] == 200
    for i in range(50):
        forged = jwt.encode(
            {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60},
            es.private,
            algorithm="ES256",
            headers={"kid": f"made-up-{i}"},
        )
        status, body = _get(client, forged)
        assert status == 401 and "is not in the project's JWKS" in body["error"]["message"]
    # One fetch for the first unknown kid, then none within the interval (default 10 s).
    assert jwks.fetches <= 2, jwks.fetches


def test_hs256_with_the_legacy_secret_still_works_beside_the_jwks(
    config: Config, jwks: JwksServer, alices_group: None
) -> None:
    secret = "legacy-jwt-secret-" + "y" * 40
    app = _app(config, jwks, jwt_secret=secret)
    client = app.test_client()
    try:
        legacy = jwt.encode(
            {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60}, secret
        )
        assert _get(client, legacy)[0] == 200
        assert _get(client, jwks.keys[1].token())[0] == 200
    finally:
        app.extensions["thumbq"].close()


# -- refused ----------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _hs256_signed_with(key: bytes, kid: str) -> str:
    """The classic confusion attack: an HS256 token whose HMAC key is the server's public key
    (PEM), which an attacker can download; PyJWT will not make one, so it is made by hand."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": kid}).encode())
    claims = {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60}
    payload = _b64(json.dumps(claims).encode())
    sig = hmac.new(key, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    return f"{header}.{payload}.{_b64(sig)}"


def test_algorithm_confusion_and_foreign_keys_are_refused(
    config: Config, jwks: JwksServer, alices_group: None
) -> None:
    es, rs = jwks.keys
    stranger = SigningKey("key-rs", "RS256")  # the project's kid, someone else's key
    none = f"{_b64(json.dumps({'alg': 'none', 'kid': 'key-es'}).encode())}." + _b64(
        json.dumps({"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60}).encode()
    )
    es_header_on_rsa_key = jwt.encode(
        {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60},
        stranger.private,
        algorithm="RS256",
        headers={"kid": "key-es"},
    )
    bad = {
        "hs256 with the es256 public key": _hs256_signed_with(es.public_pem(), "key-es"),
        "hs256 with the rs256 public key": _hs256_signed_with(rs.public_pem(), "key-rs"),
        "hs256 with the jwk json": _hs256_signed_with(json.dumps(rs.jwk).encode(), "key-rs"),
        "alg none": none + ".",
        "rs256 by a stranger under the project's kid": stranger.token(),
        "rs256 under the es256 key's kid": es_header_on_rsa_key,
        "es256 without kid": jwt.encode(
            {"sub": "alice", "aud": "authenticated", "exp": int(time.time()) + 60},
            es.private,
            algorithm="ES256",
        ),
        "expired": es.token(exp=int(time.time()) - 5),
        "wrong audience": rs.token(aud="anon"),
    }
    # With and without the legacy HS256 secret: neither lets a public key act as a secret.
    for secret in (None, "legacy-jwt-secret-" + "z" * 40):
        app = _app(config, jwks, jwt_secret=secret)
        client = app.test_client()
        try:
            messages = {}
            for name, token in bad.items():
                status, body = _get(client, token)
                assert status == 401, (name, secret, body)
                messages[name] = body["error"]["message"]
            assert _get(client, es.token())[0] == 200
        finally:
            app.extensions["thumbq"].close()
        assert "must be signed with" in messages["alg none"]
        assert "'key-es' is not a key for RS256" in messages["rs256 under the es256 key's kid"]
        assert "signature is not valid" in messages["rs256 by a stranger under the project's kid"]
        assert "no `kid`" in messages["es256 without kid"]
        assert "expired" in messages["expired"]
        if secret is None:
            assert (
                "must be signed with ES256 or RS256" in messages["hs256 with the es256 public key"]
            )
        else:
            assert "signature is not valid" in messages["hs256 with the es256 public key"]


def test_an_es256_header_on_the_rsa_keys_kid_is_refused_before_any_signature_check(
    client: FlaskClient, jwks: JwksServer
) -> None:
    stranger = SigningKey("key-rs", "ES256")  # claims ES256 under the project's RSA key
    status, body = _get(client, stranger.token())
    assert status == 401 and "'key-rs' is not a key for ES256" in body["error"]["message"]


def test_without_keys_an_unreachable_jwks_is_a_503_and_held_keys_outlive_an_outage(
    config: Config, jwks: JwksServer, alices_group: None
) -> None:
    es = jwks.keys[0]
    jwks.down = True
    app = _app(config, jwks)
    client = app.test_client()
    try:
        resp = client.get(URL, headers={"Authorization": f"Bearer {es.token()}"})
        assert resp.status_code == 503 and resp.get_json()["error"]["code"] == "jwks_unavailable"
        assert resp.headers["Retry-After"]
        jwks.down = False
        _auth(client).jwks.min_interval_s = 0.0
        assert _get(client, es.token())[0] == 200
        # Auth goes down; the periodic refresh fails; the keys held keep verifying.
        jwks.down = True
        _auth(client).jwks.max_age_s = 0.0
        assert _get(client, es.token())[0] == 200
    finally:
        app.extensions["thumbq"].close()


# -- the fast path shares the verifier --------------------------------------------------------


def test_a_jwks_verified_users_polls_are_answered_before_flask_over_http(
    config: Config, jwks: JwksServer, alices_group: None
) -> None:
    cfg = _config(config, jwks, progress_cache_ms=60_000)
    token = jwks.keys[0].token()
    with live_app(cfg) as server:
        app = server.app
        reached_flask: list[int] = []
        app.before_request(lambda: reached_flask.append(1))
        for _ in range(5):
            status, body, _ = call("GET", server.url + URL, token)
            assert status == 200 and body is not None and body["total"] == 2
        # Verified and read once by the route; the other polls came from memory.
        assert len(reached_flask) == 1
        # A forged token is never answered from memory, even for a cached group.
        forged = SigningKey("key-es", "ES256").token()
        assert call("GET", server.url + URL, forged)[0] == 401
        assert len(reached_flask) == 2


def test_the_jwks_location_comes_from_supabase_url_or_thumbq_jwks_url(tmp_path: Any) -> None:
    from worker.engine.config import ConfigError

    home = {"THUMBQ_HOME": str(tmp_path)}
    derived = Config.from_env(home | {"SUPABASE_URL": "https://ref.supabase.co/"})
    assert derived.jwks_url == "https://ref.supabase.co/auth/v1/.well-known/jwks.json"
    override = Config.from_env(
        home | {"SUPABASE_URL": "https://ref.supabase.co", "THUMBQ_JWKS_URL": "https://a/k.json"}
    )
    assert override.jwks_url == "https://a/k.json"
    assert Config.from_env(home).jwks_url is None  # HS256 only, as before
    with pytest.raises(ConfigError, match="THUMBQ_JWKS_URL must be an http"):
        Config.from_env(home | {"THUMBQ_JWKS_URL": "file:///etc/keys.json"})
