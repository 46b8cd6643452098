"""Read the ``documents`` of a run: ingested parts (``docs/part-*.parquet``) minus removed duplicates."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from core.errors import RunDirError
from core.rundir import RunPaths, path_inside_run

DUPLICATES_FILE = "duplicates.parquet"
CONTAMINATED_FILE = "contaminated.parquet"
"""``rejects/contaminated.parquet``: train documents the decontaminate stage removed (REJECTS_SCHEMA)."""

DOC_ID_MASK = 0x7FFF_FFFF_FFFF_FFFF

def doc_id_for(source: str, uri: str) -> int:
    """Stable int64 document id: 63 bits of xxh3-64 over ``source \\0 uri``."""
    return xxhash.xxh3_64_intdigest(f"{source}\x00{uri}".encode()) & DOC_ID_MASK



def document_part_files(paths: RunPaths) -> list[Path]:
    """Finished document parts in part order (``part-NNNNN.parquet`` whose ingest marker exists).

    The marker is ``stages/ingest/part-NNNNN.json`` (or, in a run dir written before ``stages/`` held every
    marker, ``docs/part-NNNNN.json``); see :meth:`core.rundir.RunPaths.done_summary`.
    """
    parts = sorted(paths.docs.glob("part-*.parquet"))
    finished = []
    for part in parts:
        marker = paths.finished_marker("ingest", part.stem)
        if not path_inside_run(paths.root, part) or (marker is not None and not path_inside_run(paths.root, marker)):
            raise RunDirError(f"{part}: resolves (through a symlink) outside the run dir {paths.root}; a run dir "
                              "may only point inside itself: replace the link by the file, or use a fresh run dir.")
        if marker is not None:
            finished.append(part)
    return finished


def document_part_marker(paths: RunPaths, part: Path) -> Path:
    """The ingest marker of a finished document part (see :func:`document_part_files`)."""
    marker = paths.finished_marker("ingest", part.stem)
    if marker is None:
        raise RunDirError(f"{part}: no ingest marker (stages/ingest/{part.stem}.json); the part is unfinished: "
                          "re-run ingest.")
    return marker


def removed_doc_ids(paths: RunPaths) -> pa.Array:
    """doc_ids the dedupe stage removed, then those the decontaminate stage removed (empty before either ran)."""
    removed = []
    path = paths.dedupe / DUPLICATES_FILE
    if path.is_file():
        removed.append(pq.read_table(path, columns=["doc_id"]).column("doc_id").combine_chunks())
    contaminated = paths.rejects / CONTAMINATED_FILE
    if contaminated.is_file():
        rows = pq.read_table(contaminated, columns=["source", "uri"]).to_pylist()  # doc_id = hash(source, uri)
        removed.append(pa.array([doc_id_for(row["source"], row["uri"]) for row in rows], pa.int64()))
    return pa.concat_arrays(removed) if removed else pa.array([], type=pa.int64())


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
