"""flows.run_sql: the one way to open a run for SQL has every view, and ``tokenmill query --help`` names them."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows.run_sql import view_names
from tests.conftest import build_query_run

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "pipeline", "tokenization", "trainer", "flows")
OPENERS = ("connect", "run_query")
"""The public names a user opens a run for SQL by (a notebook's ``connect``, a script's ``run_query``)."""


def modules_defining(name: str) -> list[str]:
    """Every project module with a top-level function ``name`` (read with ``ast``: nothing is imported)."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            if any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body):
                found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_query_run(tmp_path_factory.mktemp("run_sql") / "run")


@pytest.mark.parametrize("opener", OPENERS)
def test_there_is_one_way_to_open_a_run_and_it_has_every_view(run_dir: Path, opener: str) -> None:
    """Each ``connect``/``run_query`` in the project answers over every view, the trainer's included (there were
    two ``connect``: ``pipeline.sql.query``'s lacked ``consumed`` and ``row_losses``)."""
    assert {"consumed", "row_losses", "attributes", "sequences"} <= set(view_names())
    modules = modules_defining(opener)
    assert modules == ["flows.run_sql"]
    for module in modules:
        open_run = getattr(importlib.import_module(module), opener)
        # A statement naming no view but the catalogue: every view is registered (those it does not name, empty).
        sql = "SELECT table_name FROM information_schema.tables"
        names = ({row[0] for row in open_run(run_dir, sql).sql(sql).fetchall()} if opener == "connect"
                 else set(open_run(run_dir, sql).column("table_name").to_pylist()))
        assert set(view_names()) <= names, f"{module}.{opener} lacks {set(view_names()) - names}"


def test_query_help_lists_every_view_connect_opens(run_dir: Path) -> None:
    from flows.run_sql import connect

    con = connect(run_dir, "SELECT 1")
    opened = {row[0] for row in con.sql("SELECT table_name FROM information_schema.tables").fetchall()}
    opened -= {name for name in opened if name.startswith("_")}  # _docs: what documents filters
    tokenmill = str(Path(sys.executable).parent / "tokenmill")
    result = subprocess.run([tokenmill, "query", "--help"], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    listed = " ".join(result.stdout.split())
    assert "consumed" in opened and "row_losses" in opened
    assert all(f" {name}," in listed or f" {name}." in listed for name in opened), (sorted(opened), listed)


def test_a_query_over_documents_imports_neither_pandas_nor_torch(run_dir: Path) -> None:
    """What ``tokenmill query`` pays at start-up: pandas (pyarrow.dataset imports it, and so does ``pa.array``
    of Python values) and torch (the trainer's views) are imported only by a statement that needs them."""
    program = ("import sys\nfrom flows.cli.entry import main\nsys.argv = ['tokenmill', 'query', sys.argv[1], "
               "'SELECT source, count(*) FROM documents GROUP BY ALL']\ntry:\n    main()\nexcept SystemExit as exit:\n"
               "    assert not exit.code, exit.code\nprint(sorted({'pandas', 'torch'} & set(sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", program, str(run_dir)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", result.stdout


def test_a_run_dir_named_like_a_glob_pattern_reads_its_own_parquet(tmp_path: Path) -> None:
    """DuckDB expands ``*?[`` in a path it reads: ``runs/r[12]`` would read ``runs/r1``'s documents (or be refused)."""
    from flows.run_sql import connect

    build_query_run(tmp_path / "r1")
    (tmp_path / "r1/dedupe/duplicates.parquet").unlink()  # r1 keeps all three documents; r[12] keeps two
    pattern = build_query_run(tmp_path / "r[12]")
    assert connect(tmp_path / "r1", "SELECT 1").sql("SELECT count(*) FROM documents").fetchall() == [(3,)]
    assert connect(pattern, "SELECT 1").sql("SELECT doc_id FROM documents ORDER BY doc_id").fetchall() == [(1,), (3,)]


def test_sql_reads_no_file_of_the_run_dir_but_its_checked_parquet(run_dir: Path) -> None:
    import duckdb

    from flows.run_sql import connect

    con = connect(run_dir)
    for path in (run_dir / "metrics/train.jsonl", run_dir / "docs/part-00000.json", run_dir / "docs"):
        with pytest.raises(duckdb.PermissionException):
            con.sql("SELECT * FROM read_text(?)", params=[str(path)]).fetchall()


def test_the_report_reads_every_view_but_replays_no_training_step(run_dir: Path) -> None:
    """The report opens the run with the one ``connect``, without the trainer's views: replaying every step
    imports torch (seconds) for views the report never shows."""
    program = ("import sys\nfrom pathlib import Path\nfrom flows.report.stage import collect_report_data\n"
               "collect_report_data(Path(sys.argv[1]))\nprint('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", program, str(run_dir)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False", result.stdout
