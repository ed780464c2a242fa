"""The WSGI entry point for platforms that load `app` from api/ (e.g. Vercel's Python runtime).

Configuration comes from the environment; nothing connects until the first request.
"""

from __future__ import annotations

from api import create_app

app = create_app()
