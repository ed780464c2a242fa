"""The thumbnail task's renders in child processes killed at a deadline or on a memory limit:
`RenderPool` is the engine's process pool (worker/engine/processes.py: the zygote, the memory
limit, the framing, tasks' handlers) with a render request beside a task's.

PyMuPDF holds the GIL while it renders and must not be used from two threads, and a hostile file
can make either library spin or allocate without bound; only a separate process can be stopped.
The zygote imports PyMuPDF and Pillow once (`RenderPool.preload`), so every child has them.

Wire format of a render (framing as in worker/engine/processes.py):
- Worker -> child: a frame holding JSON `[declared type, size, degraded]`, then `size` raw bytes
  (the file); `degraded` asks for the cheaper render (RenderOptions.degraded).
  Child -> worker: a frame holding the JSON reply header, then a frame holding the thumbnails
  (empty on error). The header is `{"ok": false, "code", "message", "exit"}` or `{"ok": true,
  "content_type", "source_type", "renditions": [{"size", "width", "height", "length", "page"},
  ...], "thumbhash", "dominant_color", "degraded"}`, the renditions ascending by size (a
  document's first page, then each further page's: RenderOptions.pages), their bytes one after
  another in the second frame.
"""

from __future__ import annotations

import json
import queue
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

from worker.engine.errors import (
    CORRUPT_INPUT,
    INTERNAL,
    RENDER_TIMEOUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    ErrorCode,
    ThumbqError,
)
from worker.engine.processes import (
    FRAME,
    MAX_HEADER,
    Child,
    Overran,
    ProcessPool,
    memory_message,
    pool_stopped,
    recv_exact,
    recv_frame,
)
from worker.thumbnails.render import MemoryLimitExceeded, RenderOptions, Rendition, Thumbnail

if TYPE_CHECKING:
    from worker.thumbnails.render.office import OfficeConverter

# Bounds on what the parent accepts from a child, so that a subverted child cannot make the parent
# allocate without limit; a 4096 px thumbnail is a few MB.
_MAX_THUMBNAIL = 64 * 1024 * 1024


# A child's error reply must carry one of these; anything else is a malformed reply.
_KNOWN_CODES = frozenset(ErrorCode)


