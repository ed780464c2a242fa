"""Long-lived child processes that are killed at a deadline or on a memory limit: where a task's
handler runs (`runs_in="process"`), and where a task that needs its own child side (the
thumbnail task's renders: worker/thumbnails/render/process.py) runs its work.

A hostile input or a runaway handler can spin or allocate without bound, and a library may hold
the GIL; only a separate process can be stopped.

Children are forked from a "zygote": a Python process started with `subprocess` (so it inherits no
thread, lock, socket or database connection of the worker), which imports the pool's `preload`
modules once and then forks one child per request, handing the child's socket back over a Unix
socket. Measured on a busy 2-CPU machine: the zygote is ready in 0.2-0.45 s (nearly all of it the
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
- Worker -> zygote: one frame holding JSON `{"serve", "options", "tasks", "memory_mb"}`: the
  module that serves the child's other requests (or null), its options, the task modules to
  import (THUMBQ_TASKS) and the memory limit. Zygote -> worker: one frame holding the new child's
  pid (8-byte big-endian), sent in the same sendmsg as the worker's end of the child's socket
  (SCM_RIGHTS), so the two arrive together.
- Tasks (worker.engine.tasks, `runs_in="process"`; the child's side is worker.engine.sandbox):
  the worker sends a frame holding a JSON object `{"task", "job", "deadline_in_s"}`. While the
  handler runs, the child sends frames `{"kind": "save", "state"?, "done", "total"}` (a
  checkpoint or progress) and `{"kind": "cancelled?"}`, and waits for the worker's answer
  `{"cancelled": bool}` to each (`"saved": bool` as well to a save: the child's ctx.checkpoint
  raises when it is false). Its reply is a header `{"ok": true, "kind": "result", "result",
  "checkpoint": bool}` or an error header with `"permanent"`, then an empty frame.
- Any other request (a JSON array) goes to the `serve` module's `serve(sock, request, options,
  memory_limit_mb)`, which answers with a header frame and a body frame (the thumbnail task's
  renders: worker/thumbnails/render/process.py has its format).
"""

from __future__ import annotations

import contextlib
import importlib
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
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from worker.engine.errors import (
    INTERNAL,
    RENDER_TIMEOUT,
    ThumbqError,
)

if TYPE_CHECKING:
    from worker.engine.sandbox import TaskReply

_ZYGOTE_BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from worker.engine.processes import zygote_main; "
    "zygote_main(int(sys.argv[2]), json.loads(sys.argv[3]))"
)
FRAME = struct.Struct("!Q")
# A child's answer to a request of its pool's `serve` module: a JSON-able header (its "exit" says
# that the child must exit after replying) and a body.
ServeFn = Callable[[socket.socket, Any, dict[str, Any], int], tuple[dict[str, Any], bytes]]
# A task's handler is told of a deadline this much before its process is killed.
_TASK_GRACE_S = 0.15
# How long close() lets an idle child or the zygote exit on its own before killing it.
_STOP_GRACE_S = 0.5
# After SIGKILL, how long to wait for the kernel to close the child's socket.
_KILL_WAIT_S = 2.0
# Bounds on what the parent accepts from a child, so that a subverted child cannot make the parent
# allocate without limit; a 4096 px thumbnail is a few MB.
MAX_HEADER = 64 * 1024


@dataclass(eq=False)
class Child:
    """One child process of a pool and the parent's end of its socket."""

    pid: int
    sock: socket.socket
    served: int = 0  # jobs and renders it answered
    dead: bool = False


