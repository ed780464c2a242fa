"""Cold start: a fresh `python -c` process imports the WSGI app (api/index.py) and answers one
request, as a serverless platform's first invocation does.

Two paths, each the median of several runs: one progress request, and one batch request that
renders one small PDF (render processes started on demand). Wall time is measured by the parent
around the whole child process (interpreter start included); the child also reports its own
import and request times and which heavy modules it loaded.

    .venv/bin/python -m bench.coldstart [--runs 7]

The database server is BENCH_DATABASE_URL, TEST_DATABASE_URL or DATABASE_URL (else embedded).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from bench.common import median, scratch_database, server_url, write_result
from worker.engine import db
from worker.engine.config import Config
from worker.engine.queue import Queue

ROOT = Path(__file__).resolve().parent.parent
SECRET = "coldstart-secret"
HEAVY = ("pymupdf", "fitz", "boto3", "botocore", "PIL", "jwt", "numpy")

# The child calls the WSGI app the way a serverless adapter does: one environ, one call (no test
# client, whose own imports a platform never pays).
CHILD = """
import sys, time, json, io
t0 = time.perf_counter()
from api.index import app
t1 = time.perf_counter()
path, _, query = __PATH__.partition("?")
body = json.dumps(__BODY__).encode() if __BODY__ is not None else b""
environ = {
    "REQUEST_METHOD": __METHOD__, "PATH_INFO": path, "QUERY_STRING": query, "SCRIPT_NAME": "",
    "SERVER_NAME": "localhost", "SERVER_PORT": "443", "SERVER_PROTOCOL": "HTTP/1.1",
    "HTTP_HOST": "localhost", "HTTP_AUTHORIZATION": "Bearer __SECRET__",
    "CONTENT_TYPE": "application/json", "CONTENT_LENGTH": str(len(body)),
    "wsgi.version": (1, 0), "wsgi.url_scheme": "https", "wsgi.input": io.BytesIO(body),
    "wsgi.errors": sys.stderr, "wsgi.multithread": False, "wsgi.multiprocess": False,
    "wsgi.run_once": False,
}
status = []
chunks = app(environ, lambda s, h, exc=None: status.append(s))
payload = b"".join(chunks)
t2 = time.perf_counter()
print(json.dumps({"done_at": time.time(),
                  "status": int(status[0].split()[0]), "import_ms": (t1 - t0) * 1000,
                  "request_ms": (t2 - t1) * 1000, "body": json.loads(payload or b"null"),
                  "heavy": sorted(m for m in __HEAVY__ if m in sys.modules)}))
