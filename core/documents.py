"""Read the ``documents`` of a run: ingested parts (``docs/part-*.parquet``) minus removed duplicates."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import xxhash

from core.errors import RunDirError
from core.layout import CONTAMINATED_FILE as CONTAMINATED_FILE  # re-exported (tests)
from core.layout import DUPLICATES_FILE as DUPLICATES_FILE
from core.layout import PART_FILES
from core.rundir import RunPaths, path_inside_run

"""``rejects/contaminated.parquet``: train documents the decontaminate stage removed (REJECTS_SCHEMA)."""

DOC_ID_MASK = 0x7FFF_FFFF_FFFF_FFFF
KEY_COLUMNS = ["doc_id", "split", "source"]
"""Small columns :func:`iter_documents` reads first, to decide which rows (and row groups) it needs."""

def doc_id_for(source: str, uri: str) -> int:
    """Stable int64 document id: 63 bits of xxh3-64 over ``source \\0 uri``."""
    return xxhash.xxh3_64_intdigest(f"{source}\x00{uri}".encode()) & DOC_ID_MASK



def document_part_files(paths: RunPaths) -> list[Path]:
    """Finished document parts in part order (``part-NNNNN.parquet`` whose ingest marker exists).

    The marker is ``stages/ingest/part-NNNNN.json`` (or, in a run dir written before ``stages/`` held every
    marker, ``docs/part-NNNNN.json``); see :meth:`core.rundir.RunPaths.done_summary`.
    """
    parts = sorted(paths.docs.glob(PART_FILES))
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
    path = paths.duplicates
    if path.is_file():
        removed.append(pq.read_table(path, columns=["doc_id"]).column("doc_id").combine_chunks())
    contaminated = paths.contaminated
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

    ``split``/``source`` filter rows; ``columns`` selects columns (default all); ``parts`` restricts to some
    part files (incremental stages). Memory is bounded by one row group.

    Per row group, the key columns (``doc_id``, ``split``, ``source``) are read first, and the other columns
    only when a row is kept: a row group with none of the wanted rows (ingest writes each split in row groups
    of its own) is never decompressed. Row groups whose statistics rule the split or source out are not read.
    """
    removed = np.sort(removed_doc_ids(paths).to_numpy(zero_copy_only=False))
    for part in parts if parts is not None else document_part_files(paths):
        parquet = pq.ParquetFile(part)
        names = columns if columns is not None else parquet.schema_arrow.names
        for group in wanted_row_groups(parquet.metadata, split=split, source=source):
            kept = _read_kept_rows(parquet, group, removed, split, source, list(names))
            if kept is not None:
                yield from kept.to_batches(max_chunksize=batch_rows)


def wanted_row_groups(metadata: pq.FileMetaData, *, split: str | None = None,
                      source: str | None = None) -> list[int]:
    """Row groups of a documents part that may hold rows of ``split`` and ``source`` (by column statistics)."""
    index = {metadata.schema.column(i).name: i for i in range(metadata.num_columns)}
    wanted = {name: value for name, value in (("split", split), ("source", source)) if value is not None}
    groups = []
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        if all(_may_hold(row_group, index.get(name), value) for name, value in wanted.items()):
            groups.append(group)
    return groups


def _may_hold(row_group: pq.RowGroupMetaData, column: int | None, value: str) -> bool:
    statistics = None if column is None else row_group.column(column).statistics
    if statistics is None or not statistics.has_min_max:
        return True
    return statistics.min <= value <= statistics.max


def _read_kept_rows(parquet: pq.ParquetFile, group: int, removed: np.ndarray, split: str | None,
                    source: str | None, columns: list[str]) -> pa.Table | None:
    """The row group's kept rows with ``columns``, or None when it keeps none (other columns then stay unread)."""
    keys = parquet.read_row_group(group, columns=KEY_COLUMNS)
    doc_ids = keys.column("doc_id").to_numpy()
    mask = ~_is_in_sorted(doc_ids, removed)
    for name, value in (("split", split), ("source", source)):
        if value is not None:
            mask &= pc.fill_null(pc.equal(keys.column(name), value), False).to_numpy(zero_copy_only=False)
    if not mask.any():
        return None
    others = [name for name in columns if name not in KEY_COLUMNS]
    table = keys
    if others:
        table = parquet.read_row_group(group, columns=others)
        for name in KEY_COLUMNS:
            table = table.append_column(keys.schema.field(name), keys.column(name))
    return table.select(columns).filter(pa.array(mask))


def _is_in_sorted(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Elementwise ``values in sorted_set`` by binary search: O(n log m), the set is sorted once per call of
    :func:`iter_documents` (``pc.is_in`` rebuilt its hash table of every removed id for each batch)."""
    if not sorted_set.size:
        return np.zeros(values.shape, dtype=bool)
    positions = np.minimum(np.searchsorted(sorted_set, values), sorted_set.size - 1)
    return sorted_set[positions] == values
