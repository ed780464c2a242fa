"""The gallery of finished thumbnails and the read-only page token (issue 10, point 12).

The gallery answers with URLs an <img> can load without credentials: S3 presigns them, local
files get URLs of /api/thumbnails/image signed by the API. That route must never serve anything
outside the storage root or outside thumbnails/, whatever it is given. The page token that
`thumbq up` puts in its link reads, and does nothing else.
"""

from __future__ import annotations

import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import jwt
import pytest
from flask import Flask
from flask.testing import FlaskClient

from api import create_app
from tests.support.liveapp import put_samples
from worker.app.signing import page_token, thumbnail_signature
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.task import render_options

SECRET = "gallery-admin-secret-0123456789"
JWT_SECRET = "gallery-jwt-secret-" + "x" * 40
ADMIN = {"Authorization": f"Bearer {SECRET}"}


def _finish(config: Config, conn: db.Conn, group: str, good: int, broken: int = 0) -> None:
    from worker.thumbnails.render.process import RenderPool

    storage = open_storage(config)
    enqueue_keys(conn, storage, config, put_samples(storage, f"{group}/", good, broken), group)
    with RenderPool(render_options(config), 2, config.render_memory_mb) as pool:
        while run_batch(config, conn, storage, pool).stopped_reason != "drained":
            pass


@pytest.fixture
def gallery_config(config: Config) -> Config:
    return config.with_(cron_secret=SECRET, jwt_secret=JWT_SECRET, progress_cache_ms=0)


@pytest.fixture
def app(gallery_config: Config) -> Iterator[Flask]:
    app = create_app(gallery_config)
    yield app
    app.extensions["thumbq"].close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


def _user(sub: str) -> dict[str, str]:
    claims = {"sub": sub, "aud": "authenticated", "exp": time.time() + 300}
    return {"Authorization": "Bearer " + jwt.encode(claims, JWT_SECRET, "HS256")}


def _get_image(client: FlaskClient, url: str) -> Any:
    parts = urlsplit(url)
    assert parts.path == "/api/thumbnails/image" and not parts.netloc
    return client.get(url)


def test_the_gallery_pages_through_finished_thumbnails_with_urls_an_img_can_load(
    client: FlaskClient, gallery_config: Config, conn: db.Conn
) -> None:
    _finish(gallery_config, conn, "deck", good=7, broken=2)
    r = client.get("/api/thumbnails/gallery?group_id=deck&limit=5", headers=ADMIN)
    assert r.status_code == 200, r.get_json()
    first = r.get_json()
    assert len(first["thumbnails"]) == 5 and first["next_before"] is not None
    r = client.get(
        f"/api/thumbnails/gallery?group_id=deck&limit=5&before={first['next_before']}",
        headers=ADMIN,
    )
    second = r.get_json()
    assert len(second["thumbnails"]) == 2 and second["next_before"] is None
    items = first["thumbnails"] + second["thumbnails"]
    ids = [i["job_id"] for i in items]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 7  # the 7 finished, no broken
    for item in items:
        assert item["width"] and item["height"] and item["content_type"] == "image/webp"
        image = _get_image(client, item["url"])  # no Authorization header, as an <img>
        assert image.status_code == 200 and image.mimetype == "image/webp"
        assert image.data[:4] == b"RIFF" and image.data[8:12] == b"WEBP"
        assert "private" in image.headers["Cache-Control"]
        assert image.headers["X-Content-Type-Options"] == "nosniff"
    # Refreshing hands out the same URLs (expiry on a grid), so the browser's cache keeps them.
    again = client.get("/api/thumbnails/gallery?group_id=deck&limit=5", headers=ADMIN)
    assert [i["url"] for i in again.get_json()["thumbnails"]] == [
        i["url"] for i in first["thumbnails"]
    ]


def test_the_image_route_serves_only_signed_thumbnails_inside_the_storage_root(
    client: FlaskClient, gallery_config: Config, conn: db.Conn, tmp_path: Path
) -> None:
    _finish(gallery_config, conn, "deck", good=1)
    [item] = client.get("/api/thumbnails/gallery?group_id=deck", headers=ADMIN).get_json()[
        "thumbnails"
    ]
    query = {k: v[0] for k, v in parse_qs(urlsplit(item["url"]).query).items()}
    good_key, expires = query["key"], int(query["expires"])

    def signed(key: str, exp: int = expires, secret: str = SECRET) -> str:
        sig = thumbnail_signature(secret, key, exp)
        return "/api/thumbnails/image?" + urlencode({"key": key, "expires": exp, "sig": sig})

    assert client.get(signed(good_key)).status_code == 200
    # Wrong, expired or missing signatures, and one made with another secret.
    assert client.get(signed(good_key, secret="another-secret")).status_code == 403
    assert client.get(signed(good_key, exp=int(time.time()) - 1)).status_code == 403
    assert client.get(f"/api/thumbnails/image?key={good_key}&expires={expires}").status_code == 403
    tampered = signed(good_key).replace("deck", "deck2", 1)
    assert client.get(tampered).status_code == 403

    # Even correctly signed, nothing outside thumbnails/ or outside the root is served.
    storage_root = Path(gallery_config.storage_url.removeprefix("file://"))
    outside = tmp_path / "outside-secret.webp"
    outside.write_bytes(b"RIFF-not-for-you")
    (storage_root / "thumbnails" / "deck").mkdir(parents=True, exist_ok=True)
    os.symlink(outside, storage_root / "thumbnails" / "deck" / "link.webp")
    (storage_root / "deck" / "plain.webp").write_bytes(b"a source, not a thumbnail")
    for key in (
        "thumbnails/../../outside-secret.webp",
        "thumbnails/deck/../../../outside-secret.webp",
        "/etc/passwd.webp",
        "thumbnails//etc/passwd.webp",
        "thumbnails/deck/link.webp",  # a symlink out of the root
        "deck/plain.webp",  # not a thumbnail
        "thumbnails/deck/notes.txt",  # not an image
    ):
        r = client.get(signed(key))
        assert r.status_code in (400, 403, 404), (key, r.status_code)
        assert b"not-for-you" not in r.data and b"a source" not in r.data
        assert set(r.get_json()["error"]) == {"code", "message"}


