"""The layout rules of DESIGN.md.

- bench/ imports neither tests/ nor private names of thumbq (what a benchmark needs is public or
  lives in bench/), so a benchmark keeps running whatever the tests become, and what it measures
  goes through the same API a user has.
- The engine (worker/engine) imports nothing of the thumbnail task, the CLI, the HTTP API, what
  the API and CLI share (worker/app) or a storage backend: anything else runs on it, not in it.
- No Python module is over 800 lines: a big file is a sign that two concerns share a room."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
THUMBQ = {"api", "worker"}
# `python -m tests.x`, or code run in a child process, reaches tests/ without an import statement.
TESTS_IN_A_STRING = re.compile(
    r"^tests(\.\w+)+$|^\s*(from\s+tests(\.\w+)*\s+import|import\s+tests)\b", re.MULTILINE
)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(source: str) -> list[str]:
    """Each import of tests/, and each private name of api/ or worker/ that `source` uses."""
    found: list[str] = []
    thumbq_names: set[str] = set()  # local names bound to api/worker modules or their members
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tests":
                    found.append(f"line {node.lineno}: import {alias.name}")
                elif parts[0] in THUMBQ:
                    if any(_private(p) for p in parts):
                        found.append(f"line {node.lineno}: import {alias.name}")
                    thumbq_names.add(alias.asname or parts[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            names = [a.name for a in node.names]
            if parts[0] == "tests":
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
            elif parts[0] in THUMBQ:
                private = [n for n in names if _private(n)]
                if private or any(_private(p) for p in parts):
                    imported = ", ".join(private or names)
                    found.append(f"line {node.lineno}: from {node.module} import {imported}")
                thumbq_names |= {a.asname or a.name for a in node.names}
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and TESTS_IN_A_STRING.search(node.value)
        ):
            found.append(f"line {node.lineno}: names tests/ in {node.value[:60]!r}")
    for node in ast.walk(tree):
        # `worker.local.samples._photo(...)` or `samples._photo(...)` after a public import.
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in thumbq_names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_bench_imports_neither_tests_nor_private_names() -> None:
    # Regression: bench/batch.py, render.py, load.py and hostile.py imported tests/corpus.py and
    # the tests' faultkit (hostile.py also ran it as a module), and bench/batch.py imported a
    # private name of the demo's samples.
    files = sorted(ROOT.joinpath("bench").rglob("*.py"))
    assert len(files) > 5, files
    bad = {
        str(path.relative_to(ROOT)): v
        for path in files
        if (v := violations(path.read_text(encoding="utf-8")))
    }
    assert bad == {}


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("from tests.corpus import CORPUS", True),
        ("from tests import corpus", True),
        ("import tests.support.faultkit", True),
        ("def f():\n    from tests.support.faultkit import vector_pdf", True),
        ("argv = ['python', '-m', 'tests.support.faultkit', 'drive']", True),
        ("CHILD = '''\nfrom tests.corpus import a4_pdf\n'''", True),
        ("from worker.local.samples import _photo", True),
        ("from worker.local.samples import demo_files, _photo as photo", True),
        ("from worker._private import thing", True),
        ("import worker.local.samples\nworker.samples._photo(1, 1, 1)", True),
        ("from worker import samples\nsamples._photo(1, 1, 1)", True),
        ("from api import create_app\ncreate_app._cache", True),
        ("from worker.local.samples import photo", False),
        ("from bench.corpus import CORPUS, slow_pdf", False),
        ("from worker.engine.queue import Queue\nQueue.__name__", False),
        ("import random\nrandom._inst", False),  # not thumbq's
        ("print('the tests measure this too')", False),
        ('"""It lives in bench/ (bench/ imports nothing from tests/)."""', False),
    ],
)
def test_the_layout_check_catches_what_it_should(source: str, caught: bool) -> None:
    assert bool(violations(source)) is caught, violations(source)


# What worker/engine must never import (a module, or anything under it).
ENGINE_MUST_NOT_IMPORT = (
    "api",
    "worker.app",
    "worker.cli",
    "worker.storage.file",
    "worker.storage.s3",
    "worker.thumbnails",
)


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """Every module `source` (the module `module`) imports, wherever the import statement is (in
    a function, under TYPE_CHECKING), relative imports resolved: (line, dotted name); `from a
    import b` counts as importing `a.b` too, since b may be a module."""
    package = module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


# What worker/thumbnails must never import: it runs on the engine, and is used by the rooms above.
THUMBNAILS_MUST_NOT_IMPORT = ("api", "worker.app", "worker.cli", "worker.local")


def forbidden_in_engine(
    source: str, module: str, must_not: tuple[str, ...] = ENGINE_MUST_NOT_IMPORT
) -> list[str]:
    return [
        f"line {line}: {name}"
        for line, name in imported_modules(source, module)
        if any(name == bad or name.startswith(bad + ".") for bad in must_not)
    ]


def _violations_in(room: str, must_not: tuple[str, ...]) -> dict[str, list[str]]:
    files = sorted(ROOT.joinpath("worker", room).rglob("*.py"))
    assert len(files) > 5, files
    bad = {}
    for path in files:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        # An __init__ is its package: its relative imports resolve from the package itself.
        module = ".".join([*parts, "__init__"] if rel.name == "__init__" else parts)
        if v := forbidden_in_engine(path.read_text(encoding="utf-8"), module, must_not):
            bad[str(path.relative_to(ROOT))] = v
    return bad


def test_the_engine_imports_nothing_of_thumbnails_the_cli_http_or_storage_backends() -> None:
    assert _violations_in("engine", ENGINE_MUST_NOT_IMPORT) == {}


def test_the_thumbnail_task_imports_nothing_of_the_cli_http_or_the_rooms_that_use_it() -> None:
    assert _violations_in("thumbnails", THUMBNAILS_MUST_NOT_IMPORT) == {}


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("from worker.thumbnails.render import RenderOptions", True),
        ("import worker.thumbnails.task", True),
        ("from worker import thumbnails", True),
        ("from worker import cli", True),
        ("def f():\n    from worker.cli import main", True),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import api", True),
        ("from api.state import State", True),
        ("from worker.storage.s3 import S3Storage", True),
        ("from worker.app.jobs import submit", True),
        ("from ..thumbnails import task", True),
        ("from . import queue", False),
        ("from worker.engine import db", False),
        ("from worker.storage import BoundedStorage", False),
        ("import apispec", False),  # not thumbq's `api`
        ("import worker.engine.queue", False),
    ],
)
def test_the_engine_check_catches_what_it_should(source: str, caught: bool) -> None:
    found = forbidden_in_engine(source, "worker.engine.example")
    assert bool(found) is caught, found


MAX_MODULE_LINES = 800


def test_no_python_module_is_over_800_lines() -> None:
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in ("api", "worker", "examples")
        for path in ROOT.joinpath(folder).rglob("*.py")
    }
    assert len(sizes) > 40, sizes
    too_big = {path: lines for path, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert too_big == {}


def test_every_named_query_is_run_by_the_code() -> None:
    """sql/queries.sql holds the queries the code runs, by name (db.one, db.all, db.queries):
    a name no module of api/, worker/ or bench/ spells is dead SQL."""
    from worker.engine.db import parse_queries

    names = set(parse_queries((ROOT / "sql" / "queries.sql").read_text(encoding="utf-8")))
    spelled: set[str] = set()
    for folder in ("api", "worker", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    spelled.add(node.value)
    assert sorted(names - spelled) == []
