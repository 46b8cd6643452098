"""The console script's fast query path answers exactly as the full command line does, without typer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flows.cli.entry import plain_query
from tests.conftest import build_query_run

TOKENMILL = str(Path(sys.executable).parent / "tokenmill")
FULL_COMMAND_LINE = "import sys; from flows.cli.commands import main; sys.argv[0] = 'tokenmill'; main()"
"""The typer application, with no fast path in front of it."""


@pytest.mark.parametrize(("argv", "parsed"), [
    (["query", "RUN", "SELECT 1"], ("RUN", "SELECT 1", "table")),
    (["query", "RUN", "SELECT 1", "--format", "csv"], ("RUN", "SELECT 1", "csv")),
    (["query", "--format=json", "RUN", "SELECT 1"], ("RUN", "SELECT 1", "json")),
    (["query", "RUN"], None),  # a missing SQL: typer's usage error
    (["query", "RUN", "SELECT 1", "extra"], None),
    (["query", "RUN", "SELECT 1", "--format", "xml"], None),  # typer names the choices
    (["query", "RUN", "SELECT 1", "--format"], None),
    (["query", "RUN", "SELECT 1", "--format", "csv", "--format", "json"], None),
    (["query", "--help"], None),
    (["query", "RUN", "-- a comment"], None),
    (["--debug", "query", "RUN", "SELECT 1"], None),
    (["status", "RUN", "SELECT 1"], None),
    ([], None),
])
def test_only_a_plain_query_line_takes_the_fast_path(argv: list[str], parsed: tuple[str, str, str] | None) -> None:
    assert plain_query(argv) == parsed


@pytest.mark.parametrize("case", ["table", "csv", "json", "not read-only", "no such view", "not a run"])
def test_the_fast_path_prints_what_the_full_command_line_prints(tmp_path: Path, case: str) -> None:
    run = build_query_run(tmp_path / "run")
    sql = {"not read-only": "COPY documents TO 'x.csv'", "no such view": "SELECT * FROM nothing_here"}.get(
        case, "SELECT doc_id, source FROM documents ORDER BY doc_id")
    target = str(tmp_path if case == "not a run" else run)
    args = ["query", target, sql, *(["--format", case] if case in ("csv", "json") else [])]
    fast = subprocess.run([TOKENMILL, *args], capture_output=True, text=True, timeout=120)
    full = subprocess.run([sys.executable, "-c", FULL_COMMAND_LINE, *args], capture_output=True, text=True,
                          timeout=120)
    assert (fast.returncode, fast.stdout, fast.stderr) == (full.returncode, full.stdout, full.stderr)
    assert (fast.returncode == 0) == (case in ("table", "csv", "json")), fast.stderr


def test_a_plain_query_does_not_build_the_typer_application(tmp_path: Path) -> None:
    run = build_query_run(tmp_path / "run")
    program = ("import sys; from flows.cli.entry import main\n"
               f"sys.argv = ['tokenmill', 'query', {str(run)!r}, 'SELECT count(*) FROM documents']\n"
               "try:\n    main()\nexcept SystemExit as end:\n    assert end.code == 0, end.code\n"
               "print(sorted(name for name in ('typer', 'pydantic') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"
