"""How the CLI speaks to a person on stderr: one line per message, and every error turned into
one line that says what went wrong and what to do (DESIGN.md, "CLI manners")."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from worker.app import validation
from worker.engine import db
from worker.engine.config import ConfigError


class CliError(Exception):
    """A problem the user can fix, said in one line; exit code 1."""


def say(message: str) -> None:
    """One line for the user on stderr (stdout stays for the command's answer)."""
    if message:
        print(f"thumbq: {message}", file=sys.stderr, flush=True)


def checked(check: Callable[[], Any]) -> Any:
    """Run one of the API's validators, turning its refusal into the CLI's one-line error."""
    try:
        return check()
    except validation.ValidationError as exc:
        raise CliError(exc.message) from None


def unknown_group(group: str) -> CliError:
    """The error for a group id the database does not know."""
    return CliError(f"no group {group!r}; `thumbq status` lists the groups")


def describe_error(exc: BaseException) -> str:
    """One line that says what went wrong and what to do about it."""
    import psycopg

    from worker.engine.errors import InvalidKey, ThumbqError
    from worker.local.embedded import EmbeddedError, EmbeddedUnavailable

    if isinstance(
        exc,
        CliError | ConfigError | EmbeddedError | EmbeddedUnavailable | InvalidKey,
    ):
        text = str(exc)
    elif isinstance(exc, validation.ValidationError):
        text = exc.message
    elif isinstance(exc, db.SchemaChainError):
        text = str(exc)
    elif isinstance(
        exc,
        psycopg.errors.UndefinedTable
        | psycopg.errors.UndefinedFunction
        | psycopg.errors.InvalidSchemaName,
    ):
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        text = f"the database lacks part of the thumbq schema ({first}): run `thumbq db init`"
    elif isinstance(exc, psycopg.OperationalError):
        text = (
            f"lost the database ({' '.join(str(exc).split())[:200]}): check that it is running "
            "and try again"
        )
    elif isinstance(exc, psycopg.Error):
        text = f"the database refused: {' '.join(str(exc).split())[:300]}"
    elif isinstance(exc, ThumbqError) and exc.code == "storage_error":
        text = f"storage: {exc.message}; check THUMBQ_STORAGE_URL and its credentials"
    elif isinstance(exc, ThumbqError):
        text = exc.message
    elif isinstance(exc, RuntimeError) and str(exc).startswith("thumbq: "):
        text = str(exc)
    elif isinstance(exc, PermissionError | FileNotFoundError | IsADirectoryError):
        text = f"{exc.strerror}: {exc.filename}"
    elif isinstance(exc, ValueError) and "THUMBQ_" in str(exc):
        text = str(exc)
    else:
        text = (
            f"unexpected error: {type(exc).__name__}: {exc} (THUMBQ_DEBUG=1 shows where; "
            "please report it)"
        )
    text = " ".join(text.split())
    return text.removeprefix("thumbq: ")
