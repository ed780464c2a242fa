"""Configuration, read once from the environment into a frozen dataclass and passed down."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

# The memory of a serverless function (Netlify's limit, Vercel's default). The render processes
# share what the worker leaves of it; the reserve holds Python with psycopg (about 100 MB), the
# zygote (about 50 MB) and the source files in flight.
FUNCTION_MEMORY_MB = 1024
WORKER_RESERVE_MB = 384


def default_render_memory_mb(concurrency: int) -> int:
    """Per render process: the function's memory less the worker's, split between the
    `concurrency` processes that may render at once, so that together they cannot exceed it."""
    return max(64, (FUNCTION_MEMORY_MB - WORKER_RESERVE_MB) // max(concurrency, 1))


class ConfigError(ValueError):
    """A configuration value that cannot be used, with the variable named."""


def check_task_modules(modules: tuple[str, ...]) -> None:
    """Raise ConfigError naming a THUMBQ_TASKS module that Python cannot find (a typo), before
    anything runs: found without being imported, so a check costs no module's import time (they
    are imported where tasks run, worker.engine.tasks.load_modules)."""
    import importlib.util

    from worker.engine.tasks import search_working_dir

    search_working_dir()  # the current directory, as load_modules looks there too
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a missing parent package, or not a module name
            found = False
        if not found:
            raise ConfigError(
                f"THUMBQ_TASKS names {module!r}, which is no module Python can find (on its "
                f"path or in {os.getcwd()}): check its spelling, run thumbq where the module "
                "is, or install it"
            )


# The file in THUMBQ_HOME that keeps the admin secret `thumbq up` generates (mode 0600), so that
# every command of the same home (serve, scheduler, watch) uses the same one.
SECRET_FILE = "cron_secret"  # noqa: S105 (a file name)
MIN_SECRET_LENGTH = 16


def default_home() -> Path:
    """The per-user data directory (~/.local/share/thumbq on Linux, ~/Library/Application
    Support/thumbq on macOS, %LOCALAPPDATA%\\thumbq on Windows): the same for every command
    of a user, wherever it is run from."""
    import platformdirs

    return Path(platformdirs.user_data_dir("thumbq", appauthor=False))


def read_secret_file(path: Path) -> str | None:
    """The secret kept in `path`, or None when there is none (or it is cut short)."""
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return secret if len(secret) >= MIN_SECRET_LENGTH else None


def _database_url(env: Mapping[str, str]) -> str | None:
    raw = _str(env, "DATABASE_URL")
    if raw is None:
        return None
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    # A URL (postgresql://...) or libpq's key=value form; anything else fails later, at the
    # first connection, with a message about libpq's syntax.
    try:
        if "=" not in raw and "://" not in raw:
            raise ProgrammingError(raw)
        conninfo_to_dict(raw)
    except ProgrammingError:
        raise ConfigError(
            "DATABASE_URL is not a Postgres connection string: set it to "
            "postgresql://USER:PASSWORD@HOST:5432/DBNAME (or unset it for the embedded Postgres)"
        ) from None
    return raw


def _int(env: Mapping[str, str], name: str, default: int, *, lo: int, hi: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be between {lo} and {hi}, got {value}")
    return value


def _sizes(env: Mapping[str, str], default: int) -> tuple[int, ...]:
    """THUMBQ_THUMB_SIZES: comma-separated box sizes (16-4096), e.g. "128,256,512"."""
    raw = env.get("THUMBQ_THUMB_SIZES")
    if raw is None or raw.strip() == "":
        return (default,)
    sizes = set()
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            size = int(part)
        except ValueError:
            raise ConfigError(
                f"THUMBQ_THUMB_SIZES must be comma-separated integers, got {raw!r}"
            ) from None
        if not 16 <= size <= 4096:
            raise ConfigError(f"THUMBQ_THUMB_SIZES values must be between 16 and 4096, got {size}")
        sizes.add(size)
    if not sizes:
        raise ConfigError(f"THUMBQ_THUMB_SIZES names no size: {raw!r}")
    if len(sizes) > 8:
        raise ConfigError("THUMBQ_THUMB_SIZES may name at most 8 sizes")
    return tuple(sorted(sizes))


def _soffice(env: Mapping[str, str]) -> str | None:
    """THUMBQ_SOFFICE: LibreOffice's executable; unset finds `soffice` on PATH; "off" disables."""
    raw = (env.get("THUMBQ_SOFFICE") or "").strip()
    if raw.lower() in ("off", "none", "0", "false"):
        return None
    if raw:
        found = shutil.which(raw, path=env.get("PATH"))
        if found is None:
            raise ConfigError(f"THUMBQ_SOFFICE names {raw!r}, which is not an executable")
        return found
    path = env.get("PATH")
    return shutil.which("soffice", path=path) or shutil.which("libreoffice", path=path)


