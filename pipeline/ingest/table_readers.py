"""Ingest stage, Arrow-backed formats: a parquet file, an hf_disk folder or an hf_local file -> records and rejects.

Read one record batch at a time (``BATCH_ROWS`` rows); a value above the record byte limit is ``too_long``
without becoming a Python string, and a string column that is not valid UTF-8 is read as bytes (each bad
value is its own ``invalid_utf8`` reject). hf_local goes through ``datasets``; the JSON-lines lines it cannot
deliver are read again by the jsonl line parser, so no valid record is lost.
"""

from __future__ import annotations

import codecs
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.ingest.records import (
    RECORD_FIELDS,
    Record,
    Reject,
    parse_json_line,
    source_id_text,
    structured_record,
    too_long,
)
from pipeline.ingest.streams import (
    TOO_LONG_RAW_BYTES,
    UnreadableFileError,
    describe_error,
    iter_lines,
    open_regular,
    raw_file_bytes,
)
from pipeline.manifest import SourceConfig
from pipeline.objects import ObjectPath

BATCH_ROWS = 1024
"""Rows per record batch read from parquet and hf_disk sources."""


def read_parquet(path: Path | ObjectPath, rel: str, source: SourceConfig,
                 max_bytes: int) -> Iterator[Record | Reject]:
    """One Parquet file, ``BATCH_ROWS`` rows at a time (only the text and id columns are read)."""
    try:
        with open_regular(path) as handle:
            yield from _parquet_records(pq.ParquetFile(handle), path, rel, source, max_bytes)
    except (pa.ArrowException, OSError) as err:
        detail = f"not a Parquet file ({describe_error(err, path, rel)})"
        raise UnreadableFileError(detail, rel, raw_file_bytes(path)) from None


def _parquet_records(parquet: pq.ParquetFile, path: Path, rel: str, source: SourceConfig,
                     max_bytes: int) -> Iterator[Record | Reject]:
    columns = _batch_columns(parquet.schema_arrow.names, source, rel)
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield from _records_from_batch(batch, rel, row, source, max_bytes)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as err:
        detail = f"Parquet data is corrupt after row {row} ({describe_error(err, path, rel)})"
        raise UnreadableFileError(detail, f"{rel}#row={row}", None) from None


def read_hf_disk(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
    """A folder written by ``Dataset.save_to_disk`` (or ``DatasetDict``: splits read in name order)."""
    import datasets  # imported here: ~1 s, and only the hf formats need it

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, KeyError, OSError, pa.ArrowException) as err:
        detail = f"not a dataset folder written by save_to_disk ({describe_error(err, path, rel)})"
        raise UnreadableFileError(detail, rel, None) from None
    splits = sorted(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, dataset in splits:
        prefix = f"{rel}/{split}" if split else rel
        columns = _batch_columns(dataset.column_names, source, prefix)
        row = 0
        for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS):
            yield from _records_from_batch(table, prefix, row, source, max_bytes)
            row += table.num_rows


