"""Each route's request and answers, described once in code, and `GET /api/openapi.json` made
from them.

A view says what it takes and answers with `@describe(Op(...))` under its Flask route; the
models are msgspec Structs beside the route (a Struct's fields are a body's fields, or a
route's query, path or header parameters). The document is built from the app's own URL map,
so a route cannot go undescribed, and the schemas are msgspec's JSON Schema of the models.

The same models check requests: `read_body` refuses the fields a body's model does not have
and the required ones it lacks (`worker.app.validation.check_fields`, whose sentences the API has
always answered); what a field's value may be is checked by `worker.app.validation`, shared with
the CLI, from the constants the models' limits are written with.

msgspec rather than pydantic: importing it and defining the models costs a few milliseconds of
a serverless cold start (bench/coldstart.py), and its JSON Schema keeps every constraint the
document had.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, TypeVar

import msgspec
from flask import Blueprint, Flask, Response, current_app, has_app_context

from api import validation as v
from api.errors import CODES, RETRY_AFTER_S, json_body

JSON = "application/json"
ADMIN: tuple[dict[str, list[str]], ...] = ({"adminSecret": []},)
READER: tuple[dict[str, list[str]], ...] = ({"adminSecret": []}, {"userJwt": []})
RETRY_AFTER: dict[str, Any] = {
    "Retry-After": {
        "description": "Seconds to wait before trying again.",
        "schema": {"type": "integer"},
    }
}

V = TypeVar("V", bound=Callable[..., Any])


class ErrorDetail(msgspec.Struct, forbid_unknown_fields=True):
    code: Annotated[str, msgspec.Meta(examples=list(CODES))]
    message: str


class Error(msgspec.Struct, forbid_unknown_fields=True):
    """Every error answer."""

    error: ErrorDetail


@dataclass(frozen=True)
class Answer:
    """One status of an operation: a JSON body of `model` (a type msgspec describes, a JSON
    Schema dict that may name models as `{"$ref": Model}`, or a function returning either, for
    models built on first use), or `content` (media type -> schema) for other bodies."""

    description: str
    model: Any = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    content: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Op:
    """One operation: its request (query, path and header parameters as Structs, a body model)
    and its answers by status (an `Answer`, or the name of a shared one in RESPONSES)."""

    op_id: str
    summary: str
    answers: Mapping[int, Answer | str]
    security: tuple[dict[str, list[str]], ...] = ()
    query: type | None = None
    path: type | None = None
    headers: type | None = None
    body: Any = None
    body_required: bool = True
    # The one method of a route this describes; None: every method of the route.
    method: str | None = None


def image(description: str, media_types: Iterable[str]) -> Answer:
    """An image answer in any of `media_types`."""
    return Answer(
        description,
        content={
            t: {"schema": {"type": "string", "contentMediaType": t}}
            for t in dict.fromkeys(media_types)
        },
    )


def html(description: str) -> Answer:
    """An HTML page."""
    return Answer(description, content={"text/html": {"schema": {"type": "string"}}})


def describe(*ops: Op) -> Callable[[V], V]:
    """Attach `ops` to a view function (place it under the Flask route decorator)."""

    def mark(view: V) -> V:
        view.openapi_ops = ops  # type: ignore[attr-defined]
        return view

    return mark


BAD_REQUEST = {400: "BadRequest", 413: "TooLarge"}
ADMIN_ERRORS = {401: "Unauthorized", 503: "Unavailable"}

RESPONSES: dict[str, Answer] = {
    "BadRequest": Answer(
        "Bad JSON or fields: invalid_json, invalid_request (unknown, missing, mistyped or "
        "out-of-range fields, empty or oversized lists), invalid_key, invalid_group_id, "
        "invalid_job_id.",
        Error,
    ),
    "Unauthorized": Answer(
        "Missing or wrong credentials (code unauthorized).",
        Error,
        headers={"WWW-Authenticate": {"schema": {"type": "string"}}},
    ),
    "NotFound": Answer("Unknown route, group (or one the caller may not see) or job.", Error),
    "TooLarge": Answer(f"Request body over {v.MAX_BODY_BYTES} bytes.", Error),
    "Unavailable": Answer(
        "database_unavailable / storage_unavailable (with Retry-After: "
        f"{RETRY_AFTER_S}), schema_missing, or not_configured (no secret is set, so the "
        "route is disabled: fail closed).",
        Error,
        headers=RETRY_AFTER,
    ),
}

SECURITY_SCHEMES = {
    "adminSecret": {
        "type": "http",
        "scheme": "bearer",
        "description": "THUMBQ_CRON_SECRET (or Vercel's CRON_SECRET). Without a configured "
        "secret, admin routes answer 503 not_configured.",
    },
    "userJwt": {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "A Supabase user JWT: HS256 with THUMBQ_JWT_SECRET, aud 'authenticated', "
        "exp and sub required. Row level security decides which groups it can read; others "
        "answer 404.",
    },
}


# -- requests, checked from the models ------------------------------------------------------


def field_names(model: type) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A model's (required, optional) field names, as the JSON spells them, in order."""
    fields = msgspec.structs.fields(model)
    return (
        tuple(f.encode_name for f in fields if f.required),
        tuple(f.encode_name for f in fields if not f.required),
    )


