"""The ``tokenmill`` console script: a plain ``tokenmill query RUN SQL [--format F]`` is answered without typer.

A read-only query should answer about as fast as DuckDB from Python; building the typer application for it costs
more than the query itself (typer imports pydantic to validate its parameters). So a command line of exactly that
shape runs :func:`flows.cli.query_command.run_query_command` directly, and everything else — ``--help``, global
options, another command, a malformed query line — goes to :func:`flows.cli.commands.main`, which says what is
wrong the usual way. Both paths print the same rows, errors and exit statuses (tests/flows/test_cli_entry.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from flows.cli.output import OutputFormat

FORMATS = frozenset(item.value for item in OutputFormat)


def main() -> None:
    """Console-script entry point."""
    query = plain_query(sys.argv[1:])
    if query is None:
        from flows.cli.commands import main as full_main  # typer, pydantic: every other command line

        full_main()
        return
    _answer(*query)


def plain_query(argv: Sequence[str]) -> tuple[str, str, str] | None:
    """``(run_dir, sql, format)`` when ``argv`` is ``query RUN SQL`` with at most one ``--format F`` (F a known
    format), else None: anything else is the full command line's to parse and to explain."""
    if not argv or argv[0] != "query":
        return None
    positional: list[str] = []
    formats: list[str] = []
    items = iter(argv[1:])
    for item in items:
        if item == "--format":
            formats.append(next(items, ""))
        elif item.startswith("--format="):
            formats.append(item.removeprefix("--format="))
        elif item.startswith("-"):  # --help, --debug, --, an unknown option: typer's to explain
            return None
        else:
            positional.append(item)
    if len(positional) != 2 or len(formats) > 1 or not set(formats) <= FORMATS:
        return None
    return positional[0], positional[1], formats[0] if formats else OutputFormat.table.value


def _answer(run_dir: str, sql: str, output_format: str) -> NoReturn:
    """Run the query as :func:`flows.cli.commands.main` would: a user error is one line and exit 2, Ctrl-C 130."""
    # here, not at the top: the query's imports (DuckDB, pyarrow) only for a plain query line
    from core.errors import TokenmillError  # (with the query)
    from flows.cli.query_command import run_query_command  # DuckDB, pyarrow when it runs
    from flows.runtime.settings import configure_environment  # logging (with the query)

    configure_environment()
    try:
        run_query_command(run_dir, sql, output_format, on_interrupt=_interrupted)
    except KeyboardInterrupt:
        _interrupted()
    except Exception as err:
        if not isinstance(err, TokenmillError):
            from flows.cli.failures import user_error  # an OS limit on a path, …: one line too

            err = user_error(err, temporary_server=False) or err
        if not isinstance(err, TokenmillError):
            raise
        sys.stderr.write(f"error: {err}\n")
        sys.exit(2)
    sys.stdout.flush()
    sys.exit(0)


def _interrupted() -> NoReturn:
    """What the full command line prints for an interrupted query (it has no run dir to resume): exit 130 now."""
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(130)
