"""Security (issue 5, items 6 and 7): the API fuzzed from its own OpenAPI description, hostile
keys and bodies, constant-time secret checks, JWT forgeries, RLS across every route a user token
reaches, and decompression/PDF bombs refused before the renderer allocates for them.

What tests/db/test_api.py already covers (the basic 401s, bad enqueues, bad JWTs on progress, RLS
on progress) is not repeated here; these tests extend it.
"""

from __future__ import annotations

import base64
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import jwt
import pytest
from flask import Flask
from flask.testing import FlaskClient

from api import create_app
from tests.db.test_api import (
    JWT_SECRET,
    SECRET,
    assert_error,
    bearer,
    enqueue,
    job_count,
    unsigned_jwt,
    user_token,
)
from worker.engine import db
from worker.engine.config import Config

# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def sec_config(config: Config) -> Config:
    # A short budget: fuzzed batch-generate calls then cost at most a second each.
    return config.with_(
        cron_secret=SECRET, jwt_secret=JWT_SECRET, budget_ms=1000, buffer_ms=500, concurrency=1
    )


@pytest.fixture
def app(sec_config: Config) -> Iterator[Flask]:
    app = create_app(sec_config, db_timeout_s=2.0)
    # A fuzzed progress stream of a group that never settles would stay open for 30 minutes.
    app.extensions["thumbq"].stream_max_s = 0.5
    yield app
    app.extensions["thumbq"].close()


@pytest.fixture
def client(app: Flask) -> FlaskClient:
    return app.test_client()


# -- 6a. fuzzing from the OpenAPI description ---------------------------------------------------

# Per operation, mode and credential; 19 operations x 2 modes x 3 credentials x up to 14 cases
# makes over a thousand requests (fewer where the schema leaves little to vary).
FUZZ_EXAMPLES = 14


def _fuzz_checks() -> list[Any]:
    from schemathesis import checks

    # The response-side checks: nothing 5xx, every status, content type, header and body as
    # described. (positive_data_acceptance does not apply: a valid-looking group that does not
    # exist is a 404 by design.)
    return [
        checks.not_a_server_error,
        checks.status_code_conformance,
        checks.content_type_conformance,
        checks.response_headers_conformance,
        checks.response_schema_conformance,
    ]


@pytest.mark.slow
def test_fuzzing_the_api_from_its_openapi_description_finds_no_5xx_and_no_mismatch(
    app: Flask, conn: db.Conn
) -> None:
    import schemathesis
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation import GenerationMode

    enqueue(conn, 3, "g")
    conn.execute("insert into thumbq.group_members values ('g', 'alice')")
    schema = schemathesis.openapi.from_wsgi("/api/openapi.json", app)
    credentials = {
        "admin": bearer(SECRET),
        "none": {},
        "user": bearer(user_token("alice")),
    }
    checks = _fuzz_checks()
    counts: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[str] = []

    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for who, headers in credentials.items():
                fuzz = _fuzzer(operation, mode, headers, checks, statuses, failures, who)
                try:
                    fuzz()
                except Unsatisfiable:
                    # Negative mode on an operation with nothing to get wrong (no parameters,
                    # no body): there is no invalid request to make.
                    assert mode is GenerationMode.NEGATIVE, operation.label
                counts[who] += fuzz.calls  # type: ignore[attr-defined]

    summary = {
        "cases": sum(counts.values()),
        "by_credential": dict(counts),
        "statuses": dict(sorted(statuses.items())),
        "failures": len(failures),
    }
    print(json.dumps({"fuzz": summary}))
    assert not failures, "\n\n".join(failures[:8])
    assert summary["cases"] >= 1000, summary
    assert not [s for s in statuses if s >= 500 and s != 503], statuses