HF_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""hf_local: file suffix -> ``datasets`` builder; a trailing .gz/.bz2/.xz/.zst is decompressed by datasets."""
_HF_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")


def read_hf_local(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
    """One local json/jsonl/parquet/csv file through ``datasets.load_dataset(..., streaming=True)``.

    Streaming keeps one record batch in memory and writes no Arrow cache. ``datasets`` cannot skip a
    malformed record (it parses a block of lines at once, and one bad line fails the block), so for a
    JSON-lines file the lines it did not deliver are read again by the jsonl reader
    (:func:`_lines_not_delivered`): each broken line becomes its own reject (uri ``file:line``) and no valid
    record is lost. Other files that fail end there (``unreadable_file`` with on_error: skip).

    ``datasets`` holds a whole line in memory (it reads a block, then on to the end of its last line), so a
    JSON-lines file with a line above ``max_bytes`` (a decompression bomb) is read by the jsonl reader
    instead, which rejects that line as ``too_long`` while it streams (uris ``file:line``). Finding out costs
    one pass of the line reader over the file (~5% of what datasets takes).
    """
    import datasets  # imported here: ~1 s, and only the hf formats need it

    builder = hf_local_builder(path)
    if builder is None:
        known = ", ".join(sorted(HF_LOCAL_BUILDERS))
        detail = f"hf_local reads {known} files (optionally .gz/.bz2/.xz/.zst); narrow the source's glob"
        raise UnreadableFileError(detail, rel, None)
    if builder == "json" and _is_json_lines(path, max_bytes) and _has_long_line(path, max_bytes):
        yield from _lines_not_delivered(path, rel, source, 0, max_bytes)
        return
    row = 0
    try:
        try:
            dataset = datasets.load_dataset(builder, data_files=[str(path.resolve())], split="train", streaming=True)
        except StopIteration:  # an empty file: datasets finds no first example to infer features from
            return
        for table in dataset.with_format("arrow").iter(batch_size=BATCH_ROWS):
            columns = _batch_columns(table.schema.names, source, rel)
            yield from _records_from_batch(table.select(columns), rel, row, source, max_bytes)
            row += table.num_rows
    except (ValueError, OSError, KeyError, TypeError, pa.ArrowException, datasets.exceptions.DatasetsError) as err:
        if builder == "json" and _is_json_lines(path, max_bytes):
            yield from _lines_not_delivered(path, rel, source, row, max_bytes)
            return
        detail = f"datasets cannot read it as {builder} after row {row} ({describe_error(err, path, rel)})"
        raise UnreadableFileError(detail, f"{rel}#row={row}", raw_file_bytes(path) if row == 0 else None) from None


def _lines_not_delivered(path: Path, rel: str, source: SourceConfig, num_rows: int,
                         max_bytes: int) -> Iterator[Record | Reject]:
    """The jsonl reader's items for the lines after the first ``num_rows`` rows that datasets delivered.

    A row is not a line: a line holding two objects (``{...}{...}``) is two rows to datasets (one
    ``invalid_json`` line to the jsonl reader), a blank line none. So the delivered lines are found by
    counting the JSON values on each line. A line whose rows were only partly delivered (datasets
    stopped inside it) is read again: its raw bytes are kept, a record may then be both a document and
    in a reject, never in neither.
    """
    num_accounted = 0
    for line_no, line, num_bytes in iter_lines(path, rel, max_bytes):
        if num_bytes > len(line):
            num_accounted += 1
            if num_accounted > num_rows:
                yield too_long(f"{rel}:{line_no}", line, num_bytes, max_bytes)
            continue
        if line_no == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        if not line.strip():
            continue
        if num_accounted < num_rows:
            num_accounted += _num_json_values(line)
            if num_accounted <= num_rows:
                continue
        yield parse_json_line(line, f"{rel}:{line_no}", source)


_JSON_DECODER = json.JSONDecoder()


def _num_json_values(line: bytes) -> int:
    """How many JSON values follow each other on a line (at least 1: datasets made a row of every non-blank
    line it delivered; counting fewer than it did would skip a line it did not deliver)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return 1
    count, position = 0, 0
    while position < len(text):
        try:
            _, position = _JSON_DECODER.raw_decode(text, position)
        except (ValueError, RecursionError):
            break
        count += 1
        while position < len(text) and text[position] in " \t\r":
            position += 1
    return max(count, 1)


def _is_json_lines(path: Path, max_bytes: int) -> bool:
    """A plain, gzip or zstd file whose first non-blank byte opens an object (not a ``[...]`` JSON array)."""
    if path.name.lower().endswith((".bz2", ".xz")):
        return False  # the line reader decompresses gzip and zstd only
    try:
        for _, line, _ in iter_lines(path, path.name, max_bytes):
            if stripped := line.lstrip(codecs.BOM_UTF8).strip():
                return stripped.startswith(b"{")
    except UnreadableFileError:
        return False
    return False


def _has_long_line(path: Path, max_bytes: int) -> bool:
    """Whether a line of the file is longer than ``max_bytes`` (a file the line reader cannot read: False)."""
    try:
        return any(num_bytes > max_bytes for _, _, num_bytes in iter_lines(path, path.name, max_bytes))
    except UnreadableFileError:
        return False


def hf_local_builder(path: Path) -> str | None:
    """The ``datasets`` builder for an hf_local file (``json``, ``parquet``, ``csv``), or None."""
    name = path.name.lower()
    for compression in _HF_COMPRESSION_SUFFIXES:
        name = name.removesuffix(compression)
    return HF_LOCAL_BUILDERS.get(Path(name).suffix)


def _batch_columns(names: list[str], source: SourceConfig, rel: str) -> list[str]:
    if source.records != "text":
        return _structured_columns(names, source, rel)
    if source.text_field not in names:
        shown = ", ".join(names[:20])
        detail = f"has no column '{source.text_field}' (columns: {shown}); set text_field in the manifest"
        raise UnreadableFileError(detail, rel, None)
    columns = [source.text_field]
    if source.id_field is not None and source.id_field in names and source.id_field != source.text_field:
        columns.append(source.id_field)
    return columns


def _structured_columns(names: list[str], source: SourceConfig, rel: str) -> list[str]:
    """A chat or preference source's columns: those of :data:`RECORD_FIELDS` the file has, and its id column."""
    fields = RECORD_FIELDS[source.records]
    columns = [name for name in fields if name in names]
    if not columns:
        shown, wanted = ", ".join(names[:20]), ", ".join(f"'{name}'" for name in fields)
        what = "pairs" if source.records == "preference" else "conversations"
        raise UnreadableFileError(f"has none of the columns {wanted} (columns: {shown}); a source with records: "
                                  f"{source.records} reads {what} from them", rel, None)
    if source.id_field is not None and source.id_field in names and source.id_field not in columns:
        columns.append(source.id_field)
    return columns


