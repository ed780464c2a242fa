"""Document generation against an external HTTP API with a quota (seed system 001).

One job asks the API for one document and stores it: `POST $DOCGEN_API_URL/v1/documents` with
the request `{"template", "data"}` as JSON, the answer's bytes written to storage as
`documents/<request hash>.<ext>`, the job's result naming that key. What the example shows:

- The API's quota is the task's bucket (`rate_limit="docgen_api"`): every job takes a token
  when an invocation claims it, so any number of concurrent invocations together stay under
  the quota. `bucket_for_quota` turns "N requests per W seconds" into the bucket's capacity and
  refill (a token is taken at the claim and the call follows within the invocation's work
  window, so the window counts too).
- Duplicate requests collapse: the job's idempotency key is the SHA-256 of the request
  (`request_hash`), so asking twice for the same document makes one job, one call and one
  object. The API gets the same hash as its `Idempotency-Key` header, so a call repeated after
  a lost answer is not charged twice by an API that honours the header.
- Errors are classified: a 429, a 5xx, a timeout or a refused connection retries with backoff
  (`TransientError`, up to 5 attempts); any other 4xx ends the job `failed` at once
  (`PermanentError`, code `docgen_rejected`, the API's message in `last_error`).
- The handler runs in a thread (`runs_in="thread"`: it waits on the network, not the CPU) and
  never starts a call, or the PUT that stores its answer, that could not end before the
  invocation's deadline: a thread cannot be stopped, so it watches the time itself.

Run it (three terminals; `thumbq up` uses the embedded Postgres and ~/.local/share/thumbq):

    python -m examples.docgen stub --port 8765 --quota 20/10      # a stand-in API: 20 per 10 s
    DOCGEN_API_URL=http://127.0.0.1:8765 THUMBQ_TASKS=examples.docgen thumbq up
    python -m examples.docgen quota 20/10                        # the bucket for that quota
    python -m examples.docgen enqueue --count 60 --group letters  # 60 requests, 50 distinct

then follow the group `letters` on the progress page `thumbq up` printed, or with
`thumbq status --group letters`. Jobs can also come from `POST /api/jobs` with
`{"task": "docgen", "payload": {"template": ..., "data": ...}, "idempotency_key": <hash>}`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from examples import common
from worker.storage import BoundedStorage
from worker.tasks import PermanentError, TaskContext, TransientError, task

TASK = "docgen"
BUCKET = "docgen_api"
# Where the API is; the stub's address by default.
API_URL_ENV = "DOCGEN_API_URL"
DEFAULT_API_URL = "http://127.0.0.1:8765"
# A call is only started with at least this much of the invocation left; with less, the job
# waits for the next invocation (a checkpoint: no attempt used).
MIN_CALL_S = 1.0
# Storing the document is only started with this much left (a small PUT takes milliseconds on
# a local disk and tens of them on S3; the PUT is cut at the deadline all the same), so the
# call's answer must have arrived by then.
PUT_RESERVE_S = 0.3
# What is kept of an error answer in the job's last_error.
ERROR_TEXT_MAX = 300
EXTENSIONS = {"application/pdf": "pdf", "text/html": "html", "text/plain": "txt"}


def request_hash(request: Mapping[str, Any]) -> str:
    """The SHA-256 of the request in canonical JSON (sorted keys, no spaces): equal requests,
    however their keys were ordered, have one hash."""
    canonical = json.dumps(request, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def jobs_for(requests: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The jobs for some document requests: one per request, keyed by its hash."""
    return [
        {"task": TASK, "payload": dict(r), "idempotency_key": request_hash(r)} for r in requests
    ]


