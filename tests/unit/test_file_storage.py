"""The file storage backend on a temporary folder: keys that escape its root, atomic writes, size
limits; and how an S3 storage URL names its region."""

from __future__ import annotations

import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from worker.engine.errors import TOO_LARGE, InvalidKey, ThumbqError
from worker.storage import Storage
from worker.storage.file import TEMP_PREFIX, FileStorage
from worker.storage.s3 import S3Storage


def test_file_symlinks_that_point_outside_the_root_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"secret")
    storage = FileStorage(tmp_path / "root")
    (storage.root / "link.txt").symlink_to(outside / "secret.txt")
    (storage.root / "dir").symlink_to(outside)

    for key in ("link.txt", "dir/secret.txt", "dir/new.txt"):
        with pytest.raises(InvalidKey):
            storage.head(key)
        with pytest.raises(InvalidKey):
            storage.get(key)
        with pytest.raises(InvalidKey):
            storage.exists(key)
        with pytest.raises(InvalidKey):
            storage.put(key, b"overwritten", "text/plain")
    with pytest.raises(InvalidKey):
        storage.list("dir/")
    assert (outside / "secret.txt").read_bytes() == b"secret"
    assert sorted(os.listdir(outside)) == ["secret.txt"]
    assert keys(storage) == []

    # A link that stays inside the root is an ordinary object.
    storage.put("real.webp", b"webp", "image/webp")
    (storage.root / "alias.webp").symlink_to(storage.root / "real.webp")
    assert storage.get("alias.webp")[0] == b"webp"
    assert keys(storage) == ["alias.webp", "real.webp"]


def test_file_put_is_atomic_for_a_concurrent_reader(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    key = "thumbnails/big.pdf/abc-512.webp"
    size = 4 * 1024 * 1024
    versions = [b"a" * size, b"b" * size]
    storage.put(key, versions[0], "image/webp")
    stop = threading.Event()
    reads = 0
    torn = 0

    def read_constantly() -> None:
        nonlocal reads, torn
        while not stop.is_set():
            data, info = storage.get(key)
            reads += 1
            if data not in versions or info.size != size:
                torn += 1

    reader = threading.Thread(target=read_constantly)
    reader.start()
    try:
        for i in range(40):
            storage.put(key, versions[i % 2], "image/webp")
    finally:
        stop.set()
        reader.join()

    assert reads > 0
    assert torn == 0
    assert os.listdir(storage.root / "thumbnails/big.pdf") == ["abc-512.webp"]


def test_file_list_skips_temporary_files_left_by_a_crash(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    storage.put("thumbnails/a.webp", b"a", "image/webp")
    (storage.root / "thumbnails" / f"{TEMP_PREFIX}0123456789abcdef").write_bytes(b"half")

    assert keys(storage) == ["thumbnails/a.webp"]
    with pytest.raises(InvalidKey):
        storage.put(f"thumbnails/{TEMP_PREFIX}x", b"x", "image/webp")


def test_file_key_with_a_name_too_long_for_the_filesystem_is_invalid(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    with pytest.raises(InvalidKey):
        storage.put("thumbnails/" + "é" * 128 + ".webp", b"x", "image/webp")
    storage.put("thumbnails/" + "é" * 100 + ".webp", b"x", "image/webp")


def test_file_get_under_a_large_limit_allocates_about_the_file_not_the_limit(
    tmp_path: Path,
) -> None:
    # Every worker GET passes the 100 MB input limit; a read that sized its buffer by the limit
    # instead of the file made and dropped a 100 MB buffer per file (2.4 ms of a 2.9 MB JPEG's
    # 2.6 ms read from local disk). (S3's client reads what the response's length says; moto's
    # server, in this process, would count in the peak.)
    storage = FileStorage(tmp_path / "root")
    data = os.urandom(200_000)
    storage.put("photo.jpg", data, "image/jpeg")
    storage.get("photo.jpg", max_bytes=100 << 20)  # warm: connections, imports
    tracemalloc.start()
    try:
        got, info = storage.get("photo.jpg", max_bytes=100 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == data and info.size == len(data)
    assert peak < 4 * len(data), f"peak {peak:,} bytes to read {len(data):,}"


def test_file_get_over_max_bytes_does_not_read_the_file(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "root")
    # A sparse 8 GiB file: reading it before checking the size would take seconds and gigabytes.
    with open(storage.root / "huge.tif", "wb") as f:
        f.truncate(8 << 30)

    started = time.monotonic()
    with pytest.raises(ThumbqError) as caught:
        storage.get("huge.tif", max_bytes=1024)
    assert caught.value.code == TOO_LARGE
    assert time.monotonic() - started < 1


def test_file_storage_url_must_be_absolute(tmp_path: Path) -> None:
    root = tmp_path / "with space" / "storage"
    storage = FileStorage.from_url(root.as_uri())
    assert storage.root == root.resolve()
    assert root.is_dir()
    with pytest.raises(ValueError):
        FileStorage.from_url("file://relative/storage")


def test_s3_region_is_auto_for_r2_and_us_east_1_otherwise() -> None:
    r2 = "https://0123abcd.r2.cloudflarestorage.com"
    assert S3Storage.from_url("s3://media", endpoint_url=r2).client.meta.region_name == "auto"
    assert S3Storage.from_url("s3://media").client.meta.region_name == "us-east-1"
    explicit = S3Storage.from_url("s3://media", endpoint_url=r2, region="weur")
    assert explicit.client.meta.region_name == "weur"


def keys(storage: Storage, prefix: str = "") -> list[str]:
    return [info.key for info in storage.list(prefix)]
