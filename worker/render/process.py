"""Run `render()` in long-lived child processes that are killed at a deadline or on a memory limit.

PyMuPDF holds the GIL while it renders and must not be used from two threads, and a hostile file
can make either library spin or allocate without bound; only a separate process can be stopped.

Children are forked from a "zygote": a Python process started with `subprocess` (so it inherits no
thread, lock, socket or database connection of the worker), which imports PyMuPDF and Pillow once
and then forks one child per request, handing the child's socket back over a Unix socket.
Measured on a busy 2-CPU machine: the zygote is ready in 0.2-0.45 s (nearly all of it the
imports), and each child, including the replacement of a killed one, in about 3 ms.
- `fork` straight from the worker would copy its locks mid-use (its threads hold the logging,
  psycopg and OpenSSL locks at random moments) and its open connections.
- `spawn` pays a fresh interpreter and the imports (about 0.3 s) for every child, including every
  replacement of a killed one.
- multiprocessing's "forkserver" is the same idea, but it makes every child re-import the parent's
  `__main__` module (a console script, `python -m bench.render`, a serverless launcher), which
  costs time per child and runs code that was never meant to run there.

The memory limit is RLIMIT_DATA, set by each child on itself. Since Linux 4.7 it counts the heap and
all private writable mappings, which is where Python, Pillow and MuPDF allocate, but not the shared
libraries' code that RLIMIT_AS also counts (a child maps about 100 MB of address space for about
50 MB of data). Either way malloc fails cleanly: Pillow raises MemoryError, MuPDF an error naming
malloc, and the child reports `too_large`, then exits so that its successor starts unfragmented.
macOS enforces neither limit on the memory malloc maps, so there a child is held only by the
input limits (bytes, pixels, pages, checked before decoding) and by the system; other Unixes get
RLIMIT_AS, which they do enforce.

Portability: everything below is plain POSIX and runs the same on Linux and macOS (the CI runs
this very code path). Linux-only calls are made on Linux only: RLIMIT_DATA (above) and prctl's
PDEATHSIG (a child dies with its zygote). Elsewhere a child that outlives a dead worker is
stopped by its zygote instead, which kills its own process group when the worker's socket closes.

Wire format. Every socket is an AF_UNIX stream (macOS has no SOCK_SEQPACKET), and every message
on it is a frame: an 8-byte big-endian unsigned length, then that many bytes.
- Worker -> zygote: one frame holding JSON `[render options, memory limit in MB]`.
  Zygote -> worker: one frame holding the new child's pid (8-byte big-endian), sent in the same
  sendmsg as the worker's end of the child's socket (SCM_RIGHTS), so the two arrive together.
- Worker -> child: a frame holding JSON `[declared type, size, degraded]`, then `size` raw bytes
  (the file); `degraded` asks for the cheaper render (RenderOptions.degraded).
  Child -> worker: a frame holding the JSON reply header, then a frame holding the thumbnails
  (empty on error). The header is `{"ok": false, "code", "message", "exit"}` or `{"ok": true,
  "content_type", "source_type", "renditions": [{"size", "width", "height", "length", "page"},
  ...], "thumbhash", "dominant_color", "degraded"}`, the renditions ascending by size (a
  document's first page, then each further page's: RenderOptions.pages), their bytes one after
  another in the second frame.
- Tasks (worker.tasks, `runs_in="process"`; the child's side is worker.sandbox): the worker
  sends a frame holding a JSON object `{"task", "job", "deadline_in_s"}`. While the handler
  runs, the child sends frames `{"kind": "save", "state"?, "done", "total"}` (a checkpoint or
  progress) and
  `{"kind": "cancelled?"}`, and waits for the worker's answer `{"cancelled": bool}` to each
  (`"saved": bool` as well to a save: the child's ctx.checkpoint raises when it is false). Its
  reply ends as a render's does: a header `{"ok": true, "kind": "result", "result",
  "checkpoint": bool}` or an error header with `"permanent"`, then an empty frame.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import resource
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Any

from worker.errors import (
    CORRUPT_INPUT,
    INTERNAL,
    RENDER_TIMEOUT,
    TOO_LARGE,
    UNSUPPORTED_TYPE,
    ErrorCode,
    ThumbqError,
)
from worker.render import MemoryLimitExceeded, RenderOptions, Rendition, Thumbnail

if TYPE_CHECKING:
    from worker.render.office import OfficeConverter
    from worker.sandbox import TaskReply

_ZYGOTE_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from worker.render.process import _zygote_main; _zygote_main(int(sys.argv[2]))"
)
_FRAME = struct.Struct("!Q")
# A task's handler is told of a deadline this much before its process is killed.
_TASK_GRACE_S = 0.15
# How long close() lets an idle child or the zygote exit on its own before killing it.
_STOP_GRACE_S = 0.5
# After SIGKILL, how long to wait for the kernel to close the child's socket.
_KILL_WAIT_S = 2.0
# Bounds on what the parent accepts from a child, so that a subverted child cannot make the parent
# allocate without limit; a 4096 px thumbnail is a few MB.
_MAX_HEADER = 64 * 1024
_MAX_THUMBNAIL = 64 * 1024 * 1024
# A child's error reply must carry one of these; anything else is a malformed reply.
_KNOWN_CODES = frozenset(ErrorCode)


@dataclass(eq=False)
class _Child:
    pid: int
    sock: socket.socket
    renders: int = 0
    dead: bool = False


class RenderPool:
    """Up to `workers` concurrent renders, each in its own long-lived child process.

    Thread-safe: each calling thread borrows one child for one render. A child that overruns its
    timeout is killed and replaced on a later call; one that exceeds `memory_limit_mb` reports
    `too_large` and is replaced as well.
    """

    def __init__(self, opts: RenderOptions, workers: int, memory_limit_mb: int) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.opts = opts
        self.workers = workers
        self.memory_limit_mb = memory_limit_mb
        # A slot holds an idle child, or None: start one when it is borrowed. LIFO keeps the
        # most recently used children busy.
        self._slots: queue.LifoQueue[_Child | None] = queue.LifoQueue()
        for _ in range(workers):
            self._slots.put(None)
        self._lock = threading.Lock()  # guards _live, _closed, _zygote
        self._fork_lock = threading.Lock()  # one fork request at a time on the zygote's socket
        self._live: set[_Child] = set()
        self._zygote: _Zygote | None = None
        self._closed = False
        self._office: OfficeConverter | None = None  # started on the first office document

    def __enter__(self) -> RenderPool:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        """Start the zygote and every child now, so that the first renders do not wait."""
        borrowed = [self._slots.get() for _ in range(self.workers)]
        try:
            for i, child in enumerate(borrowed):
                if child is None or child.dead:
                    borrowed[i] = self._start_child()
        finally:
            for child in borrowed:
                self._slots.put(child if child is not None and not child.dead else None)

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
            raise _stopped()
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
        except _Overran:
            if first_deadline >= deadline:
                raise
        try:
            return self._render_in_child(data, declared_type, deadline, degraded=True)
        except _Overran:
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
            raise _Overran(RENDER_TIMEOUT, "no time was left to render")
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

    def run_task(
        self,
        task: str,
        job: dict[str, Any],
        *,
        timeout_s: float,
        on_save: Callable[[Any | None, int | None, int | None], bool],
        is_cancelled: Callable[[], bool],
    ) -> TaskReply:
        """Run a task's handler in a child process (worker.sandbox); kill it once `timeout_s`
        passes (ThumbqError RENDER_TIMEOUT). `on_save(state, done, total)` records the
        handler's checkpoints and progress as they come, and says whether it was written (the
        child's ctx.checkpoint raises if not); `is_cancelled()` answers its checks."""
        from worker.sandbox import TaskNotStarted, TaskReply

        deadline = time.monotonic() + timeout_s
        if self._closed:
            raise _stopped()
        if timeout_s <= 0:
            raise TaskNotStarted(RENDER_TIMEOUT, "no time was left to run the task")
        try:
            child = self._slots.get(timeout=timeout_s)
        except queue.Empty:
            raise TaskNotStarted(
                RENDER_TIMEOUT,
                f"no process became free within {timeout_s:.1f} s (all {self.workers} busy)",
            ) from None
        # The handler sees a deadline a little before the kill, so that a checkpoint made at
        # its last moment still reaches the worker.
        grace_s = min(_TASK_GRACE_S, timeout_s / 4)

        def request() -> bytes:
            # The child counts its deadline from when the request arrives: measured at the
            # send, so that the time a process took to start is not given to the handler.
            left_s = deadline - time.monotonic() - grace_s
            return json.dumps({"task": task, "job": job, "deadline_in_s": left_s}).encode()

        try:
            if child is None or child.dead:
                child = self._start_child_by(deadline - grace_s)
            if child is None or deadline - time.monotonic() <= grace_s:
                raise TaskNotStarted(
                    RENDER_TIMEOUT, "its process took the whole window to start: it never ran"
                )
            try:
                child.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                _send_frame(child.sock, request())
            except (BrokenPipeError, ConnectionResetError):
                self._kill(child)
                child = self._start_child()
                _send_frame(child.sock, request())
            while True:
                header = json.loads(_recv_frame(child.sock, deadline, _MAX_HEADER))
                answer = {}
                if header.get("kind") == "save":
                    # A save that arrived before the kill is written and answered first, however
                    # long that takes (on_save has the reserve after the deadline): a checkpoint
                    # in flight at the deadline is not lost to the kill.
                    answer["saved"] = on_save(
                        header.get("state"), header.get("done"), header.get("total")
                    )
                elif header.get("kind") != "cancelled?":
                    _recv_frame(child.sock, deadline, 0)
                    break
                answer["cancelled"] = is_cancelled()
                _send_frame(child.sock, json.dumps(answer).encode())
            child.renders += 1
            if header.get("exit"):
                self._kill(child)
        except TaskNotStarted:
            raise  # its process is idle and healthy: back to its slot
        except TimeoutError:
            if child is not None:
                self._kill(child)
            raise _Overran(
                RENDER_TIMEOUT,
                f"the task ran past the invocation's deadline ({timeout_s:.1f} s) and was "
                "stopped (a long task checkpoints: ctx.checkpoint)",
            ) from None
        except (EOFError, OSError, ValueError) as exc:
            if child is not None:
                self._kill(child)
            if self._closed:
                raise _stopped() from None
            raise ThumbqError(
                INTERNAL, f"the task's process died or sent a malformed message: {exc}"
            ) from None
        except BaseException:
            if child is not None:
                self._kill(child)
            raise
        finally:
            self._slots.put(child if child is not None and not child.dead else None)
        return TaskReply.from_header(header)

    def _start_child_by(self, deadline: float) -> _Child | None:
        """A new child if it is ready by `deadline`, else None (it is stopped once ready). A
        cold start (the zygote's interpreter and imports) took over 1.7 s on a loaded 2-core
        machine: a task's worker must not wait past its deadline for it, or its job is
        neither run nor handed back in time (its lease then runs out, an attempt lost)."""
        lock = threading.Lock()
        ready: queue.SimpleQueue[_Child | BaseException] = queue.SimpleQueue()
        late = False

        def start() -> None:
            try:
                child: _Child | BaseException = self._start_child()
            except BaseException as exc:  # the waiting thread raises it
                child = exc
            with lock:
                if not late:
                    ready.put(child)
                    return
            if isinstance(child, _Child):
                self._kill(child)  # the zygote stays: the next child forks in milliseconds

        threading.Thread(target=start, name="thumbq-child-start", daemon=True).start()
        try:
            got = ready.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            with lock:
                late = True
                if ready.empty():
                    return None
                got = ready.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def _office_type(self, data: bytes) -> str | None:
        """The office type of `data` when LibreOffice is configured to convert it, else None
        (the child then shows the document's embedded thumbnail, or says what is missing)."""
        if not self.opts.soffice:
            return None
        from worker.render.sniff import OFFICE_TYPES, sniff

        detected = sniff(data)
        return detected if detected in OFFICE_TYPES else None

    def _render_office(
        self, data: bytes, source_type: str, first_deadline: float, deadline: float
    ) -> Thumbnail:
        """LibreOffice makes a one-page PDF, a child draws it. When LibreOffice overruns its share
        of the window, the document's embedded thumbnail is the degraded fallback."""
        from worker.render.office import OfficeConverter

        with self._lock:
            if self._closed:
                raise _stopped()
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

    def pids(self) -> list[int]:
        """Process ids of the live children (for tests and operators)."""
        with self._lock:
            return [child.pid for child in self._live]

    def close(self) -> None:
        """Stop every child and the zygote: idle ones exit on their own, busy ones are killed."""
        with self._lock:
            self._closed = True
            live = set(self._live)
            zygote, self._zygote = self._zygote, None
        idle = []
        with contextlib.suppress(queue.Empty):
            while True:
                child = self._slots.get_nowait()
                if child is not None and child in live:
                    idle.append(child)
        for child in live.difference(idle):
            # Busy in another thread: that render raises RenderStopped (not run, not failed).
            self._kill(child)
        for child in idle:
            # EOF on its socket tells an idle child to exit.
            with contextlib.suppress(OSError):
                child.sock.shutdown(socket.SHUT_WR)
        stop_by = time.monotonic() + _STOP_GRACE_S
        for child in idle:
            if not _wait_for_eof(child.sock, max(0.0, stop_by - time.monotonic())):
                self._kill(child)
            self._forget(child)
        if zygote is not None:
            zygote.close()
        with self._lock:
            office, self._office = self._office, None
        if office is not None:
            office.close()

    # -- internals --------------------------------------------------------------------------------

    def _start_child(self) -> _Child:
        with self._fork_lock:
            for attempt in (1, 2):
                with self._lock:
                    if self._closed:
                        raise _stopped()
                    zygote = self._zygote
                try:
                    if zygote is None or not zygote.alive():
                        if zygote is not None:
                            zygote.close()
                        zygote = _Zygote()
                        with self._lock:
                            self._zygote = zygote
                    pid, sock = zygote.fork(self.opts, self.memory_limit_mb)
                    break
                except (OSError, EOFError) as exc:
                    # The zygote died (killed by an operator or the OOM killer) or could not
                    # start: try a fresh one once.
                    if zygote is not None:
                        zygote.close()
                    with self._lock:
                        self._zygote = None
                    if attempt == 2:
                        reason = str(exc) or type(exc).__name__
                        raise ThumbqError(
                            INTERNAL, f"cannot start a render process: {reason}"
                        ) from None
        child = _Child(pid=pid, sock=sock)
        with self._lock:
            closed = self._closed
            if not closed:
                self._live.add(child)
        if closed:
            # close() ran meanwhile and could not see this child.
            self._kill(child)
            raise _stopped()
        return child

    def _send(
        self,
        child: _Child | None,
        data: bytes,
        declared_type: str | None,
        deadline: float,
        timeout_s: float,
        degraded: bool = False,
    ) -> _Child:
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

    def _await_reply(self, child: _Child, deadline: float, timeout_s: float) -> Thumbnail:
        try:
            header = _recv_frame(child.sock, deadline, _MAX_HEADER)
            payload = (bytes(header), bytes(_recv_frame(child.sock, deadline, _MAX_THUMBNAIL)))
        except TimeoutError:
            self._kill(child)
            raise _timeout(timeout_s) from None
        except ValueError:
            self._kill(child)
            raise ThumbqError(INTERNAL, "render process sent an oversized reply") from None
        except (EOFError, OSError):
            self._kill(child)
            if self._closed:
                raise _stopped() from None
            raise ThumbqError(
                INTERNAL,
                "render process died unexpectedly (a crash, or killed by the system, "
                "possibly for lack of memory)",
            ) from None
        child.renders += 1
        reply = _parse_reply(payload)
        if isinstance(reply, Thumbnail):
            return reply
        error, child_exits = reply
        if child_exits:
            self._kill(child)
        raise error

    def _kill(self, child: _Child) -> None:
        """SIGKILL: a render stuck in C code (PyMuPDF, libjpeg) cannot be interrupted otherwise.

        Returns once the kernel has closed the child's socket, i.e. the child is gone.
        """
        if not child.dead:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            _wait_for_eof(child.sock, _KILL_WAIT_S)
        self._forget(child)

    def _forget(self, child: _Child) -> None:
        child.dead = True
        with contextlib.suppress(OSError):
            child.sock.close()
        with self._lock:
            self._live.discard(child)


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


