"""Local folder storage (`file:///abs/dir`): the embedded default, one file per key under a root.

Design choices, in short:

- ETag: a hash of the file's `st_mtime_ns` and `st_size`. It costs one `stat` (no read), stays the
  same while the file is untouched, survives copies that keep timestamps (`cp -p`, `rsync -a`, a
  restore) and changes after any rewrite. `put` stamps the new file with a nanosecond clock so that
  two writes of the same size in one kernel clock tick still get different ETags. It is not a
  content hash: touching a file changes it (which only costs a regenerated thumbnail).
- Content type: guessed from the key's extension with Python's built-in table (not the machine's
  `/etc/mime.types`, so every host agrees), plus WebP. Thumbnails always carry their extension,
  so they read back with the type they were written with; no sidecar files to keep in step.
- `put` writes a temporary file next to the target, fsyncs it and `os.replace`s it over the key:
  a reader sees the old file or the whole new one. The fsync is there because the job is marked
  `completed` in Postgres right after `put` returns; without it a power loss could leave an empty
  or torn thumbnail behind a `completed` row. It costs a few milliseconds per thumbnail.
- A process killed between creating that temporary file and renaming it leaves it behind. It is
  never an object (`list` skips it, no key may name it), and `sweep_temp_files` (run by
  `cleanup-stale`) removes those old enough that no live write can own them.
"""

from __future__ import annotations

import contextlib
import hashlib
import mimetypes
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from worker.engine.errors import TOO_LARGE, InvalidKey, ThumbqError, validate_key
from worker.storage import NotFound, ObjectInfo, StorageError

# The longest file name common filesystems (ext4, XFS, APFS, NTFS) accept, in bytes.
NAME_MAX = 255

# (key, stat) pairs gathered by a walk; an alias because `list` is also a method name below.
_Found = list[tuple[str, os.stat_result]]

# Temporary files from `put` start with this; `list` skips them and no key may use it, so a crash
# mid-write never shows up as an object.
TEMP_PREFIX = ".thumbq-tmp-"
# A temporary file this much older than its last write belongs to no live write: a write takes
# milliseconds, is bounded by its invocation's budget, and serverless functions run 15 min at most.
TEMP_MIN_AGE_S = 15 * 60


