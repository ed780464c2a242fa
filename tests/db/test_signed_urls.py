"""Signed thumbnail URLs in job answers (THUMBQ_SIGNED_URL_TTL_S): they fetch the thumbnail with
no credentials until they expire, over real HTTP: S3's presigned GET against moto's server, and
thumbq's own signed path for local files, which refuses a tampered or expired link."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest

from tests.support.liveapp import live_app, put_samples
from worker.app.jobs import get
from worker.app.signing import thumbnail_signature
from worker.app.urls import UrlSigner
from worker.engine import db
from worker.engine.batch import run_batch
from worker.engine.config import Config
from worker.storage import open_storage
from worker.thumbnails.files import enqueue_keys
from worker.thumbnails.task import render_options

SECRET = "signed-urls-admin-secret-0123456789"
TTL_S = 120


def finish(config: Config, conn: db.Conn, group: str) -> list[int]:
    """Two files (a PDF and a JPEG) rendered; their job ids."""
    from worker.thumbnails.render.process import RenderPool

    storage = open_storage(config)
    enqueue_keys(conn, storage, config, put_samples(storage, f"{group}/", 2), group)
    with RenderPool(render_options(config), 2, config.render_memory_mb) as pool:
        while run_batch(config, conn, storage, pool).stopped_reason != "drained":
            pass
    rows = conn.execute(
        "select id from thumbq.jobs where group_id = %s and status = 'completed' order by id",
        [group],
    ).fetchall()
    assert len(rows) == 2
    return [r["id"] for r in rows]


def fetch(url: str, authorization: str | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url)
    if authorization:
        req.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def answer(url: str) -> dict[str, Any]:
    status, body, _ = fetch(url, f"Bearer {SECRET}")
    assert status == 200, body
    result: dict[str, Any] = json.loads(body)
    return result


def code_of(body: bytes) -> str:
    return str(json.loads(body)["error"]["code"])


@pytest.fixture
def local_config(config: Config) -> Config:
    return config.with_(
        cron_secret=SECRET, signed_url_ttl_s=TTL_S, thumb_sizes=(128, 256), thumb_size=256
    )


def test_job_answers_carry_urls_that_fetch_local_thumbnails_without_credentials(
    local_config: Config, conn: db.Conn
) -> None:
    job_id = finish(local_config, conn, "local")[0]
    storage = open_storage(local_config)
    with live_app(local_config) as server:
        for path in (f"/api/jobs/{job_id}", f"/api/thumbnails/jobs/{job_id}"):
            job = answer(server.url + path)
            url = job["thumbnail_url"]
            assert url.startswith(server.url + "/thumbnails/"), url
            assert set(job["thumbnail_urls"]) == {"128", "256"}
            status, data, headers = fetch(url)  # no Authorization header at all
            assert status == 200
            assert headers["Content-Type"] == "image/webp"
            row = conn.execute(
                "select thumbnail_key, thumbnails from thumbq.jobs where id = %s", [job_id]
            ).fetchone()
            assert row is not None
            assert data == storage.get(row["thumbnail_key"])[0]
            for size, sized_url in job["thumbnail_urls"].items():
                status, data, _ = fetch(sized_url)
                assert status == 200 and data == storage.get(row["thumbnails"][size])[0]
            expires = int(parse_qs(urlsplit(url).query)["expires"][0])
            assert abs(expires - (time.time() + TTL_S)) < 30


def test_a_tampered_or_expired_local_url_is_refused_with_403(
    local_config: Config, conn: db.Conn
) -> None:
    first, second = finish(local_config, conn, "tamper")
    with live_app(local_config) as server:
        url = answer(f"{server.url}/api/jobs/{first}")["thumbnail_url"]
        other = answer(f"{server.url}/api/jobs/{second}")["thumbnail_url"]
        parts = urlsplit(url)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}

        def with_query(path: str, **changes: Any) -> str:
            return f"{server.url}{path}?{urlencode({**query, **changes})}"

        sig = query["signature"]
        flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
        tampered = [
            with_query(parts.path, signature=flipped),
            with_query(parts.path, expires=int(query["expires"]) + 3600),
            with_query(urlsplit(other).path),  # another thumbnail, this one's signature
            with_query(parts.path, signature=""),
            f"{server.url}{parts.path}",
        ]
        for bad in tampered:
            status, body, _ = fetch(bad)
            assert status == 403 and code_of(body) == "signature_invalid", bad

        # A link signed a while ago, whose time is up.
        storage = open_storage(local_config)
        signer = UrlSigner.for_config(local_config, storage, server.url)
        assert signer is not None
        key = parts.path.lstrip("/")
        stale = signer.url(key, now=time.time() - TTL_S - 5)
        assert stale is not None
        status, body, _ = fetch(stale)
        assert status == 403 and code_of(body) == "url_expired"

        # Even with a genuine signature, nothing outside the storage root is served.
        root = Path(urlsplit(local_config.storage_url).path)
        (root.parent / "outside.webp").write_bytes(b"RIFF-not-a-thumbnail")
        escape = "thumbnails/../../outside.webp"
        expires = int(time.time()) + 60
        sig = thumbnail_signature(SECRET, escape, expires)
        raw = http.client.HTTPConnection(urlsplit(server.url).netloc, timeout=10)
        raw.request("GET", f"/{escape}?{urlencode({'expires': expires, 'signature': sig})}")
        response = raw.getresponse()
        body = response.read()
        raw.close()
        assert response.status == 400 and code_of(body) == "invalid_key", body


def test_without_a_ttl_job_answers_carry_no_urls_and_the_route_opens_nothing(
    config: Config, conn: db.Conn
) -> None:
    plain = config.with_(cron_secret=SECRET)
    job_id = finish(plain, conn, "plain")[0]
    with live_app(plain) as server:
        job = answer(f"{server.url}/api/jobs/{job_id}")
        assert "thumbnail_url" not in job and "thumbnail_urls" not in job
        key = conn.execute(
            "select thumbnail_key from thumbq.jobs where id = %s", [job_id]
        ).fetchone()
        assert key is not None
        status, body, _ = fetch(f"{server.url}/{key['thumbnail_key']}")
        assert status == 403 and code_of(body) == "signature_invalid"


def test_the_cli_view_of_a_job_carries_the_same_urls(local_config: Config, conn: db.Conn) -> None:
    """worker.app.jobs.get, what `thumbq jobs show` prints, given the signer the CLI makes."""
    job_id = finish(local_config, conn, "cli")[0]
    storage = open_storage(local_config)
    signer = UrlSigner.for_config(local_config, storage, local_config.api_url)
    job = get(conn, job_id, signer)
    assert job is not None
    assert job["thumbnail_url"].startswith(local_config.api_url + "/thumbnails/")
    assert set(job["thumbnail_urls"]) == {"128", "256"}
    pending = get(conn, job_id + 1000, signer)
    assert pending is None


def test_with_s3_job_answers_carry_presigned_urls_that_a_plain_get_fetches(
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
            "THUMBQ_SIGNED_URL_TTL_S": str(TTL_S),
        }
    )
    with db.connect(db_url) as conn:
        job_id = finish(config, conn, "s3")[0]
    with live_app(config) as server:
        job = answer(f"{server.url}/api/jobs/{job_id}")
    url = job["thumbnail_url"]
    assert url.startswith(endpoint) and "X-Amz-Signature=" in url
    assert parse_qs(urlsplit(url).query)["X-Amz-Expires"] == [str(TTL_S)]
    status, data, _ = fetch(url)  # no credentials but the URL
    assert status == 200 and data[8:12] == b"WEBP"
    for sized in job["thumbnail_urls"].values():
        status, data, _ = fetch(sized)
        assert status == 200 and data[8:12] == b"WEBP"
