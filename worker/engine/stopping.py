"""Clean stops: SIGINT or SIGTERM asks the running invocations to end, not the process to die.

The signal handler only sets the process's stop event (`requested()`). A batch watches it
(`BatchStop`): it claims nothing more, its deadline becomes now + GRACE_S so that renders in
flight may finish, the renders still running at that deadline are stopped with the render pool
(each handed back without an attempt, `StoppableRecorder`), and its normal end (completions
written, the unstarted released, the run finished) does the rest. Servers stop accepting, wait
for the batch in flight to end that way, then exit. A second signal ends the process at once,
as a crash does (its jobs come back when their leases run out).

Signals are process-wide, so the stop event is too: a batch started by an HTTP request in a
server sees the same event as one started by a command.

Exit codes: a command whose work was cut short (`backfill --now`, `enqueue --now`, `demo`,
`run-batch`) exits 130 after SIGINT and 143 after SIGTERM, as a shell reports a process killed
by them, so that a script can tell a finished run from a stopped one. A server (`serve`, `up`,
`scheduler`) exits 0 after either: being stopped is how a server ends (systemd, Docker and
Kubernetes send SIGTERM; a person presses Ctrl-C).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from worker.engine import db
from worker.engine.errors import ThumbqError
from worker.engine.log import log_event
from worker.engine.recording import CUT_AT_DEADLINE, Recorder
from worker.engine.states import Outcome

if TYPE_CHECKING:
    from worker.engine.budget import Budget
    from worker.engine.processes import ProcessPool
    from worker.engine.queue import ClaimedJob

# After a stop, renders in flight get this long to finish (a photo or a slide takes tens to
# hundreds of ms); then the pool is closed and what still runs is handed back. With the end of
# the run (about 0.3 s) and the pool's own close, a command exits 1.5-2.5 s after the signal.
GRACE_S = 1.0
# How long a server waits for requests in flight (a batch: GRACE_S and its end) before it
# closes their connections.
SERVER_WAIT_S = 3.0
# How long a scheduler waits for its call in flight: the answer of a batch that is stopping too
# (`thumbq up`'s own server) comes within GRACE_S and the run's end; a remote API records its
# batch whether or not anyone waits for the answer.
CALL_WAIT_S = 1.5
# How often a batch's watcher looks at the stop event.
WATCH_S = 0.05
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stop(threading.Event):
    """A request to stop, with the name of the signal that made it (None: asked in code).

    Set from a signal handler, which runs on the main thread between two bytecodes: the main
    thread must never hold this event's lock (call `set()`, `wait()` or `clear()` on it) while
    a signal may arrive; `is_set()` takes no lock. Other threads may wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.signal: str | None = None

    def request(self, name: str | None = None) -> None:
        """Ask every invocation of this process to stop."""
        if self.signal is None:
            self.signal = name
        self.set()

    def exit_code(self, *, server: bool) -> int:
        """The process's exit code after this stop (module docstring)."""
        if server:
            return 0
        return 143 if self.signal == "SIGTERM" else 130


_PROCESS_STOP = Stop()


def requested() -> Stop:
    """The process's stop event, set by the first SIGINT or SIGTERM while `on_signals` holds."""
    return _PROCESS_STOP


class Interrupted(Exception):
    """A command stopped by a signal after ending its work cleanly; carries its exit code."""

    def __init__(self, stop: Stop, done: str = "") -> None:
        self.code = stop.exit_code(server=False)
        self.signal = stop.signal or "stop"
        super().__init__(f"{self.signal}: stopped{'; ' + done if done else ''}")


@contextlib.contextmanager
def on_signals() -> Iterator[Stop]:
    """While held (on the main thread), SIGINT and SIGTERM set the process's stop event instead
    of raising KeyboardInterrupt or killing the process; a second one kills it at once."""
    stop = requested()

    def handler(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            # The second: die now, as the default action does (children follow: the render
            # zygote kills its group when our socket closes).
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        stop.request(name)

    previous = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield stop
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def wait_for(stop: Stop, poll_s: float = 0.2) -> str:
    """Block the main thread until `stop` is set; the signal's name. Polls `is_set()` (which
    takes no lock), so the handler never waits on a lock this thread holds."""
    import time

    while not stop.is_set():
        time.sleep(poll_s)
    return stop.signal or "stop"


class BatchStop:
    """Ends one batch early when `stop` is set: its deadline becomes now + GRACE_S (every
    storage call and statement is bound by it), and at that deadline `pool` is closed, which
    stops the renders still running (handed back, not failed). The batch's own end does the
    rest. Runs a watcher thread from `start()` to `close()`."""

    def __init__(
        self,
        stop: threading.Event,
        budget: Budget,
        pool: ProcessPool,
        *,
        grace_s: float = GRACE_S,
    ) -> None:
        self.stop = stop
        self.budget = budget
        self.pool = pool
        self.grace_s = grace_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="thumbq-stop", daemon=True)

    def start(self) -> BatchStop:
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self.stop.wait(WATCH_S):
            if self._done.is_set():
                return
        budget = self.budget
        budget.deadline = min(budget.deadline, budget.clock() + self.grace_s)
        log_event(
            "batch_stopping",
            signal=getattr(self.stop, "signal", None),
            remaining_ms=round(budget.remaining_ms()),
        )
        # Renders are bound by their own timeout, set when they started: stop the ones still
        # running at the new deadline (the end of the run waits for nothing longer).
        if not self._done.wait(budget.remaining_ms() / 1000):
            self.pool.close()


class StoppableRecorder(Recorder):
    """A batch's recorder, except that after a stop an item cut short (its render stopped with
    the pool, or a call cut at the shortened deadline) is handed back without an attempt, as an
    interactive run's is: the stop says nothing of the file."""

    def __init__(self, *args: Any, stop: threading.Event, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop = stop

    def failed(self, job: ClaimedJob, exc: BaseException, window_ms: float) -> Outcome:
        cut = isinstance(exc, db.DeadlineExceeded) or (
            isinstance(exc, ThumbqError) and exc.code in CUT_AT_DEADLINE
        )
        if cut and self.stop.is_set():
            with self.lock:
                self.late.append(job.id)
            return Outcome.RELEASED
        return super().failed(job, exc, window_ms)
