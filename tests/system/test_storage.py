"""Storage backends as a user sees them: a local folder, and S3 over real HTTP (moto's server)."""

from __future__ import annotations

import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_file_storage import keys
from worker.engine.config import Config
from worker.engine.errors import SOURCE_MISSING, STORAGE_ERROR, TOO_LARGE, InvalidKey, ThumbqError
from worker.storage import NotFound, Storage, StorageError, open_storage
from worker.storage.file import FileStorage
from worker.storage.s3 import S3Storage

UNSAFE_KEYS = [
    "",
    "../escape.txt",
    "a/../../escape.txt",
    "a/./b.txt",
    "..",
    "/etc/passwd",
    "C:/Windows/win.ini",
    "a\\b.txt",
    "..\\escape.txt",
    "a\x00b.txt",
    "a\nb.txt",
]


@pytest.fixture(params=["file", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    """Each backend in turn, empty."""
    if request.param == "file":
        return FileStorage(tmp_path / "storage")
    url, endpoint = request.getfixturevalue("s3_storage_url")
    return S3Storage.from_url(url, endpoint_url=endpoint)


@pytest.fixture
def s3(s3_storage_url: tuple[str, str]) -> S3Storage:
    """An S3 storage on a fresh bucket."""
    url, endpoint = s3_storage_url
    return S3Storage.from_url(url, endpoint_url=endpoint)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dummy credentials, so that a test about the network does not fail on signing first."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/thumbq-tests/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/thumbq-tests/aws-credentials")


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def on_event(s3: S3Storage, event: str) -> list[dict[str, Any]]:
    """Record what botocore hands to `event` handlers (observation only, nothing replaced)."""
    seen: list[dict[str, Any]] = []
    s3.client.meta.events.register(event, lambda **kwargs: seen.append(kwargs))
    return seen


# -- both backends ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "content_type"),
    [
        ("thumbnails/decks/q3 review.pdf/9b2f-512.webp", "image/webp"),
        ("thumbnails/photos/été.heic/77aa-512.jpg", "image/jpeg"),
    ],
)
def test_put_then_get_and_head_return_the_bytes_and_content_type(
    storage: Storage, key: str, content_type: str
) -> None:
    data = os.urandom(3000)
    written = storage.put(key, data, content_type)

    got, info = storage.get(key)
    assert got == data
    assert info.content_type == content_type
    assert storage.head(key) == info == written
    assert info.size == len(data)
    assert storage.exists(key)


def test_etag_is_stable_until_the_content_changes(storage: Storage) -> None:
    key = "slides/deck.pdf"
    first = storage.put(key, b"a" * 100, "application/pdf").etag
    assert storage.head(key).etag == first
    assert storage.head(key).etag == first

    # Same size, written straight after: only the content differs.
    second = storage.put(key, b"b" * 100, "application/pdf").etag
    assert second != first
    assert storage.head(key).etag == second
    assert storage.get(key)[1].etag == second
    # The etag goes into thumbnail keys, so it must be usable in one.
    assert '"' not in second
    assert storage.put(f"thumbnails/{key}/{second}-512.webp", b"x", "image/webp")


def test_missing_key_is_not_found_with_code_source_missing(storage: Storage) -> None:
    for call in (storage.head, storage.get):
        with pytest.raises(NotFound) as caught:
            call("no/such/file.pdf")
        assert caught.value.code == SOURCE_MISSING
        assert caught.value.permanent
    assert not storage.exists("no/such/file.pdf")


def test_get_over_max_bytes_is_too_large(storage: Storage) -> None:
    storage.put("big.png", b"x" * 10_000, "image/png")
    with pytest.raises(ThumbqError) as caught:
        storage.get("big.png", max_bytes=9_999)
    assert caught.value.code == TOO_LARGE
    assert caught.value.permanent
    assert storage.get("big.png", max_bytes=10_000)[0] == b"x" * 10_000


