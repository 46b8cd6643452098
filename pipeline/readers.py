"""Ingest stage, reading: one source file (jsonl/.gz/.zst, parquet, text, hf_disk, hf_local) -> records and rejects.

Readers stream (bounded memory: one decompressed chunk or one record batch at a time) and never let a
broken record vanish: it becomes a :class:`Reject` with a ``REJECT_REASONS`` reason, its uri and its
raw bytes. Only a file that cannot be read at all stops the run (``SourceReadError``), or, with the
source's ``on_error: skip``, becomes one ``unreadable_file`` reject.
"""

from __future__ import annotations

import codecs
import gzip
import itertools
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from pipeline.errors import SourceReadError
from pipeline.manifest import SourceConfig

CHUNK_BYTES = 1 << 20
"""Bytes read (or decompressed) per step from a jsonl file."""
BATCH_ROWS = 1024
"""Rows per record batch read from parquet and hf_disk sources."""
RAW_FILE_LIMIT_BYTES = 16 << 20
"""An unreadable file's bytes are copied into its reject row only up to this size (it stays at its path)."""


@dataclass(frozen=True, slots=True)
class Record:
    """A document as read: text not yet normalised; ``raw`` is kept when the reader had the bytes anyway."""

    uri: str
    text: str
    source_id: str | None
    raw: bytes | None


@dataclass(frozen=True, slots=True)
class Reject:
    """A record (or file) that could not become a document, with why and its original bytes."""

    uri: str
    reason: str
    detail: str
    raw: bytes | None
    source_id: str | None = None


