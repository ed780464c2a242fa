"""The `thumbq` parser, without a database: a command run makes only the parsers it needs
(worker/cli/parser.py), and what a user sees must not depend on that."""

from __future__ import annotations

import argparse
import contextlib
import io
from collections.abc import Callable

import pytest

from worker.cli import build_parser
from worker.cli.parser import parse


def _commands() -> list[list[str]]:
    """Every command's words: `["status"]`, `["jobs", "enqueue"]`, ..."""
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found: list[list[str]] = []
    for name, sp in top.choices.items():
        nested = [a for a in sp._actions if isinstance(a, argparse._SubParsersAction)]
        found += [[name, n] for n in nested[0].choices] if nested else [[name]]
    return found


def _said(run: Callable[[list[str]], argparse.Namespace], argv: list[str]) -> tuple[object, ...]:
    """What `thumbq ARGV` prints and exits with before any command runs, or what it parsed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            parsed = {k: getattr(v, "__name__", v) for k, v in vars(run(argv)).items()}
        except SystemExit as exc:
            return exc.code, out.getvalue(), err.getvalue()
    return 0, parsed


ARGVS = [
    [],
    ["--help"],
    ["--version"],
    ["nope"],
    ["jobs"],
    ["jobs", "nope"],
    ["db", "--help"],
    ["status", "--group", "g", "--failures"],
    ["enqueue", "a", "b", "--now", "--max-seconds", "9"],
    ["serve", "--port", "70000"],
    ["jobs", "enqueue", "t", "--payload", "{}", "--priority", "3", "--wait-ms", "500"],
    ["jobs", "show", "0"],
    ["db", "export-migration", "--out", "x"],
]


@pytest.mark.parametrize(
    "argv",
    ARGVS + [[*c, "--help"] for c in _commands()] + [[*c, "--no-such-option"] for c in _commands()],
    ids=" ".join,
)
def test_a_command_says_the_same_whether_its_parser_is_made_alone_or_with_all(
    argv: list[str],
) -> None:
    # `thumbq` makes the parser of the chosen command only (each parser costs its start about
    # 0.2 ms); --help, usage errors (whose list of choices keeps its order) and the parsed
    # options are those of the whole parser that the tests and the docs check.
    whole = _said(lambda a: build_parser().parse_args(a), argv)
    assert _said(parse, argv) == whole
    assert whole[0] in (0, 2)
