"""``tokenmill query``'s work, importable without typer: the typer command and the fast entry both run it.

Kept apart from :mod:`flows.cli.commands` so that :mod:`flows.cli.entry` can answer a plain ``tokenmill query RUN
SQL`` without building the typer application (typer validates every parameter through pydantic: ~0.15 CPU-s, a
quarter of what the whole query costs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from core.rundir import RunPaths
from flows.cli.output import OutputFormat, emit_rows

T = TypeVar("T")


def run_query_command(run_dir: str, sql: str, output_format: OutputFormat | str,
                      on_interrupt: Callable[[], NoReturn]) -> None:
    """Print the answer of ``sql`` over ``run_dir``'s views in ``output_format``; ``on_interrupt`` ends the
    process when Ctrl-C arrives while DuckDB works."""
    from flows.run_sql import run_query  # DuckDB, pyarrow (~0.3 s)
    from pipeline.objects import is_remote  # logging (~13 ms): with the query

    if not is_remote(run_dir):
        RunPaths(run_dir).check_is_run()  # a folder with no run: one line, not 0 rows
    table = interruptible(on_interrupt, run_query, run_dir, sql)
    emit_rows(table.column_names, [list(row.values()) for row in table.to_pylist()], output_format)


def interruptible(on_interrupt: Callable[[], NoReturn], function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a worker thread, so that Ctrl-C ends the command at once.

    DuckDB notices Python's Ctrl-C only between its own checks, which a long join made a minute apart;
    this thread waits in Python, so the first Ctrl-C exits 130 within a fraction of a second. The query is
    read-only: nothing is left half-written when the process exits under it.
    """
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = function(*args)
        except BaseException as err:  # handed to the main thread, raised there
            outcome["error"] = err

    worker = threading.Thread(target=call, name="query", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(timeout=0.1)
    except KeyboardInterrupt:
        on_interrupt()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
