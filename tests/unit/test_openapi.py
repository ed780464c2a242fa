"""The OpenAPI document keeps everything the released one (0.1.0) promised: every path, method,
parameter, request body field, answer status and answer field of tests/fixtures/openapi_0.1.0.json
is still there, and the document is valid OpenAPI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from flask import Flask

from api import create_app
from worker.engine.config import Config

RELEASED = Path(__file__).resolve().parents[1] / "fixtures" / "openapi_0.1.0.json"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


@pytest.fixture
def app(tmp_path: Path) -> Flask:
    # The document needs no database: nothing connects until a request needs it.
    env = {"DATABASE_URL": "postgresql://127.0.0.1:1/none", "THUMBQ_HOME": str(tmp_path)}
    return create_app(Config.from_env(env))


def _deref(doc: dict[str, Any], node: Any) -> Any:
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        target: Any = doc
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _fields(doc: dict[str, Any], schema: Any, prefix: str, seen: tuple[str, ...] = ()) -> set[str]:
    """Every property a schema names, as dotted paths (`[]` for array items, `{}` for map
    values, `<json>` for a string's JSON content), through $ref, allOf, anyOf and oneOf."""
    if not isinstance(schema, dict):
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str):
        if ref in seen:
            return set()
        return _fields(doc, _deref(doc, schema), prefix, (*seen, ref))
    out: set[str] = set()
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in schema.get(key, ()):
            out |= _fields(doc, sub, prefix, seen)
    for name, sub in (schema.get("properties") or {}).items():
        out.add(prefix + name)
        out |= _fields(doc, sub, f"{prefix}{name}.", seen)
    if isinstance(schema.get("items"), dict):
        out |= _fields(doc, schema["items"], f"{prefix}[].", seen)
    if isinstance(schema.get("additionalProperties"), dict):
        out |= _fields(doc, schema["additionalProperties"], f"{prefix}{{}}.", seen)
    if isinstance(schema.get("contentSchema"), dict):
        out |= _fields(doc, schema["contentSchema"], f"{prefix}<json>.", seen)
    return out


def surface(doc: dict[str, Any]) -> set[str]:
    """What a client of `doc` relies on, one line per promise."""
    out: set[str] = set()
    for path, item in doc["paths"].items():
        for method in METHODS:
            op = item.get(method)
            if op is None:
                continue
            where = f"{method.upper()} {path}"
            out.add(where)
            for p in [*item.get("parameters", ()), *op.get("parameters", ())]:
                p = _deref(doc, p)
                out.add(f"{where} parameter {p['in']}:{p['name']} required={p.get('required')}")
            body = _deref(doc, op.get("requestBody"))
            if body:
                out.add(f"{where} body")
                for media, content in body.get("content", {}).items():
                    out.add(f"{where} body {media}")
                    for name in _fields(doc, content.get("schema"), ""):
                        out.add(f"{where} body {media} {name}")
            for status, answer in op["responses"].items():
                out.add(f"{where} {status}")
                answer = _deref(doc, answer)
                for media, content in (answer.get("content") or {}).items():
                    out.add(f"{where} {status} {media}")
                    for name in _fields(doc, content.get("schema"), ""):
                        out.add(f"{where} {status} {media} {name}")
    return out


def _every_ref_resolves(doc: dict[str, Any], node: Any) -> None:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            _deref(doc, node)
        for value in node.values():
            _every_ref_resolves(doc, value)
    elif isinstance(node, list):
        for value in node:
            _every_ref_resolves(doc, value)


def test_the_document_keeps_every_route_parameter_and_field_of_the_released_one(
    app: Flask,
) -> None:
    from openapi_spec_validator import validate

    released = json.loads(RELEASED.read_text())
    doc = app.test_client().get("/api/openapi.json").get_json()
    validate(doc)
    _every_ref_resolves(doc, doc)
    promised = surface(released)
    assert len(promised) > 500  # the walk reaches the fields, not just the paths
    lost = sorted(promised - surface(doc))
    assert not lost, "\n".join(lost)


SECRET = "contract-secret"


def _properties(doc: dict[str, Any], schema: Any, *steps: str) -> list[str]:
    schema = _deref(doc, schema)
    for step in steps:
        schema = _deref(doc, schema["anyOf"][int(step)] if step.isdigit() else schema[step])
    return list(schema["properties"])


def _allowed(answer: Any) -> list[str]:
    assert answer.status_code == 400, answer.get_data(as_text=True)
    message = answer.get_json()["error"]["message"]
    listed = message.split("allowed: ", 1)[1]
    return [] if listed == "none" else listed.split(", ")


def test_request_bodies_are_refused_on_the_fields_their_models_have(tmp_path: Path) -> None:
    env = {
        "DATABASE_URL": "postgresql://127.0.0.1:1/none",
        "THUMBQ_HOME": str(tmp_path),
        "THUMBQ_CRON_SECRET": SECRET,
    }
    client = create_app(Config.from_env(env)).test_client()
    doc = client.get("/api/openapi.json").get_json()

    def body_schema(path: str) -> Any:
        return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    admin = {"Authorization": f"Bearer {SECRET}"}
    # Nothing here reaches the database: a body is checked before anything is read or written.
    cases = [
        (
            "/api/thumbnails/batch-generate",
            {"zz": 1},
            _properties(doc, body_schema("/api/thumbnails/batch-generate")),
        ),
        (
            "/api/thumbnails/backfill",
            {"zz": 1},
            _properties(doc, body_schema("/api/thumbnails/backfill")),
        ),
        (
            "/api/thumbnails/retry-failed",
            {"zz": 1},
            _properties(doc, body_schema("/api/thumbnails/retry-failed")),
        ),
        (
            "/api/thumbnails/cancel",
            {"zz": 1},
            _properties(doc, body_schema("/api/thumbnails/cancel")),
        ),
        ("/api/thumbnails/cleanup-stale", {"zz": 1}, []),
        ("/api/jobs/1/cancel", {"zz": 1}, []),
        (
            "/api/thumbnails/enqueue",
            {"items": [{"source_key": "a.pdf", "zz": 1}]},
            _properties(
                doc, body_schema("/api/thumbnails/enqueue"), "properties", "items", "items"
            ),
        ),
        (
            "/api/jobs",
            {"items": [{"task": "t", "zz": 1}]},
            _properties(doc, body_schema("/api/jobs"), "1", "properties", "items", "items"),
        ),
    ]
    for path, body, fields in cases:
        assert _allowed(client.post(path, json=body, headers=admin)) == fields, path
    # Vercel Cron's GET takes the batch's options from the query string, as described.
    described = [
        p["name"] for p in doc["paths"]["/api/thumbnails/batch-generate"]["get"]["parameters"]
    ]
    assert _allowed(client.get("/api/thumbnails/batch-generate?zz=1", headers=admin)) == described
