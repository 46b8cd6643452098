"""pipeline.sql.query: every view over a hand-built run dir; statements that could write are refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from core.errors import QueryError
from flows.run_sql import connect, run_query
from pipeline.sql.query import VIEWS
from tests.conftest import build_query_run


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return build_query_run(tmp_path / "run")


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def test_views_answer_real_questions(run_dir: Path) -> None:
    con = connect(run_dir)
    assert con.sql("SELECT doc_id FROM documents ORDER BY doc_id").fetchall() == [(1,), (3,)]
    assert con.sql("SELECT reason, raw FROM rejects").fetchall() == [("invalid_json", b"{oops")]
    assert con.sql("SELECT duplicate_of FROM duplicates").fetchall() == [(1,)]
    assert con.sql("SELECT num_rows, num_tokens FROM shards").fetchall() == [(2, 16)]
    assert con.sql("SELECT doc_ids, split, source, input_ids[2], row_in_shard FROM sequences ORDER BY first_doc_offset"
                   ).fetchall() == [([1], "train", "a", 1, 0), ([1, 3], "train", "a", 9, 1)]
    assert con.sql("SELECT max(step), min(loss) FROM train_metrics").fetchall() == [(2, 3.0)]
    assert con.sql("SELECT count(*) FROM eval_metrics").fetchall() == [(0,)]
    assert {row[0] for row in con.sql("SHOW TABLES").fetchall()} >= set(VIEWS)


@pytest.mark.parametrize("sql", [
    "COPY (SELECT * FROM documents) TO 'stolen.csv'",
    "CREATE TABLE t AS SELECT 1",
    "ATTACH 'other.duckdb' AS other",
    "INSTALL httpfs",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT 1; SELECT 2",
])
def test_statements_that_could_write_or_escape_are_refused(run_dir: Path, sql: str) -> None:
    before = tree_digest(run_dir)
    with pytest.raises(QueryError) as refused:
        run_query(run_dir, sql)
    assert str(refused.value).split()[0] in {"queries", "query", "expected"}
    assert tree_digest(run_dir) == before


def test_notebook_connection_cannot_touch_files(run_dir: Path, tmp_path: Path) -> None:
    import duckdb

    con = connect(run_dir)
    with pytest.raises(duckdb.PermissionException):
        con.sql(f"COPY (SELECT 1) TO '{tmp_path / 'out.csv'}'")
    with pytest.raises(duckdb.Error):
        con.sql("SET enable_external_access = true")
    assert not (tmp_path / "out.csv").exists()


def test_the_eval_history_of_a_dpo_run_has_no_perplexity(tmp_path: Path) -> None:
    """A DPO run's eval rows hold the val pairs' DPO loss and rewards, no ``val_ppl``: the run summary's in-loop
    table reads them (it failed with a DuckDB binder error on the missing column, after a whole run)."""
    from pipeline.sql.query import eval_history

    (tmp_path / "metrics").mkdir()
    rows = [{"rewards/accuracy": 0.0, "step": 0, "val_loss": 0.6931471824645996, "val_pairs": 29},
            {"rewards/accuracy": 0.69, "step": 40, "val_loss": 0.6074716387123897, "val_pairs": 29}]
    (tmp_path / "metrics" / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert eval_history(tmp_path) == [{"step": 0, "val_loss": 0.6931, "val_ppl": None},
                                      {"step": 40, "val_loss": 0.6075, "val_ppl": None}]
