"""Office documents (PPTX, DOCX, XLSX, ODP, ODT, ODS; legacy DOC, XLS, PPT/PPS and RTF).

Where LibreOffice is installed, `OfficeConverter` turns the first page or slide into a one-page
PDF, which the PDF renderer draws at every size. One soffice process serves a whole batch (its
start costs 1-2 s; a conversion then 0.1-0.3 s); a conversion that overruns its deadline kills it,
and the next document starts a fresh one.

Without LibreOffice, the thumbnail the document carries is used (`docProps/thumbnail.jpeg` in
OOXML, `Thumbnails/thumbnail.png` in ODF, a bitmap in `SummaryInformation` in legacy binary
files, where it is not a Windows metafile); python-pptx, python-docx and some exporters write a
plain white one there, which counts as none. Without either the job ends `unsupported_type`,
naming what to install.

Archives are checked first: a ZIP whose parts declare more than a safe unpacked size, or an
absurd compression ratio (a "zip bomb"), is `too_large` before LibreOffice or zipfile sees it,
and a legacy document protected by a password is `encrypted_input` (its first bytes say so)
before LibreOffice spends its window failing to open it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from pathlib import Path

from worker.engine.errors import (
    CORRUPT_INPUT,
    ENCRYPTED_INPUT,
    INTERNAL,
    RENDER_TIMEOUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    ThumbqError,
)
from worker.thumbnails.render import RenderOptions, Thumbnail
from worker.thumbnails.render.sniff import (
    ODG,
    ODP,
    ODS,
    ODT,
    OFFICE_TYPES,
    OLE2_OFFICE_TYPES,
    RTF,
    zip_entries,
)

ODF_TYPES = frozenset({ODT, ODP, ODS, ODG})
# Unpacked size of all parts together, and of one part with a suspicious compression ratio.
MAX_UNPACKED_BYTES = 2 * 1024**3
MAX_PART_BYTES = 64 * 1024**2
MAX_RATIO = 200
MAX_ENTRIES = 50_000
# LibreOffice is given at most this much of an RTF file (see rtf_head).
MAX_RTF_BYTES = 256 * 1024
# An embedded thumbnail is a small picture; a larger part is not read.
MAX_EMBEDDED_BYTES = 16 * 1024**2
# Below this spread of pixel values (0-255, every channel) an embedded thumbnail is one flat colour.
UNIFORM_STDDEV = 2.0
_EMBEDDED = (
    "docProps/thumbnail.jpeg",
    "docProps/thumbnail.jpg",
    "docProps/thumbnail.png",
    "Thumbnails/thumbnail.png",
)
_PDF_FILTERS = {
    "pptx": "impress_pdf_Export",
    "odp": "impress_pdf_Export",
    "docx": "writer_pdf_Export",
    "odt": "writer_pdf_Export",
    "xlsx": "calc_pdf_Export",
    "ods": "calc_pdf_Export",
    "odg": "draw_pdf_Export",
    "doc": "writer_pdf_Export",
    "rtf": "writer_pdf_Export",
    "xls": "calc_pdf_Export",
    "ppt": "impress_pdf_Export",
}
# Where converters keep their profile and files; a folder whose owner process is gone (a worker
# killed mid-batch) is removed by the next converter that starts.
_SCRATCH_PREFIX = "thumbq-office-"


def check_document(data: bytes, source_type: str) -> None:
    """Refuse what LibreOffice should never be given: a ZIP bomb (`too_large`), a legacy
    document protected by a password (`encrypted_input`)."""
    if source_type in OLE2_OFFICE_TYPES:
        from worker.thumbnails.render import ole2

        compound = ole2.open_compound(data)
        if compound is not None and ole2.is_encrypted(compound):
            raise ThumbqError(
                ENCRYPTED_INPUT,
                f"this {OFFICE_TYPES[source_type].upper()} is protected by a password",
            )
    elif source_type != RTF:
        check_archive(data, source_type)
        if source_type in ODF_TYPES and _odf_encrypted(data):
            raise ThumbqError(
                ENCRYPTED_INPUT,
                f"this {OFFICE_TYPES[source_type].upper()} is protected by a password",
            )


def _odf_encrypted(data: bytes) -> bool:
    """An ODF package saved with a password lists how each part is encrypted in its manifest."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            info = archive.getinfo("META-INF/manifest.xml")
            if info.file_size > MAX_EMBEDDED_BYTES:
                return False
            with archive.open(info) as part:
                return b"encryption-data" in part.read(MAX_EMBEDDED_BYTES)
    except (KeyError, zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error,
            NotImplementedError, RuntimeError):  # fmt: skip
        return False  # unreadable here: LibreOffice says what it is