def check_body(body: Mapping[str, Any], model: type) -> None:
    """Refuse fields of `body` that `model` lacks, and required ones it misses."""
    required, optional = field_names(model)
    v.check_fields(body, required=required, optional=optional)


def read_body(model: type, *, optional: bool = False) -> dict[str, Any]:
    """The request's JSON body with exactly the fields `model` allows (empty is `{}` when
    `optional`); the values are the caller's to check."""
    body = v.json_body(optional=optional)
    check_body(body, model)
    return body


# -- the document -----------------------------------------------------------------------------


def _resolve(model: Any) -> Any:
    # A function (cached or not) builds its model on first use.
    return model() if inspect.isfunction(inspect.unwrap(model)) else model


class _Models:
    """The models a document names, to be described by msgspec in one pass."""

    def __init__(self) -> None:
        self.types: list[Any] = []
        self.named: set[Any] = set()  # models the document refers to by name

    def add(self, model: Any, *, named: bool = True) -> Any:
        """`model` as a placeholder to fill in once every schema is known."""
        model = _resolve(model)
        if isinstance(model, dict):
            return self.raw(model)
        if model not in self.types:
            self.types.append(model)
        if named:
            self.named.add(model)
        return _Placeholder(model)

    def raw(self, value: Any) -> Any:
        """A JSON Schema written out, whose `{"$ref": Model}` name models."""
        if isinstance(value, dict):
            return {
                k: (self.add(x) if k == "$ref" and not isinstance(x, str) else self.raw(x))
                for k, x in value.items()
            }
        if isinstance(value, list):
            return [self.raw(x) for x in value]
        return value


@dataclass(frozen=True)
class _Placeholder:
    model: Any


def _fill(value: Any, schemas: dict[Any, Any]) -> Any:
    if isinstance(value, _Placeholder):
        return copy.deepcopy(schemas[value.model])
    if isinstance(value, dict):
        if set(value) == {"$ref"} and isinstance(value["$ref"], _Placeholder):
            return _fill(value["$ref"], schemas)
        return {k: _fill(x, schemas) for k, x in value.items()}
    if isinstance(value, list):
        return [_fill(x, schemas) for x in value]
    return value


def _answer(answer: Answer, models: _Models) -> dict[str, Any]:
    out: dict[str, Any] = {"description": answer.description}
    if answer.content is not None:
        out["content"] = models.raw(dict(answer.content))
    elif answer.model is not None:
        out["content"] = {JSON: {"schema": models.add(answer.model)}}
    if answer.headers:
        out["headers"] = copy.deepcopy(dict(answer.headers))
    return out


def _parameters(op: Op, models: _Models) -> list[Any]:
    out: list[Any] = []
    for where, model in (("path", op.path), ("query", op.query), ("header", op.headers)):
        if model is not None:
            models.add(model, named=False)
            out.append((where, model))
    return out


