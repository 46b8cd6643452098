"""Read-only SQL over a run: DuckDB views on the run's Parquet, Arrow and JSONL artifacts.

A run dir is data from whoever made it, so nothing read from it (folder names, paths, metadata, rows)
is ever pasted into SQL. DuckDB's file access is switched off and its configuration locked first, except for
the exact Parquet files checked here (``allowed_paths``, set as a bound value), which DuckDB scans itself
through its relation API; every other artifact is registered as a pyarrow table (its paths and names are
columns of data), and the only SQL executed is constant text. A query can neither write files nor read any
but those (no ``COPY``, ``ATTACH``, ``INSTALL``, ``read_csv('/etc/...')``) and the run dir is never changed.
Only files inside the run dir, in the layout tokenmill writes, are read: anything else under ``shards/`` is
refused, naming it.

The one public way to open a run for SQL is :mod:`flows.run_sql` (``connect``, ``run_query``): it adds the
trainer's views, which this package cannot import, to the views built here (:func:`open_views`,
:func:`run_statement`). The questions the report, the Prefect artifacts and docs/querying.md ask are named functions
here (:func:`data_funnel`, :func:`rejects_by_reason`, :func:`eval_history`, :func:`token_mix`,
:func:`near_duplicate_pairs`), each docstring listing its output columns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import duckdb
import pyarrow as pa

from core.documents import document_part_files
from core.errors import QueryError, ShardFormatError
from core.eval_results import all_rows, result_files
from core.layout import REJECT_FILES
from core.rundir import RunPaths, path_inside_run
from core.schemas import (
    ATTRIBUTES_SCHEMA,
    DOCUMENTS_SCHEMA,
    DUPLICATES_SCHEMA,
    REJECTS_SCHEMA,
    SHARD_INDEX_SCHEMA,
)
from core.shards.check import checked_shard_path, damaged_shard_message
from core.shards.store import SHARD_LAYOUT, ShardInfo, read_shard_index, scan_shard_files
from pipeline.objects import checked_url, is_remote
from pipeline.sql.preference_pairs import (
    PREFERENCE_PAIRS_SCHEMA,
    PREFERENCE_PAIRS_VIEW,
    preference_pairs_table,
    reference_files,
    score_files,
)
from pipeline.sql.remote_run import remote_run_tables
from pipeline.sql.run_mirror import mirror_run
from pipeline.sql.view_tables import (
    EMPTY_SEQUENCES_SCHEMA,
    EVAL_METRICS_SCHEMA,
    EVAL_RESULTS_SCHEMA,
    SEQUENCES_VIEW,
    TRAIN_METRICS_SCHEMA,
    TRAIN_SEGMENTS_SCHEMA,
    checked_shard,
    empty_table,
    first_line,
    jsonl_objects,
    metrics_table,
    sequences_of,
)

if TYPE_CHECKING:
    import pyarrow.dataset as ds

VIEWS = ("documents", "rejects", "attributes", "duplicates", "shards", "sequences", "train_metrics", "eval_metrics",
         "eval_results", "train_segments", PREFERENCE_PAIRS_VIEW)
ALLOWED_STATEMENTS = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}
TRAIN_SEGMENTS_VIEW = "train_segments"
DEPTH_ADVICE = 'Use "SET max_expression_depth'
GLOB_CHARACTERS = "*?[]{}"
"""Characters DuckDB's file readers may expand as a pattern."""
# Kept documents: not removed as a duplicate, not dropped by decontamination (those are in rejects).
DOCUMENTS_VIEW_SQL = ("CREATE VIEW documents AS SELECT * FROM _docs "
                      "WHERE doc_id NOT IN (SELECT doc_id FROM duplicates) "
                      "AND (source, uri) NOT IN (SELECT source, uri FROM rejects WHERE reason = 'contaminated')")


DerivedView = tuple[Callable[[Path], pa.Table], pa.Schema]
"""A view computed from the run dir by another package (the trainer's ``consumed``): (build, its empty schema).
``flows.run_sql`` hands them in: pipeline cannot import the trainer, and the trainer's order code derives them."""


