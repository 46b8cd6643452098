"""Ingest stage: the files of one part as they are written, by ingest and when a part is re-decided
(:mod:`pipeline.ingest.redecide`): documents, rejects and attributes rows, Parquet row groups, the part's MinHash
signature cache."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.parquet as pq

from core.documents import doc_id_for
from core.layout import part_file_name
from core.rundir import RunPaths
from core.schemas import ATTRIBUTES_SCHEMA
from pipeline.config import NearDedupeConfig
from pipeline.filters.screen import Attributes, content_hash, split_for
from pipeline.filters.web_filters import storable_statistics
from pipeline.ingest.readers import Reject

if TYPE_CHECKING:
    from pipeline.dedupe.near_dedupe import SignatureBlocks

ROW_GROUP_ROWS = 65_536
ROW_GROUP_CHARS = 8 << 20
"""A row group is flushed at this many rows or characters of text, whichever comes first: bounded memory
here (per split: each split is buffered apart), and for every later reader (a row group is the least a
Parquet reader decompresses)."""

def document_row(source: str, uri: str, source_id: str | None, text: str, val_fraction: float,
                 record: str | None = None) -> dict[str, Any]:
    """The documents row of a kept text (its id, hash and split follow from it); ``record``: a chat document's
    conversation JSON (a text part's schema has no such column: the sink leaves it out)."""
    text_hash = content_hash(text)
    return {"doc_id": doc_id_for(source, uri), "source": source, "source_id": source_id, "uri": uri, "text": text,
            "num_chars": len(text), "content_hash": text_hash, "split": split_for(text_hash, val_fraction),
            "record": record}


ATTRIBUTE_NAMES = tuple(field.name for field in ATTRIBUTES_SCHEMA)


def attribute_row(row: dict[str, Any], values: Attributes) -> dict[str, Any]:
    """The attributes row of a parsed document from its documents or rejects ``row`` and measured ``values``."""
    identity = {"doc_id": doc_id_for(row["source"], row["uri"]), "source": row["source"],
                "source_id": row["source_id"], "uri": row["uri"], "reason": row.get("reason")}
    stored = storable_statistics(values)
    return {name: identity[name] if name in identity else stored.get(name) for name in ATTRIBUTE_NAMES}


def reject_row(reject: Reject, source: str) -> dict[str, Any]:
    return {"source": source, "source_id": reject.source_id, "uri": reject.uri, "reason": reject.reason,
            "detail": reject.detail, "raw": reject.raw, "text": None}


class SignatureCollector:
    """MinHash signatures of a part's documents, row group by row group, streamed into the dedupe stage's cache.

    They are written in blocks of ``near_dedupe.SIGNATURE_BLOCK_BYTES`` as they are made, to a temporary
    file that :meth:`write` renames over the cache, so memory does not grow with the part. Used as a
    context manager, an exception removes the unfinished file. Any cache of this part from earlier is
    removed first: its documents are being rewritten (the files behind an unfinished part may have
    changed), and a cache is trusted by the part's fingerprint alone.
    """

    def __init__(self, paths: RunPaths, part_id: int, part_fingerprint: str, near: NearDedupeConfig | None) -> None:
        self._near = near if near is not None and near.enabled else None
        self._paths = paths
        self._open = contextlib.ExitStack()
        self._blocks: SignatureBlocks | None = None
        if self._near is None and not paths.dedupe.is_dir():
            self._caches: tuple[Path, ...] = ()
            return
        from pipeline.dedupe import near_dedupe  # numba and DuckDB: loaded only when near dedupe is on (or was)

        self._near_dedupe = near_dedupe
        self._caches = near_dedupe.near_cache_files(paths, part_file_name(part_id))
        self._metadata = (near_dedupe.signature_cache_metadata(part_fingerprint, self._near)
                          if self._near is not None else {})
        for cache in self._caches:
            cache.unlink(missing_ok=True)

    def __enter__(self) -> SignatureCollector:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._open.__exit__(*exc_info)

    def add(self, documents: pa.Table) -> None:
        if self._near is not None:
            self._cache_blocks().add_texts(documents.column("text"), self._near)

    def write(self) -> None:
        """Finish the cache and rename it in place (after the part's documents); nothing without near settings."""
        if self._near is None:
            return
        self._cache_blocks()  # a part without documents still gets its (empty) cache
        self._open.close()

    def _cache_blocks(self) -> SignatureBlocks:
        if self._blocks is None:
            self._blocks = self._open.enter_context(
                self._near_dedupe.signature_cache_writer(self._paths, self._caches[0], self._metadata,
                                                         self._near.num_perm))
        return self._blocks


UNDICTIONARIED_COLUMNS = frozenset({"text", "raw"})


class ParquetSink:
    """Rows in, row groups out: buffers rows as columns and flushes them at a size bound.

    With ``group_column``, rows of each value of that column are buffered and flushed apart, so every row group
    holds one value: a documents part keeps each split in row groups of its own, and a reader of one split
    skips the other's row groups undecompressed (:func:`core.documents.iter_documents`). Rows of one value keep
    their order; the bound holds per value.
    """

    def __init__(self, path: Path, schema: pa.Schema, on_flush: Callable[[pa.Table], None] | None = None,
                 group_column: str | None = None) -> None:
        """``on_flush`` sees each row group's table as it is written."""
        self._schema = schema
        self._on_flush = on_flush
        self._group_column = group_column
        # Documents' text and rejects' raw bytes are (nearly) all distinct: a dictionary page for them is built,
        # found useless and dropped on every row group, and reading the column back costs ~25% more.
        dictionary = [name for name in schema.names if name not in UNDICTIONARIED_COLUMNS]
        self._writer = pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=dictionary)
        self._buffers: dict[Any, _RowBuffer] = {}

    def append(self, row: dict[str, Any], size: int) -> None:
        key = row[self._group_column] if self._group_column is not None else None
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = _RowBuffer(self._schema.names)
        buffer.append(row, size)
        if buffer.size >= ROW_GROUP_CHARS or buffer.num_rows >= ROW_GROUP_ROWS:
            self._flush(key)

    def _flush(self, key: Any) -> None:
        buffer = self._buffers.pop(key)
        table = pa.Table.from_pydict(buffer.columns, schema=self._schema)
        self._writer.write_table(table)
        if self._on_flush is not None:
            self._on_flush(table)

    def close(self) -> None:
        for key in sorted(self._buffers, key=str):  # str: a None group (no group_column) sorts too
            self._flush(key)
        self._writer.close()


class _RowBuffer:
    """Rows of one future row group, as columns, and the size they count towards the flush bound."""

    def __init__(self, names: list[str]) -> None:
        self.columns: dict[str, list[Any]] = {name: [] for name in names}
        self.num_rows = 0
        self.size = 0

    def append(self, row: dict[str, Any], size: int) -> None:
        for name, values in self.columns.items():
            values.append(row[name])
        self.num_rows += 1
        self.size += size