def rtf_head(data: bytes, limit: int = MAX_RTF_BYTES) -> bytes:
    """The first `limit` bytes of an RTF document, cut before its last paragraph mark there and
    with its open groups closed: LibreOffice lays out a whole document before it exports page 1
    (a 2.4 MB RTF of plain text took 19.5 s, its first 256 KB about 2 s), and the first pages
    of the head are the document's."""
    if len(data) <= limit:
        return data
    head = data[:limit]
    cut = head.rfind(b"\\par")
    head = head[:cut] if cut > 0 else head
    unescaped = head.replace(b"\\\\", b"").replace(b"\\{", b"").replace(b"\\}", b"")
    depth = unescaped.count(b"{") - unescaped.count(b"}")
    return head + b"\n" + b"}" * max(depth, 1)


def check_archive(data: bytes, source_type: str) -> None:
    """Refuse a ZIP that would unpack to far more than it weighs, before anything unpacks it."""
    entries = zip_entries(data, MAX_ENTRIES + 1)
    name = OFFICE_TYPES.get(source_type, "archive").upper()
    if len(entries) > MAX_ENTRIES:
        raise ThumbqError(TOO_LARGE, f"{name} has over {MAX_ENTRIES:,} parts")
    total = 0
    for entry in entries:
        total += entry.uncompressed
        ratio = entry.uncompressed / max(entry.compressed, 1)
        if entry.uncompressed > MAX_PART_BYTES and ratio > MAX_RATIO:
            raise ThumbqError(
                TOO_LARGE,
                f"{name} part {entry.name[:100]} unpacks to {entry.uncompressed:,} bytes from "
                f"{entry.compressed:,} (a compression bomb)",
            )
    if total > MAX_UNPACKED_BYTES:
        raise ThumbqError(
            TOO_LARGE,
            f"{name} unpacks to {total:,} bytes, over the limit of {MAX_UNPACKED_BYTES:,}",
        )


def render_embedded_thumbnail(data: bytes, source_type: str, opts: RenderOptions) -> Thumbnail:
    """The document's own thumbnail, at every size (never enlarged); `unsupported_type` naming
    the missing converter when there is none worth showing."""
    from PIL import Image, ImageStat

    from worker.thumbnails.render.image import open_image
    from worker.thumbnails.render.output import finish
    from worker.thumbnails.render.sniff import sniff

    check_document(data, source_type)
    kind = OFFICE_TYPES[source_type].upper()
    picture = _embedded_picture(data, source_type)
    if picture is not None:
        try:
            with Image.open(io.BytesIO(picture)) as probe:
                probe.load()
                spread = max(ImageStat.Stat(probe.convert("RGB")).stddev)
        except (OSError, ValueError, SyntaxError):
            spread = 0.0  # damaged: as good as none
        if spread > UNIFORM_STDDEV:
            picture_type = sniff(picture) or "image/jpeg"
            img, icc = open_image(picture, picture_type, opts)
            return finish(img, opts, source_type, icc_profile=icc, degraded=opts.degraded)
    if opts.degraded:
        # LibreOffice could not finish in its window: the document's first words on a page.
        from worker.thumbnails.render.office_text import document_lines, text_page

        lines = document_lines(data, source_type)
        if lines:
            return finish(
                text_page(lines, source_type, opts.size), opts, source_type, degraded=True
            )
    if opts.soffice:
        # RenderPool asks for the embedded thumbnail only when LibreOffice failed on this file;
        # it reports LibreOffice's error rather than this one.
        raise ThumbqError(UNSUPPORTED_TYPE, f"this {kind} carries no embedded thumbnail")
    raise ThumbqError(
        UNSUPPORTED_TYPE,
        f"cannot make a thumbnail of this {kind}: LibreOffice (soffice) is not installed to "
        f"render it, and the file carries no embedded thumbnail",
    )