def _fuzzer(
    operation: Any,
    mode: Any,
    headers: dict[str, str],
    checks: list[Any],
    statuses: Counter[int],
    failures: list[str],
    who: str,
) -> Any:
    """A Hypothesis test of one operation, generation mode and credential."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(
        max_examples=FUZZ_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        # Schemas with tight patterns make Hypothesis filter a lot; that is expected here.
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
            HealthCheck.data_too_large,
        ],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        # The credential replaces whatever the generator put in Authorization.
        case.headers = {
            k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"
        }
        case.headers.update(headers)
        response = case.call()
        fuzz.calls += 1  # type: ignore[attr-defined]
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=checks)
        except (AssertionError, BaseExceptionGroup) as exc:
            # Schemathesis raises a group of every check that failed on this response.
            found = getattr(exc, "exceptions", [exc])
            detail = "; ".join(f"{type(e).__name__}: {e}" for e in found)
            failures.append(f"{operation.label} [{mode.value}, {who}]: {detail}"[:1500])

    fuzz.calls = 0  # type: ignore[attr-defined]
    return fuzz


# -- 6b. hostile keys, NUL bytes, absurd sizes (beyond tests/db/test_api.py) -----------------------


def _enqueue(**item: Any) -> tuple[str, bytes]:
    # json.dumps escapes NULs and lone surrogates, so the server's JSON parser makes them again.
    return "enqueue", json.dumps({"items": [item]}).encode()


def _backfill(prefix: str) -> tuple[str, bytes]:
    return "backfill", json.dumps({"prefix": prefix}).encode()


HOSTILE_BODIES: list[tuple[str, tuple[str, bytes], int, str]] = [
    # A lone surrogate is valid JSON and a Python str, but no database can store it (was a 500).
    ("surrogate key", _enqueue(source_key="a\ud800b", etag="1"), 400, "invalid_key"),
    ("surrogate etag", _enqueue(source_key="a", etag="1\udfff"), 400, "invalid_request"),
    ("surrogate prefix", _backfill("\ud800/"), 400, "invalid_key"),
    ("NUL in prefix", _backfill("a\x00/"), 400, "invalid_key"),
    ("NUL in etag", _enqueue(source_key="a", etag="1\x00"), 400, "invalid_request"),
    ("NUL in type", _enqueue(source_key="a", content_type="image/png\x00"), 400, "invalid_request"),
    ("newline in key", _enqueue(source_key="a\nb"), 400, "invalid_key"),
    ("escape in key", _enqueue(source_key="a\x1b[2Jb"), 400, "invalid_key"),
    ("traversal in prefix", _backfill("a/../../etc/"), 400, "invalid_key"),
    ("dot segment in key", _enqueue(source_key="a/./b"), 400, "invalid_key"),
    ("backslash traversal", _enqueue(source_key="a\\..\\..\\b"), 400, "invalid_key"),
    ("UNC prefix", _backfill("\\\\server\\share"), 400, "invalid_key"),
    ("1 026 bytes in 513 chars", _enqueue(source_key="\u00e9" * 513), 400, "invalid_key"),
    ("etag of 201", _enqueue(source_key="a", etag="e" * 201), 400, "invalid_request"),
    ("type of 256", _enqueue(source_key="a", content_type="a/" + "p" * 254), 400, "invalid_request"),  # noqa: E501
    ("key of 1 MB", _enqueue(source_key="k" * 1_000_000), 400, "invalid_key"),
    ("5 000 digits", ("batch-generate", b'{"budget_ms": 1%s}' % (b"0" * 5000)), 400, "invalid_json"),  # noqa: E501
    ("infinite float", ("batch-generate", b'{"budget_ms": 1e999}'), 400, "invalid_request"),
]  # fmt: skip

HOSTILE_URLS: list[tuple[str, int, str]] = [
    ("/api/thumbnails/jobs/1%00", 400, "invalid_job_id"),
    ("/api/thumbnails/jobs/99999999999999999999", 400, "invalid_job_id"),
    ("/api/thumbnails/jobs/9223372036854775808", 400, "invalid_job_id"),
    ("/api/thumbnails/jobs/-1", 400, "invalid_job_id"),
    ("/api/thumbnails/jobs/%EF%BC%91", 400, "invalid_job_id"),  # a full-width digit one
    ("/api/thumbnails/jobs/..%2F..%2Fetc%2Fpasswd", 404, "not_found"),
    ("/api/thumbnails/progress?group_id=%ED%A0%80", 400, "invalid_group_id"),
    ("/api/thumbnails/progress?group_id=" + "g" * 100_000, 400, "invalid_group_id"),
    ("/api/thumbnails/progress?group_id=a%0Ab", 400, "invalid_group_id"),
    ("/api/thumbnails/failures?group_id=g&limit=%00", 400, "invalid_request"),
    ("/api/thumbnails/failures?group_id=g&limit=" + "9" * 5000, 400, "invalid_request"),
    ("/api/thumbnails/failures?group_id=%00", 400, "invalid_group_id"),
    ("/api/thumbnails/batch-generate?max_items=%00", 400, "invalid_request"),
    ("/api/thumbnails/batch-generate?budget_ms=" + "1" * 5000, 400, "invalid_request"),
]


def test_hostile_keys_nul_bytes_and_absurd_sizes_are_refused_and_write_nothing(
    client: FlaskClient, conn: db.Conn
) -> None:
    wrong = []
    for case, (route, body), status, code in HOSTILE_BODIES:
        resp = client.post(
            f"/api/thumbnails/{route}",
            data=body,
            headers={**bearer(SECRET), "Content-Type": "application/json"},
        )
        try:
            assert_error(resp, status, code)
        except AssertionError as exc:
            wrong.append(f"{case}: {exc}")
    for url, status, code in HOSTILE_URLS:
        try:
            assert_error(client.get(url, headers=bearer(SECRET)), status, code)
        except AssertionError as exc:
            wrong.append(f"{url[:60]}: {exc}")
    assert not wrong, "\n".join(wrong)
    assert job_count(conn) == 0


def test_the_largest_valid_enqueue_fits_and_one_byte_more_is_refused(
    client: FlaskClient, conn: db.Conn
) -> None:
    # 1 000 items with 1 024-byte keys, each with an etag, content type and group: the limits
    # the description promises are usable together under the 2 MiB body limit.
    items = [
        {
            "source_key": f"{i:04d}/" + "k" * 1019,
            "etag": "e" * 200,
            "content_type": "application/pdf",
            "group_id": "g" * 200,
        }
        for i in range(1000)
    ]
    resp = client.post("/api/thumbnails/enqueue", json={"items": items}, headers=bearer(SECRET))
    assert resp.status_code == 202, resp.get_data(as_text=True)[:300]
    assert resp.get_json()["enqueued"] == 1000
    items[-1] = {**items[-1], "source_key": items[-1]["source_key"] + "k"}
    items = [{**it, "etag": "other"} for it in items]
    resp = client.post("/api/thumbnails/enqueue", json={"items": items}, headers=bearer(SECRET))
    assert_error(resp, 400, "invalid_key")
    assert job_count(conn) == 1000


# -- 6c. the admin secret is compared in constant time ------------------------------------------


def _paired_us(client: FlaskClient, tokens: dict[str, str], rounds: int) -> dict[str, float]:
    """Median, over rounds, of each token's refusal time minus the first token's in the same
    round: pairing within a round cancels the load drifting on a shared machine."""
    import random

    names = list(tokens)
    diffs: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(7)
    for _ in range(rounds):
        shuffled = names[:]
        order.shuffle(shuffled)
        took: dict[str, float] = {}
        for name in shuffled:
            headers = {"Authorization": f"Bearer {tokens[name]}"}
            started = time.perf_counter_ns()
            resp = client.get("/api/queues", headers=headers)
            took[name] = (time.perf_counter_ns() - started) / 1000
            assert resp.status_code == 401
        for name in names:
            diffs[name].append(took[name] - took[names[0]])
    return {name: round(statistics.median(values), 2) for name, values in diffs.items()}


def test_a_wrong_admin_secret_is_refused_in_the_same_time_wherever_it_differs(
    sec_config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long secret makes an early exit measurable through the whole HTTP stack: a comparison
    # that stops at the first differing character of 4 096 is tens of microseconds quicker.
    secret = "S" * 4096
    app = create_app(sec_config.with_(cron_secret=secret))
    client = app.test_client()
    tokens = {
        "first byte differs": "X" + secret[1:],
        "last byte differs": secret[:-1] + "X",
        # One longer: a length check that returns early would answer at once.
        "wrong length": secret + "S",
    }
    rounds = 500
    _paired_us(client, tokens, 50)  # warm up
    real = _paired_us(client, tokens, rounds)

    # The same measurement proves it can see an early exit: with a comparison that stops at the
    # first difference (as `==` does, made slower here so it shows) first and last differ.
    def early_exit(token: str, configured: str) -> bool:
        if len(token) != len(configured):
            return False
        return all(a == b for a, b in zip(token, configured, strict=True))

    monkeypatch.setattr("api.auth.secret_matches", early_exit)
    leaky = _paired_us(client, tokens, rounds)
    app.extensions["thumbq"].close()

    print(json.dumps({"constant_time_paired_median_us": {"real": real, "early_exit": leaky}}))
    # The control's leak is plain; the real comparison shows none beyond a few microseconds.
    assert leaky["last byte differs"] > 60, leaky
    assert abs(real["last byte differs"]) < 15, real
    assert abs(real["wrong length"]) < 15, real


# -- 6d. JWTs, and RLS through every route a user token reaches ----------------------------------


def test_forged_and_misused_jwts_get_401_on_every_route_that_takes_one(
    client: FlaskClient, conn: db.Conn, app: Flask
) -> None:
    enqueue(conn, 1, "g")
    conn.execute("insert into thumbq.group_members values ('g', 'alice')")
    anon_key = "anon-key-as-published-in-every-frontend"
    now = int(time.time())
    supabase_anon = jwt.encode(
        {"iss": "supabase", "role": "anon", "iat": now, "exp": now + 600}, JWT_SECRET, "HS256"
    )
    supabase_service = jwt.encode(
        {"iss": "supabase", "role": "service_role", "iat": now, "exp": now + 600},
        JWT_SECRET,
        "HS256",
    )
    header_none = unsigned_jwt({"sub": "alice", "aud": "authenticated", "exp": now + 60})
    forged = {
        "signed with the anon key": user_token("alice", secret=anon_key + "-" * 10),
        "signed with the admin secret": user_token("alice", secret=SECRET + "-" * 10),
        "signed with an empty key": _hs256(
            {"sub": "alice", "aud": "authenticated", "exp": now}, b""
        ),
        "alg NONE": header_none.replace(header_none.split(".")[0], _b64({"alg": "NONE"})),
        "alg none with a signature": header_none + "c2ln",
        "not yet valid": user_token("alice", nbf=now + 3600),
        "audience anon": user_token("alice", aud="anon"),
        "Supabase anon key": supabase_anon,
        "Supabase service_role key": supabase_service,
        "empty sub": user_token(""),
        "sub not a string": user_token(42),  # type: ignore[arg-type]
        "payload swapped": _swap_payload(user_token("bob"), {"sub": "alice"}),
    }
    routes = ["/api/thumbnails/progress?group_id=g", "/api/thumbnails/failures?group_id=g"]
    wrong = []
    for route in routes:
        assert client.get(route, headers=bearer(user_token("alice"))).status_code == 200
        for name, token in forged.items():
            resp = client.get(route, headers=bearer(token))
            try:
                assert_error(resp, 401, "unauthorized")
            except AssertionError as exc:
                wrong.append(f"{route} {name}: {exc}")
    assert not wrong, "\n".join(wrong)


def _b64(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()


def _hs256(claims: dict[str, Any], key: bytes) -> str:
    """Sign by hand (PyJWT refuses an empty key, an attacker does not)."""
    import hashlib
    import hmac

    head = f"{_b64({'alg': 'HS256', 'typ': 'JWT'})}.{_b64(claims)}"
    sig = hmac.new(key, head.encode(), hashlib.sha256).digest()
    return f"{head}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"


def _swap_payload(token: str, changes: dict[str, Any]) -> str:
    """The same header and signature over a changed payload."""
    header, _, signature = token.split(".")
    claims = jwt.decode(token, options={"verify_signature": False})
    return f"{header}.{_b64({**claims, **changes})}.{signature}"


ADMIN_ROUTES = [
    ("POST", "/api/thumbnails/batch-generate"),
    ("GET", "/api/thumbnails/batch-generate"),
    ("POST", "/api/thumbnails/enqueue"),
    ("POST", "/api/thumbnails/backfill"),
    ("POST", "/api/thumbnails/retry-failed"),
    ("POST", "/api/thumbnails/cancel"),
    ("POST", "/api/thumbnails/cleanup-stale"),
    ("GET", "/api/thumbnails/cleanup-stale"),
    ("GET", "/api/thumbnails/jobs/1"),
    ("GET", "/api/queues"),
]


def test_a_user_never_sees_another_users_group_through_any_route(
    client: FlaskClient, conn: db.Conn
) -> None:
    from worker.engine.queue import Queue

    enqueue(conn, 2, "bobs-group", "b")
    queue = Queue(conn)
    claimed = queue.claim("w", 1, 60).jobs
    queue.fail("w", claimed[0], "corrupt_input", "bob's secret file name is in here", True)
    enqueue(conn, 2, "alices-group", "a")
    conn.execute(
        "insert into thumbq.group_members values ('alices-group', 'alice'), ('bobs-group', 'bob')"
    )
    alice, bob = bearer(user_token("alice")), bearer(user_token("bob"))
    fail_url = "/api/thumbnails/failures?group_id="
    prog_url = "/api/thumbnails/progress?group_id="

    # Bob sees his own group and failure; the admin too.
    assert client.get(fail_url + "bobs-group", headers=bob).get_json()["failures"]
    bobs = client.get(prog_url + "bobs-group", headers=bob)
    assert bobs.status_code == 200
    etag = bobs.headers["ETag"]

    # Alice: Bob's group answers exactly as a group that does not exist, on both routes, and
    # knowing its ETag does not turn that into a 304.
    for url in (fail_url, prog_url):
        hidden = client.get(url + "bobs-group", headers=alice)
        missing = client.get(url + "no-such-group", headers=alice)
        assert_error(hidden, 404, "group_not_found")
        assert hidden.get_data().replace(b"bobs-group", b"X") == missing.get_data().replace(
            b"no-such-group", b"X"
        )
        assert "bob" not in hidden.get_data(as_text=True).replace("bobs-group", "")
    with_etag = client.get(prog_url + "bobs-group", headers={**alice, "If-None-Match": etag})
    assert_error(with_etag, 404, "group_not_found")
    assert client.get(fail_url + "alices-group", headers=alice).get_json()["failures"] == []

    # Admin routes never take a user token, whoever's.
    job_id = claimed[0].id
    wrong = []
    for token in (alice, bob):
        for method, path in [*ADMIN_ROUTES, ("GET", f"/api/thumbnails/jobs/{job_id}")]:
            body = {"group_id": "bobs-group"} if method == "POST" else None
            resp = client.open(path, method=method, json=body, headers=token)
            try:
                assert_error(resp, 401, "unauthorized")
            except AssertionError as exc:
                wrong.append(f"{method} {path}: {exc}")
    assert not wrong, "\n".join(wrong)
    counts = conn.execute(
        "select status, count(*) as n from thumbq.jobs where group_id = 'bobs-group'"
        " group by status order by status"
    ).fetchall()
    assert [(r["status"], r["n"]) for r in counts] == [("failed", 1), ("pending", 1)]


# -- 7. decompression and PDF bombs -----------------------------------------------------------


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` RGBA and carries one byte of pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + body))
        return struct.pack(">I", len(body)) + kind + body + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    idat = zlib.compress(b"\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _deflate_bomb_pdf(width: int, height: int) -> bytes:
    """A one-page PDF drawing a `width` x `height` 8-bit grey image XObject whose FlateDecode
    stream is all zeros (about 1 000:1): a few hundred KB that inflate to width x height bytes."""
    import zlib

    from bench.corpus import build_pdf

    packer = zlib.compressobj(9)
    block = b"\x00" * (width * 256)
    parts = [packer.compress(block) for _ in range(height // 256)]
    parts.append(packer.compress(b"\x00" * (width * (height % 256))))
    parts.append(packer.flush())
    return build_pdf(
        [
            ("<< /Type /Catalog /Pages 2 0 R >>", None),
            ("<< /Type /Pages /Kids [3 0 R] /Count 1 >>", None),
            (
                "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 600 600] "
                "/Resources << /XObject << /Im1 5 0 R >> >> /Contents 4 0 R >>",
                None,
            ),
            ("<< >>", b"q 600 0 0 600 0 0 cm /Im1 Do Q"),
            (
                f"<< /Type /XObject /Subtype /Image /Width {width} /Height {height} "
                "/ColorSpace /DeviceGray /BitsPerComponent 8 /Filter /FlateDecode >>",
                b"".join(parts),
            ),
        ]
    )


def _huge_page_pdf(points: float) -> bytes:
    import pymupdf

    doc = pymupdf.open()
    page = doc.new_page(width=points, height=points)
    page.draw_rect(pymupdf.Rect(0, 0, points / 2, points / 2), color=None, fill=(0.9, 0.1, 0.1))
    data = bytes(doc.tobytes())
    doc.close()
    return data


def _peak_rss_mb(pid: int) -> float:
    """The high-water mark of a live process's resident memory (VmHWM), in MB."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