class UnreadableFileError(Exception):
    """Raised inside readers when (the rest of) a file cannot be read; ``read_file`` applies on_error."""

    def __init__(self, detail: str, uri: str, raw: bytes | None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.uri = uri
        self.raw = raw


class _TruncatedStreamError(Exception):
    """A compressed stream ended inside a frame."""


def read_file(path: Path, rel: str, source: SourceConfig) -> Iterator[Record | Reject]:
    """Yield every record of one source file in file order; ``rel`` (posix, relative) builds the uris.

    Raises ``SourceReadError`` (one line: the file, what is wrong, what to do) when the file cannot be
    read and the source has ``on_error: fail``; with ``skip`` yields one ``unreadable_file`` reject.
    """
    try:
        yield from _READERS[source.format](path, rel, source)
    except UnreadableFileError as err:
        if source.on_error == "fail":
            raise SourceReadError(
                f"{path}: {err.detail}; fix or remove the file, or set on_error: skip on source "
                f"'{source.name}' to record it in rejects and go on."
            ) from None
        yield Reject(err.uri, "unreadable_file", err.detail, err.raw)


def _describe(err: BaseException, path: Path, rel: str) -> str:
    """One-line exception text with the absolute path replaced by ``rel`` (outputs hold no absolute paths)."""
    text = getattr(err, "strerror", None) if isinstance(err, OSError) and err.strerror else str(err)
    text = " ".join((text or type(err).__name__).split())
    return text.replace(str(path.resolve()), rel).replace(str(path), rel)


def _file_bytes(path: Path) -> bytes | None:
    """The file's bytes for an unreadable_file reject, when small enough to copy."""
    try:
        return path.read_bytes() if path.stat().st_size <= RAW_FILE_LIMIT_BYTES else None
    except OSError:
        return None


# ---- text ---------------------------------------------------------------------------------------


def _read_text(path: Path, rel: str, source: SourceConfig) -> Iterator[Record | Reject]:
    """One document per file, UTF-8 (a leading BOM is dropped)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise UnreadableFileError(f"cannot read the file ({_describe(err, path, rel)})", rel, None) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        yield Reject(rel, "invalid_utf8", f"byte {err.start}: {err.reason}; save the file as UTF-8", data)
        return
    yield Record(rel, text.removeprefix("\ufeff"), None, data)


# ---- jsonl --------------------------------------------------------------------------------------


def _read_jsonl(path: Path, rel: str, source: SourceConfig) -> Iterator[Record | Reject]:
    """One JSON object per line; blank lines carry no record and are skipped."""
    for line_no, line in _iter_lines(path, rel):
        if line_no == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        if line.strip():
            yield parse_json_line(line, f"{rel}:{line_no}", source)


def parse_json_line(line: bytes, uri: str, source: SourceConfig) -> Record | Reject:
    """A jsonl line as a record, or the reject that says why it is not one."""
    try:
        obj = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return Reject(uri, "invalid_utf8", f"byte {err.start}: {err.reason}", line)
    except (ValueError, RecursionError) as err:
        return Reject(uri, "invalid_json", " ".join(str(err).split())[:200], line)
    if not isinstance(obj, dict):
        return Reject(uri, "not_an_object", f"the line holds a JSON {type(obj).__name__}, not an object", line)
    source_id = _source_id(obj.get(source.id_field)) if source.id_field else None
    value = obj.get(source.text_field)
    if value is None:
        keys = ", ".join(sorted(obj)[:10])
        detail = f"no '{source.text_field}' field (keys: {keys}); set text_field in the manifest"
        return Reject(uri, "missing_text", detail, line, source_id)
    if not isinstance(value, str):
        detail = f"'{source.text_field}' holds a JSON {type(value).__name__}, not a string"
        return Reject(uri, "non_string_text", detail, line, source_id)
    if not value.isascii() and not _is_encodable(value):
        return Reject(uri, "invalid_utf8", "the text has a lone surrogate escape (\\ud8xx)", line, source_id)
    return Record(uri, value, source_id, line)


def _source_id(value: object) -> str | None:
    if value is None:
        return None
    text = str(value)
    return text if text.isascii() or _is_encodable(text) else text.encode("utf-8", "backslashreplace").decode()


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _iter_lines(path: Path, rel: str) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, line bytes without \\n)``; a corrupt or cut stream raises after its good lines."""
    line_no = 0
    pieces: list[bytes] = []  # the line being assembled across chunks (no quadratic concatenation)
    try:
        for chunk in _decompressed_chunks(path):
            if b"\n" not in chunk:
                pieces.append(chunk)
                continue
            lines = chunk.split(b"\n")
            lines[0] = b"".join([*pieces, lines[0]])
            pieces = [lines.pop()]
            for line in lines:
                line_no += 1
                yield line_no, line
    except (OSError, EOFError, zlib.error, zstandard.ZstdError, _TruncatedStreamError) as err:
        tail = b"".join(pieces)
        if line_no == 0 and not tail:
            detail = f"cannot be read as {_stream_kind(path)} ({_describe(err, path, rel)})"
            raise UnreadableFileError(detail, rel, _file_bytes(path)) from None
        detail = (f"{_stream_kind(path)} stream is cut or corrupt after line {line_no} "
                  f"({_describe(err, path, rel)}); the {line_no} complete lines before it are kept")
        raise UnreadableFileError(detail, f"{rel}:{line_no + 1}", tail) from None
    tail = b"".join(pieces)
    if tail:
        yield line_no + 1, tail


def _stream_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        return "gzip"
    return "zstd" if name.endswith((".zst", ".zstd")) else "text"


def _decompressed_chunks(path: Path) -> Iterator[bytes]:
    kind = _stream_kind(path)
    with open(path, "rb") as handle:
        if kind == "gzip":
            with gzip.GzipFile(fileobj=handle) as stream:
                yield from _gzip_chunks(stream)
        elif kind == "zstd":
            yield from _zstd_chunks(handle)
        else:
            while chunk := handle.read(CHUNK_BYTES):
                yield chunk


def _gzip_chunks(stream: gzip.GzipFile) -> Iterator[bytes]:
    """Decompressed chunks of about CHUNK_BYTES; at a cut or corrupt spot, the data before it comes out first.

    ``GzipFile.read(CHUNK_BYTES)`` raises at a cut without returning what it had decompressed, so a truncated
    file smaller than a chunk lost all its complete lines; ``read1`` returns what each read decompresses.
    """
    pieces: list[bytes] = []
    num_bytes = 0
    try:
        while piece := stream.read1(CHUNK_BYTES):
            pieces.append(piece)
            num_bytes += len(piece)
            if num_bytes >= CHUNK_BYTES:
                yield b"".join(pieces)
                pieces, num_bytes = [], 0
    except (OSError, EOFError, zlib.error) as err:
        if pieces:
            yield b"".join(pieces)  # the data before the cut: its complete lines are kept
        raise err
    if pieces:
        yield b"".join(pieces)


def _zstd_chunks(handle: BinaryIO) -> Iterator[bytes]:
    """Decompress every zstd frame; unlike ``stream_reader``, a cut last frame is an error, not silence."""
    context = zstandard.ZstdDecompressor()
    frame = context.decompressobj()
    frame_started = False
    while compressed := handle.read(CHUNK_BYTES):
        while compressed:
            frame_started = True
            if out := frame.decompress(compressed):
                yield out
            compressed = b""
            if frame.eof:
                compressed = frame.unused_data
                frame = context.decompressobj()
                frame_started = False
    if frame_started:
        raise _TruncatedStreamError("the last zstd frame is incomplete")


# ---- parquet and hf_disk (Arrow record batches) ------------------------------------------------


def _read_parquet(path: Path, rel: str, source: SourceConfig) -> Iterator[Record | Reject]:
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        detail = f"not a Parquet file ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, rel, _file_bytes(path)) from None
    columns = _batch_columns(parquet.schema_arrow.names, source, rel)
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield from _records_from_batch(batch, rel, row, source)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as err:
        detail = f"Parquet data is corrupt after row {row} ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, f"{rel}#row={row}", None) from None


def _read_hf_disk(path: Path, rel: str, source: SourceConfig) -> Iterator[Record | Reject]:
    """A folder written by ``Dataset.save_to_disk`` (or ``DatasetDict``: splits read in name order)."""
    import datasets  # imported here: ~1 s, and only the hf formats need it

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, KeyError, OSError, pa.ArrowException) as err:
        detail = f"not a dataset folder written by save_to_disk ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, rel, None) from None
    splits = sorted(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for split, dataset in splits:
        prefix = f"{rel}/{split}" if split else rel
        columns = _batch_columns(dataset.column_names, source, prefix)
        row = 0
        for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=BATCH_ROWS):
            yield from _records_from_batch(table, prefix, row, source)
            row += table.num_rows