def _webhook(env: Mapping[str, str]) -> tuple[str | None, bytes | None]:
    """THUMBQ_WEBHOOK_URL (http or https) and THUMBQ_WEBHOOK_SECRET (`whsec_` + base64 of the
    key, as Standard Webhooks writes it): both or neither."""
    import base64
    import binascii

    url = _str(env, "THUMBQ_WEBHOOK_URL")
    secret = _str(env, "THUMBQ_WEBHOOK_SECRET")
    if url is None and secret is None:
        return None, None
    if url is None or secret is None:
        missing = "THUMBQ_WEBHOOK_SECRET" if url else "THUMBQ_WEBHOOK_URL"
        raise ConfigError(
            f"webhooks need THUMBQ_WEBHOOK_URL and THUMBQ_WEBHOOK_SECRET: set {missing}"
        )
    if urlsplit(url).scheme not in ("https", "http") or not urlsplit(url).netloc:
        raise ConfigError(f"THUMBQ_WEBHOOK_URL must be an http(s) URL, got {url!r}")
    try:
        if not secret.startswith("whsec_"):
            raise ValueError
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except (ValueError, binascii.Error):
        raise ConfigError(
            "THUMBQ_WEBHOOK_SECRET must be whsec_ followed by base64 (e.g. "
            "`python -c \"import os,base64; print('whsec_' + base64.b64encode(os.urandom(32))"
            '.decode())"`)'
        ) from None
    if len(key) < MIN_SECRET_LENGTH:
        raise ConfigError(f"THUMBQ_WEBHOOK_SECRET's key must be at least {MIN_SECRET_LENGTH} bytes")
    return url, key