def open_views(run_dir: str | Path, sql: str | None,
               derived: Mapping[str, DerivedView]) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with the run's views and ``derived``, unable to touch any file but the run's
    checked Parquet files. Users open a run with :func:`flows.run_sql.connect`, which hands in every derived view;
    the named questions here pass none (they read only the data views).

    ``run_dir`` may be a URL (``s3://bucket/runs/NAME``): the data views are then read through fsspec
    (:mod:`pipeline.sql.remote_run`), a statement naming eval_results, train_segments, preference_pairs or a
    derived view runs on the run's local mirror (:mod:`pipeline.sql.run_mirror`), and DuckDB is confined just the
    same.

    Views: documents, rejects, attributes, duplicates, shards, sequences, train_metrics, eval_metrics, eval_results,
    preference_pairs (columns: docs/querying.md, "The views"). ``sql``, when given, is the one statement the
    connection is for: a view not read straight from Parquet (metrics, results, launches, sequences, pairs,
    ``derived``) is built only when it names the view (else it is empty), so a damaged shard or metrics file breaks
    only the queries that read it, and a query pays only for what it reads.
    Raises QueryError, naming the folder or file, when the run dir holds what tokenmill would not write
    (a folder under ``shards/`` outside the layout, a file resolving outside the run dir, a broken shard).
    """
    mirrored = [*derived, TRAIN_SEGMENTS_VIEW, "eval_results", PREFERENCE_PAIRS_VIEW]
    if is_remote(str(run_dir)):
        checked_url(str(run_dir), "run dir")  # a bad bucket name or key: one line, before any request
    if is_remote(str(run_dir)) and sql is not None and not any(name in sql.lower() for name in mirrored):
        tables = remote_run_tables(str(run_dir), sql, mirrored)
        tables.update({name: empty_table(schema) for name, (_, schema) in derived.items()})
    elif is_remote(str(run_dir)):
        # Views built by code that reads files (the trainer's replayed order, eval results): from the run's
        # local, deletable mirror (pipeline.sql.run_mirror), fetched or brought up to date first.
        tables = _local_tables(mirror_run(str(run_dir)), sql, derived)
    else:
        tables = _local_tables(Path(run_dir), sql, derived)
    con = duckdb.connect(":memory:")
    # Locked before anything from the run dir reaches DuckDB: registered Arrow data needs no file access, and
    # DuckDB may open only the checked Parquet files (a bound value; a path is never SQL text).
    con.execute("SET allowed_paths = ?", [[path for data in tables.values() if isinstance(data, ParquetParts)
                                           for path in data.paths]])
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")
    for name, data in tables.items():
        if isinstance(data, ParquetParts):
            _create_parquet_view(con, name, data)
        else:
            con.register(name, data)
    con.execute(DOCUMENTS_VIEW_SQL)
    return con


@dataclass(frozen=True)
class ParquetParts:
    """A view's Parquet files, checked (regular, inside the run dir), for DuckDB to scan itself: no glob
    character in any path, as DuckDB would expand one (see :func:`_parquet_view`)."""

    paths: list[str]
    folder: Path


ViewData: TypeAlias = "ParquetParts | ds.Dataset | pa.Table"
"""What a view is made from: Parquet files DuckDB scans, or Arrow data registered with it."""


def _create_parquet_view(con: duckdb.DuckDBPyConnection, name: str, parts: ParquetParts) -> None:
    try:
        # by name: a run with text and chat sources has documents parts with and without ``record``
        con.read_parquet(parts.paths, union_by_name=True).create_view(name)
    except duckdb.Error as err:
        raise QueryError(f"{parts.folder}: not readable as Parquet ({first_line(err)}); remove or restore the "
                         "broken file, or re-run the stage that wrote it.") from None


def _local_tables(run_dir: Path, sql: str | None,
                  derived: Mapping[str, DerivedView]) -> dict[str, ViewData]:
    if not run_dir.is_dir():
        raise QueryError(f"{run_dir}: no such run directory; give the folder a tokenmill run wrote "
                         "(runs/<name> by default).")
    # Everything but the Parquet files is read (or refused) before a connection exists. A word test, not a
    # parse: a statement can read a view only by naming it, and a false positive merely builds that view.
    def named(view: str) -> bool:
        return sql is None or view in sql.lower()

    tables = _run_tables(run_dir, named)
    for name, (build, schema) in derived.items():
        tables[name] = build(run_dir) if named(name) else empty_table(schema)
    return tables


def run_statement(run_dir: str | Path, sql: str, derived: Mapping[str, DerivedView]) -> pa.Table:
    """Run one read-only statement (SELECT, WITH … SELECT, DESCRIBE, SUMMARIZE, EXPLAIN) and return a table:
    the machinery of :func:`flows.run_sql.run_query`. ``derived``: more views, as :func:`open_views` takes them.
    """
    try:
        statements = duckdb.extract_statements(sql)
    except duckdb.Error as err:
        raise QueryError(f"query failed: {duckdb_error_line(err)}") from None
    if not statements:
        raise QueryError("expected one SQL statement, got none; e.g. SELECT count(*) FROM documents")
    if len(statements) != 1:
        raise QueryError(f"expected exactly one SQL statement, got {len(statements)}; run them one at a time.")
    kind = statements[0].type
    if kind not in ALLOWED_STATEMENTS:
        raise QueryError(f"queries are read-only: {kind.name} statements are not allowed; use SELECT "
                         f"over the views {', '.join([*VIEWS, *derived])}.")
    con = open_views(run_dir, sql, derived)
    try:
        return con.sql(sql).to_arrow_table()
    except duckdb.Error as err:
        raise QueryError(f"query failed: {duckdb_error_line(err)}") from None
    finally:
        con.close()


def duckdb_error_line(err: duckdb.Error) -> str:
    """DuckDB's message as one line, its hints kept ("Did you mean ...", candidate columns).

    Dropped: the echoed statement with its ``^^^`` marker (multi-line), and the advice to
    ``SET max_expression_depth``, which a locked, one-statement connection cannot follow.
    """
    message = str(err).split("\n\nLINE ", 1)[0]
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    if DEPTH_ADVICE in line:
        line = (f"{line.split(DEPTH_ADVICE, 1)[0].rstrip()} Nest the expression less deeply: sum a list with "
                "list_sum, or split a long chain of operators.")
    return line


# ---- named questions ---------------------------------------------------------------------------


# A reject that is also in _docs (a contaminated document; a conversation or pair the SFT or preference data stage
# could not render or fit) was read once: told apart by its (source, uri), not its reason (a pair's identical_sides
# is an ingest reject as written, a document once rendered).
FUNNEL_SQL = """
WITH read_docs AS (SELECT source, count(*) AS n FROM _docs GROUP BY source),
     rej AS (SELECT source, count(*) AS n FROM rejects WHERE (source, uri) NOT IN (SELECT source, uri FROM _docs)
             GROUP BY source),
     contaminated AS (SELECT source, count(*) AS n FROM rejects WHERE reason = 'contaminated' GROUP BY source),
     dup AS (SELECT source, count(*) FILTER (WHERE kind = 'exact') AS exact,
                    count(*) FILTER (WHERE kind = 'near') AS near FROM duplicates GROUP BY source),
     kept AS (SELECT source, count(*) AS n FROM documents GROUP BY source)
SELECT s.source,
       coalesce(r.n, 0) + coalesce(j.n, 0) AS records_read,
       coalesce(j.n, 0) AS rejected,
       coalesce(d.exact, 0) AS exact_duplicates,
       coalesce(d.near, 0) AS near_duplicates,
       coalesce(c.n, 0) AS contaminated,
       coalesce(k.n, 0) AS kept
FROM (SELECT source FROM read_docs UNION SELECT source FROM rej) s
LEFT JOIN read_docs r USING (source) LEFT JOIN rej j USING (source)
LEFT JOIN dup d USING (source) LEFT JOIN contaminated c USING (source) LEFT JOIN kept k USING (source)
ORDER BY s.source
"""
REJECTS_BY_REASON_SQL = "SELECT source, reason, count(*) AS records FROM rejects GROUP BY ALL ORDER BY source, reason"
EVAL_SQL = "SELECT * FROM eval_metrics ORDER BY step"
EVAL_RESULTS_SQL = """
SELECT step, task, metric, round(value, 4) AS value, round(stderr, 4) AS stderr, num_samples
FROM eval_results WHERE source IS NULL AND metric NOT IN ('tokens', 'bytes') ORDER BY step, task, metric
"""
TOKEN_MIX_SQL = """
WITH docs AS (SELECT split, source, count(*) AS num_documents, sum(num_chars) AS num_chars
              FROM documents GROUP BY ALL),
     toks AS (SELECT split, source, count(*) AS num_shards, sum(num_rows) AS num_rows, sum(num_tokens) AS num_tokens
              FROM shards GROUP BY ALL)
SELECT split, source, coalesce(d.num_documents, 0) AS num_documents, coalesce(d.num_chars, 0)::BIGINT AS num_chars,
       t.num_shards, t.num_rows::BIGINT AS num_rows, t.num_tokens::BIGINT AS num_tokens,
       round(100 * t.num_tokens / sum(t.num_tokens) OVER (PARTITION BY split), 2) AS pct_of_split_tokens,
       round(t.num_tokens / nullif(d.num_chars, 0), 4) AS tokens_per_char
FROM toks t LEFT JOIN docs d USING (split, source)
ORDER BY split, source
"""
MIX_STEPS_SQL = """
SELECT step, m.stage, m.source, m.samples FROM (SELECT step, unnest(mix) AS m FROM train_metrics)
ORDER BY step, m.stage, m.source
"""
REALISED_MIX_SQL = """
WITH per_source AS (
    SELECT m.stage AS stage, m.source AS source, sum(m.samples)::BIGINT AS samples, min(step) AS first_row_step,
           max(step) AS last_row_step
    FROM (SELECT step, unnest(mix) AS m FROM train_metrics) GROUP BY ALL)
SELECT *, round(100 * samples / sum(samples) OVER (PARTITION BY stage), 2) AS pct_of_stage
FROM per_source ORDER BY stage, source
"""
NEAR_DUPLICATE_PAIRS_SQL = """
SELECT d.similarity, d.source, d.doc_id, d.uri AS removed_uri, d.duplicate_of, k.uri AS kept_uri
FROM duplicates d LEFT JOIN _docs k ON k.doc_id = d.duplicate_of
WHERE d.kind = 'near'
ORDER BY d.similarity DESC, d.doc_id
"""


def _rows(run_dir: Path, sql: str) -> list[dict[str, Any]]:
    con = open_views(run_dir, sql, {})
    try:
        return con.sql(sql).to_arrow_table().to_pylist()
    finally:
        con.close()


def data_funnel(run_dir: Path) -> list[dict[str, Any]]:
    """Per source: ``source, records_read, rejected, exact_duplicates, near_duplicates, contaminated, kept``.

    ``records_read`` counts every record once: a contaminated document is in ``docs`` and in ``rejects``, and so is
    a conversation or preference pair the SFT or preference data stage could not render (counted kept here: a
    document, not trained on; the rejects table says why).
    """
    return _rows(run_dir, FUNNEL_SQL)


def rejects_by_reason(run_dir: Path) -> list[dict[str, Any]]:
    """Per source and reason: ``source, reason, records``."""
    return _rows(run_dir, REJECTS_BY_REASON_SQL)


def eval_history(run_dir: Path) -> list[dict[str, Any]]:
    """Every evaluation: ``step, val_loss, val_ppl``; ``val_ppl`` None for a DPO run, whose ``val_loss`` is its val
    pairs' DPO loss, not a perplexity's logarithm (its eval rows have no ``val_ppl`` column to select)."""
    return [{"step": row["step"], "val_loss": round(row["val_loss"], 4),
             "val_ppl": None if row.get("val_ppl") is None else round(row["val_ppl"], 2)}
            for row in _rows(run_dir, EVAL_SQL)]


def eval_results_table(run_dir: Path) -> list[dict[str, Any]]:
    """The full evaluation, overall rows: step, task, metric, value (rounded), stderr, num_samples."""
    return _rows(run_dir, EVAL_RESULTS_SQL)


def token_mix(run_dir: Path) -> list[dict[str, Any]]:
    """Per split and source: ``split, source, num_documents, num_chars, num_shards, num_rows, num_tokens``
    (EOS included, padding excluded), ``pct_of_split_tokens``, ``tokens_per_char``."""
    return _rows(run_dir, TOKEN_MIX_SQL)


def mix_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The samples each train row's steps took, per mixture stage and source: ``step, stage, source, samples``.

    Empty for a run without ``mixture``/``mixture_schedule`` (its train rows have no ``mix`` column).
    """
    return _rows(run_dir, MIX_STEPS_SQL) if _has_mix_column(run_dir) else []


def realised_mix(run_dir: Path) -> list[dict[str, Any]]:
    """Per mixture stage and source: ``stage, source, samples, first_row_step, last_row_step, pct_of_stage``
    (the samples the run took; empty without a mixture)."""
    return _rows(run_dir, REALISED_MIX_SQL) if _has_mix_column(run_dir) else []


def _has_mix_column(run_dir: Path) -> bool:
    """Whether the train rows record a mixture (a run without one has no ``mix`` column to unnest)."""
    return any(row["column_name"] == "mix" for row in _rows(run_dir, "DESCRIBE SELECT * FROM train_metrics"))


def near_duplicate_pairs(run_dir: Path) -> list[dict[str, Any]]:
    """Every near duplicate with its survivor, most similar first:
    ``similarity, source, doc_id, removed_uri, duplicate_of, kept_uri``."""
    return _rows(run_dir, NEAR_DUPLICATE_PAIRS_SQL)


# ---- the run's artifacts as Arrow data ---------------------------------------------------------


def _run_tables(run_dir: Path, named: Callable[[str], bool]) -> dict[str, ViewData]:
    """Every artifact of the run as a view's data, by the name it is registered under (``_docs`` feeds
    ``documents``): the Parquet files as checked paths; the rest as Arrow data, built only for a view ``named``
    (else an empty table of its columns), as converting Python rows to Arrow imports pandas (0.2 s at start-up)
    and opening shards reads them. The layout under ``shards/`` is checked either way.
    """
    paths = RunPaths(run_dir)
    shard_files = _checked_shard_files(run_dir)
    built: dict[str, tuple[Callable[[], pa.Table], pa.Schema]] = {
        "train_metrics": (lambda: _jsonl_table(run_dir, paths.train_metrics, TRAIN_METRICS_SCHEMA),
                          TRAIN_METRICS_SCHEMA),
        "eval_metrics": (lambda: _jsonl_table(run_dir, paths.eval_metrics, EVAL_METRICS_SCHEMA), EVAL_METRICS_SCHEMA),
        "eval_results": (lambda: _eval_results_table(run_dir, paths), EVAL_RESULTS_SCHEMA),
        TRAIN_SEGMENTS_VIEW: (lambda: _train_segments_table(run_dir, paths.train_segments), TRAIN_SEGMENTS_SCHEMA),
        SEQUENCES_VIEW: (lambda: _sequences_table(run_dir, shard_files), EMPTY_SEQUENCES_SCHEMA),
        PREFERENCE_PAIRS_VIEW: (lambda: preference_pairs_table(run_dir, _checked_files(run_dir, score_files(paths)),
                                                               _checked_files(run_dir, reference_files(paths))),
                                PREFERENCE_PAIRS_SCHEMA),
    }
    return {
        "_docs": _parquet_view(run_dir, document_part_files(paths), DOCUMENTS_SCHEMA),
        "duplicates": _parquet_view(run_dir, _existing([paths.duplicates]), DUPLICATES_SCHEMA),
        "rejects": _parquet_view(run_dir, sorted(paths.rejects.glob(REJECT_FILES)), REJECTS_SCHEMA),
        "attributes": _parquet_view(run_dir, _existing([paths.attributes_of(part)
                                                        for part in document_part_files(paths)]),
                                    ATTRIBUTES_SCHEMA),
        "shards": _parquet_view(run_dir, _existing([paths.shard_index]), SHARD_INDEX_SCHEMA),
        **{name: build() if named(name) else empty_table(schema) for name, (build, schema) in built.items()},
    }


def _existing(candidates: list[Path]) -> list[Path]:
    return [path for path in candidates if path.exists()]


def _checked_files(run_dir: Path, files: list[Path]) -> list[Path]:
    """``files``, each a regular file inside the run dir; QueryError naming the first that is not."""
    for path in files:
        if not path_inside_run(run_dir, path):
            raise QueryError(f"{path}: resolves (through a symlink) outside the run dir {run_dir}; a run dir may "
                             "only point inside itself: replace the link by the file, or remove it.")
        if not path.is_file():
            raise QueryError(f"{path}: not a regular file (a folder, FIFO or device); remove it from the run dir.")
    return files


def _parquet_view(run_dir: Path, files: list[Path], schema: pa.Schema) -> ViewData:
    """The Parquet files of a view, for DuckDB to scan (``schema``'s empty table when there are none).

    A path with a glob character (a run dir named ``runs/[a]``) would be expanded by DuckDB into other files:
    those are scanned through a pyarrow dataset instead.
    """
    if not files:
        return empty_table(schema)
    paths = [str(path.absolute()) for path in _checked_files(run_dir, files)]
    if not any(char in path for path in paths for char in GLOB_CHARACTERS):
        return ParquetParts(paths, files[0].parent)
    # Imported here for start-up time: pyarrow.dataset imports pandas (0.2 s), which no other query needs.
    import pyarrow.dataset as ds

    try:
        return ds.dataset(paths, format="parquet")
    except (pa.ArrowException, OSError) as err:
        raise QueryError(f"{files[0].parent}: not readable as Parquet ({first_line(err)}); remove or restore "
                         "the broken file, or re-run the stage that wrote it.") from None


def _jsonl_rows(run_dir: Path, path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (none when absent); a torn last line (a writer killed mid-line) is skipped."""
    if not path.exists():
        return []
    return jsonl_objects(_checked_files(run_dir, [path])[0].read_text(encoding="utf-8", errors="replace"))


def _jsonl_table(run_dir: Path, path: Path, empty_schema: pa.Schema) -> pa.Table:
    """Metrics rows; a torn last line (a writer killed mid-line) is skipped rather than failing the query."""
    return metrics_table(_jsonl_rows(run_dir, path), path, empty_schema)


def _train_segments_table(run_dir: Path, path: Path) -> pa.Table:
    """The launches' summary columns (the full records hold the loader state and shard list the trainer replays)."""
    rows = []
    for record in _jsonl_rows(run_dir, path):
        shards = record.get("shards") if isinstance(record.get("shards"), list) else []
        num_rows = [shard.get("num_rows") for shard in shards if isinstance(shard, dict)]
        rows.append({**{name: record.get(name) for name in TRAIN_SEGMENTS_SCHEMA.names},
                     "num_shards": len(shards),
                     "num_train_rows": sum(n for n in num_rows if isinstance(n, int))})
    try:
        return pa.Table.from_pylist(rows, schema=TRAIN_SEGMENTS_SCHEMA)
    except (pa.ArrowException, TypeError) as err:
        raise QueryError(f"{path}: a line holds values of the wrong type ({first_line(err)}); the trainer writes "
                         "this file: restore it, or remove the odd line.") from None


def _eval_results_table(run_dir: Path, paths: RunPaths) -> pa.Table:
    """The full evaluation's results (``eval/results/step-N/<task>.json``): finished ones only, values as data."""
    rows = all_rows(paths, _checked_files(run_dir, result_files(paths)))
    try:
        return pa.Table.from_pylist(rows, schema=EVAL_RESULTS_SCHEMA)
    except (pa.ArrowException, TypeError) as err:
        raise QueryError(f"{paths.eval_results}: a result file holds values of the wrong type ({first_line(err)}); "
                         "delete it and re-run `tokenmill eval` to compute it again.") from None


def _checked_shard_files(run_dir: Path) -> list[Path]:
    """The shard files under ``shards/``; QueryError naming the first folder or file tokenmill would not write."""
    files, faults = scan_shard_files(run_dir)
    if faults:
        more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
        raise QueryError(f"{run_dir}: {faults[0]}{more}; "
                         f"shards live only at {SHARD_LAYOUT} inside the run dir: "
                         "remove or move what is not a shard (`tokenmill shards verify` lists every fault).")
    return files


def _sequences_table(run_dir: Path, shard_files: list[Path]) -> pa.Table:
    """``sequences``: every packed row, with its shard's ``split``, ``source`` and ``shard_path`` as data.

    One table of the memory-mapped shards (no copy of the tokens). The added columns share two arrays sized
    by the largest shard: ``row_in_shard`` slices one arange; split, source and shard_path are one-value
    dictionaries over one array of zero indices, so they cost a byte per row, not a string.
    Each shard is read only once its bytes are those the index recorded (:func:`_indexed_shards`).
    """
    if not shard_files and not RunPaths(run_dir).shard_index.is_file():
        return sequences_of({}, run_dir)
    indexed = _indexed_shards(run_dir, shard_files)
    shards = {}
    for path in shard_files:
        relpath = path.relative_to(run_dir).as_posix()
        shards[relpath] = _open_shard(run_dir, path)  # the format first: a truncated file is named as such
        _check_against_index(run_dir, path, indexed.get(relpath))
    return sequences_of(shards, run_dir)


def _indexed_shards(run_dir: Path, shard_files: list[Path]) -> dict[str, ShardInfo]:
    """The index's rows by path; QueryError when the index is missing or unsafe, or lists a shard not on disk."""
    try:
        infos = {info.path: info for info in read_shard_index(run_dir)}
    except ShardFormatError as err:
        raise QueryError(f"{err} (`sequences` reads only shards the index vouches for; queries that do not read "
                         "it still work)") from None
    on_disk = {path.relative_to(run_dir).as_posix() for path in shard_files}
    missing = sorted(set(infos) - on_disk)
    if missing:
        raise QueryError(damaged_shard_message(run_dir / missing[0], run_dir, "missing"))
    return infos


def _check_against_index(run_dir: Path, path: Path, info: ShardInfo | None) -> None:
    """QueryError naming ``path`` unless the index lists it with the sha256 of its bytes (hashed once per version)."""
    if info is None:
        raise QueryError(f"{path}: a shard file that shards/index.parquet does not list, so its bytes cannot be "
                         f"checked; nothing was read from it: `tokenmill shards verify {run_dir}` lists every fault; "
                         "remove the file, or re-run `tokenmill prepare` to write the index.")
    try:
        checked_shard_path(run_dir, info)
    except ShardFormatError as err:
        raise QueryError(str(err)) from None


def _open_shard(run_dir: Path, shard: Path) -> pa.Table:
    """A shard's rows, memory-mapped (no copy of the tokens), without schema metadata; QueryError if unreadable.

    Fully validated (list offsets within their buffers, ...): DuckDB trusts the Arrow data it scans, and a
    damaged file must fail here with its name, not inside the scan. That reads the offsets, not the tokens.
    """
    return checked_shard(lambda: pa.memory_map(str(shard)), shard, run_dir)