HF_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""hf_local: file suffix -> ``datasets`` builder; a trailing .gz/.bz2/.xz/.zst is decompressed by datasets."""
_HF_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")


def _read_hf_local(path: Path, rel: str, source: SourceConfig) -> Iterator[Record | Reject]:
    """One local json/jsonl/parquet/csv file through ``datasets.load_dataset(..., streaming=True)``.

    Streaming keeps one record batch in memory and writes no Arrow cache. ``datasets`` cannot skip a
    malformed record (it parses a block of lines at once, and one bad line fails the block), so for a
    JSON-lines file the rest of the file, from the first row it did not deliver, is read line by line by
    the jsonl reader: each broken line becomes its own reject (uri ``file:line``) and no valid record is
    lost. Other files that fail end there (``unreadable_file`` with on_error: skip).
    """
    import datasets  # imported here: ~1 s, and only the hf formats need it

    builder = hf_local_builder(path)
    if builder is None:
        known = ", ".join(sorted(HF_LOCAL_BUILDERS))
        detail = f"hf_local reads {known} files (optionally .gz/.bz2/.xz/.zst); narrow the source's glob"
        raise UnreadableFileError(detail, rel, None)
    row = 0
    try:
        try:
            dataset = datasets.load_dataset(builder, data_files=[str(path.resolve())], split="train", streaming=True)
        except StopIteration:  # an empty file: datasets finds no first example to infer features from
            return
        for table in dataset.with_format("arrow").iter(batch_size=BATCH_ROWS):
            columns = _batch_columns(table.schema.names, source, rel)
            yield from _records_from_batch(table.select(columns), rel, row, source)
            row += table.num_rows
    except (ValueError, OSError, KeyError, TypeError, pa.ArrowException, datasets.exceptions.DatasetsError) as err:
        if builder == "json" and _is_json_lines(path):
            yield from itertools.islice(_read_jsonl(path, rel, source), row, None)
            return
        detail = f"datasets cannot read it as {builder} after row {row} ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, f"{rel}#row={row}", _file_bytes(path) if row == 0 else None) from None


def _is_json_lines(path: Path) -> bool:
    """A plain, gzip or zstd file whose first non-blank byte opens an object (not a ``[...]`` JSON array)."""
    if path.name.lower().endswith((".bz2", ".xz")):
        return False  # the line reader decompresses gzip and zstd only
    try:
        for _, line in _iter_lines(path, path.name):
            if stripped := line.lstrip(codecs.BOM_UTF8).strip():
                return stripped.startswith(b"{")
    except UnreadableFileError:
        return False
    return False


def hf_local_builder(path: Path) -> str | None:
    """The ``datasets`` builder for an hf_local file (``json``, ``parquet``, ``csv``), or None."""
    name = path.name.lower()
    for compression in _HF_COMPRESSION_SUFFIXES:
        name = name.removesuffix(compression)
    return HF_LOCAL_BUILDERS.get(Path(name).suffix)


def _batch_columns(names: list[str], source: SourceConfig, rel: str) -> list[str]:
    if source.text_field not in names:
        shown = ", ".join(names[:20])
        detail = f"has no column '{source.text_field}' (columns: {shown}); set text_field in the manifest"
        raise UnreadableFileError(detail, rel, None)
    columns = [source.text_field]
    if source.id_field is not None and source.id_field in names and source.id_field != source.text_field:
        columns.append(source.id_field)
    return columns


def _records_from_batch(
    batch: pa.RecordBatch | pa.Table, rel: str, first_row: int, source: SourceConfig
) -> Iterator[Record | Reject]:
    texts = _column_values(batch.column(source.text_field))
    has_id = source.id_field is not None and source.id_field in batch.schema.names
    ids = _column_values(batch.column(source.id_field)) if has_id else itertools.repeat(None)
    for offset, (value, id_value) in enumerate(zip(texts, ids, strict=False)):
        yield _record_from_value(value, _source_id(id_value), f"{rel}#row={first_row + offset}", source)


def _column_values(column: pa.Array | pa.ChunkedArray) -> list[object]:
    """Python values of a column; ``datasets``' JSON-typed columns (mixed types in a json file) are parsed."""
    values = column.to_pylist()
    if getattr(column.type, "extension_name", None) == "arrow.json":
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


_READERS: dict[str, Callable[[Path, str, SourceConfig], Iterator[Record | Reject]]] = {
    "text": _read_text,
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "hf_disk": _read_hf_disk,
    "hf_local": _read_hf_local,
}
