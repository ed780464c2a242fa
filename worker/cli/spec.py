"""How a command module describes its commands: records from which `worker.cli.parser` builds
the argparse parser, the environment each kind of command reads (its --help lists it), and the
checks of option values that argparse turns into usage errors."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.cli.runtime import Runtime

Handler = Callable[["Runtime", argparse.Namespace], int]


class Arg:
    """One argument or option, as `ArgumentParser.add_argument` takes it."""

    __slots__ = ("flags", "options")

    def __init__(self, *flags: str, **options: Any) -> None:
        self.flags = flags
        self.options = options


# Plain classes, not dataclasses: every `thumbq` run imports them, and making a dataclass costs
# about a millisecond at import.
class Command:
    """A command: its handler, a one-line summary (the list of commands shows it), details
    for its --help (or the whole first paragraph of it, `description`), the environment it reads
    and its arguments."""

    __slots__ = ("args", "description", "details", "env", "name", "run", "summary")

    def __init__(
        self,
        name: str,
        run: Handler,
        summary: str,
        details: str = "",
        *,
        env: tuple[dict[str, str], ...] = (),
        args: tuple[Arg, ...] = (),
        description: str | None = None,
    ) -> None:
        self.name = name
        self.run = run
        self.summary = summary
        self.details = details
        self.env = env
        self.args = args
        self.description = description or f"{summary}. {details}".strip()


class Group:
    """A command with commands of its own (`thumbq jobs ...`, `thumbq db ...`): `dest` names
    the chosen one in the parsed arguments."""

    __slots__ = ("commands", "description", "dest", "name", "summary")

    def __init__(
        self, name: str, *, summary: str, description: str, dest: str, commands: tuple[Command, ...]
    ) -> None:
        self.name = name
        self.summary = summary
        self.description = description
        self.dest = dest
        self.commands = commands


# -- the environment each kind of command reads -----------------------------------------------

ENV_DATABASE = {
    "DATABASE_URL": "Postgres to use; unset: the embedded Postgres in THUMBQ_HOME",
    "THUMBQ_HOME": "the per-user data directory (embedded database, storage, admin secret); "
    "default ~/.local/share/thumbq on Linux",
}
ENV_STORAGE = {
    "THUMBQ_STORAGE_URL": "file:///abs/dir or s3://bucket[/prefix]; default THUMBQ_HOME/storage",
    "THUMBQ_S3_ENDPOINT_URL": "S3-compatible endpoint (R2, Supabase Storage, MinIO)",
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION": "S3 credentials",
}
ENV_BATCH = {
    "THUMBQ_BUDGET_MS / THUMBQ_BUFFER_MS": "a batch's budget and safety buffer (10000 / 2000)",
    "THUMBQ_BATCH_SIZE": "most jobs one batch claims",
    "THUMBQ_CONCURRENCY": "parallel renders (CPU count)",
    "THUMBQ_MAX_ATTEMPTS": "attempts before the dead-letter queue (3)",
    "THUMBQ_THUMB_SIZE, THUMBQ_THUMB_SIZES, THUMBQ_THUMB_FORMAT": "thumbnail box(es) and format "
    "(512, webp)",
    "THUMBQ_PDF_PAGE, THUMBQ_MAX_PIXELS, THUMBQ_MAX_PAGES, THUMBQ_MAX_BYTES, "
    "THUMBQ_RENDER_MEMORY_MB, THUMBQ_RATE_BUCKET, THUMBQ_SOFFICE": "limits and tools: see the "
    "README's configuration table",
    "THUMBQ_TASKS, THUMBQ_PRIORITY_AGEING_S": "modules with more tasks; priority ageing (60 s)",
}
ENV_API = {
    "THUMBQ_CRON_SECRET": "the admin secret; default: the one `thumbq up` keeps in THUMBQ_HOME",
    "THUMBQ_JWT_SECRET, THUMBQ_JWKS_URL": "how users' Supabase tokens are verified (legacy "
    "HS256 secret; JWKS, default from SUPABASE_URL)",
    "THUMBQ_PROGRESS_CACHE_MS, THUMBQ_ACCESS_CACHE_MS": "progress and access caches",
    "THUMBQ_MAX_STREAMS": "progress streams (Server-Sent Events) open at once (32; 0: none)",
    "SUPABASE_URL, SUPABASE_ANON_KEY, THUMBQ_SUPABASE_JS_URL": "Realtime on the progress page",
}
ENV_SCHEDULE = {
    "THUMBQ_SCHEDULE": "cron schedule of the batch calls, UTC (*/5 * * * *)",
}
ENV_ALWAYS = {"THUMBQ_DEBUG": "1: print a traceback with an error"}


def epilog(*groups: dict[str, str]) -> str:
    """The "environment:" section of a --help: `groups`, then what every command reads."""
    lines = ["environment:"]
    for group in (*groups, ENV_ALWAYS):
        for name, meaning in group.items():
            lines.append(f"  {name}\n      {meaning}")
    return "\n".join(lines)


# -- option values (argparse says a refusal as a usage error, exit code 2) ----------------------


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def threads(text: str) -> int:
    """A number of server threads, 1 to 256."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"must be 1 to 256, got {text!r}")
    return int(text)


def job_id(text: str) -> int:
    """A job id: a positive bigint."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 2**63 - 1:
        raise argparse.ArgumentTypeError(f"must be a job id (a positive integer), got {text!r}")
    return int(text)


def seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value
