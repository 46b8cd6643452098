"""Read the ``documents`` of a run: ingested parts (``docs/part-*.parquet``) minus removed duplicates."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.rundir import RunPaths

DUPLICATES_FILE = "duplicates.parquet"


def document_part_files(paths: RunPaths) -> list[Path]:
    """Finished document parts in part order (``part-NNNNN.parquet`` whose ``.json`` marker exists)."""
    parts = sorted(paths.docs.glob("part-*.parquet"))
    return [part for part in parts if part.with_suffix(".json").is_file()]


def removed_doc_ids(paths: RunPaths) -> pa.Array:
    """doc_ids the dedupe stage removed (empty before dedupe has run)."""
    path = paths.dedupe / DUPLICATES_FILE
    if not path.is_file():
        return pa.array([], type=pa.int64())
    return pq.read_table(path, columns=["doc_id"]).column("doc_id").combine_chunks()


def iter_documents(
    paths: RunPaths,
    *,
    split: str | None = None,
    source: str | None = None,
    columns: Sequence[str] | None = None,
    parts: Sequence[Path] | None = None,
    batch_rows: int = 1024,
) -> Iterator[pa.RecordBatch]:
    """Yield kept documents in a deterministic order (part order, then row order), batch by batch.

    ``split``/``source`` filter rows; ``columns`` selects columns (filter columns are read anyway);
    ``parts`` restricts to some part files (incremental stages). Memory is bounded by one row group.
    """
    removed = removed_doc_ids(paths)
    wanted = None if columns is None else list(dict.fromkeys([*columns, "doc_id", "split", "source"]))
    for part in parts if parts is not None else document_part_files(paths):
        parquet = pq.ParquetFile(part)
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=wanted):
            mask = pc.invert(pc.is_in(batch.column("doc_id"), value_set=removed))
            if split is not None:
                mask = pc.and_(mask, pc.equal(batch.column("split"), split))
            if source is not None:
                mask = pc.and_(mask, pc.equal(batch.column("source"), source))
            kept = batch.filter(mask)
            if columns is not None:
                kept = kept.select(list(columns))
            if kept.num_rows:
                yield kept
