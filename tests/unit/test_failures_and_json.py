"""How a failure is classified (ended at once, or tried again later), which object keys are
refused before anything is stored, and the JSON thumbq writes in its answers, CLI and logs."""

from __future__ import annotations

import datetime as dt
import decimal
import json

import psycopg
import pytest

from worker.engine import jsonfmt
from worker.engine.db import DeadlineExceeded
from worker.engine.errors import (
    CORRUPT_INPUT,
    DB_ERROR,
    DB_TIMEOUT,
    INTERNAL,
    INVALID_KEY,
    RENDER_TIMEOUT,
    STORAGE_ERROR,
    TOO_LARGE,
    InvalidKey,
    ThumbqError,
    validate_key,
)
from worker.engine.retry import classify


@pytest.mark.parametrize(
    ("exc", "code", "permanent"),
    [
        (ThumbqError(CORRUPT_INPUT, "the PDF ends mid-object"), CORRUPT_INPUT, True),
        (ThumbqError(TOO_LARGE, "80 megapixels at most"), TOO_LARGE, True),
        (ThumbqError(STORAGE_ERROR, "S3 answered 503"), STORAGE_ERROR, False),
        (ThumbqError(RENDER_TIMEOUT, "killed after 20 s"), RENDER_TIMEOUT, False),
        (InvalidKey("key must not contain '.' or '..' segments"), INVALID_KEY, True),
        (DeadlineExceeded("canceling statement due to statement timeout"), DB_TIMEOUT, False),
        (psycopg.OperationalError("server closed the connection"), DB_ERROR, False),
        (KeyError("width"), INTERNAL, False),
    ],
)
def test_a_failure_ends_the_job_only_when_trying_again_cannot_help(
    exc: BaseException, code: str, permanent: bool
) -> None:
    failure = classify(exc)
    assert (failure.code, failure.permanent) == (code, permanent)
    assert failure.message and "\n" not in failure.message


def test_an_unexpected_exception_is_named_in_the_jobs_error() -> None:
    assert classify(KeyError("width")).message == "KeyError: 'width'"
    assert classify(InvalidKey("key contains a NUL byte")).message == (
        "the source key cannot be stored: key contains a NUL byte"
    )


@pytest.mark.parametrize(
    ("key", "says"),
    [
        ("", "non-empty"),
        ("/etc/passwd", "relative"),
        ("C:/Windows/win.ini", "relative"),
        ("\\\\server\\share", "relative"),
        ("photos\\cat.jpg", "'/' as separator"),
        ("photos/../../etc/passwd", "'..' segments"),
        ("photos/./cat.jpg", "'..' segments"),
        ("photos/cat\x00.jpg", "NUL byte"),
        ("photos/cat\n.jpg", "control character"),
        ("photos/\ud800.jpg", "lone surrogate"),
        ("é" * 513, "longer than 1024 bytes"),
    ],
)
def test_keys_that_could_escape_or_not_be_stored_are_refused(key: str, says: str) -> None:
    with pytest.raises(InvalidKey, match=None) as info:
        validate_key(key)
    assert says in str(info.value)


@pytest.mark.parametrize("key", ["photos/cat.jpg", "a..b/c", ".hidden/x", "ünïcödé/日本.png"])
def test_ordinary_keys_pass_unchanged(key: str) -> None:
    assert validate_key(key) == key


def test_json_dates_are_iso_8601_and_numerics_and_durations_are_numbers() -> None:
    when = dt.datetime(2026, 11, 26, 20, 45, 1, 250_000, tzinfo=dt.UTC)
    value = {
        "finished_at": when,
        "day": dt.date(2026, 11, 26),
        "percent": decimal.Decimal("66.67"),
        "eta": dt.timedelta(minutes=1, milliseconds=500),
        "none": None,
    }
    text = jsonfmt.dumps(value)
    assert text == (
        '{"finished_at":"2026-11-26T20:45:01.250000+00:00","day":"2026-11-26",'
        '"percent":66.67,"eta":60.5,"none":null}'
    )
    assert json.loads(jsonfmt.dumps(value, indent=2)) == json.loads(text)
    assert jsonfmt.dumps([1], indent=2) == "[\n  1\n]"


def test_json_refuses_what_it_cannot_write_naming_its_type() -> None:
    with pytest.raises(TypeError, match="cannot serialise set"):
        jsonfmt.dumps({"ids": {1, 2}})
