"""Errors with a stable machine code and a sentence for a person.

Every failure a job can end with is one of these codes; `retry.py` decides which are permanent.
"""

from __future__ import annotations

# Permanent: the input itself is the problem; retrying cannot help.
UNSUPPORTED_TYPE = "unsupported_type"
CORRUPT_INPUT = "corrupt_input"
ENCRYPTED_INPUT = "encrypted_input"
TOO_LARGE = "too_large"
SOURCE_MISSING = "source_missing"
# A key enqueued without the API's checks (through SQL or RPC) that storage refuses.
INVALID_KEY = "invalid_key"
# A job names a task no module of THUMBQ_TASKS registered.
UNSUPPORTED_TASK = "unsupported_task"
# Transient: the world may be different next time.
STORAGE_ERROR = "storage_error"
RENDER_TIMEOUT = "render_timeout"
DB_ERROR = "db_error"
# A storage call or database statement cut at the invocation's deadline (a stall, a slow drip,
# a lock held elsewhere).
STORAGE_TIMEOUT = "storage_timeout"
DB_TIMEOUT = "db_timeout"
INTERNAL = "internal"
LEASE_EXPIRED = "lease_expired"

PERMANENT_CODES = frozenset(
    {
        UNSUPPORTED_TYPE,
        CORRUPT_INPUT,
        ENCRYPTED_INPUT,
        TOO_LARGE,
        SOURCE_MISSING,
        INVALID_KEY,
        UNSUPPORTED_TASK,
    }
)
TRANSIENT_CODES = frozenset(
    {STORAGE_ERROR, STORAGE_TIMEOUT, RENDER_TIMEOUT, DB_ERROR, DB_TIMEOUT, INTERNAL, LEASE_EXPIRED}
)


class ThumbqError(Exception):
    """An error with a stable machine `code` and a readable `message`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @property
    def permanent(self) -> bool:
        return self.code in PERMANENT_CODES


class InvalidKey(ValueError):
    """A storage key that is empty, absolute, has a NUL byte or escapes its root with `..`."""

    code = "invalid_key"


def validate_key(key: str, *, max_length: int = 1024) -> str:
    """Return `key` if it is a safe relative object key, else raise `InvalidKey`."""
    if not isinstance(key, str) or not key:
        raise InvalidKey("key must be a non-empty string")
    try:
        # JSON's "\ud800" decodes to a lone surrogate, which no database or storage can store.
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidKey("key is not valid Unicode (it contains a lone surrogate)") from None
    if len(key.encode("utf-8")) > max_length:
        raise InvalidKey(f"key is longer than {max_length} bytes")
    if "\x00" in key:
        raise InvalidKey("key contains a NUL byte")
    if any(ord(c) < 0x20 for c in key):
        raise InvalidKey("key contains a control character")
    if key.startswith(("/", "\\")) or (len(key) > 1 and key[1] == ":"):
        raise InvalidKey("key must be relative, not an absolute path")
    if "\\" in key:
        raise InvalidKey("key must use '/' as separator, not '\\'")
    if any(part in ("..", ".") for part in key.split("/")):
        raise InvalidKey("key must not contain '.' or '..' segments")
    return key


class MemoryLimitExceeded(ThumbqError):
    """Work in a child process (a render, a task's handler) ran out of memory: its input needs
    more than it may use (`too_large`)."""

    def __init__(self, what: str) -> None:
        super().__init__(TOO_LARGE, f"rendering this {what} exceeded the memory limit")