def test_a_page_token_reads_but_never_acts_and_expires(
    client: FlaskClient, gallery_config: Config, conn: db.Conn
) -> None:
    _finish(gallery_config, conn, "deck", good=2)
    token = {"Authorization": "Bearer " + page_token(SECRET, ttl_s=60)}
    for path in (
        "/api/thumbnails/progress?group_id=deck",
        "/api/thumbnails/failures?group_id=deck",
        "/api/thumbnails/gallery?group_id=deck",
    ):
        assert client.get(path, headers=token).status_code == 200, path
    # Twice: the second poll is answered from memory, before Flask, by the same rule.
    assert client.get("/api/thumbnails/progress?group_id=deck", headers=token).status_code == 200
    for method, path, body in (
        ("post", "/api/thumbnails/retry-failed", {"group_id": "deck"}),
        ("post", "/api/thumbnails/cancel", {"group_id": "deck"}),
        ("post", "/api/thumbnails/enqueue", {"items": [{"source_key": "x.jpg"}]}),
        ("post", "/api/thumbnails/batch-generate", {}),
        ("get", "/api/queues", None),
    ):
        r = getattr(client, method)(path, headers=token, json=body)
        assert r.status_code == 401, (path, r.get_json())
    expired = {"Authorization": "Bearer " + page_token(SECRET, ttl_s=-1)}
    r = client.get("/api/thumbnails/progress?group_id=deck", headers=expired)
    assert r.status_code == 401 and "expired" in r.get_json()["error"]["message"]
    forged = {"Authorization": "Bearer " + page_token("not-the-secret", ttl_s=60)}
    assert client.get("/api/thumbnails/progress?group_id=deck", headers=forged).status_code == 401


def test_a_user_sees_the_gallery_of_their_groups_only(
    client: FlaskClient, gallery_config: Config, conn: db.Conn
) -> None:
    _finish(gallery_config, conn, "alices", good=2)
    conn.execute("insert into thumbq.group_members values ('alices', 'alice')")
    mine = client.get("/api/thumbnails/gallery?group_id=alices", headers=_user("alice"))
    assert mine.status_code == 200 and len(mine.get_json()["thumbnails"]) == 2
    theirs = client.get("/api/thumbnails/gallery?group_id=alices", headers=_user("bob"))
    assert theirs.status_code == 404
    for query, status in (("group_id=alices&limit=0", 400), ("group_id=alices&before=x", 400)):
        r = client.get(f"/api/thumbnails/gallery?{query}", headers=ADMIN)
        assert r.status_code == status, query


def test_with_s3_the_gallery_hands_out_presigned_urls_and_the_page_allows_their_origin(
    tmp_path: Path, db_url: str, s3_storage_url: tuple[str, str]
) -> None:
    storage_url, endpoint = s3_storage_url
    config = Config.from_env(
        {
            "THUMBQ_HOME": str(tmp_path / "home"),
            "DATABASE_URL": db_url,
            "THUMBQ_STORAGE_URL": storage_url,
            "THUMBQ_S3_ENDPOINT_URL": endpoint,
            "THUMBQ_CONCURRENCY": "2",
            "THUMBQ_CRON_SECRET": SECRET,
        }
    )
    with db.connect(db_url) as conn:
        _finish(config, conn, "s3deck", good=2)
    app = create_app(config)
    try:
        client = app.test_client()
        body = client.get("/api/thumbnails/gallery?group_id=s3deck", headers=ADMIN).get_json()
        assert len(body["thumbnails"]) == 2
        for item in body["thumbnails"]:
            url = item["url"]
            assert url.startswith(endpoint) and "X-Amz-Signature=" in url
            with urllib.request.urlopen(url, timeout=10) as resp:  # no credentials but the URL
                data = resp.read()
            assert data[8:12] == b"WEBP"
        csp = client.get("/progress?group_id=s3deck").headers["Content-Security-Policy"]
        img_src = next(d for d in csp.split("; ") if d.startswith("img-src"))
        assert endpoint in img_src.split()
    finally:
        app.extensions["thumbq"].close()
