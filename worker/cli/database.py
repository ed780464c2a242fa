"""`thumbq db init` and `thumbq db export-migration`: the schema."""

from __future__ import annotations

import argparse
from pathlib import Path

from worker.cli.errors import CliError
from worker.cli.runtime import Runtime, connect_error
from worker.cli.spec import ENV_DATABASE, Arg, Command, Group
from worker.engine import db
from worker.local.terminal import print_json


def cmd_db_init(rt: Runtime, args: argparse.Namespace) -> int:
    import psycopg

    url = rt.database_url()
    try:
        conn = db.connect(url)
    except psycopg.OperationalError as exc:
        raise CliError(connect_error(exc, rt, url)) from None
    with conn:
        print_json(db.init_schema(conn))
    return 0


def cmd_db_export_migration(rt: Runtime, args: argparse.Namespace) -> int:
    from worker.engine.migrations import export

    for path in export(Path(args.out)):
        print(path)
    return 0


COMMANDS = (
    Group(
        "db",
        summary="schema management: init, export-migration",
        description="Schema management.",
        dest="db_command",
        commands=(
            Command(
                "init",
                cmd_db_init,
                "install pgmq and the thumbq schema (safe to re-run)",
                description="Install pgmq (the extension where offered, else the pgmq "
                "package's SQL) and apply the schema files not yet applied. Safe to run again "
                "and again.",
                env=(ENV_DATABASE,),
            ),
            Command(
                "export-migration",
                cmd_db_export_migration,
                "write Supabase CLI migrations generated from sql/",
                description="Write supabase/migrations/ from sql/ (new files only; shipped ones "
                "are never rewritten).",
                args=(
                    Arg(
                        "--out",
                        default="supabase/migrations",
                        help="where (default supabase/migrations)",
                    ),
                ),
            ),
        ),
    ),
)
