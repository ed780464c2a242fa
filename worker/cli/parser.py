"""The `thumbq` parser, built from the commands each module of `worker.cli` declares."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NoReturn

from worker.cli import database, demo, jobs, reading, serve, up, work
from worker.cli.spec import ENV_DATABASE, ENV_STORAGE, Command, Group, epilog

# The commands in the order `thumbq --help` lists them: the main jobs, work, reading, serving,
# then the commands with commands of their own.
COMMANDS: tuple[Command | Group, ...] = (
    *up.COMMANDS,
    *demo.COMMANDS,
    *work.COMMANDS,
    *reading.COMMANDS,
    *serve.COMMANDS,
    *jobs.COMMANDS,
    *database.COMMANDS,
)
FORMAT = argparse.RawDescriptionHelpFormatter


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error said in one line (exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


class _Commands(argparse._SubParsersAction):
    """Commands listed at once, each parser made only when its command is chosen. argparse
    spends about 0.2 ms making a parser (some 40% of it in gettext, looking for translations of
    its own words) and thumbq has 22: making them all took 4 ms of CPU at every command's start,
    making the chosen one (and the list) takes about 1.5 ms."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.later: dict[str, tuple[dict[str, Any], Callable[[argparse.ArgumentParser], None]]]
        self.later = {}

    def add_later(
        self,
        name: str,
        summary: str,
        fill: Callable[[argparse.ArgumentParser], None],
        **kwargs: Any,
    ) -> None:
        """List `name` with `summary`; when chosen, `add_parser(name, **kwargs)` and `fill`."""
        self._choices_actions.append(self._ChoicesPseudoAction(name, (), summary))
        self._name_parser_map[name] = None  # a choice now, a parser when chosen
        self.later[name] = (kwargs, fill)

    def make(self, name: str) -> argparse.ArgumentParser:
        """The parser of command `name`, made now if it is not yet."""
        if name in self.later:
            kwargs, fill = self.later.pop(name)
            # add_parser refuses a name its map holds. The map is also the list of choices that
            # a usage error names, but they are checked before any command's parser is made.
            del self._name_parser_map[name]
            fill(self.add_parser(name, **kwargs))
        parser: argparse.ArgumentParser = self._name_parser_map[name]
        return parser

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if values and values[0] in self.later:
            self.make(values[0])
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    """The `thumbq` parser: every command, option and the environment each reads."""
    parser = _parser()
    _make_all(parser)
    return parser


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """`argv` parsed, making only the parsers of the commands it names."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        here = version("thumbq")
    except PackageNotFoundError:  # run from a source tree that is not installed
        here = "unknown"
    p = _Parser(
        prog="thumbq",
        description="Background thumbnails for files in object storage: pgmq queues in "
        "Postgres, short time-budgeted batches, a progress page. Start with `thumbq demo` "
        "(a tour on sample files) or `thumbq up` (API, schedule and progress page).",
        epilog=epilog(ENV_DATABASE, ENV_STORAGE)
        + "\n\n`thumbq COMMAND --help` describes a command and the environment it reads.",
        formatter_class=FORMAT,
    )
    p.add_argument("--version", action="version", version=f"thumbq {here}")
    _add_all(_commands_of(p, "command"), COMMANDS)
    return p


def _commands_of(parser: argparse.ArgumentParser, dest: str) -> _Commands:
    """The commands of `parser`; `dest` names the chosen one in the parsed arguments."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar="COMMAND", action=_Commands)
    assert isinstance(sub, _Commands)
    return sub


def _add_all(sub: _Commands, commands: Sequence[Command | Group]) -> None:
    """Each of `commands` as a choice of `sub`, its parser made when it is chosen."""
    for command in commands:
        if isinstance(command, Group):
            sub.add_later(
                command.name,
                command.summary,
                partial(_fill_group, command),
                description=command.description,
                formatter_class=FORMAT,
            )
        else:
            sub.add_later(
                command.name,
                command.summary,
                partial(_fill_command, command),
                description=command.description,
                epilog=epilog(*command.env),
                formatter_class=FORMAT,
            )


def _fill_group(group: Group, parser: argparse.ArgumentParser) -> None:
    _add_all(_commands_of(parser, group.dest), group.commands)


def _fill_command(command: Command, parser: argparse.ArgumentParser) -> None:
    for arg in command.args:
        parser.add_argument(*arg.flags, **arg.options)
    parser.set_defaults(func=command.run)


def _make_all(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, _Commands):
            for name in list(action.choices or ()):
                _make_all(action.make(name))