def _str(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return raw if raw else None


@dataclass(frozen=True)
class Config:
    """Everything thumbq reads from the environment, with the documented defaults."""

    home: Path
    database_url: str | None = None
    # Where the admin secret came from: THUMBQ_CRON_SECRET (or CRON_SECRET), the home's secret
    # file, or nowhere (None).
    cron_secret_source: str | None = None
    # THUMBQ_DEBUG: the CLI prints tracebacks instead of one line per error.
    debug: bool = False
    storage_url: str = ""
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    cron_secret: str | None = None
    jwt_secret: str | None = None
    budget_ms: int = 10_000
    buffer_ms: int = 2_000
    # The most jobs one invocation claims. High enough that the time budget binds first: at 500,
    # an invocation of small files stopped after about 6 of its 8 s of work (bench.formats).
    batch_size: int = 5000
    concurrency: int = 2
    max_attempts: int = 3
    thumb_size: int = 512  # the largest of thumb_sizes
    thumb_format: str = "webp"
    thumb_sizes: tuple[int, ...] = (512,)
    # LibreOffice's soffice, which renders office documents; None: embedded thumbnails only.
    soffice: str | None = None
    pdf_page: int = 1
    # "contain": the whole picture inside each box; "cover": a square of each box (pictures keep
    # their most salient part, documents the top of the page).
    thumb_fit: str = "contain"
    # Pages 1..N of a multi-page document (PDF, office, EPUB) get a thumbnail each.
    pages: int = 1
    max_pixels: int = 80_000_000
    max_pages: int = 10_000
    max_bytes: int = 100 * 1024 * 1024
    render_memory_mb: int = 320  # default_render_memory_mb(2)
    rate_bucket: str = "thumbnail_generation"
    # Finished jobs, batch runs and archived messages older than this are pruned by
    # cleanup-stale (0 keeps everything); group summaries stay.
    retention_days: int = 30
    # Modules whose @task handlers this process runs besides the built-in thumbnail task.
    tasks: tuple[str, ...] = ()
    # A priority's queue whose oldest job has waited this long counts one priority higher.
    priority_ageing_s: int = 60
    # How long one process reuses a progress answer for a group (0: read the database each time).
    progress_cache_ms: int = 500
    # How long one process trusts RLS's "this user may see this group" (a "may not" is kept only
    # as long as a progress answer). 0: every user poll reads through RLS.
    access_cache_ms: int = 30_000
    # Progress streams (Server-Sent Events) one API process serves at once; 0 turns them off.
    max_streams: int = 32
    api_url: str = "http://127.0.0.1:8000"
    schedule: str = "*/5 * * * *"
    supabase_url: str | None = None
    supabase_anon_key: str | None = None
    # Where the project's JWT signing keys are published (THUMBQ_JWKS_URL, else derived from
    # SUPABASE_URL); None: only the HS256 secret verifies user tokens.
    jwks_url: str | None = None
    # Where the progress page loads supabase-js (an ES module) from, when Realtime is configured.
    supabase_js_url: str = "https://esm.sh/@supabase/supabase-js@2"
    # A read-only bearer token for GET /metrics (the admin secret works too).
    metrics_token: str | None = None
    # Where group.completed events are POSTed, and the Standard Webhooks key that signs them
    # (the bytes after `whsec_`, base64-decoded); None: no webhooks.
    webhook_url: str | None = None
    webhook_key: bytes | None = None
    # How long the thumbnail URLs in job answers work; None: job answers carry no URLs.
    signed_url_ttl_s: int | None = None

    @property
    def deadline_ms(self) -> int:
        """Milliseconds of work an invocation may do: budget minus the safety buffer."""
        return self.budget_ms - self.buffer_ms

    @property
    def thumb_ext(self) -> str:
        return "jpg" if self.thumb_format == "jpeg" else self.thumb_format

    @property
    def all_thumb_sizes(self) -> tuple[int, ...]:
        """Every size to make, ascending (`thumb_sizes`, and `thumb_size` if set apart)."""
        return tuple(sorted({*self.thumb_sizes, self.thumb_size}))

    def with_(self, **changes: object) -> Config:
        """A copy with some fields changed (tests, CLI flags)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Read the configuration from `env` (default: the process environment)."""
        env = os.environ if env is None else env
        home = Path(env.get("THUMBQ_HOME") or default_home()).expanduser().resolve()
        cron_secret = _str(env, "THUMBQ_CRON_SECRET") or _str(env, "CRON_SECRET")
        secret_source = "THUMBQ_CRON_SECRET" if cron_secret else None
        if cron_secret is None:
            cron_secret = read_secret_file(home / SECRET_FILE)
            secret_source = str(home / SECRET_FILE) if cron_secret else None
        storage_url = _str(env, "THUMBQ_STORAGE_URL") or (home / "storage").as_uri()
        budget_ms = _int(env, "THUMBQ_BUDGET_MS", 10_000, lo=1_000, hi=900_000)
        buffer_ms = _int(env, "THUMBQ_BUFFER_MS", 2_000, lo=0, hi=600_000)
        if buffer_ms >= budget_ms:
            raise ConfigError("THUMBQ_BUFFER_MS must be smaller than THUMBQ_BUDGET_MS")
        concurrency = _int(env, "THUMBQ_CONCURRENCY", os.cpu_count() or 1, lo=1, hi=64)
        fmt = (env.get("THUMBQ_THUMB_FORMAT") or "webp").lower()
        if fmt == "jpg":
            fmt = "jpeg"
        if fmt not in ("webp", "jpeg", "avif"):
            raise ConfigError(f"THUMBQ_THUMB_FORMAT must be webp, jpeg or avif, got {fmt!r}")
        sizes = _sizes(env, _int(env, "THUMBQ_THUMB_SIZE", 512, lo=16, hi=4096))
        fit = (env.get("THUMBQ_THUMB_FIT") or "contain").strip().lower()
        if fit not in ("contain", "cover"):
            raise ConfigError(f"THUMBQ_THUMB_FIT must be contain or cover, got {fit!r}")
        supabase_url = _str(env, "SUPABASE_URL")
        jwks_url = _str(env, "THUMBQ_JWKS_URL")
        if jwks_url is None and supabase_url:
            jwks_url = supabase_url.rstrip("/") + "/auth/v1/.well-known/jwks.json"
        if jwks_url is not None and urlsplit(jwks_url).scheme not in ("https", "http"):
            name = "THUMBQ_JWKS_URL" if env.get("THUMBQ_JWKS_URL") else "SUPABASE_URL"
            raise ConfigError(f"{name} must be an http(s) URL, got {jwks_url!r}")
        webhook_url, webhook_key = _webhook(env)
        metrics_token = _str(env, "THUMBQ_METRICS_TOKEN")
        if metrics_token is not None and len(metrics_token) < MIN_SECRET_LENGTH:
            raise ConfigError(
                f"THUMBQ_METRICS_TOKEN must be at least {MIN_SECRET_LENGTH} characters"
            )
        return cls(
            home=home,
            database_url=_database_url(env),
            cron_secret_source=secret_source,
            debug=(env.get("THUMBQ_DEBUG") or "").lower() in ("1", "true", "yes", "on"),
            storage_url=storage_url,
            s3_endpoint_url=_str(env, "THUMBQ_S3_ENDPOINT_URL"),
            s3_region=_str(env, "AWS_REGION") or _str(env, "AWS_DEFAULT_REGION"),
            cron_secret=cron_secret,
            jwt_secret=_str(env, "THUMBQ_JWT_SECRET"),
            budget_ms=budget_ms,
            buffer_ms=buffer_ms,
            batch_size=_int(env, "THUMBQ_BATCH_SIZE", 5000, lo=1, hi=10_000),
            concurrency=concurrency,
            max_attempts=_int(env, "THUMBQ_MAX_ATTEMPTS", 3, lo=1, hi=100),
            thumb_size=max(sizes),
            thumb_format=fmt,
            thumb_sizes=sizes,
            soffice=_soffice(env),
            pdf_page=_int(env, "THUMBQ_PDF_PAGE", 1, lo=1, hi=100_000),
            thumb_fit=fit,
            pages=_int(env, "THUMBQ_PAGES", 1, lo=1, hi=100),
            max_pixels=_int(env, "THUMBQ_MAX_PIXELS", 80_000_000, lo=1, hi=2_000_000_000),
            max_pages=_int(env, "THUMBQ_MAX_PAGES", 10_000, lo=1, hi=10_000_000),
            max_bytes=_int(env, "THUMBQ_MAX_BYTES", 100 * 1024 * 1024, lo=1, hi=2**40),
            render_memory_mb=_int(
                env,
                "THUMBQ_RENDER_MEMORY_MB",
                default_render_memory_mb(concurrency),
                lo=64,
                hi=65_536,
            ),
            rate_bucket=env.get("THUMBQ_RATE_BUCKET") or "thumbnail_generation",
            retention_days=_int(env, "THUMBQ_RETENTION_DAYS", 30, lo=0, hi=36_500),
            tasks=tuple(m.strip() for m in (env.get("THUMBQ_TASKS") or "").split(",") if m.strip()),
            priority_ageing_s=_int(env, "THUMBQ_PRIORITY_AGEING_S", 60, lo=1, hi=86_400),
            progress_cache_ms=_int(env, "THUMBQ_PROGRESS_CACHE_MS", 500, lo=0, hi=60_000),
            access_cache_ms=_int(env, "THUMBQ_ACCESS_CACHE_MS", 30_000, lo=0, hi=3_600_000),
            max_streams=_int(env, "THUMBQ_MAX_STREAMS", 32, lo=0, hi=10_000),
            api_url=(env.get("THUMBQ_API_URL") or "http://127.0.0.1:8000").rstrip("/"),
            schedule=env.get("THUMBQ_SCHEDULE") or "*/5 * * * *",
            supabase_url=supabase_url,
            jwks_url=jwks_url,
            supabase_anon_key=_str(env, "SUPABASE_ANON_KEY"),
            supabase_js_url=env.get("THUMBQ_SUPABASE_JS_URL")
            or "https://esm.sh/@supabase/supabase-js@2",
            metrics_token=metrics_token,
            webhook_url=webhook_url,
            webhook_key=webhook_key,
            # Seven days is the longest a presigned S3 URL may live (SigV4).
            signed_url_ttl_s=_int(env, "THUMBQ_SIGNED_URL_TTL_S", 0, lo=1, hi=7 * 86_400)
            if _str(env, "THUMBQ_SIGNED_URL_TTL_S")
            else None,
        )