@pytest.mark.slow
def test_bombs_are_refused_or_rendered_small_before_the_renderer_allocates_for_them(
    sec_config: Config,
) -> None:
    from bench.corpus import png_bomb
    from worker.engine.errors import ThumbqError
    from worker.thumbnails.render.process import RenderPool
    from worker.thumbnails.task import render_options

    # (name, bytes, decoded size in MB were it decoded whole (a PDF page at 72 dpi, RGB),
    # expected outcome)
    bombs: list[tuple[str, bytes, float, str]] = [
        ("PNG declaring 30 000 x 30 000 (1-bit, all data present)", png_bomb(), 900, "too_large"),
        ("PNG declaring 65 535 x 65 535 RGBA, header only", _png_header_only(65535, 65535), 17179,
         "too_large"),
        ("PNG declaring 10 000 x 10 000 RGBA (over 80 MP, under Pillow's limit)",
         _png_header_only(10000, 10000), 400, "too_large"),
        ("PDF page of 14 400 x 14 400 pt", _huge_page_pdf(14400), 622, "512x512"),
        ("PDF image XObject 20 000 x 20 000, deflate bomb", _deflate_bomb_pdf(20000, 20000), 400,
         "512x512"),
    ]  # fmt: skip
    opts = render_options(sec_config)
    figures = []
    wrong = []
    for name, data, decoded_mb, expected in bombs:
        # A fresh single render process per bomb, so that its high-water mark is this bomb's.
        with RenderPool(opts, 1, sec_config.render_memory_mb) as pool:
            (pid,) = pool.pids()
            before = _peak_rss_mb(pid)
            started = time.monotonic()
            try:
                thumb = pool.render(data, None, timeout_s=30)
                outcome = f"{thumb.width}x{thumb.height}"
            except ThumbqError as exc:
                outcome = exc.code
            took = time.monotonic() - started
            # Still alive: it was not stopped by the memory limit (which makes a child exit).
            alive = pid in pool.pids()
            peak = _peak_rss_mb(pid) if alive else float("nan")
        figures.append(
            {
                "bomb": name,
                "file_kb": round(len(data) / 1024),
                "decoded_mb": decoded_mb,
                "outcome": outcome,
                "child_peak_rss_mb": round(peak, 1),
                "child_rss_before_mb": round(before, 1),
                "seconds": round(took, 2),
            }
        )
        if outcome != expected or not alive or peak - before > 64 or peak > decoded_mb / 4:
            wrong.append(figures[-1])
    print(json.dumps({"bombs": figures, "render_memory_limit_mb": sec_config.render_memory_mb}))
    assert not wrong, wrong