def _structured_records_from_batch(batch: pa.RecordBatch | pa.Table, rel: str, first_row: int,
                                   source: SourceConfig) -> Iterator[Record | Reject]:
    """A conversation (or pair) document or reject per row. A null field (a column other rows fill, a message
    struct's optional key) counts as absent, as a JSON record would leave it out."""
    for offset, row in enumerate(batch.to_pylist()):
        source_id = source_id_text(row.get(source.id_field)) if source.id_field is not None else None
        record = _without_nulls({key: row[key] for key in RECORD_FIELDS[source.records] if key in row})
        yield structured_record(source.records, record, f"{rel}#row={first_row + offset}", None, source_id)


def _without_nulls(value: object) -> object:
    """``value`` with every null-valued key of its objects dropped, at any depth."""
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _records_from_batch(batch: pa.RecordBatch | pa.Table, rel: str, first_row: int, source: SourceConfig,
                        max_bytes: int) -> Iterator[Record | Reject]:
    """A record or reject per row; a value above ``max_bytes`` is ``too_long`` without becoming a Python string."""
    if source.records != "text":
        yield from _structured_records_from_batch(batch, rel, first_row, source)
        return
    text_column = batch.column(source.text_field)
    oversized = _oversized_values(text_column, max_bytes)
    if oversized:
        text_column = pc.if_else(pa.array([row in oversized for row in range(len(text_column))]),
                                 pa.scalar(None, text_column.type), text_column)
    texts = _column_values(text_column, keep_invalid_bytes=True)
    has_id = source.id_field is not None and source.id_field in batch.schema.names
    ids = _column_values(batch.column(source.id_field)) if has_id else itertools.repeat(None)
    for offset, (value, id_value) in enumerate(zip(texts, ids, strict=False)):
        uri, source_id = f"{rel}#row={first_row + offset}", source_id_text(id_value)
        if offset in oversized:
            yield too_long(uri, oversized[offset][0], oversized[offset][1], max_bytes, source_id)
        else:
            yield _record_from_value(value, source_id, uri, source)


def _oversized_values(column: pa.Array | pa.ChunkedArray, max_bytes: int) -> dict[int, tuple[bytes, int]]:
    """``{row: (first bytes, size in bytes)}`` of the string or binary values longer than ``max_bytes``."""
    kind = column.type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind)) or len(column) == 0:
        return {}
    lengths = pc.binary_length(column)
    if (pc.max(lengths).as_py() or 0) <= max_bytes:
        return {}
    rows = pc.indices_nonzero(pc.greater(lengths, max_bytes)).to_pylist()
    return {row: (column[row].as_buffer()[:TOO_LONG_RAW_BYTES].to_pybytes(), lengths[row].as_py()) for row in rows}


def _column_values(column: pa.Array | pa.ChunkedArray, keep_invalid_bytes: bool = False) -> list[object]:
    """Python values of a column; ``datasets``' JSON-typed columns (mixed types in a json file) are parsed.

    A string column holding bytes that are not UTF-8 (Parquet and Arrow files do not check what they are
    given) is read as binary: with ``keep_invalid_bytes`` each value comes as ``bytes`` (the record reader
    decodes each and rejects the bad ones with their bytes), else decoded with ``\\xNN`` escapes.
    """
    kind = column.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        try:
            column.validate(full=True)
        except pa.ArrowInvalid:
            binary = pa.large_binary() if pa.types.is_large_string(kind) else pa.binary()
            chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
            values = [value for chunk in chunks for value in chunk.view(binary).to_pylist()]
            if keep_invalid_bytes:
                return values
            return [None if value is None else value.decode("utf-8", "backslashreplace") for value in values]
    values = column.to_pylist()
    if getattr(kind, "extension_name", None) == "arrow.json":
        return [None if value is None else json.loads(value) for value in values]
    return values


def _record_from_value(value: object, source_id: str | None, uri: str, source: SourceConfig) -> Record | Reject:
    if isinstance(value, str):
        return Record(uri, value, source_id, None)
    if value is None:
        return Reject(uri, "missing_text", f"'{source.text_field}' is null", None, source_id)
    if isinstance(value, bytes):
        try:
            return Record(uri, value.decode("utf-8"), source_id, value)
        except UnicodeDecodeError as err:
            return Reject(uri, "invalid_utf8", f"byte {err.start}: {err.reason}", value, source_id)
    raw = json.dumps(value, default=str).encode("utf-8")
    detail = f"'{source.text_field}' holds a {type(value).__name__}, not a string"
    return Reject(uri, "non_string_text", detail, raw, source_id)