class RenderPool(ProcessPool):
    """Up to `workers` concurrent renders (or tasks' jobs), each in its own long-lived child
    process.

    Thread-safe: each calling thread borrows one child for one render. A child that overruns its
    timeout is killed and replaced on a later call; one that exceeds `memory_limit_mb` reports
    `too_large` and is replaced as well.
    """

    serve = __name__
    preload = ("worker.thumbnails.render.image", "worker.thumbnails.render.pdf")

    def __init__(self, opts: RenderOptions, workers: int, memory_limit_mb: int) -> None:
        super().__init__(
            workers, memory_limit_mb, options=asdict(opts), task_modules=tuple(opts.tasks)
        )
        self.opts = opts
        self._office: OfficeConverter | None = None  # started on the first office document

    def __enter__(self) -> RenderPool:
        self.start()
        return self

    def render(
        self,
        data: bytes,
        declared_type: str | None,
        *,
        timeout_s: float,
        degrade_after_s: float | None = None,
    ) -> Thumbnail:
        """Render in a child process; raise ThumbqError(RENDER_TIMEOUT) once `timeout_s` passes.

        With `degrade_after_s`, a render still running after that long is stopped and a cheaper
        one (`RenderOptions.degraded`) gets the rest of the time; its thumbnail is marked
        `degraded`. Office documents go through LibreOffice first when it is configured. Errors
        raised in the child come back with their code and message.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        if self._closed:
            raise pool_stopped()
        if timeout_s <= 0:
            # Nothing could finish; do not start (and then have to kill) a healthy child.
            raise ThumbqError(RENDER_TIMEOUT, "no time was left to render")
        first_deadline = deadline
        if degrade_after_s is not None:
            first_deadline = min(deadline, started + max(degrade_after_s, 0.0))
        office_type = self._office_type(data)
        if office_type is not None:
            return self._render_office(data, office_type, first_deadline, deadline)
        try:
            return self._render_in_child(data, declared_type, first_deadline, degraded=False)
        except Overran:
            if first_deadline >= deadline:
                raise
        try:
            return self._render_in_child(data, declared_type, deadline, degraded=True)
        except Overran:
            raise ThumbqError(
                RENDER_TIMEOUT,
                f"rendering took longer than {timeout_s:.1f} s and was stopped, and so did a "
                "cheaper (degraded) render",
            ) from None

    def _render_in_child(
        self, data: bytes, declared_type: str | None, deadline: float, *, degraded: bool
    ) -> Thumbnail:
        timeout_s = deadline - time.monotonic()
        if timeout_s <= 0:
            raise Overran(RENDER_TIMEOUT, "no time was left to render")
        try:
            child = self._slots.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            raise ThumbqError(
                RENDER_TIMEOUT,
                f"no render process became free within {timeout_s:.1f} s (all {self.workers} busy)",
            ) from None
        try:
            child = self._send(child, data, declared_type, deadline, timeout_s, degraded)
            return self._await_reply(child, deadline, timeout_s)
        except ThumbqError:
            raise
        except BaseException:
            # Interrupted half-way (KeyboardInterrupt, an OS error): the child's state is unknown.
            if child is not None:
                self._kill(child)
            raise
        finally:
            self._slots.put(child if child is not None and not child.dead else None)

    def _office_type(self, data: bytes) -> str | None:
        """The office type of `data` when LibreOffice is configured to convert it, else None
        (the child then shows the document's embedded thumbnail, or says what is missing)."""
        if not self.opts.soffice:
            return None
        from worker.thumbnails.render.sniff import OFFICE_TYPES, sniff

        detected = sniff(data)
        return detected if detected in OFFICE_TYPES else None

    def _render_office(
        self, data: bytes, source_type: str, first_deadline: float, deadline: float
    ) -> Thumbnail:
        """LibreOffice makes a one-page PDF, a child draws it. When LibreOffice overruns its share
        of the window, the document's embedded thumbnail is the degraded fallback."""
        from worker.thumbnails.render.office import OfficeConverter

        with self._lock:
            if self._closed:
                raise pool_stopped()
            if self._office is None:
                assert self.opts.soffice is not None
                self._office = OfficeConverter(self.opts.soffice)
            office = self._office
        try:
            pdf = office.convert_to_pdf(data, source_type, first_deadline, self.opts.pages)
        except ThumbqError as exc:
            if exc.code == RENDER_TIMEOUT and first_deadline < deadline:
                degraded = True
            elif exc.code == CORRUPT_INPUT:
                degraded = False  # LibreOffice cannot read it; its own thumbnail may still do
            else:
                raise
            try:
                return self._render_in_child(data, source_type, deadline, degraded=degraded)
            except ThumbqError as fallback:
                if fallback.code == UNSUPPORTED_TYPE:  # no embedded thumbnail either
                    raise exc from None
                raise
        thumb = self._render_in_child(pdf, "application/pdf", deadline, degraded=False)
        return replace(thumb, source_type=source_type)

    @property
    def office(self) -> OfficeConverter | None:
        """The LibreOffice converter, once an office document has started it (tests, operators)."""
        with self._lock:
            return self._office

    def _closed_extra(self) -> None:
        with self._lock:
            office, self._office = self._office, None
        if office is not None:
            office.close()

    def _send(
        self,
        child: Child | None,
        data: bytes,
        declared_type: str | None,
        deadline: float,
        timeout_s: float,
        degraded: bool = False,
    ) -> Child:
        """Hand the job to `child`, starting one if the slot is empty or its child has died."""
        if child is not None and not child.dead:
            try:
                _send_job(child.sock, data, declared_type, deadline, degraded)
                return child
            except (BrokenPipeError, ConnectionResetError):
                # The child died while idle (the system's OOM killer, an operator): nothing was
                # rendered, so a fresh child can take the job.
                self._kill(child)
            except TimeoutError:
                self._kill(child)
                raise _timeout(timeout_s) from None
        child = self._start_child()
        try:
            _send_job(child.sock, data, declared_type, deadline, degraded)
        except TimeoutError:
            self._kill(child)
            raise _timeout(timeout_s) from None
        return child

    def _await_reply(self, child: Child, deadline: float, timeout_s: float) -> Thumbnail:
        try:
            header = recv_frame(child.sock, deadline, MAX_HEADER)
            payload = (bytes(header), bytes(recv_frame(child.sock, deadline, _MAX_THUMBNAIL)))
        except TimeoutError:
            self._kill(child)
            raise _timeout(timeout_s) from None
        except ValueError:
            self._kill(child)
            raise ThumbqError(INTERNAL, "render process sent an oversized reply") from None
        except (EOFError, OSError):
            self._kill(child)
            if self._closed:
                raise pool_stopped() from None
            raise ThumbqError(
                INTERNAL,
                "render process died unexpectedly (a crash, or killed by the system, "
                "possibly for lack of memory)",
            ) from None
        child.served += 1
        reply = _parse_reply(payload)
        if isinstance(reply, Thumbnail):
            return reply
        error, child_exits = reply
        if child_exits:
            self._kill(child)
        raise error


def _parse_reply(payload: tuple[bytes, bytes]) -> Thumbnail | tuple[ThumbqError, bool]:
    """Read a child's reply as data, never as code: a child that a hostile file managed to
    subvert must not be able to run anything in this process (hence JSON, not pickle)."""
    header_bytes, body = payload
    try:
        header = json.loads(header_bytes)
        if header["ok"] is True:
            renditions = []
            offset = 0
            for r in header["renditions"]:
                length = int(r["length"])
                if length < 0 or offset + length > len(body):
                    raise ValueError("rendition outside the reply")
                renditions.append(
                    Rendition(
                        size=int(r["size"]),
                        data=body[offset : offset + length],
                        width=int(r["width"]),
                        height=int(r["height"]),
                        page=int(r.get("page", 1)),
                    )
                )
                offset += length
            if not renditions or offset != len(body):
                raise ValueError("renditions do not add up to the reply")
            # The first page's largest size (a document's further pages follow it).
            first_page = [r for r in renditions if r.page == renditions[0].page]
            largest = first_page[-1]
            return Thumbnail(
                data=largest.data,
                content_type=str(header["content_type"]),
                width=largest.width,
                height=largest.height,
                source_type=str(header["source_type"]),
                renditions=tuple(renditions),
                thumbhash=_optional_str(header.get("thumbhash"), 100),
                dominant_color=_optional_str(header.get("dominant_color"), 7),
                degraded=bool(header.get("degraded", False)),
            )
        code, message = str(header["code"]), str(header["message"])[:1000]
        exits = bool(header["exit"])
    except (ValueError, KeyError, TypeError):
        return ThumbqError(INTERNAL, "render process sent a malformed reply"), True
    if code not in _KNOWN_CODES:
        return ThumbqError(INTERNAL, f"render process sent an unknown error code: {message}"), True
    return ThumbqError(code, message), exits


def _optional_str(value: object, max_length: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_length:
        raise ValueError("bad placeholder")
    return value


def _timeout(timeout_s: float) -> ThumbqError:
    return Overran(RENDER_TIMEOUT, f"rendering took longer than {timeout_s:.1f} s and was stopped")


def _send_job(
    sock: socket.socket,
    data: bytes,
    declared_type: str | None,
    deadline: float,
    degraded: bool = False,
) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    header = json.dumps([declared_type, len(data), degraded]).encode()
    sock.sendall(FRAME.pack(len(header)) + header)
    sock.sendall(data)


def serve(
    sock: socket.socket, request: Any, options: dict[str, Any], memory_limit_mb: int
) -> tuple[dict[str, Any], bytes]:
    """A child's side of one render request (ProcessPool's `serve` hook)."""
    from worker.thumbnails.render import render

    opts = RenderOptions(
        **{
            **options,
            "sizes": tuple(options.get("sizes") or ()),
            "tasks": tuple(options.get("tasks") or ()),
        }
    )
    declared_type, size, degraded = request
    job_opts = replace(opts, degraded=True) if degraded else opts
    return _render_one(sock, size, declared_type, job_opts, memory_limit_mb, render)


def _render_one(
    sock: socket.socket,
    size: int,
    declared_type: str | None,
    opts: RenderOptions,
    memory_limit_mb: int,
    render: Callable[[bytes, str | None, RenderOptions], Thumbnail],
) -> tuple[dict[str, Any], bytes]:
    """Receive one file and render it: a JSON-able header and the thumbnail bytes. The header's
    "exit" says that this child must exit after replying."""

    def error(code: str, message: str, *, exits: bool) -> tuple[dict[str, Any], bytes]:
        return {"ok": False, "code": code, "message": message, "exit": exits}, b""

    try:
        data = _recv_bytes(sock, size)
        thumb = render(data, declared_type, opts)
    except (MemoryLimitExceeded, MemoryError):
        # Exit after replying: a fresh child starts with an unfragmented heap.
        return error(TOO_LARGE, memory_message(memory_limit_mb), exits=True)
    except ThumbqError as exc:
        return error(exc.code, exc.message, exits=False)
    except (EOFError, OSError) as exc:
        return error(INTERNAL, f"receiving the file failed: {exc}", exits=True)
    except Exception as exc:
        return error(INTERNAL, f"render failed: {type(exc).__name__}: {exc}"[:500], exits=False)
    renditions = thumb.renditions or (
        Rendition(max(thumb.width, thumb.height), thumb.data, thumb.width, thumb.height),
    )
    header = {
        "ok": True,
        "content_type": thumb.content_type,
        "source_type": thumb.source_type,
        "renditions": [
            {
                "size": r.size,
                "width": r.width,
                "height": r.height,
                "length": len(r.data),
                "page": r.page,
            }
            for r in renditions
        ],
        "thumbhash": thumb.thumbhash,
        "dominant_color": thumb.dominant_color,
        "degraded": thumb.degraded,
    }
    return header, b"".join(r.data for r in renditions)


def _recv_bytes(sock: socket.socket, size: int) -> bytes:
    """Receive exactly `size` bytes as one bytes object (no second copy of a large file)."""
    data = sock.recv(size, socket.MSG_WAITALL) if size else b""
    if len(data) == size:
        return data
    # MSG_WAITALL can return early (a signal); finish the rest the slow way.
    return data + bytes(recv_exact(sock, size - len(data), None))