class ProcessPool:
    """Up to `workers` concurrent jobs, each in its own long-lived child process.

    Thread-safe: each calling thread borrows one child for one job. A child that overruns its
    timeout is killed and replaced on a later call; one that exceeds `memory_limit_mb` reports
    `too_large` and is replaced as well. `serve` names the module whose `serve()` answers the
    children's other requests (a subclass's: RenderPool), `options` its options (JSON), `preload`
    the modules the zygote imports once for every child.
    """

    serve: str | None = None
    preload: tuple[str, ...] = ()

    def __init__(
        self,
        workers: int,
        memory_limit_mb: int,
        *,
        options: dict[str, Any] | None = None,
        task_modules: tuple[str, ...] = (),
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.options = options or {}
        self.task_modules = task_modules
        self.workers = workers
        self.memory_limit_mb = memory_limit_mb
        # A slot holds an idle child, or None: start one when it is borrowed. LIFO keeps the
        # most recently used children busy.
        self._slots: queue.LifoQueue[Child | None] = queue.LifoQueue()
        for _ in range(workers):
            self._slots.put(None)
        self._lock = threading.Lock()  # guards _live, _closed, _zygote
        self._fork_lock = threading.Lock()  # one fork request at a time on the zygote's socket
        self._live: set[Child] = set()
        self._zygote: _Zygote | None = None
        self._closed = False

    def __enter__(self) -> ProcessPool:
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

    def run_task(
        self,
        task: str,
        job: dict[str, Any],
        *,
        timeout_s: float,
        on_save: Callable[[Any | None, int | None, int | None], bool],
        is_cancelled: Callable[[], bool],
    ) -> TaskReply:
        """Run a task's handler in a child process (worker.engine.sandbox); kill it once `timeout_s`
        passes (ThumbqError RENDER_TIMEOUT). `on_save(state, done, total)` records the
        handler's checkpoints and progress as they come, and says whether it was written (the
        child's ctx.checkpoint raises if not); `is_cancelled()` answers its checks."""
        from worker.engine.sandbox import TaskNotStarted, TaskReply

        deadline = time.monotonic() + timeout_s
        if self._closed:
            raise pool_stopped()
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
                send_frame(child.sock, request())
            except (BrokenPipeError, ConnectionResetError):
                self._kill(child)
                child = self._start_child()
                send_frame(child.sock, request())
            while True:
                header = json.loads(recv_frame(child.sock, deadline, MAX_HEADER))
                answer = {}
                if header.get("kind") == "save":
                    # A save that arrived before the kill is written and answered first, however
                    # long that takes (on_save has the reserve after the deadline): a checkpoint
                    # in flight at the deadline is not lost to the kill.
                    answer["saved"] = on_save(
                        header.get("state"), header.get("done"), header.get("total")
                    )
                elif header.get("kind") != "cancelled?":
                    recv_frame(child.sock, deadline, 0)
                    break
                answer["cancelled"] = is_cancelled()
                send_frame(child.sock, json.dumps(answer).encode())
            child.served += 1
            if header.get("exit"):
                self._kill(child)
        except TaskNotStarted:
            raise  # its process is idle and healthy: back to its slot
        except TimeoutError:
            if child is not None:
                self._kill(child)
            raise Overran(
                RENDER_TIMEOUT,
                f"the task ran past the invocation's deadline ({timeout_s:.1f} s) and was "
                "stopped (a long task checkpoints: ctx.checkpoint)",
            ) from None
        except (EOFError, OSError, ValueError) as exc:
            if child is not None:
                self._kill(child)
            if self._closed:
                raise pool_stopped() from None
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

    def _start_child_by(self, deadline: float) -> Child | None:
        """A new child if it is ready by `deadline`, else None (it is stopped once ready). A
        cold start (the zygote's interpreter and imports) took over 1.7 s on a loaded 2-core
        machine: a task's worker must not wait past its deadline for it, or its job is
        neither run nor handed back in time (its lease then runs out, an attempt lost)."""
        lock = threading.Lock()
        ready: queue.SimpleQueue[Child | BaseException] = queue.SimpleQueue()
        late = False

        def start() -> None:
            try:
                child: Child | BaseException = self._start_child()
            except BaseException as exc:  # the waiting thread raises it
                child = exc
            with lock:
                if not late:
                    ready.put(child)
                    return
            if isinstance(child, Child):
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
            # Busy in another thread: that render raises PoolStopped (not run, not failed).
            self._kill(child)
        for child in idle:
            # EOF on its socket tells an idle child to exit.
            with contextlib.suppress(OSError):
                child.sock.shutdown(socket.SHUT_WR)
        stop_by = time.monotonic() + _STOP_GRACE_S
        for child in idle:
            if not wait_for_eof(child.sock, max(0.0, stop_by - time.monotonic())):
                self._kill(child)
            self._forget(child)
        if zygote is not None:
            zygote.close()
        self._closed_extra()

    def _closed_extra(self) -> None:
        """What a subclass stops after the children and the zygote (RenderPool: LibreOffice)."""

    # -- internals --------------------------------------------------------------------------------

    def _fork_request(self) -> dict[str, Any]:
        return {
            "serve": self.serve,
            "options": self.options,
            "tasks": list(self.task_modules),
            "memory_mb": self.memory_limit_mb,
        }

    def _start_child(self) -> Child:
        with self._fork_lock:
            for attempt in (1, 2):
                with self._lock:
                    if self._closed:
                        raise pool_stopped()
                    zygote = self._zygote
                try:
                    if zygote is None or not zygote.alive():
                        if zygote is not None:
                            zygote.close()
                        zygote = _Zygote(self.preload)
                        with self._lock:
                            self._zygote = zygote
                    pid, sock = zygote.fork(self._fork_request())
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
        child = Child(pid=pid, sock=sock)
        with self._lock:
            closed = self._closed
            if not closed:
                self._live.add(child)
        if closed:
            # close() ran meanwhile and could not see this child.
            self._kill(child)
            raise pool_stopped()
        return child

    def _kill(self, child: Child) -> None:
        """SIGKILL: a render stuck in C code (PyMuPDF, libjpeg) cannot be interrupted otherwise.

        Returns once the kernel has closed the child's socket, i.e. the child is gone.
        """
        if not child.dead:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)
            wait_for_eof(child.sock, _KILL_WAIT_S)
        self._forget(child)

    def _forget(self, child: Child) -> None:
        child.dead = True
        with contextlib.suppress(OSError):
            child.sock.close()
        with self._lock:
            self._live.discard(child)


class Overran(ThumbqError):
    """A render was stopped at its deadline (as opposed to never starting)."""


