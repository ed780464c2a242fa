"""The layout rule of DESIGN.md: bench/ imports neither tests/ nor private names of thumbq
(what a benchmark needs is public or lives in bench/), so a benchmark keeps running whatever
the tests become, and what it measures goes through the same API a user has."""

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
        # `worker.samples._photo(...)` or `samples._photo(...)` after a public import.
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in thumbq_names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_bench_imports_neither_tests_nor_private_names() -> None:
    # Regression: bench/batch.py, render.py, load.py and hostile.py imported tests/corpus.py and
    # tests/faultkit.py (hostile.py also ran `python -m tests.faultkit drive`), and bench/batch.py
    # imported worker.samples._photo.
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
        ("import tests.faultkit", True),
        ("def f():\n    from tests.faultkit import vector_pdf", True),
        ("argv = ['python', '-m', 'tests.faultkit', 'drive']", True),
        ("CHILD = '''\nfrom tests.corpus import a4_pdf\n'''", True),
        ("from worker.samples import _photo", True),
        ("from worker.samples import demo_files, _photo as photo", True),
        ("from worker._private import thing", True),
        ("import worker.samples\nworker.samples._photo(1, 1, 1)", True),
        ("from worker import samples\nsamples._photo(1, 1, 1)", True),
        ("from api import create_app\ncreate_app._cache", True),
        ("from worker.samples import photo", False),
        ("from bench.corpus import CORPUS, slow_pdf", False),
        ("from worker.queue import Queue\nQueue.__name__", False),
        ("import random\nrandom._inst", False),  # not thumbq's
        ("print('the tests measure this too')", False),
        ('"""It lives in bench/ (bench/ imports nothing from tests/)."""', False),
    ],
)
def test_the_layout_check_catches_what_it_should(source: str, caught: bool) -> None:
    assert bool(violations(source)) is caught, violations(source)