def _expand(params: list[Any], components: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for where, model in params:
        schema = components[model.__name__]
        required = set(schema.get("required", ()))
        for name, prop in schema.get("properties", {}).items():
            out.append(
                {
                    "name": name,
                    "in": where,
                    "required": where == "path" or name in required,
                    "schema": prop,
                }
            )
    return out


def _bare_app() -> Flask:
    from api import blueprints

    app = Flask("api")
    for bp in blueprints():
        app.register_blueprint(bp)
    return app


def _path(rule: str) -> str:
    out = rule
    for part in rule.split("<")[1:]:
        inner = part.split(">", 1)[0]
        out = out.replace(f"<{inner}>", "{" + inner.rsplit(":", 1)[-1] + "}")
    return out


def spec(app: Flask | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every described route of `app` (default: the current one, or
    the API's routes outside a request)."""
    if app is None:
        app = current_app if has_app_context() else _bare_app()
    models = _Models()
    paths: dict[str, dict[str, Any]] = {}
    params: dict[tuple[str, str], list[Any]] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        ops: tuple[Op, ...] = getattr(app.view_functions.get(rule.endpoint), "openapi_ops", ())
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}, reverse=True):
            found = [op for op in ops if op.method in (None, method)]
            if not found:
                continue
            op = found[0]
            out: dict[str, Any] = {"operationId": op.op_id, "summary": op.summary}
            out["responses"] = {
                str(status): (
                    {"$ref": f"#/components/responses/{a}"}
                    if isinstance(a, str)
                    else _answer(a, models)
                )
                for status, a in op.answers.items()
            }
            out["security"] = [dict(s) for s in op.security]
            if op.body is not None:
                out["requestBody"] = {
                    "required": op.body_required,
                    "content": {JSON: {"schema": models.add(op.body)}},
                }
            path = _path(rule.rule)
            params[(path, method.lower())] = _parameters(op, models)
            paths.setdefault(path, {})[method.lower()] = out
    responses = {name: _answer(a, models) for name, a in RESPONSES.items()}

    named, components = msgspec.json.schema_components(
        models.types, ref_template="#/components/schemas/{name}"
    )
    schemas = dict(zip(models.types, named, strict=True))
    for (path, method), found in params.items():
        if found:
            paths[path][method]["parameters"] = _expand(found, components)
    # Models only of parameters are read into parameters, not kept as schemas of their own.
    for model in set(models.types) - models.named:
        components.pop(model.__name__, None)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "thumbq",
            "version": "0.1.0",
            "description": "Thumbnails for files in object storage, made by short time-budgeted "
            'batches. Every error is `{"error": {"code", "message"}}`; request bodies are at '
            f"most {v.MAX_BODY_BYTES} bytes (413 beyond); a wrong method answers 405 with Allow; "
            "a database outage answers 503 with Retry-After.",
        },
        "servers": [{"url": "/"}],
        "paths": _fill(paths, schemas),
        "components": {
            "schemas": components,
            "responses": _fill(responses, schemas),
            "securitySchemes": copy.deepcopy(SECURITY_SCHEMES),
        },
    }


bp = Blueprint("openapi", __name__)


@bp.get("/api/openapi.json")
@describe(
    Op(
        "getOpenapi",
        "This description.",
        {200: Answer("The OpenAPI 3.1 document.", {"type": "object"})},
    )
)
def openapi_json() -> Response:
    """The OpenAPI description (made once per app: its routes do not change)."""
    doc = current_app.extensions.get("openapi")
    if doc is None:
        doc = current_app.extensions["openapi"] = json_body(spec())
    return Response(doc, mimetype=JSON, headers={"Cache-Control": "public, max-age=300"})


# -- the vocabulary several routes share ------------------------------------------------------

GroupId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=200,
        pattern=f"^{v.GROUP_ID_RE.pattern}$",
        description="Letters, digits and _ . : @ / + = -",
    ),
]
Key = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=1024,
        description="A relative object key: no leading '/', no NUL or control characters, no "
        "'.' or '..' segments, no backslashes; at most 1 024 UTF-8 bytes.",
    ),
]
JobId = Annotated[int, msgspec.Meta(ge=1)]
# A field an answer may leave out: `name: int | Absent = UNSET`.
Absent = msgspec.UnsetType
Timestamp = datetime | None


class JobPath(msgspec.Struct):
    job_id: JobId


class GroupQuery(msgspec.Struct):
    group_id: GroupId


class Empty(msgspec.Struct, forbid_unknown_fields=True):
    """No fields."""