def _embedded_picture(data: bytes, source_type: str) -> bytes | None:
    if source_type == RTF:
        return None
    if source_type in OLE2_OFFICE_TYPES:
        from worker.thumbnails.render import ole2

        compound = ole2.open_compound(data)
        return ole2.summary_thumbnail(compound) if compound is not None else None
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError):
        # NotImplementedError: a "zip file version" zipfile does not know (damaged header).
        raise ThumbqError(CORRUPT_INPUT, "document is not a readable ZIP archive") from None
    with archive:
        names = set(archive.namelist())
        for name in _EMBEDDED:
            if name not in names:
                continue
            info = archive.getinfo(name)
            if info.file_size > MAX_EMBEDDED_BYTES:
                continue
            try:
                with archive.open(info) as part:
                    return part.read(MAX_EMBEDDED_BYTES)
            except (
                zipfile.BadZipFile,
                OSError,
                ValueError,
                EOFError,
                zlib.error,
                NotImplementedError,  # a method or encryption zipfile does not know
                RuntimeError,  # "File ... is encrypted, password required"
            ):
                return None
    return None


def find_soffice() -> str | None:
    """LibreOffice's `soffice` on PATH, or None."""
    return shutil.which("soffice") or shutil.which("libreoffice")


class OfficeConverter:
    """One LibreOffice process, reused for every conversion until it is closed or overruns.

    Thread-safe: conversions take turns (LibreOffice converts one document at a time anyway).
    """

    def __init__(self, soffice: str, memory_limit_mb: int = 2048) -> None:
        self.soffice = soffice
        self.memory_limit_mb = memory_limit_mb
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._scratch: Path | None = None
        self._python: str | None = None
        self._closed = False
        self.starts = 0  # how many soffice processes were started (tests, operators)
        self.conversions = 0

    def convert_to_pdf(
        self, data: bytes, source_type: str, deadline: float, pages: int = 1
    ) -> bytes:
        """The first `pages` pages or slides of the document as a PDF, or ThumbqError:
        `render_timeout` when `deadline` (time.monotonic()) passes first, `corrupt_input` when
        LibreOffice cannot open it, `internal` when LibreOffice cannot run."""
        kind = OFFICE_TYPES[source_type]
        check_document(data, source_type)
        if source_type == RTF:
            data = rtf_head(data)
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ThumbqError(RENDER_TIMEOUT, "LibreOffice was busy until the deadline")
        try:
            if self._closed:
                raise ThumbqError(INTERNAL, "the office converter is closed")
            proc = self._ensure_started(deadline)
            assert self._scratch is not None
            name = secrets.token_hex(8)
            src = self._scratch / f"{name}.{kind}"
            out = self._scratch / f"{name}.pdf"
            src.write_bytes(data)
            try:
                request = {
                    "in": str(src),
                    "out": str(out),
                    "filter": _PDF_FILTERS[kind],
                    "pages": pages,  # its first `pages` pages (RenderOptions.pages)
                }
                reply = self._ask(proc, request, deadline, converting=kind)
                if reply.get("crashed"):
                    self._stop()
                    raise ThumbqError(
                        CORRUPT_INPUT,
                        f"LibreOffice crashed converting this {kind.upper()}: {reply.get('error')}",
                    )
                if not reply.get("ok"):
                    raise ThumbqError(
                        CORRUPT_INPUT,
                        f"LibreOffice cannot convert this {kind.upper()}: {reply.get('error')}",
                    )
                try:
                    pdf = out.read_bytes()
                except FileNotFoundError:
                    raise ThumbqError(
                        CORRUPT_INPUT, f"LibreOffice made nothing of this {kind.upper()}"
                    ) from None
                self.conversions += 1
                return pdf
            finally:
                for path in (src, out):
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
        finally:
            self._lock.release()

    def close(self) -> None:
        """Stop LibreOffice and remove its profile and files."""
        with self._lock:
            self._closed = True
            self._stop()

    # -- internals --------------------------------------------------------------------------

    def _ensure_started(self, deadline: float) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        python = self._python or _uno_python(self.soffice)
        if python is None:
            raise ThumbqError(
                INTERNAL,
                "LibreOffice is installed but no Python with its 'uno' module was found "
                "(Debian: python3-uno)",
            )
        self._python = python
        _sweep_stale_scratch()
        self._scratch = Path(tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}-"))
        helper = Path(__file__).with_name("office_helper.py")
        self._proc = subprocess.Popen(
            [
                python,
                "-I",
                str(helper),
                self.soffice,
                str(self._scratch / "profile"),
                f"thumbq_{os.getpid()}_{secrets.token_hex(4)}",
                str(self.memory_limit_mb),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.starts += 1
        reply = self._read(self._proc, deadline)
        if not reply.get("ready"):
            self._stop()
            raise ThumbqError(INTERNAL, f"LibreOffice did not start: {reply.get('error')}")
        return self._proc

    def _ask(
        self,
        proc: subprocess.Popen[bytes],
        request: dict[str, object],
        deadline: float,
        *,
        converting: str,
    ) -> dict[str, object]:
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            self._stop()
            raise ThumbqError(INTERNAL, "LibreOffice stopped unexpectedly") from None
        return self._read(proc, deadline, converting=converting)

    def _read(
        self, proc: subprocess.Popen[bytes], deadline: float, *, converting: str | None = None
    ) -> dict[str, object]:
        """One reply line, or kill everything at the deadline. LibreOffice gone while it was
        `converting` a document (its kind) is that document's doing: `corrupt_input`."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        line = b""
        while not line.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                self._stop()
                raise ThumbqError(RENDER_TIMEOUT, "LibreOffice did not finish before the deadline")
            chunk = os.read(fd, 65536)
            if not chunk:
                self._stop()
                if converting:
                    raise ThumbqError(
                        CORRUPT_INPUT,
                        f"LibreOffice stopped converting this {converting.upper()} (a crash, "
                        "or out of memory)",
                    )
                raise ThumbqError(
                    INTERNAL, "LibreOffice stopped unexpectedly (a crash, or out of memory)"
                )
            line += chunk
        try:
            reply = json.loads(line)
        except ValueError:
            self._stop()
            raise ThumbqError(INTERNAL, "LibreOffice's helper sent a malformed reply") from None
        return reply if isinstance(reply, dict) else {}

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            # The helper and soffice each lead their own session; kill both groups. The helper
            # kills soffice's group itself when it can, this covers a helper that cannot.
            for pgid in [*_soffice_groups(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                proc.wait(5)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        scratch, self._scratch = self._scratch, None
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _soffice_groups(helper_pid: int) -> list[int]:
    """Process groups led by the helper's children (soffice runs in its own session)."""
    try:
        children = Path(f"/proc/{helper_pid}/task/{helper_pid}/children").read_text().split()
    except OSError:
        return []
    return [int(pid) for pid in children if pid.isdigit()]


def _uno_python(soffice: str) -> str | None:
    """A Python interpreter that can import LibreOffice's `uno`: LibreOffice's own (upstream
    builds bundle one), this one, or the system's (Debian's python3-uno)."""
    program = Path(os.path.realpath(soffice)).parent
    candidates = [str(program / "python"), sys.executable, "/usr/bin/python3"]
    for python in candidates:
        if not os.access(python, os.X_OK):
            continue
        try:
            ok = subprocess.run(
                [python, "-I", "-c", "import uno"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok.returncode == 0:
            return python
    return None


def _sweep_stale_scratch() -> None:
    """Remove converter folders whose process no longer exists (it was killed mid-batch)."""
    root = Path(tempfile.gettempdir())
    for folder in root.glob(f"{_SCRATCH_PREFIX}*"):
        pid = folder.name[len(_SCRATCH_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)