class _Overran(ThumbqError):
    """A render was stopped at its deadline (as opposed to never starting)."""


class RenderStopped(ThumbqError):
    """A render (or a task's run) that the pool's close() stopped, or that came after it: the
    process is stopping (worker.stopping), which says nothing of the file. Cut short like a
    render at its deadline (`render_timeout`, never `internal`), so that a batch hands the job
    back without an attempt."""


def _stopped() -> RenderStopped:
    return RenderStopped(
        RENDER_TIMEOUT, "render stopped: thumbq is stopping (the render pool closed)"
    )


def _timeout(timeout_s: float) -> ThumbqError:
    return _Overran(RENDER_TIMEOUT, f"rendering took longer than {timeout_s:.1f} s and was stopped")


class _Zygote:
    """A clean Python process with the renderers imported, which forks render children."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _ZYGOTE_BOOT, json.dumps(sys.path), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self.sock = ours

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, opts: RenderOptions, memory_limit_mb: int) -> tuple[int, socket.socket]:
        """Ask for a new child; returns its pid and the parent's end of its socket."""
        self.sock.settimeout(None)
        _send_frame(self.sock, json.dumps([asdict(opts), memory_limit_mb]).encode())
        # The descriptor travels with the reply's first bytes; a stream may split the bytes
        # themselves, so the rest of the frame is read like any other.
        head, fds, _flags, _addr = socket.recv_fds(self.sock, _FRAME.size * 2, 1)
        try:
            if not head or not fds:
                raise EOFError("render zygote closed its socket")
            head += _recv_exact(self.sock, _FRAME.size * 2 - len(head), None)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        size, pid = struct.unpack("!QQ", head)
        if size != _FRAME.size:
            os.close(fds[0])
            raise EOFError("render zygote sent a malformed reply")
        return pid, socket.socket(fileno=fds[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        try:
            self.process.wait(_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- framing ---------------------------------------------------------------------------------------


def _send_job(
    sock: socket.socket,
    data: bytes,
    declared_type: str | None,
    deadline: float,
    degraded: bool = False,
) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 0.001))
    header = json.dumps([declared_type, len(data), degraded]).encode()
    sock.sendall(_FRAME.pack(len(header)) + header)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError
        got += n
    return buf


def _recv_frame(sock: socket.socket, deadline: float | None, max_size: int) -> bytearray:
    (size,) = _FRAME.unpack(_recv_exact(sock, _FRAME.size, deadline))
    if size > max_size:
        raise ValueError(f"frame of {size} bytes is over the limit of {max_size}")
    return _recv_exact(sock, size, deadline)


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def _wait_for_eof(sock: socket.socket, timeout_s: float) -> bool:
    """Read and drop whatever is left until EOF; False if the peer is still there at the timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            sock.settimeout(remaining)
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


# -- zygote and child side -----------------------------------------------------------------------


def _zygote_main(control_fd: int) -> None:
    """Import the renderers once, then fork a render child for every request until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The kernel reaps exited children; the parent learns of a death from the child's socket.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # Its own process group, which its children join: when the worker goes away (its socket
    # closes), the zygote kills the group, so no child renders on for nobody (see _stop_children).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    control = socket.socket(fileno=control_fd)
    # Children inherit these imports. Rendering a sample here as well was measured to save a
    # child's first render only a few ms, less than it cost the start of every pool.
    # A library a lean install lacks fails only its format's renders, in the child, by name.
    with contextlib.suppress(ImportError):
        import worker.render.image
    with contextlib.suppress(ImportError):
        import worker.render.pdf  # noqa: F401

    zygote_pid = os.getpid()

    while True:
        try:
            request = _recv_frame(control, None, _MAX_HEADER)
        except (EOFError, OSError):
            _stop_children()
            return
        options, memory_limit_mb = json.loads(request)
        opts = RenderOptions(
            **{
                **options,
                "sizes": tuple(options.get("sizes") or ()),
                "tasks": tuple(options.get("tasks") or ()),
            }
        )
        _import_tasks(opts.tasks)
        parent_end, child_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                control.close()
                parent_end.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent(zygote_pid)
                _child_main(child_end, opts, memory_limit_mb)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        child_end.close()
        socket.send_fds(
            control, [_FRAME.pack(_FRAME.size) + _FRAME.pack(pid)], [parent_end.fileno()]
        )
        parent_end.close()


def _stop_children() -> None:
    """Kill this zygote's process group (its children, and itself) if it leads one.

    Runs when the worker's socket closes: after a normal close() no child is left, but after the
    worker was killed a child may still be busy with a pathological file. PDEATHSIG covers this
    on Linux; this is the same guarantee everywhere else, and it runs on Linux too.
    """
    if os.getpgrp() == os.getpid():
        # SIGKILL cannot be caught: this is also the zygote's own exit.
        os.killpg(os.getpgrp(), signal.SIGKILL)


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this child when the zygote exits (Linux only: prctl).

    The zygote exits when the worker closes its socket, including when the worker itself dies;
    without this, a child busy with a pathological page would go on rendering for nobody. It also
    covers a zygote killed outright, which _stop_children cannot.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the zygote was already gone before prctl took effect
        os._exit(0)


def _limit_memory(megabytes: int) -> str:
    """Cap this process's private memory; returns the mechanism used (for diagnostics)."""
    limit = megabytes * 1024 * 1024
    if sys.platform.startswith("linux"):
        names: tuple[str, ...] = ("RLIMIT_DATA", "RLIMIT_AS")
    elif sys.platform == "darwin":
        names = ()  # neither is enforced on what malloc maps (module docstring)
    else:
        names = ("RLIMIT_AS",)  # RLIMIT_DATA elsewhere counts only brk, which malloc rarely uses
    for name in names:
        which = getattr(resource, name, None)
        if which is None:
            continue
        try:
            resource.setrlimit(which, (limit, limit))
        except (ValueError, OSError):
            continue
        return name
    return "none"


def _import_tasks(modules: tuple[str, ...]) -> None:
    """Import the task modules in the zygote (once each), so that every child has them."""
    import importlib

    from worker.tasks import search_working_dir

    search_working_dir()
    for module in modules:
        # A module that fails to import fails its tasks' jobs in the child, with its error.
        with contextlib.suppress(Exception):
            importlib.import_module(module)


def _child_main(sock: socket.socket, opts: RenderOptions, memory_limit_mb: int) -> None:
    """Serve renders (and tasks' jobs) one after another until the parent closes the socket."""
    from worker.render import render

    _limit_memory(memory_limit_mb)
    while True:
        try:
            request = json.loads(_recv_frame(sock, None, _MAX_HEADER))
        except (EOFError, OSError):
            return
        if isinstance(request, dict):
            from worker.sandbox import run_task

            header = run_task(sock, request, memory_limit_mb)
            try:
                _send_frame(sock, json.dumps(header).encode())
                _send_frame(sock, b"")
            except (OSError, MemoryError):
                return
            if header.get("exit"):
                return
            continue
        declared_type, size, degraded = request
        job_opts = replace(opts, degraded=True) if degraded else opts
        header, body = _render_one(sock, size, declared_type, job_opts, memory_limit_mb, render)
        try:
            _send_frame(sock, json.dumps(header).encode())
            _send_frame(sock, body)
        except (OSError, MemoryError):
            return
        if header.get("exit"):
            return


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
        return error(TOO_LARGE, _memory_message(memory_limit_mb), exits=True)
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
    return data + bytes(_recv_exact(sock, size - len(data), None))


def _memory_message(megabytes: int) -> str:
    return f"rendering exceeded the memory limit of {megabytes} MB"