def bucket_for_quota(
    requests: int, per_s: float, *, late_s: float, capacity: int | None = None
) -> tuple[int, float]:
    """The bucket (capacity, refill per second) that keeps calls within `requests` per any
    `per_s` seconds, when a call follows its token by at most `late_s` (the invocation's work
    window, budget - buffer, at worst).

    Calls inside a window of W seconds took their tokens within W + late_s seconds, and a
    bucket hands out at most capacity + refill * (W + late_s) tokens in that time."""
    if requests < 2 or per_s <= 0 or late_s < 0:
        raise ValueError("a quota is at least 2 requests over a positive window")
    capacity = capacity or max(1, requests // 5)
    if not 1 <= capacity < requests:
        raise ValueError("the capacity must be at least 1 and below the quota")
    return capacity, (requests - capacity) / (per_s + late_s)


@task(TASK, rate_limit=BUCKET, max_attempts=5, runs_in="thread")
def generate(ctx: TaskContext, payload: Any) -> Any:
    """Ask the API for one document, store it, and return where it is."""
    if not isinstance(payload, dict) or not isinstance(payload.get("template"), str):
        raise PermanentError(
            'a docgen payload is {"template": "<name>", "data": {...}}', code="bad_payload"
        )
    timeout_s = ctx.remaining_ms() / 1000 - PUT_RESERVE_S
    if timeout_s < MIN_CALL_S:
        return ctx.checkpoint(ctx.state)
    digest = request_hash(payload)
    url = os.environ.get(API_URL_ENV, DEFAULT_API_URL).rstrip("/") + "/v1/documents"
    call = urllib.request.Request(  # noqa: S310 (an http(s) URL the operator configured)
        url,
        data=json.dumps(payload).encode("utf-8"),
        method="POST",
        headers={"Content-Type": "application/json", "Idempotency-Key": digest},
    )
    try:
        with urllib.request.urlopen(call, timeout=timeout_s) as answer:  # noqa: S310
            content_type = answer.headers.get_content_type()
            # The socket timeout bounds each read, not a slow drip of many: this thread cannot
            # be killed at the deadline, so it watches the time itself.
            chunks = []
            while chunk := answer.read(64 * 1024):
                chunks.append(chunk)
                if ctx.remaining_ms() / 1000 <= PUT_RESERVE_S:
                    raise TransientError(
                        "the document API's answer did not end before the deadline",
                        code="docgen_unavailable",
                    )
            body = b"".join(chunks)
    except urllib.error.HTTPError as exc:
        detail = exc.read(ERROR_TEXT_MAX).decode("utf-8", "replace").strip()
        message = f"the document API answered {exc.code}: {detail or exc.reason}"
        if exc.code in (408, 425, 429) or exc.code >= 500:
            raise TransientError(message, code="docgen_unavailable") from None
        raise PermanentError(message, code="docgen_rejected") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
        reason = getattr(exc, "reason", exc)
        raise TransientError(
            f"the document API at {url} could not be reached: {reason}", code="docgen_unreachable"
        ) from None
    key = f"documents/{digest}.{EXTENSIONS.get(content_type, 'bin')}"
    if ctx.remaining_ms() / 1000 < PUT_RESERVE_S:
        # No time left to store it: the job waits for the next invocation (no attempt used),
        # which asks again under the same Idempotency-Key (not charged twice by an API that
        # honours it).
        return ctx.checkpoint(ctx.state)
    storage = BoundedStorage(common.storage(), lambda: ctx.remaining_ms() / 1000)
    try:
        storage.put(key, body, content_type)  # cut at the deadline (StorageTimeout: a retry)
    finally:
        storage.close()
    return {"key": key, "bytes": len(body), "content_type": content_type, "request_hash": digest}


# -- a stand-in for the external API ---------------------------------------------------------


class QuotaStub:
    """A local document API with a sliding-window quota: at most `requests` calls in any
    `per_s` seconds, the rest refused with 429 and Retry-After. Documents are small PDFs."""

    def __init__(self, requests: int, per_s: float, host: str = "127.0.0.1", port: int = 0):
        self.requests = requests
        self.per_s = per_s
        self.served: deque[float] = deque()
        self.refused = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, out = stub.answer(self.path, body)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}"

    def answer(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """The answer to one call."""
        if path != "/v1/documents":
            return 404, {}, b"no such endpoint"
        now = time.monotonic()
        with self.lock:
            while self.served and self.served[0] <= now - self.per_s:
                self.served.popleft()
            if len(self.served) >= self.requests:
                self.refused += 1
                wait = self.served[0] + self.per_s - now
                return 429, {"Retry-After": str(math.ceil(wait))}, b"quota exceeded"
            self.served.append(now)
        try:
            request = json.loads(body)
            template, data = request["template"], request.get("data", {})
        except (ValueError, KeyError, TypeError):
            return 400, {}, b"the body must be JSON with a template"
        if template not in ("letter", "invoice"):
            return 422, {}, f"unknown template {template!r}".encode()
        return 200, {"Content-Type": "application/pdf"}, _pdf(template, data)

    def serve_forever(self) -> None:
        self.httpd.serve_forever()


def _pdf(template: str, data: Any) -> bytes:
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=420, height=595)
    lines = [template.title(), ""] + [f"{k}: {v}" for k, v in sorted(dict(data).items())]
    page.insert_text((48, 72), "\n".join(lines), fontsize=14)
    out: bytes = doc.tobytes(garbage=3, deflate=True)
    doc.close()
    return out


# -- the demo's commands ---------------------------------------------------------------------


def _quota(text: str) -> tuple[int, float]:
    try:
        n, per = text.split("/")
        return int(n), float(per)
    except ValueError:
        raise argparse.ArgumentTypeError("a quota is REQUESTS/SECONDS, e.g. 100/60") from None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m examples.docgen stub|quota|enqueue`: the demo's stand-in API, the bucket for
    a quota, and demo requests."""
    parser = argparse.ArgumentParser(prog="python -m examples.docgen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    stub = sub.add_parser("stub", help="serve a stand-in document API with a quota")
    stub.add_argument("--port", type=int, default=8765)
    stub.add_argument("--quota", type=_quota, default=(20, 10.0), help="REQUESTS/SECONDS")
    quota = sub.add_parser("quota", help="set the docgen_api bucket for an API's quota")
    quota.add_argument("quota", type=_quota, help="REQUESTS/SECONDS, e.g. 100/60")
    enqueue = sub.add_parser("enqueue", help="enqueue demo document requests")
    enqueue.add_argument("--count", type=int, default=60)
    enqueue.add_argument("--distinct", type=int, default=None, help="default: 5/6 of --count")
    enqueue.add_argument("--group", default="docgen-demo")
    args = parser.parse_args(argv)

    if args.command == "stub":
        limit, per_s = args.quota
        server = QuotaStub(limit, per_s, port=args.port)
        print(f"document API stand-in on {server.url}, quota {limit} per {per_s:g} s")
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
        return 0
    if args.command == "quota":
        from worker.engine import ratelimit

        late_s = common.config().deadline_ms / 1000
        capacity, refill = bucket_for_quota(*args.quota, late_s=late_s)
        with common.connect() as conn:
            ratelimit.set_limit(conn, BUCKET, capacity, refill)
        print(f"{BUCKET}: capacity {capacity}, refill {refill:.3f}/s ({refill * 60:.1f}/min)")
        return 0
    distinct = args.distinct or max(1, args.count * 5 // 6)
    requests = [
        {"template": "letter", "data": {"to": f"customer {i % distinct}", "n": i % distinct}}
        for i in range(args.count)
    ]
    rows = common.enqueue(jobs_for(requests), args.group)
    made = sum(1 for r in rows if r["created"])
    print(f"{len(rows)} requests, {made} new jobs in group {args.group!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
