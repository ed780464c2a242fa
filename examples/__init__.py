"""Runnable task modules for the other systems the engine serves (docs/tasks.md, "Examples").

- `examples.docgen`: documents from an external HTTP API with a quota (its bucket), one job per
  request, duplicate requests collapsed by the request's hash.
- `examples.segments`: the segments of a file processed strictly in order, one at a time per
  file, each resumable from its checkpoints.
- `examples.export`: a large table streamed to storage as one CSV over many invocations,
  cancellable, with progress.

Each runs under `thumbq up` with `THUMBQ_TASKS=examples.<name>`; `python -m examples.<name>
--help` lists the commands that enqueue its demo jobs.
"""