def test_list_returns_keys_under_a_prefix_in_s3_key_order(storage: Storage) -> None:
    written = ["a/b.pdf", "a-c.pdf", "a/c/d.png", "b.jpg", "ab.pdf", "a/c/e.png"]
    for key in random.sample(written, len(written)):
        storage.put(key, key.encode(), "application/octet-stream")

    # '-' sorts before '/', so a walk that sorts each folder on its own would get this wrong.
    assert keys(storage) == ["a-c.pdf", "a/b.pdf", "a/c/d.png", "a/c/e.png", "ab.pdf", "b.jpg"]
    assert keys(storage, "a/") == ["a/b.pdf", "a/c/d.png", "a/c/e.png"]
    assert keys(storage, "a") == ["a-c.pdf", "a/b.pdf", "a/c/d.png", "a/c/e.png", "ab.pdf"]
    assert keys(storage, "a/c") == ["a/c/d.png", "a/c/e.png"]
    assert keys(storage, "zzz/") == []
    for info in storage.list():
        head = storage.head(info.key)
        assert (info.etag, info.size) == (head.etag, head.size)


def test_unsafe_keys_are_refused_by_every_method(storage: Storage) -> None:
    calls: list[Callable[[str], object]] = [
        storage.head,
        storage.get,
        storage.exists,
        lambda key: storage.put(key, b"x", "text/plain"),
    ]
    for key in UNSAFE_KEYS:
        for call in calls:
            with pytest.raises(InvalidKey):
                call(key)
        if key:  # an empty prefix means "everything"
            with pytest.raises(InvalidKey):
                storage.list(key)
    assert keys(storage) == []


# -- file storage -------------------------------------------------------------------------------


# -- S3 -----------------------------------------------------------------------------------------


def test_s3_get_over_max_bytes_does_not_download_the_body(s3: S3Storage) -> None:
    s3.put("big.pdf", os.urandom(2 * 1024 * 1024), "application/pdf")
    responses = on_event(s3, "after-call.s3.GetObject")

    with pytest.raises(ThumbqError) as caught:
        s3.get("big.pdf", max_bytes=1024)
    assert caught.value.code == TOO_LARGE
    assert len(responses) == 1
    assert responses[0]["parsed"]["Body"].tell() == 0


def test_s3_list_pages_through_more_than_1000_objects(s3: S3Storage) -> None:
    from moto.backends import get_backend
    from moto.core import DEFAULT_ACCOUNT_ID

    expected = [f"many/{i:05d}.txt" for i in range(1100)]
    # 1,100 PUTs through moto's server take about 10 s, so most objects go straight into the
    # server's store; the listing under test still goes over HTTP. A few real PUTs, from several
    # threads sharing the one client as the batch's workers do, prove the two agree.
    backend = get_backend("s3")[DEFAULT_ACCOUNT_ID]["aws"]
    for key in expected[16:]:
        backend.put_object(s3.bucket, key, b"x")
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda key: s3.put(key, b"x", "text/plain"), expected[:16]))
    s3.put("other/outside.txt", b"x", "text/plain")
    requests = on_event(s3, "after-call.s3.ListObjectsV2")

    assert keys(s3, "many/") == expected
    assert len(requests) == 2


def test_s3_prefix_is_added_on_write_and_removed_on_list(s3_storage_url: tuple[str, str]) -> None:
    url, endpoint = s3_storage_url
    whole = S3Storage.from_url(url, endpoint_url=endpoint)
    tenant = S3Storage.from_url(f"{url}/tenant-1/", endpoint_url=endpoint)
    assert tenant.url == f"{url}/tenant-1/"

    tenant.put("x/y.webp", b"y", "image/webp")
    whole.put("elsewhere.txt", b"e", "text/plain")

    assert keys(whole) == ["elsewhere.txt", "tenant-1/x/y.webp"]
    assert keys(tenant) == ["x/y.webp"]
    assert keys(tenant, "x/") == ["x/y.webp"]
    assert tenant.get("x/y.webp")[0] == b"y"
    assert not tenant.exists("elsewhere.txt")
    assert not whole.exists("x/y.webp")


