"""A bounded reader of OLE2 compound files (Microsoft's "Compound File Binary Format"), the
container of legacy Office documents (`.doc`, `.xls`, `.ppt`/`.pps`) and of password-protected
OOXML.

thumbq reads three things from it, without LibreOffice: the names of the streams (which say what
the document is: `WordDocument`, `Workbook`, `PowerPoint Document`, or `EncryptedPackage` for an
encrypted OOXML file), whether a legacy document is password-encrypted (its first bytes say), and
the thumbnail an application may have stored in `SummaryInformation`. Every chain of sectors is
walked at most once per sector of the file, so a loop or a hostile count costs a bounded walk;
anything malformed raises `Malformed`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

MAGIC = b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1"
# The directory is read up to this many entries: real documents hold tens to a few hundred.
MAX_ENTRIES = 20_000
_END_OF_CHAIN = 0xFFFFFFFE
_FREE = 0xFFFFFFFF
_HEADER_DIFAT = 109


class Malformed(Exception):
    """The compound file's structure is damaged (or built to mislead a reader)."""


@dataclass(frozen=True)
class Entry:
    """One stream or storage of the directory."""

    name: str
    kind: int  # 1 storage, 2 stream, 5 root
    start: int
    size: int


class CompoundFile:
    """The directory of a compound file held in memory, and its streams on request."""

    def __init__(self, data: bytes) -> None:
        if len(data) < 512 or not data.startswith(MAGIC):
            raise Malformed("not a compound file")
        self.data = data
        try:
            self._read_header()
        except (struct.error, IndexError, ValueError) as exc:
            raise Malformed(f"damaged header: {exc}") from None

    def _read_header(self) -> None:
        data = self.data
        shift, mini_shift = struct.unpack_from("<HH", data, 0x1E)
        if shift not in (9, 12) or mini_shift != 6:
            raise Malformed(f"sector shift {shift}/{mini_shift}")
        self.sector = 1 << shift
        self.mini_sector = 1 << mini_shift
        self.sectors = max(0, (len(data) - self.sector) // self.sector + 1)
        n_fat, first_dir = struct.unpack_from("<II", data, 0x2C)
        (self.mini_cutoff,) = struct.unpack_from("<I", data, 0x38)
        first_minifat, _n_minifat, first_difat, n_difat = struct.unpack_from("<IIII", data, 0x3C)
        if n_fat > self.sectors:
            raise Malformed(f"{n_fat:,} FAT sectors in a file of {self.sectors:,}")
        fat_sectors = [
            s for s in struct.unpack_from(f"<{_HEADER_DIFAT}I", data, 0x4C) if s < self.sectors
        ]
        sector = first_difat
        for _ in range(min(n_difat, self.sectors)):
            if sector >= self.sectors:
                break
            ids = struct.unpack_from(f"<{self.sector // 4}I", data, self._offset(sector))
            fat_sectors.extend(s for s in ids[:-1] if s < self.sectors)
            sector = ids[-1]
        fat = bytearray()
        for s in fat_sectors[:n_fat]:
            fat += self._sector_bytes(s)
        self.fat = memoryview(bytes(fat)).cast("I") if len(fat) % 4 == 0 else memoryview(b"")
        directory = self._chain_bytes(first_dir, self.fat, self._sector_bytes)
        self.entries: list[Entry] = []
        for pos in range(0, min(len(directory), MAX_ENTRIES * 128) - 127, 128):
            name_len, kind = struct.unpack_from("<HB", directory, pos + 0x40)
            if kind not in (1, 2, 5) or not 2 <= name_len <= 64:
                continue
            name = directory[pos : pos + name_len - 2].decode("utf-16-le", "replace")
            start, size = struct.unpack_from("<IQ", directory, pos + 0x74)
            if self.sector == 512:
                size &= 0xFFFFFFFF  # version 3 files may leave junk in the high half
            self.entries.append(Entry(name, kind, start, size))
        root = next((e for e in self.entries if e.kind == 5), None)
        self._mini_stream = b""
        self.minifat = memoryview(b"")
        if root is not None and first_minifat < self.sectors:
            minifat = self._chain_bytes(first_minifat, self.fat, self._sector_bytes)
            self.minifat = memoryview(minifat[: len(minifat) // 4 * 4]).cast("I")
            self._mini_stream = self._chain_bytes(root.start, self.fat, self._sector_bytes)[
                : root.size
            ]

    def names(self) -> set[str]:
        """The names of every stream and storage."""
        return {e.name for e in self.entries}

    def stream(self, name: str, limit: int = 1 << 20) -> bytes:
        """The first `limit` bytes of the stream `name`; Malformed when there is none."""
        entry = next((e for e in self.entries if e.kind == 2 and e.name == name), None)
        if entry is None:
            raise Malformed(f"no stream {name!r}")
        want = min(entry.size, limit)
        if entry.size < self.mini_cutoff:
            data = self._chain_bytes(entry.start, self.minifat, self._mini, want)
        else:
            data = self._chain_bytes(entry.start, self.fat, self._sector_bytes, want)
        return data[:want]

    # -- internals ----------------------------------------------------------------------------

    def _offset(self, sector: int) -> int:
        return (sector + 1) * self.sector

    def _sector_bytes(self, sector: int) -> bytes:
        start = self._offset(sector)
        return self.data[start : start + self.sector]

    def _mini(self, sector: int) -> bytes:
        start = sector * self.mini_sector
        return self._mini_stream[start : start + self.mini_sector]

    def _chain_bytes(
        self,
        start: int,
        table: memoryview,
        read: Callable[[int], bytes],
        limit: int | None = None,
    ) -> bytes:
        """The sectors of the chain from `start`, each visited at most once."""
        out = bytearray()
        seen: set[int] = set()
        sector = start
        while sector not in (_END_OF_CHAIN, _FREE) and (limit is None or len(out) < limit):
            if sector in seen or sector >= len(table) or len(seen) > self.sectors * 8:
                if sector >= len(table) and not seen and table is self.fat:
                    raise Malformed(f"chain starts at sector {sector} beyond the table")
                break
            seen.add(sector)
            out += read(sector)
            sector = table[sector]
        return bytes(out)


def open_compound(data: bytes) -> CompoundFile | None:
    """The compound file in `data`, or None when it cannot be read."""
    try:
        return CompoundFile(data)
    except Malformed:
        return None


# -- what the streams say -------------------------------------------------------------------------

_ENCRYPTED_PPT_TOKEN = 0xF3D1C4DF


def is_encrypted(cf: CompoundFile) -> bool:
    """Whether a legacy Word, Excel or PowerPoint document is protected by a password (its content
    cannot be read without it), or the file is an encrypted OOXML package."""
    names = cf.names()
    if "EncryptedPackage" in names:
        return True
    try:
        if "WordDocument" in names:
            fib = cf.stream("WordDocument", 32)
            # FibBase.fEncrypted (bit 8 of the flags at 0x0A); XOR obfuscation sets it too.
            return len(fib) >= 12 and bool(struct.unpack_from("<H", fib, 0x0A)[0] & 0x0100)
        for book in ("Workbook", "Book"):
            if book in names:
                return _xls_has_filepass(cf.stream(book, 64 * 1024))
        if "PowerPoint Document" in names:
            if "EncryptedSummary" in names:
                return True
            user = cf.stream("Current User", 64)
            return len(user) >= 16 and struct.unpack_from("<I", user, 12)[0] == (
                _ENCRYPTED_PPT_TOKEN
            )
    except Malformed:
        return False
    return False


def _xls_has_filepass(book: bytes) -> bool:
    """FILEPASS (0x002F) follows the workbook's first BOF when the workbook is encrypted."""
    pos = 0
    for _ in range(64):
        if pos + 4 > len(book):
            return False
        kind, length = struct.unpack_from("<HH", book, pos)
        if kind == 0x002F:
            return True
        if kind in (0x0085, 0x000A):  # BOUNDSHEET or EOF: past where FILEPASS would be
            return False
        pos += 4 + length
    return False


_PIDSI_THUMBNAIL = 0x11
_VT_CF = 71
_CF_DIB = 8


def summary_thumbnail(cf: CompoundFile) -> bytes | None:
    """The preview picture an application stored in `SummaryInformation` as a file Pillow
    reads (a DIB made a BMP, or PNG/JPEG bytes), or None. Windows metafiles, the most common
    kind, cannot be drawn here and count as none."""
    try:
        stream = cf.stream("\x05SummaryInformation", 16 * 1024 * 1024)
        (n_sets,) = struct.unpack_from("<I", stream, 24)
        if n_sets < 1:
            return None
        (section,) = struct.unpack_from("<I", stream, 44)
        _size, count = struct.unpack_from("<II", stream, section)
        for i in range(min(count, 256)):
            pid, offset = struct.unpack_from("<II", stream, section + 8 + 8 * i)
            if pid != _PIDSI_THUMBNAIL:
                continue
            at = section + offset
            vtype, size, tag = struct.unpack_from("<IIi", stream, at)
            if vtype != _VT_CF:
                return None
            body = stream[at + 12 : at + 8 + size]
            if tag == -1 and len(body) > 4 and struct.unpack_from("<I", body)[0] == _CF_DIB:
                return _dib_as_bmp(body[4:])
            for magic in (b"\x89PNG", b"\xff\xd8\xff"):
                found = body.find(magic, 0, 16)
                if found >= 0:
                    return body[found:]
            return None
    except (Malformed, struct.error, IndexError):
        return None
    return None


def _dib_as_bmp(dib: bytes) -> bytes | None:
    """A device-independent bitmap with the 14-byte file header that makes it a .bmp."""
    if len(dib) < 40:
        return None
    header, _w, _h, _planes, bits, _comp, _img, _x, _y, used = struct.unpack_from(
        "<IiiHHIIiiI", dib
    )
    colours = used or (1 << bits if bits <= 8 else 0)
    pixels_at = 14 + header + 4 * colours
    return b"BM" + struct.pack("<IHHI", 14 + len(dib), 0, 0, pixels_at) + dib
