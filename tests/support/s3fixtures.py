"""Pytest fixtures for a real S3 API over HTTP: moto's server on a free local port.

Imported by the conftest.py of tests/db and tests/system, so boto3 signs, retries and parses
real HTTP responses in tests, without mocks and without touching a real account.
"""

from __future__ import annotations

import socket
import uuid
from collections.abc import Iterator

import pytest

# Dummy credentials, and no shared config or credentials files: a developer's ~/.aws (profiles,
# SSO, credential_process, a region) must neither leak into tests nor be needed by them.
_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/thumbq-tests/aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/thumbq-tests/aws-credentials",
}
_AWS_UNSET = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_REGION")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Run moto's S3 server for the whole session, with dummy AWS credentials; yield its URL."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _AWS_ENV.items():
            mp.setenv(name, value)
        for name in _AWS_UNSET:
            mp.delenv(name, raising=False)
        port = free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.stop()


@pytest.fixture
def s3_storage_url(moto_server: str) -> tuple[str, str]:
    """A fresh, empty bucket on the moto server: `(storage_url, endpoint_url)`."""
    import boto3.session

    bucket = f"thumbq-test-{uuid.uuid4().hex[:16]}"
    client = boto3.session.Session().client("s3", endpoint_url=moto_server, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    return f"s3://{bucket}", moto_server
