"""The public interface of task modules: `from worker.tasks import task, TaskContext,
PermanentError, TransientError` (the engine's room, worker/engine, holds the implementation)."""

from __future__ import annotations

from worker.engine.tasks import (
    Checkpoint,
    CheckpointNotSaved,
    PermanentError,
    TaskContext,
    TransientError,
    task,
)

__all__ = [
    "Checkpoint",
    "CheckpointNotSaved",
    "PermanentError",
    "TaskContext",
    "TransientError",
    "task",
]
