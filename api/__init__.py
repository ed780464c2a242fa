"""The HTTP layer: a Flask app factory and its blueprints (no SQL strings, no rendering here)."""

from __future__ import annotations

import atexit

from flask import Blueprint, Flask

from api.fastpath import ProgressFastPath
from api.state import AppState
from api.validation import MAX_BODY_BYTES
from worker.engine.config import Config


def create_app(
    config: Config | None = None,
    *,
    db_timeout_s: float = 5.0,
    pool_size: int = 4,
    pooled: bool = True,
) -> Flask:
    """Build the app on `config` (default: the environment). Nothing connects until a request
    needs it: the connection pool, storage client and render processes are created lazily and
    kept for the life of the process (closed at exit).

    `db_timeout_s` bounds how long a request waits for a database connection before it answers
    503; `pooled=False` opens one connection per request instead of keeping a pool.
    """
    from api import errors

    config = config or Config.from_env()
    app = Flask("api")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.json.sort_keys = False  # type: ignore[attr-defined]

    st = AppState(config, pool_size=pool_size, db_timeout_s=db_timeout_s, pooled=pooled)
    app.extensions["thumbq"] = st
    app.wsgi_app = ProgressFastPath(app.wsgi_app, st)  # type: ignore[method-assign]
    atexit.register(st.close)

    errors.register_error_handlers(app)

    @app.before_request
    def _configured() -> None:
        # A host where thumbq cannot work (no database, a misspelt task module) says so on every
        # route, /healthz included, instead of a 500 that looks like a bug.
        if (problem := st.configuration_problem()) is not None:
            raise errors.ApiError(503, "not_configured", problem, {"Cache-Control": "no-store"})

    for bp in blueprints():
        app.register_blueprint(bp)
    return app


def blueprints() -> list[Blueprint]:
    """Every blueprint of the API, in the order the app registers them."""
    from api import contract, jobs, metrics, operator, ops, pages, signed, stream, thumbnails

    return [
        thumbnails.bp,
        stream.bp,
        jobs.bp,
        ops.bp,
        metrics.bp,
        signed.bp,
        operator.bp,
        contract.bp,
        pages.bp,
    ]
