"""Errors with a stable machine code and a sentence for a person.

Every failure thumbq itself ends a job with carries one of the codes of
`worker.engine.states.ErrorCode`; the permanent ones end the job at once, the others retry.
"""

from __future__ import annotations

from worker.engine.states import PERMANENT_CODES, ErrorCode

# The codes by their old names, for the modules that raise them.
UNSUPPORTED_TYPE = ErrorCode.UNSUPPORTED_TYPE
CORRUPT_INPUT = ErrorCode.CORRUPT_INPUT
ENCRYPTED_INPUT = ErrorCode.ENCRYPTED_INPUT
TOO_LARGE = ErrorCode.TOO_LARGE
SOURCE_MISSING = ErrorCode.SOURCE_MISSING
INVALID_KEY = ErrorCode.INVALID_KEY
UNSUPPORTED_TASK = ErrorCode.UNSUPPORTED_TASK
STORAGE_ERROR = ErrorCode.STORAGE_ERROR
RENDER_TIMEOUT = ErrorCode.RENDER_TIMEOUT
DB_ERROR = ErrorCode.DB_ERROR
STORAGE_TIMEOUT = ErrorCode.STORAGE_TIMEOUT
DB_TIMEOUT = ErrorCode.DB_TIMEOUT
INTERNAL = ErrorCode.INTERNAL
LEASE_EXPIRED = ErrorCode.LEASE_EXPIRED


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
