"""Ingest stage, reading: one source file (jsonl/.gz/.zst, parquet, text, hf_disk, hf_local) -> records and rejects.

Readers stream (bounded memory: one decompressed chunk or one record batch at a time) and never let a
broken record vanish: it becomes a :class:`Reject` with a ``REJECT_REASONS`` reason, its uri and its
raw bytes. Only a file that cannot be read at all stops the run (``SourceReadError``), or, with the
source's ``on_error: skip``, becomes one ``unreadable_file`` reject.

What a source folder holds is data, never trusted: only regular files inside the source folder are opened
(a symbolic link that leads outside it, a FIFO, a device or a socket becomes one reject, whatever
``on_error`` says), a record longer than :func:`record_byte_limit` is rejected as ``too_long`` while it
streams (a decompression bomb costs one chunk of memory, not its expanded size), and every string a reader
hands on is valid UTF-8 (what Parquet stores).
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import itertools
import json
import os
import stat
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import zstandard

from core.errors import SourceReadError
from pipeline.manifest import FilterConfig, SourceConfig

CHUNK_BYTES = 1 << 20
"""Bytes read (or decompressed) per step from a jsonl file."""
BATCH_ROWS = 1024
"""Rows per record batch read from parquet and hf_disk sources."""
RAW_FILE_LIMIT_BYTES = 16 << 20
"""An unreadable file's bytes are copied into its reject row only up to this size (it stays at its path)."""
MAX_JSON_BYTES_PER_CHAR = 12
"""The most bytes one character takes in a JSON line: an astral character escaped as ``\\uXXXX\\uXXXX``."""
RECORD_SLACK_BYTES = 64 << 20
"""Added to a record's byte limit: room for its other fields, and a record a little above ``max_chars`` is
still read whole (its reject keeps all its raw bytes, so it can be re-ingested with a higher limit)."""
TOO_LONG_RAW_BYTES = 1 << 20
"""A record rejected unread as ``too_long`` keeps only its first this many bytes in ``raw``."""
DEFAULT_MAX_CHARS = FilterConfig().max_chars


def record_byte_limit(max_chars: int) -> int:
    """Bytes above which one record (jsonl line, text file, column value) is ``too_long`` without being parsed.

    ``MAX_JSON_BYTES_PER_CHAR * max_chars + RECORD_SLACK_BYTES``: no record this long can hold a text of at most
    ``max_chars`` characters (plus 64 MiB of other fields), so nothing the quality filter keeps is refused here.
    With the default ``max_chars`` (2,000,000) that is 87 MiB; it bounds what one record costs in memory.
    """
    return MAX_JSON_BYTES_PER_CHAR * max_chars + RECORD_SLACK_BYTES


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


def read_file(path: Path, rel: str, source: SourceConfig,
              max_chars: int = DEFAULT_MAX_CHARS) -> Iterator[Record | Reject]:
    """Yield every record of one source file in file order; ``rel`` (posix, relative) builds the uris.

    ``path`` is ``<source folder>/<rel>``. A path that must not be read (a link leading outside the source
    folder, anything but a regular file) is one reject, checked here when the file is read, so it holds even
    if the file changed after planning. A record longer than ``record_byte_limit(max_chars)`` bytes is a
    ``too_long`` reject with a truncated ``raw``. Every string yielded is valid UTF-8 (:func:`storable`).

    Raises ``SourceReadError`` (one line: the file, what is wrong, what to do) when the file cannot be
    read and the source has ``on_error: fail``; with ``skip`` yields one ``unreadable_file`` reject.
    """
    try:
        refused = refusal(path, rel, source)
        items = [refused] if refused else _READERS[source.format](path, rel, source, record_byte_limit(max_chars))
        for item in items:
            yield storable(item)
    except UnreadableFileError as err:
        if source.on_error == "fail":
            raise SourceReadError(
                f"{path}: {err.detail}; fix or remove the file, or set on_error: skip on source "
                f"'{source.name}' to record it in rejects and go on."
            ) from None
        yield storable(Reject(err.uri, "unreadable_file", err.detail, err.raw))