def test_s3_put_sets_cache_control_and_sends_no_default_checksums(s3: S3Storage) -> None:
    sent = on_event(s3, "before-send.s3.PutObject")
    s3.put("thumbnails/a.pdf/e1-512.webp", b"webp", "image/webp")

    headers = {name.lower() for name in sent[0]["request"].headers}
    # R2 and other S3-compatibles refuse the CRC checksums botocore adds by default.
    assert not [h for h in headers if h.startswith("x-amz-checksum-")]
    assert "x-amz-sdk-checksum-algorithm" not in headers
    # A thumbnail goes out in one round trip, without waiting for "100 Continue".
    assert "expect" not in headers
    stored = s3.client.head_object(Bucket=s3.bucket, Key="thumbnails/a.pdf/e1-512.webp")
    assert stored["ContentType"] == "image/webp"
    assert "immutable" in stored["CacheControl"]


def test_s3_missing_bucket_is_a_storage_error_not_a_missing_source(moto_server: str) -> None:
    bucket = f"thumbq-absent-{uuid.uuid4().hex[:12]}"
    s3 = S3Storage(bucket, endpoint_url=moto_server)

    for call in (s3.head, s3.get, s3.exists, lambda key: s3.put(key, b"x", "text/plain")):
        with pytest.raises(StorageError) as caught:
            call("a.pdf")
        assert not isinstance(caught.value, NotFound)
        assert caught.value.code == STORAGE_ERROR
        assert bucket in caught.value.message
    with pytest.raises(StorageError, match=r"HTTP 404 NoSuchBucket"):
        s3.get("a.pdf")


@pytest.mark.usefixtures("aws_env")
def test_s3_unreachable_endpoint_fails_fast_with_storage_error() -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    s3 = S3Storage("thumbq-test", endpoint_url=endpoint)

    started = time.monotonic()
    calls: list[Callable[[], object]] = [
        lambda: s3.head("a.pdf"),
        lambda: s3.get("a.pdf"),
        lambda: s3.put("a.pdf", b"x", "application/pdf"),
        lambda: list(s3.list("a")),
    ]
    for call in calls:
        with pytest.raises(StorageError) as caught:
            call()
        assert caught.value.code == STORAGE_ERROR
        assert "127.0.0.1" in caught.value.message
    assert time.monotonic() - started < 10


@pytest.mark.usefixtures("aws_env")
def test_s3_endpoint_that_never_answers_times_out_instead_of_hanging() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        # Listening but never accepting: the kernel completes the handshake, nobody answers.
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        s3 = S3Storage("thumbq-test", endpoint_url=endpoint, read_timeout=0.3, max_attempts=2)

        started = time.monotonic()
        with pytest.raises(StorageError, match=r"(?i)timeout"):
            s3.head("a.pdf")
        assert time.monotonic() - started < 3


# -- choosing a backend -------------------------------------------------------------------------


def test_open_storage_picks_the_backend_named_by_the_config(
    tmp_path: Path, s3_storage_url: tuple[str, str]
) -> None:
    home = tmp_path / "home"
    default = open_storage(Config.from_env({"THUMBQ_HOME": str(home)}))
    assert isinstance(default, FileStorage)
    assert default.root == (home / "storage").resolve()
    assert default.root.is_dir()

    folder = tmp_path / "my files"
    env = {"THUMBQ_HOME": str(home), "THUMBQ_STORAGE_URL": folder.as_uri()}
    local = open_storage(Config.from_env(env))
    assert isinstance(local, FileStorage)
    assert local.root == folder.resolve()

    url, endpoint = s3_storage_url
    env = {
        "THUMBQ_HOME": str(home),
        "THUMBQ_STORAGE_URL": f"{url}/media",
        "THUMBQ_S3_ENDPOINT_URL": endpoint,
        "AWS_REGION": "eu-west-1",
    }
    remote = open_storage(Config.from_env(env))
    assert isinstance(remote, S3Storage)
    assert (remote.prefix, remote.region) == ("media/", "eu-west-1")
    remote.put("a.webp", b"a", "image/webp")
    assert remote.get("a.webp")[0] == b"a"

    with pytest.raises(ValueError):
        open_storage(Config.from_env({"THUMBQ_HOME": str(home), "THUMBQ_STORAGE_URL": "ftp://x"}))
