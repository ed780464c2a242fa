"""Fixtures of the tests of servers, `thumbq` subprocesses, the browser, S3, pgbouncer and
extensions: a database per test on the session's
Postgres server (tests/support/postgres.py), and moto's S3 server."""

from tests.support.postgres import (  # noqa: F401  (fixtures, and the hook of `pgmq_versions`)
    config,
    conn,
    db_url,
    dropper,
    empty_db_url,
    new_db,
    pg_server_url,
    pgmq_install,
    pytest_generate_tests,
    template_db,
    templates,
)
from tests.support.s3fixtures import moto_server, s3_storage_url  # noqa: F401