def refusal(path: Path, rel: str, source: SourceConfig) -> Reject | None:
    """The reject for a path no reader may open, or None: the rule for every file and folder of a source.

    ``outside_source``: the path resolves (through symbolic links) outside the source folder, which is
    ``path`` with ``rel`` taken off; ``not_a_regular_file``: a FIFO, socket, device (or a folder, but for an
    hf_disk dataset). Neither is opened (opening a FIFO blocks; a device never ends), whatever ``on_error``
    says: nothing in them is a record. A ``rel`` that is absolute or climbs with ``..`` (a hostile
    ``docs/plan.json`` could hold one) is outside by definition. A path that no longer resolves raises
    ``UnreadableFileError``.
    """
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or ".." in parts:
        return Reject(rel, "outside_source", "the planned path is absolute or climbs out with '..'; not read", None)
    folder = path
    for _ in parts:
        folder = folder.parent
    try:
        resolved = path.resolve(strict=True)
        mode = resolved.stat().st_mode
        inside = resolved.is_relative_to(folder.resolve(strict=True))
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop, up to Python 3.12
        raise UnreadableFileError(f"cannot be read ({_describe(err, path, rel)})", rel, None) from None
    if not inside:
        return Reject(rel, "outside_source", f"a symbolic link to a {file_kind(mode)} outside the source folder, "
                      "not read; copy what it points to into the folder, or make that a source of its own", None)
    if stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and source.format == "hf_disk"):
        return None
    return Reject(rel, "not_a_regular_file", f"a {file_kind(mode)}, not a regular file; only regular files are "
                  "read: remove it or add it to the source's exclude", None)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``file``, ``folder``, ``FIFO``, ``socket``, ``character device``, …"""
    kinds = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symbolic link"))
    return next((name for test, name in kinds if test(mode)), "special file")


def storable(item: Record | Reject) -> Record | Reject:
    """``item`` with every string valid UTF-8, the one check before anything reaches a Parquet row.

    A text holding a lone surrogate (a JSON ``\\ud800`` escape) is no document: it becomes an
    ``invalid_utf8`` reject. A uri made from a file name that is not UTF-8 shows its bytes as ``\\xNN``
    (the document is kept, and its ``doc_id`` comes from that uri, stable across runs); a detail or
    ``source_id`` shows a lone surrogate as ``\\udNNN``.
    """
    if isinstance(item, Record) and not _is_utf8(item.text):
        raw = item.raw if item.raw is not None else item.text.encode("utf-8", "surrogatepass")
        item = Reject(item.uri, "invalid_utf8", "the text has a lone surrogate escape (\\ud8xx)", raw, item.source_id)
    changes: dict[str, str] = {}
    if not _is_utf8(item.uri):
        changes["uri"] = escape_file_name(item.uri)
    if item.source_id is not None and not _is_utf8(item.source_id):
        changes["source_id"] = _backslash_escaped(item.source_id)
    if isinstance(item, Reject) and not _is_utf8(item.detail):
        changes["detail"] = _backslash_escaped(item.detail)
    return dataclasses.replace(item, **changes) if changes else item


def escape_file_name(name: str) -> str:
    """A file name (or a uri made from one) as valid UTF-8: bytes that are not UTF-8 become ``\\xNN``.

    ``os.walk`` hands such bytes on as surrogate escapes (``\\udcff`` for byte 0xff); other lone surrogates
    become ``\\udNNN``.
    """
    try:
        data = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return _backslash_escaped(name)
    return data.decode("utf-8", "backslashreplace")


def _backslash_escaped(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _is_utf8(text: str) -> bool:
    return text.isascii() or _is_encodable(text)


def _describe(err: BaseException, path: Path, rel: str) -> str:
    """One-line exception text with the absolute path replaced by ``rel`` (outputs hold no absolute paths)."""
    text = getattr(err, "strerror", None) if isinstance(err, OSError) and err.strerror else str(err)
    text = " ".join((text or type(err).__name__).split())
    return text.replace(str(path.resolve()), rel).replace(str(path), rel)


def open_regular(path: Path) -> BinaryIO:
    """``path`` opened for reading, only if it is a regular file (checked on the open file: no race).

    Opened non-blocking, so a FIFO put in its place after the last check cannot hang the open; raises
    ``OSError`` ("not a regular file") for anything but a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(0, f"not a regular file (a {file_kind(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_bytes(path: Path) -> bytes | None:
    """The file's bytes for an unreadable_file reject, when small enough to copy."""
    try:
        with open_regular(path) as handle:
            data = handle.read(RAW_FILE_LIMIT_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= RAW_FILE_LIMIT_BYTES else None


def too_long(uri: str, prefix: bytes, num_bytes: int, max_bytes: int, source_id: str | None = None) -> Reject:
    """The ``too_long`` reject of a record of ``num_bytes`` not read whole; ``raw`` holds its first bytes."""
    kept = prefix[:TOO_LONG_RAW_BYTES]
    detail = (f"{num_bytes} bytes, above the {max_bytes}-byte limit for one record ({MAX_JSON_BYTES_PER_CHAR} bytes "
              f"per character of filters.max_chars, plus {RECORD_SLACK_BYTES >> 20} MiB); not parsed, raw holds "
              f"its first {len(kept)} bytes")
    return Reject(uri, "too_long", detail, kept, source_id)


# ---- text ---------------------------------------------------------------------------------------


def _read_text(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
    """One document per file, UTF-8 (a leading BOM is dropped); a file above ``max_bytes`` is read no further."""
    try:
        with open_regular(path) as handle:
            num_bytes = os.fstat(handle.fileno()).st_size
            data = handle.read(TOO_LONG_RAW_BYTES if num_bytes > max_bytes else num_bytes + 1)
            if num_bytes < len(data) <= max_bytes:  # it grew while being read: read on, up to the limit
                data += handle.read(max_bytes + 1 - len(data))
    except OSError as err:
        raise UnreadableFileError(f"cannot read the file ({_describe(err, path, rel)})", rel, None) from None
    if num_bytes > max_bytes or len(data) > max_bytes:
        yield too_long(rel, data, max(num_bytes, len(data)), max_bytes)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        yield Reject(rel, "invalid_utf8", f"byte {err.start}: {err.reason}; save the file as UTF-8", data)
        return
    yield Record(rel, text.removeprefix("\ufeff"), None, data)


# ---- jsonl --------------------------------------------------------------------------------------


def _read_jsonl(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
    """One JSON object per line; blank lines carry no record and are skipped."""
    for line_no, line, num_bytes in iter_lines(path, rel, max_bytes):
        if num_bytes > len(line):
            yield too_long(f"{rel}:{line_no}", line, num_bytes, max_bytes)
            continue
        if line_no == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        if line.strip():
            yield parse_json_line(line, f"{rel}:{line_no}", source)


def parse_json_line(line: bytes, uri: str, source: SourceConfig) -> Record | Reject:
    """A jsonl line as a record, or the reject that says why it is not one (a lone surrogate in the text is
    found by :func:`storable`)."""
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
    return Record(uri, value, source_id, line)


def _source_id(value: object) -> str | None:
    if value is None:
        return None
    text = value.decode("utf-8", "backslashreplace") if isinstance(value, bytes) else str(value)
    return text if _is_utf8(text) else _backslash_escaped(text)


def _is_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _LineBuffer:
    """The line being assembled across chunks (no quadratic concatenation), bounded: past ``max_bytes`` only
    its first TOO_LONG_RAW_BYTES are kept, while its size goes on being counted."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.pieces: list[bytes] = []
        self.num_bytes = 0

    def add(self, piece: bytes) -> None:
        within = self.num_bytes <= self.max_bytes
        self.num_bytes += len(piece)
        if self.num_bytes <= self.max_bytes:
            self.pieces.append(piece)
        elif within:  # just went over the limit: keep the prefix for the reject; what comes next is only counted
            self.pieces = _prefix([*self.pieces, piece])

    def take(self) -> tuple[bytes, int]:
        """The line (or its kept prefix) and its size in bytes; the buffer starts a new line."""
        line, num_bytes = b"".join(self.pieces), self.num_bytes
        self.pieces, self.num_bytes = [], 0
        return line, num_bytes


def _prefix(pieces: list[bytes]) -> list[bytes]:
    """The first TOO_LONG_RAW_BYTES of ``pieces``, without joining them all."""
    kept: list[bytes] = []
    num_kept = 0
    for piece in pieces:
        if num_kept >= TOO_LONG_RAW_BYTES:
            break
        kept.append(piece[: TOO_LONG_RAW_BYTES - num_kept])
        num_kept += len(kept[-1])
    return kept


def iter_lines(path: Path, rel: str, max_bytes: int) -> Iterator[tuple[int, bytes, int]]:
    """``(1-based line number, line bytes without \\n, its size in bytes)``; a corrupt or cut stream raises
    after its good lines.

    A line longer than ``max_bytes`` comes with only its first TOO_LONG_RAW_BYTES (its size is bigger than
    what comes): memory holds one chunk and at most ``max_bytes`` of one line, however large the line is.
    """
    line_no = 0
    buffer = _LineBuffer(max_bytes)
    try:
        for chunk in _decompressed_chunks(path):
            if b"\n" not in chunk:
                buffer.add(chunk)
                continue
            lines = chunk.split(b"\n")
            buffer.add(lines[0])
            tail = lines.pop()
            line_no += 1
            yield (line_no, *buffer.take())
            for line in itertools.islice(lines, 1, None):
                line_no += 1
                yield line_no, line if len(line) <= max_bytes else line[:TOO_LONG_RAW_BYTES], len(line)
            buffer.add(tail)
    except (OSError, EOFError, zlib.error, zstandard.ZstdError, _TruncatedStreamError) as err:
        tail, _ = buffer.take()
        if line_no == 0 and not tail:
            detail = f"cannot be read as {_stream_kind(path)} ({_describe(err, path, rel)})"
            raise UnreadableFileError(detail, rel, _file_bytes(path)) from None
        detail = (f"{_stream_kind(path)} stream is cut or corrupt after line {line_no} "
                  f"({_describe(err, path, rel)}); the {line_no} complete lines before it are kept")
        raise UnreadableFileError(detail, f"{rel}:{line_no + 1}", tail) from None
    if buffer.num_bytes:
        yield (line_no + 1, *buffer.take())


def _stream_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        return "gzip"
    return "zstd" if name.endswith((".zst", ".zstd")) else "text"


def _decompressed_chunks(path: Path) -> Iterator[bytes]:
    kind = _stream_kind(path)
    with open_regular(path) as handle:
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
    file smaller than a chunk lost all its complete lines; ``read1`` returns what each read decompresses
    (at most CHUNK_BYTES: a gzip bomb costs one chunk).
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
    """Decompress every zstd frame; unlike ``stream_reader``, a cut last frame is an error, not silence.

    ``decompressobj`` returns all a call decompresses (it has no ``max_length``), so it is fed a few
    blocks at a time (:func:`_zstd_pieces`): each call then returns at most about CHUNK_BYTES.
    """
    context = zstandard.ZstdDecompressor()
    frame = context.decompressobj()
    frame_started = False
    for piece in _zstd_pieces(handle):
        compressed = piece
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


ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE_MAGIC = 0x184D2A50
"""A skippable frame's magic number, ignoring its low 4 bits."""
ZSTD_BLOCK_MAX_BYTES = 128 << 10
"""What one zstd block decompresses to at most, however small it is (RFC 8878, Block_Maximum_Size)."""
ZSTD_BLOCKS_PER_PIECE = CHUNK_BYTES // ZSTD_BLOCK_MAX_BYTES


def _zstd_pieces(handle: BinaryIO) -> Iterator[bytes]:
    """The compressed stream cut at block boundaries, at most ZSTD_BLOCKS_PER_PIECE blocks a piece.

    Only the frame and block headers are parsed (RFC 8878), to know where blocks end: 32 KB of blocks can
    hold 1 GiB of repeats. Bytes that are not a zstd frame are passed on as they are, for the decompressor
    to refuse; a frame cut short ends the pieces, for it to find incomplete.
    """
    while len(magic := handle.read(4)) == 4:
        number = int.from_bytes(magic, "little")
        if number == ZSTD_MAGIC:
            if not (yield from _zstd_frame_pieces(handle, magic)):
                return
        elif number & ~0xF == ZSTD_SKIPPABLE_MAGIC:
            size = handle.read(4)
            yield magic + size + handle.read(int.from_bytes(size, "little"))  # no output: a frame to skip
        else:
            yield magic
            while rest := handle.read(CHUNK_BYTES):
                yield rest
            return
    if magic:
        yield magic


def _zstd_frame_pieces(handle: BinaryIO, magic: bytes) -> Iterator[bytes]:
    """One frame's header and blocks, as pieces; returns False when the file ended inside the frame."""
    descriptor = handle.read(1)
    if not descriptor:
        yield magic
        return False
    flags = descriptor[0]
    single_segment = flags >> 5 & 1
    header_size = (1 - single_segment) + (0, 1, 2, 4)[flags & 3] + (single_segment, 2, 4, 8)[flags >> 6]
    piece = [magic, descriptor, handle.read(header_size)]
    num_blocks = 0
    while len(block_header := handle.read(3)) == 3:
        value = int.from_bytes(block_header, "little")
        piece += [block_header, handle.read(1 if value >> 1 & 3 == 1 else value >> 3)]  # an RLE block: 1 byte
        num_blocks += 1
        if value & 1:  # the last block, then the checksum when the frame has one
            yield b"".join([*piece, handle.read(4 if flags >> 2 & 1 else 0)])
            return True
        if num_blocks == ZSTD_BLOCKS_PER_PIECE:
            yield b"".join(piece)
            piece, num_blocks = [], 0
    yield b"".join([*piece, block_header])
    return False


# ---- parquet and hf_disk (Arrow record batches) ------------------------------------------------


def _read_parquet(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
    try:
        with open_regular(path) as handle:
            yield from _parquet_records(pq.ParquetFile(handle), path, rel, source, max_bytes)
    except (pa.ArrowException, OSError) as err:
        detail = f"not a Parquet file ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, rel, _file_bytes(path)) from None


def _parquet_records(parquet: pq.ParquetFile, path: Path, rel: str, source: SourceConfig,
                     max_bytes: int) -> Iterator[Record | Reject]:
    columns = _batch_columns(parquet.schema_arrow.names, source, rel)
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield from _records_from_batch(batch, rel, row, source, max_bytes)
            row += batch.num_rows
    except (pa.ArrowException, OSError) as err:
        detail = f"Parquet data is corrupt after row {row} ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, f"{rel}#row={row}", None) from None


def _read_hf_disk(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
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
            yield from _records_from_batch(table, prefix, row, source, max_bytes)
            row += table.num_rows


HF_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""hf_local: file suffix -> ``datasets`` builder; a trailing .gz/.bz2/.xz/.zst is decompressed by datasets."""
_HF_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")


def _read_hf_local(path: Path, rel: str, source: SourceConfig, max_bytes: int) -> Iterator[Record | Reject]:
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
        detail = f"datasets cannot read it as {builder} after row {row} ({_describe(err, path, rel)})"
        raise UnreadableFileError(detail, f"{rel}#row={row}", _file_bytes(path) if row == 0 else None) from None


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
    if source.text_field not in names:
        shown = ", ".join(names[:20])
        detail = f"has no column '{source.text_field}' (columns: {shown}); set text_field in the manifest"
        raise UnreadableFileError(detail, rel, None)
    columns = [source.text_field]
    if source.id_field is not None and source.id_field in names and source.id_field != source.text_field:
        columns.append(source.id_field)
    return columns


def _records_from_batch(batch: pa.RecordBatch | pa.Table, rel: str, first_row: int, source: SourceConfig,
                        max_bytes: int) -> Iterator[Record | Reject]:
    """A record or reject per row; a value above ``max_bytes`` is ``too_long`` without becoming a Python string."""
    text_column = batch.column(source.text_field)
    oversized = _oversized_values(text_column, max_bytes)
    if oversized:
        text_column = pc.if_else(pa.array([row in oversized for row in range(len(text_column))]),
                                 pa.scalar(None, text_column.type), text_column)
    texts = _column_values(text_column, keep_invalid_bytes=True)
    has_id = source.id_field is not None and source.id_field in batch.schema.names
    ids = _column_values(batch.column(source.id_field)) if has_id else itertools.repeat(None)
    for offset, (value, id_value) in enumerate(zip(texts, ids, strict=False)):
        uri, source_id = f"{rel}#row={first_row + offset}", _source_id(id_value)
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


_READERS: dict[str, Callable[[Path, str, SourceConfig, int], Iterator[Record | Reject]]] = {
    "text": _read_text,
    "jsonl": _read_jsonl,
    "parquet": _read_parquet,
    "hf_disk": _read_hf_disk,
    "hf_local": _read_hf_local,
}