class PoolStopped(ThumbqError):
    """A render (or a task's run) that the pool's close() stopped, or that came after it: the
    process is stopping (worker.engine.stopping), which says nothing of the file. Cut short like a
    render at its deadline (`render_timeout`, never `internal`), so that a batch hands the job
    back without an attempt."""


def pool_stopped() -> PoolStopped:
    return PoolStopped(
        RENDER_TIMEOUT, "render stopped: thumbq is stopping (the render pool closed)"
    )


class _Zygote:
    """A clean Python process with the pool's `preload` modules imported, which forks children."""

    def __init__(self, preload: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _ZYGOTE_BOOT,
                    json.dumps(sys.path),
                    str(theirs.fileno()),
                    json.dumps(list(preload)),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        self.sock = ours

    def alive(self) -> bool:
        return self.process.poll() is None

    def fork(self, request: dict[str, Any]) -> tuple[int, socket.socket]:
        """Ask for a new child; returns its pid and the parent's end of its socket."""
        self.sock.settimeout(None)
        send_frame(self.sock, json.dumps(request).encode())
        # The descriptor travels with the reply's first bytes; a stream may split the bytes
        # themselves, so the rest of the frame is read like any other.
        head, fds, _flags, _addr = socket.recv_fds(self.sock, FRAME.size * 2, 1)
        try:
            if not head or not fds:
                raise EOFError("render zygote closed its socket")
            head += recv_exact(self.sock, FRAME.size * 2 - len(head), None)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        size, pid = struct.unpack("!QQ", head)
        if size != FRAME.size:
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


def recv_exact(sock: socket.socket, size: int, deadline: float | None) -> bytearray:
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


def recv_frame(sock: socket.socket, deadline: float | None, max_size: int) -> bytearray:
    (size,) = FRAME.unpack(recv_exact(sock, FRAME.size, deadline))
    if size > max_size:
        raise ValueError(f"frame of {size} bytes is over the limit of {max_size}")
    return recv_exact(sock, size, deadline)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(FRAME.pack(len(payload)) + payload)


def wait_for_eof(sock: socket.socket, timeout_s: float) -> bool:
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


def zygote_main(control_fd: int, preload: list[str]) -> None:
    """Import the `preload` modules once, then fork a child for every request until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The kernel reaps exited children; the parent learns of a death from the child's socket.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    # Its own process group, which its children join: when the worker goes away (its socket
    # closes), the zygote kills the group, so no child renders on for nobody (see _stop_children).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    control = socket.socket(fileno=control_fd)
    # Children inherit these imports (the thumbnail task's: its renderers). Rendering a sample
    # here as well was measured to save a child's first render only a few ms, less than it cost
    # the start of every pool.
    # A library a lean install lacks fails only its format's renders, in the child, by name.
    for module in preload:
        with contextlib.suppress(ImportError):
            importlib.import_module(module)

    zygote_pid = os.getpid()

    while True:
        try:
            request = recv_frame(control, None, MAX_HEADER)
        except (EOFError, OSError):
            _stop_children()
            return
        fork = json.loads(request)
        memory_limit_mb = int(fork["memory_mb"])
        if fork["serve"] is not None:
            importlib.import_module(fork["serve"])  # once: every child has it
        _import_tasks(tuple(fork["tasks"]))
        parent_end, child_end = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                control.close()
                parent_end.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _die_with_parent(zygote_pid)
                _child_main(child_end, fork["serve"], fork["options"], memory_limit_mb)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        child_end.close()
        socket.send_fds(control, [FRAME.pack(FRAME.size) + FRAME.pack(pid)], [parent_end.fileno()])
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


def limit_memory(megabytes: int) -> str:
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
    from worker.engine.tasks import REGISTRY, search_working_dir

    REGISTRY.names()  # the built-in tasks too (Registry's `builtin`)
    search_working_dir()
    for module in modules:
        # A module that fails to import fails its tasks' jobs in the child, with its error.
        with contextlib.suppress(Exception):
            importlib.import_module(module)


def _child_main(
    sock: socket.socket, serve: str | None, options: dict[str, Any], memory_limit_mb: int
) -> None:
    """Serve tasks' jobs (and the `serve` module's requests) one after another until the parent
    closes the socket."""
    serve_other: ServeFn | None = None
    if serve is not None:
        serve_other = importlib.import_module(serve).serve
    limit_memory(memory_limit_mb)
    while True:
        try:
            request = json.loads(recv_frame(sock, None, MAX_HEADER))
        except (EOFError, OSError):
            return
        if isinstance(request, dict):
            from worker.engine.sandbox import run_task

            header = run_task(sock, request, memory_limit_mb)
            try:
                send_frame(sock, json.dumps(header).encode())
                send_frame(sock, b"")
            except (OSError, MemoryError):
                return
            if header.get("exit"):
                return
            continue
        if serve_other is None:
            return
        header, body = serve_other(sock, request, options, memory_limit_mb)
        try:
            send_frame(sock, json.dumps(header).encode())
            send_frame(sock, body)
        except (OSError, MemoryError):
            return
        if header.get("exit"):
            return


def memory_message(megabytes: int) -> str:
    return f"rendering exceeded the memory limit of {megabytes} MB"
