"""The engine: queue, claims, invocations, tasks; nothing of thumbnails, the CLI or HTTP."""