def _etag(st: os.stat_result) -> str:
    raw = f"{st.st_mtime_ns}:{st.st_size}".encode()
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def _is_utf8(name: str) -> bool:
    # os.scandir hands back undecodable bytes as surrogates; such names cannot be keys anywhere.
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class FileStorage:
    """Objects as files under `root`; keys are '/'-separated paths that must stay inside it."""

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        """Use `root` (created if missing); `fsync=False` trades crash durability for speed."""
        path = Path(root)
        if not path.is_absolute():
            raise ValueError(f"file storage root must be an absolute path, got {str(root)!r}")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create storage root {str(path)!r}: {exc}") from exc
        self.root = path.resolve()
        self.url = self.root.as_uri()
        self.fsync = fsync
        self._types = mimetypes.MimeTypes()
        self._types.add_type("image/webp", ".webp")

    @classmethod
    def from_url(cls, url: str, *, fsync: bool = True) -> FileStorage:
        """Open `file:///abs/dir` (percent-escapes decoded, as `Path.as_uri()` writes them)."""
        parts = urlsplit(url)
        if parts.scheme != "file":
            raise ValueError(f"not a file:// URL: {url!r}")
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"file storage URL must be file:///absolute/path, got {url!r}")
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise ValueError(f"file storage URL must be file:///absolute/path, got {url!r}")
        return cls(path, fsync=fsync)

    def __repr__(self) -> str:
        return f"FileStorage({self.url!r})"

    # -- keys and paths ---------------------------------------------------------------------

    def _inside(self, path: Path) -> bool:
        return path != self.root and path.is_relative_to(self.root)

    def _path(self, key: str) -> Path:
        """The real path for `key`, refusing keys that are unsafe or resolve outside the root."""
        validate_key(key)
        parts = key.split("/")
        if "" in parts:
            # 'a//b' and 'a/' would name the same file as 'a/b' and 'a': they could not round-trip.
            raise InvalidKey("key must not have empty path segments ('//' or a trailing '/')")
        if any(len(part.encode("utf-8", "surrogatepass")) > NAME_MAX for part in parts):
            # Would fail with ENAMETOOLONG on every attempt: refuse it as a bad key instead.
            raise InvalidKey(f"key has a path segment longer than {NAME_MAX} bytes")
        if parts[-1].startswith(TEMP_PREFIX):
            raise InvalidKey(f"key must not name a temporary file ({TEMP_PREFIX}*)")
        # realpath follows every symlink on the way, so a link that points out of the root is
        # caught here rather than followed by open().
        resolved = Path(os.path.realpath(self.root.joinpath(*parts)))
        if not self._inside(resolved):
            raise InvalidKey(f"key {key!r} resolves outside the storage root")
        return resolved

    def _info(self, key: str, st: os.stat_result) -> ObjectInfo:
        return ObjectInfo(key=key, etag=_etag(st), size=st.st_size, content_type=self._type(key))

    def _type(self, key: str) -> str | None:
        content_type, encoding = self._types.guess_type(key, strict=False)
        # 'x.pdf.gz' holds gzip bytes, not a PDF: better unknown than wrong.
        return None if encoding else content_type

    # -- the protocol -----------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo:
        """Metadata of `key`; raises `NotFound` when there is no such file."""
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(key) from None
        except OSError as exc:
            raise StorageError(f"cannot stat {key!r} in {self.url}: {exc.strerror}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(key)
        return self._info(key, st)

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, ObjectInfo]:
        """Bytes and metadata of `key`; the size is checked before anything is read."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                # fstat on the open file: the metadata describes exactly the bytes read, even if
                # a put replaces the file meanwhile.
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise NotFound(key)
                if max_bytes is not None and st.st_size > max_bytes:
                    raise _too_large(key, st.st_size, max_bytes)
                if max_bytes is None:
                    data = f.read()
                else:
                    # read(n) makes a buffer of n bytes first: sized by the file, not by the
                    # limit (100 MB by default), one byte more shows whether it grew since.
                    data = f.read(min(st.st_size, max_bytes) + 1)
                    if len(data) > st.st_size:
                        data += f.read(max_bytes + 1 - len(data))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None
        except OSError as exc:
            raise StorageError(f"cannot read {key!r} in {self.url}: {exc.strerror}") from exc
        if max_bytes is not None and len(data) > max_bytes:
            # Someone appended to the file in place after the fstat.
            raise _too_large(key, len(data), max_bytes)
        return data, self._info(key, st)

    def put(self, key: str, data: bytes, content_type: str) -> ObjectInfo:
        """Write `key` atomically (temp file, fsync, rename); `content_type` comes from the key."""
        path = self._path(key)
        tmp = path.parent / f"{TEMP_PREFIX}{secrets.token_hex(8)}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # os.open with 0o666 lets the umask decide the mode, as for any other new file
            # (mkstemp would force 0600).
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    # The kernel stamps mtime with a coarse clock; a fine one keeps ETags of
                    # back-to-back same-size writes apart.
                    now = time.time_ns()
                    os.utime(f.fileno(), ns=(now, now))
                    if self.fsync:
                        os.fsync(f.fileno())
                    st = os.fstat(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            if self.fsync:
                _fsync_dir(path.parent)
        except OSError as exc:
            raise StorageError(f"cannot write {key!r} in {self.url}: {exc.strerror}") from exc
        return self._info(key, st)

    def exists(self, key: str) -> bool:
        """Whether `key` is a file in this storage."""
        try:
            self.head(key)
        except NotFound:
            return False
        return True

    def presigned_get_url(self, key: str, expires_s: int) -> None:
        """None: local files have no URL of their own; the API serves them (signed URLs)."""
        return None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every file whose key starts with `prefix`, sorted by key as S3 sorts them.

        Temporary files are skipped; symlinks count only when they resolve inside the root, and
        symlinked directories are not descended into (so the walk is finite).
        """
        if prefix:
            validate_key(prefix)
        # Only the directory named by the prefix up to its last '/' can hold matching keys.
        base = prefix.rpartition("/")[0]
        start = Path(os.path.realpath(self.root.joinpath(*base.split("/")))) if base else self.root
        if start != self.root and not self._inside(start):
            raise InvalidKey(f"prefix {prefix!r} resolves outside the storage root")
        return self._list(start, base, prefix)

    def _list(self, start: Path, base: str, prefix: str) -> Iterator[ObjectInfo]:
        found: _Found = []
        try:
            self._walk(start, f"{base}/" if base else "", prefix, found)
        except OSError as exc:
            raise StorageError(f"cannot list {prefix!r} in {self.url}: {exc.strerror}") from exc
        # Code point order is UTF-8 byte order, which is the order S3 lists keys in. Sorting the
        # whole result (not each directory) matters: 'a-b' sorts before 'a/b'.
        found.sort(key=lambda item: item[0])
        for key, st in found:
            yield self._info(key, st)

    def sweep_temp_files(self, min_age_s: float = TEMP_MIN_AGE_S) -> int:
        """Remove the temporary files of writes that were killed before their rename, those
        last written over `min_age_s` ago; returns how many. Symlinks are not followed."""
        cutoff = time.time() - min_age_s
        removed = 0
        stack = [self.root]
        while stack:
            try:
                entries = list(os.scandir(stack.pop()))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                raise StorageError(f"cannot sweep {self.url}: {exc.strerror}") from exc
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif (
                        entry.name.startswith(TEMP_PREFIX)
                        and entry.is_file(follow_symlinks=False)
                        and entry.stat(follow_symlinks=False).st_mtime < cutoff
                    ):
                        os.unlink(entry.path)
                        removed += 1
                except FileNotFoundError:
                    continue  # renamed or removed meanwhile
                except OSError as exc:
                    raise StorageError(f"cannot sweep {entry.path!r}: {exc.strerror}") from exc
        return removed

    def _walk(self, directory: Path, rel: str, prefix: str, found: _Found) -> None:
        try:
            entries = list(os.scandir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            name = entry.name
            if name.startswith(TEMP_PREFIX) or not _is_utf8(name):
                continue
            key = rel + name
            try:
                if entry.is_symlink():
                    if not key.startswith(prefix):
                        continue
                    target = Path(os.path.realpath(entry.path))
                    if not self._inside(target):
                        continue
                    st = os.stat(target)
                    if stat.S_ISREG(st.st_mode):
                        found.append((key, st))
                elif entry.is_dir(follow_symlinks=False):
                    sub = key + "/"
                    if sub.startswith(prefix) or prefix.startswith(sub):
                        self._walk(Path(entry.path), sub, prefix, found)
                elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                    found.append((key, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # replaced or deleted while we walked


def _too_large(key: str, size: int, max_bytes: int) -> ThumbqError:
    return ThumbqError(TOO_LARGE, f"object {key!r} is {size} bytes, over the {max_bytes} limit")


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable. Some platforms and filesystems cannot open or fsync a
    # directory; the data is already synced, so that is not worth failing a write for.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
