"""A task's handler in a child process: the child's side of worker.engine.processes's
task protocol (its module docstring has the wire format).

The child runs the handler with a TaskContext whose checkpoints, progress and cancellation
checks are questions to the worker over the child's socket; the worker writes them to the
database and answers whether each was written (a checkpoint that was not raises in the
handler, tasks.CheckpointNotSaved). The handler's end is one reply header, read by the worker
as data (TaskReply), never as code.
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

from worker.engine.errors import INTERNAL, TOO_LARGE, MemoryLimitExceeded, ThumbqError
from worker.engine.processes import MAX_HEADER, memory_message, recv_frame, send_frame


class TaskNotStarted(ThumbqError):
    """A task's handler never ran: no process became free, or none was left time by its start
    (a cold process in a short window). It says nothing of the job, which costs no attempt."""


# What a task's error code may look like (it is stored and shown as is).
_CODE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass(frozen=True)
class TaskReply:
    """How a task's handler ended in its child: a result, a checkpoint, or an error (`code`,
    `message`, `permanent`)."""

    ok: bool
    checkpoint: bool = False
    result: Any = None
    state: Any = None
    progress: tuple[int, int | None] | None = None
    code: str | None = None
    message: str | None = None
    permanent: bool = False

    @classmethod
    def from_header(cls, header: dict[str, Any]) -> TaskReply:
        """Read a child's final header as data (never as code), checking its shape."""
        progress = header.get("progress")
        if progress is not None:
            done, total = progress
            progress = (int(done), None if total is None else int(total))
        if header.get("ok") is True:
            return cls(
                ok=True,
                checkpoint=bool(header.get("checkpoint")),
                result=header.get("result"),
                state=header.get("state"),
                progress=progress,
            )
        code = str(header.get("code") or INTERNAL)
        if not _CODE_RE.fullmatch(code):
            code = INTERNAL
        return cls(
            ok=False,
            code=code,
            message=str(header.get("message") or "")[:2000],
            permanent=bool(header.get("permanent")),
        )


class _ChildBackend:
    """A task context's backend in the child: every save and check is a question to the worker,
    answered with whether the job was cancelled meanwhile."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._cancelled = False

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        send_frame(self.sock, json.dumps(message).encode())
        answer = json.loads(recv_frame(self.sock, None, MAX_HEADER))
        self._cancelled = self._cancelled or bool(answer.get("cancelled"))
        return dict(answer)

    def save(self, state: Any | None, done: int | None, total: int | None) -> bool:
        message: dict[str, Any] = {"kind": "save", "done": done, "total": total}
        if state is not None:
            message["state"] = state
        return bool(self._ask(message).get("saved"))

    def cancelled(self) -> bool:
        if not self._cancelled:
            self._ask({"kind": "cancelled?"})
        return self._cancelled


def run_task(sock: socket.socket, request: dict[str, Any], memory_limit_mb: int) -> dict[str, Any]:
    """Run one task's handler in this child; the reply header."""
    from worker.engine import tasks

    def error(code: str, message: str, *, permanent: bool, exits: bool) -> dict[str, Any]:
        return {
            "ok": False,
            "code": code,
            "message": message[:2000],
            "permanent": permanent,
            "exit": exits,
        }

    # The handler's deadline counts from the request's arrival, before anything else is done.
    deadline = time.monotonic() + float(request["deadline_in_s"])
    name = str(request.get("task"))
    registered = tasks.REGISTRY.get(name)
    if registered is None:
        return error(
            tasks.UNSUPPORTED_TASK,
            f"no handler for task {name!r} in the render process (THUMBQ_TASKS)",
            permanent=True,
            exits=False,
        )
    ctx = tasks.TaskContext(request["job"], deadline, _ChildBackend(sock))
    try:
        value = registered.fn(ctx, ctx.payload)
        # The last progress reported goes with the outcome.
        last = ctx.last_progress()
        if isinstance(value, tasks.Checkpoint):
            return {
                "ok": True,
                "kind": "result",
                "checkpoint": True,
                "state": value.state,
                "progress": last,
            }
        json.dumps(value)  # a result the database cannot store fails here, as the handler's
        return {
            "ok": True,
            "kind": "result",
            "checkpoint": False,
            "result": value,
            "progress": last,
        }
    except (MemoryLimitExceeded, MemoryError):
        return error(TOO_LARGE, memory_message(memory_limit_mb), permanent=True, exits=True)
    except tasks.PermanentError as exc:
        return error(exc.code, exc.message, permanent=True, exits=False)
    except tasks.TransientError as exc:
        return error(exc.code, exc.message, permanent=False, exits=False)
    except (EOFError, OSError) as exc:
        # The worker went away (or killed the job): nothing to report to.
        return error(INTERNAL, f"lost the worker: {exc}", permanent=False, exits=True)
    except Exception as exc:
        return error(INTERNAL, f"{type(exc).__name__}: {exc}", permanent=False, exits=False)
