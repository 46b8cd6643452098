"""Read-only SQL over a run: DuckDB views on the run's Parquet, Arrow and JSONL artifacts.

Every view is a pyarrow dataset registered in an in-memory DuckDB; then DuckDB's file access is switched
off and its configuration locked, so a query can neither read nor write files (no ``COPY``, ``ATTACH``,
``INSTALL``, ``read_csv('/etc/...')``) and the run dir is never changed.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.ipc as ipc

from pipeline.documents import DUPLICATES_FILE, document_part_files
from pipeline.errors import TokenmillError
from pipeline.rundir import RunPaths
from pipeline.schemas import DOCUMENTS_SCHEMA, DUPLICATES_SCHEMA, REJECTS_SCHEMA, SHARD_INDEX_SCHEMA

VIEWS = ("documents", "rejects", "duplicates", "shards", "sequences", "train_metrics", "eval_metrics")
ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
TRAIN_METRICS_SCHEMA = pa.schema([("step", pa.int64()), ("loss", pa.float64()), ("lr", pa.float64()),
                                  ("tokens_seen", pa.int64()), ("tokens_per_s", pa.float64())])
EVAL_METRICS_SCHEMA = pa.schema([("step", pa.int64()), ("val_loss", pa.float64()), ("val_ppl", pa.float64())])


class QueryError(TokenmillError):
    """A query was refused or failed."""


def connect(run_dir: str | Path) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the run's views, unable to touch any file.

    Views: documents, rejects, duplicates, shards, sequences, train_metrics, eval_metrics
    (columns as in the README's data contracts). For notebooks: ``connect("runs/tiny").sql("...").df()``.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise QueryError(f"{run_dir}: no such run directory; give the folder a tokenmill run wrote "
                         "(runs/<name> by default).")
    paths = RunPaths(run_dir)
    con = duckdb.connect(":memory:")
    _register(con, "_docs", _parquet_dataset(document_part_files(paths), DOCUMENTS_SCHEMA))
    _register(con, "duplicates", _parquet_dataset(_existing([paths.dedupe / DUPLICATES_FILE]), DUPLICATES_SCHEMA))
    _register(con, "rejects", _parquet_dataset(sorted(paths.rejects.glob("*.parquet")), REJECTS_SCHEMA))
    _register(con, "shards", _parquet_dataset(_existing([paths.shard_index]), SHARD_INDEX_SCHEMA))
    _register(con, "train_metrics", _jsonl_table(paths.metrics / "train.jsonl", TRAIN_METRICS_SCHEMA))
    _register(con, "eval_metrics", _jsonl_table(paths.metrics / "eval.jsonl", EVAL_METRICS_SCHEMA))
    # Kept documents: not removed as a duplicate, not dropped by decontamination (those are in rejects).
    con.execute("CREATE VIEW documents AS SELECT * FROM _docs WHERE doc_id NOT IN (SELECT doc_id FROM duplicates) "
                "AND (source, uri) NOT IN (SELECT source, uri FROM rejects WHERE reason = 'contaminated')")
    _create_sequences_view(con, run_dir)
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    return con


def run_query(run_dir: str | Path, sql: str) -> pa.Table:
    """Run one read-only statement (SELECT, WITH … SELECT, DESCRIBE, SUMMARIZE, EXPLAIN) and return a table."""
    statements = duckdb.extract_statements(sql)
    if len(statements) != 1:
        raise QueryError(f"expected exactly one SQL statement, got {len(statements)}; run them one at a time.")
    kind = statements[0].type
    if kind not in ALLOWED_STATEMENTS:
        raise QueryError(f"queries are read-only: {kind.name} statements are not allowed; use SELECT "
                         f"over the views {', '.join(VIEWS)}.")
    con = connect(run_dir)
    try:
        return con.sql(sql).to_arrow_table()
    except duckdb.Error as err:
        message = str(err).splitlines()[0]
        raise QueryError(f"query failed: {message}") from None
    finally:
        con.close()


def _register(con: duckdb.DuckDBPyConnection, name: str, data: ds.Dataset | pa.Table) -> None:
    con.register(name, data)


def _existing(candidates: list[Path]) -> list[Path]:
    return [path for path in candidates if path.is_file()]


def _parquet_dataset(files: list[Path], schema: pa.Schema) -> ds.Dataset | pa.Table:
    if not files:
        return schema.empty_table()
    return ds.dataset([str(path) for path in files], format="parquet")


def _jsonl_table(path: Path, empty_schema: pa.Schema) -> pa.Table:
    """Metrics rows; a torn last line (a writer killed mid-line) is skipped rather than failing the query."""
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
    if not rows:
        return empty_schema.empty_table()
    return pa.Table.from_pylist(rows)


def _create_sequences_view(con: duckdb.DuckDBPyConnection, run_dir: Path) -> None:
    """``sequences``: every packed row, with its shard's ``split``, ``source`` and ``shard_path``."""
    shard_files = sorted((run_dir / "shards").rglob("*.arrow"))
    if not shard_files:
        empty = pa.schema([("input_ids", pa.list_(pa.uint16())), ("doc_ids", pa.list_(pa.int64())),
                           ("doc_starts", pa.list_(pa.int32())), ("first_doc_offset", pa.int32()),
                           ("num_tokens", pa.int32()), ("row_in_shard", pa.int64()), ("split", pa.string()),
                           ("source", pa.string()), ("shard_path", pa.string())])
        _register(con, "sequences", empty.empty_table())
        return
    selects = []
    for number, shard in enumerate(shard_files):
        relpath = shard.relative_to(run_dir).as_posix()
        split, source = (part.split("=", 1)[1] for part in shard.relative_to(run_dir / "shards").parts[:2])
        name = f"_shard_{number}"
        _register(con, name, _numbered_rows(shard))
        selects.append(f"SELECT *, '{split}' AS split, '{source}' AS source, '{relpath}' AS shard_path FROM {name}")
    con.execute("CREATE VIEW sequences AS " + " UNION ALL ".join(selects))


def _numbered_rows(shard: Path) -> pa.Table:
    """A shard's rows, memory-mapped (no copy of the tokens), plus ``row_in_shard`` (0-based): a scan has no
    row number of its own, and ``shard_path`` + ``row_in_shard`` name a row the way the loader and
    ``tokenmill shards sample`` (its ``row``) do."""
    table = ipc.open_file(pa.memory_map(str(shard))).read_all()
    return table.append_column("row_in_shard", pa.array(np.arange(table.num_rows, dtype=np.int64)))