"""


def child_code(method: str, path: str, body: Any) -> str:
    return (
        CHILD.replace("__PATH__", repr(path))
        .replace("__METHOD__", repr(method))
        .replace("__BODY__", repr(body))
        .replace("__SECRET__", SECRET)
        .replace("__HEAVY__", repr(HEAVY))
    )


def run_child(code: str, env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """Run `code` in a fresh interpreter; its last stdout line is JSON with `done_at` (epoch s)."""
    spawned = time.time()
    t = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )
    wall = (time.perf_counter() - t) * 1000
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    # What a caller waits for: spawn to response. Interpreter teardown (tens of ms here) happens
    # after the answer, and a serverless platform keeps the process anyway.
    result["first_response_ms"] = (result["done_at"] - spawned) * 1000
    result["wall_ms"] = wall
    return result


def small_pdf() -> bytes:
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=595, height=842)
    page.insert_text((72, 100), "Cold start", fontsize=36)
    page.draw_rect(pymupdf.Rect(72, 150, 520, 700), color=(0, 0, 0), fill=(0.2, 0.5, 0.8))
    data: bytes = doc.tobytes(garbage=3, deflate=True)
    return data


def stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "first_response_ms_median": round(median([r["first_response_ms"] for r in runs]), 1),
        "first_response_ms_min": round(min(r["first_response_ms"] for r in runs), 1),
        "first_response_ms_all": [round(r["first_response_ms"], 1) for r in runs],
        "process_wall_ms_median": round(median([r["wall_ms"] for r in runs]), 1),
        "import_ms_median": round(median([r["import_ms"] for r in runs]), 1),
        "request_ms_median": round(median([r["request_ms"] for r in runs]), 1),
        "heavy_modules_imported": sorted({m for r in runs for m in r["heavy"]}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    name = f"thumbq_bench_cold_{uuid.uuid4().hex[:8]}"
    url = scratch_database(name)
    home = Path(tempfile.mkdtemp(prefix="thumbq-cold-"))
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "THUMBQ_HOME": str(home),
        "THUMBQ_STORAGE_URL": (home / "storage").as_uri(),
        "THUMBQ_CRON_SECRET": SECRET,
        "THUMBQ_CONCURRENCY": "1",
    }
    # An installed wheel (and a deploy bundle built from it) carries compiled bytecode; a source
    # checkout under PYTHONDONTWRITEBYTECODE compiles every module on every start. Measure the
    # first on a compiled copy of the code (nothing is written into the checkout) and the second
    # on the checkout, for comparison.
    bundle = home / "bundle"
    for folder in ("api", "worker", "sql"):
        shutil.copytree(
            ROOT / folder, bundle / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "api", "worker"],
        cwd=bundle,
        env={k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"},
        check=True,
        capture_output=True,
    )
    try:
        config = Config.from_env(env)
        from worker.storage import open_storage

        storage = open_storage(config)
        pdf = small_pdf()
        with db.connect(url) as conn:
            # A group to read; cancelled so that the batches below find only their own job.
            Queue(conn).enqueue_files([{"source_key": "seed.pdf", "etag": "0"}], "cold")
            Queue(conn).cancel("cold")

        # Interleaved, so that the floor and the app see the same load on a shared machine.
        bare: list[float] = []
        floor: list[float] = []
        progress = []
        from_source = []
        progress_code = child_code("GET", "/api/thumbnails/progress?group_id=cold", None)
        for _ in range(args.runs):
            bare.append(_bare(env))
            floor.append(_bare(env, "import flask, psycopg, psycopg_pool"))
            progress.append(run_child(progress_code, env, bundle))
            from_source.append(run_child(progress_code, env, ROOT))
        assert all(r["status"] == 200 for r in progress), progress[0]

        batch = []
        for i in range(args.runs):
            key = f"cold/{i}.pdf"
            storage.put(key, pdf, "application/pdf")
            with db.connect(url) as conn:
                Queue(conn).enqueue_files(
                    [{"source_key": key, "etag": storage.head(key).etag}], "cold-batch"
                )
            r = run_child(
                child_code("POST", "/api/thumbnails/batch-generate", {"max_items": 1}), env, bundle
            )
            assert r["status"] == 200 and r["body"]["succeeded"] == 1, r
            batch.append(r)

        result = {
            "method": "a fresh `python -c` child imports api.index and makes one WSGI call as a "
            "serverless adapter does; first_response = spawn to response ready (epoch clocks of "
            "parent and child), process_wall also counts interpreter exit; medians of runs; the "
            "child reports import and request times and the heavy modules it loaded; api/ "
            "and worker/ precompiled to bytecode as in an installed wheel, except where stated",
            "python_startup_ms_median": round(median(bare), 1),
            # What any Flask + psycopg app pays before its own code runs (spawn to imported).
            "floor_import_flask_psycopg_ms_median": round(median(floor), 1),
            "progress_over_floor_ms_median": round(
                median([r["first_response_ms"] - f for r, f in zip(progress, floor, strict=True)]),
                1,
            ),
            "progress": stats(progress),
            "progress_compiling_sources_each_start": stats(from_source),
            "batch_one_small_pdf": {
                **stats(batch),
                "pdf_bytes": len(pdf),
                "sample_body": batch[-1]["body"],
            },
            "targets": {
                "progress_first_response_le_400ms": median(
                    [r["first_response_ms"] for r in progress]
                )
                <= 400,
                "progress_path_without_pymupdf_and_boto3": not {
                    "pymupdf",
                    "fitz",
                    "boto3",
                    "botocore",
                }
                & {m for r in progress for m in r["heavy"]},
            },
        }
        # Other work on the machine inflates every figure: say how busy it was.
        result["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
        write_result("coldstart", result)
    finally:
        with psycopg.connect(make_conninfo(server_url(), dbname="postgres"), autocommit=True) as a:
            a.execute(f'drop database if exists "{name}" with (force)')


def _bare(env: dict[str, str], imports: str = "") -> float:
    """Spawn to ready of an interpreter that only imports `imports`."""
    code = f"import time, json\n{imports}\nprint(json.dumps({{'done_at': time.time()}}))"
    return float(run_child(code, env, Path(tempfile.gettempdir()))["first_response_ms"])


if __name__ == "__main__":
    main()
