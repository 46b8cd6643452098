"""Ingest stage, bytes: one source file -> its decompressed bytes (plain, gzip, zstd) and bounded lines.

The layer under the readers (:mod:`pipeline.ingest.readers`). A file is opened only if it is a regular file
(:func:`open_regular`), decompression goes one chunk at a time (a decompression bomb costs one chunk of memory,
not its expanded size), and :func:`iter_lines` holds at most :func:`record_byte_limit` bytes of one line. A
file that cannot be read (any more) raises :class:`UnreadableFileError`, which the reader turns into a reject
or an error.
"""

from __future__ import annotations

import gzip
import itertools
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import zstandard

from pipeline.objects import ObjectPath

CHUNK_BYTES = 1 << 20
"""Bytes read (or decompressed) per step from a jsonl file."""
RAW_FILE_LIMIT_BYTES = 16 << 20
"""An unreadable file's bytes are copied into its reject row only up to this size (it stays at its path)."""
MAX_JSON_BYTES_PER_CHAR = 12
"""The most bytes one character takes in a JSON line: an astral character escaped as ``\\uXXXX\\uXXXX``."""
RECORD_SLACK_BYTES = 64 << 20
"""Added to a record's byte limit: room for its other fields, and a record a little above ``max_chars`` is
still read whole (its reject keeps all its raw bytes, so it can be re-ingested with a higher limit)."""
TOO_LONG_RAW_BYTES = 1 << 20
"""A record rejected unread as ``too_long`` keeps only its first this many bytes in ``raw``."""


def record_byte_limit(max_chars: int) -> int:
    """Bytes above which one record (jsonl line, text file, column value) is ``too_long`` without being parsed.

    ``MAX_JSON_BYTES_PER_CHAR * max_chars + RECORD_SLACK_BYTES``: no record this long can hold a text of at most
    ``max_chars`` characters (plus 64 MiB of other fields), so nothing the quality filter keeps is refused here.
    With the default ``max_chars`` (2,000,000) that is 87 MiB; it bounds what one record costs in memory.
    """
    return MAX_JSON_BYTES_PER_CHAR * max_chars + RECORD_SLACK_BYTES


class UnreadableFileError(Exception):
    """Raised inside readers when (the rest of) a file cannot be read; ``read_file`` applies on_error."""

    def __init__(self, detail: str, uri: str, raw: bytes | None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.uri = uri
        self.raw = raw


class _TruncatedStreamError(Exception):
    """A compressed stream ended inside a frame."""


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``file``, ``folder``, ``FIFO``, ``socket``, ``character device``, …"""
    kinds = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symbolic link"))
    return next((name for test, name in kinds if test(mode)), "special file")


def describe_error(err: BaseException, path: Path | ObjectPath, rel: str) -> str:
    """One-line exception text with the absolute path replaced by ``rel`` (outputs hold no absolute paths)."""
    text = getattr(err, "strerror", None) if isinstance(err, OSError) and err.strerror else str(err)
    text = " ".join((text or type(err).__name__).split())
    return text.replace(str(path.resolve()), rel).replace(str(path), rel)


def open_regular(path: Path | ObjectPath) -> BinaryIO:
    """``path`` opened for reading, only if it is a regular file (checked on the open file: no race).

    Opened non-blocking, so a FIFO put in its place after the last check cannot hang the open; raises
    ``OSError`` ("not a regular file") for anything but a regular file. An object is streamed through fsspec
    (every object is a regular file).
    """
    if isinstance(path, ObjectPath):
        return path.open()
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


def raw_file_bytes(path: Path | ObjectPath) -> bytes | None:
    """The file's bytes for an unreadable_file reject, when small enough to copy."""
    try:
        with open_regular(path) as handle:
            data = handle.read(RAW_FILE_LIMIT_BYTES + 1)
    except OSError:
        return None
    return data if len(data) <= RAW_FILE_LIMIT_BYTES else None


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


def iter_lines(path: Path | ObjectPath, rel: str, max_bytes: int) -> Iterator[tuple[int, bytes, int]]:
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
            detail = f"cannot be read as {_stream_kind(path)} ({describe_error(err, path, rel)})"
            raise UnreadableFileError(detail, rel, raw_file_bytes(path)) from None
        detail = (f"{_stream_kind(path)} stream is cut or corrupt after line {line_no} "
                  f"({describe_error(err, path, rel)}); the {line_no} complete lines before it are kept")
        raise UnreadableFileError(detail, f"{rel}:{line_no + 1}", tail) from None
    if buffer.num_bytes:
        yield (line_no + 1, *buffer.take())


def stream_size(handle: BinaryIO) -> int:
    """Size in bytes of an open file or object (an fsspec file has no file descriptor)."""
    size = getattr(handle, "size", None)
    return int(size) if isinstance(size, int) else os.fstat(handle.fileno()).st_size


def decompressed_size_estimate(path: Path | ObjectPath) -> int:
    """About how many bytes ``path`` decompresses to, from what its format records, without decompressing.

    gzip: the trailer's ISIZE (the size modulo 4 GiB, of the last member); zstd: the first frame's content
    size when its header records it; otherwise (plain files, folders, unknown sizes, unreadable files) the
    size on disk. Never less than the size on disk: it only orders work, a wrong guess costs no correctness.
    """
    if isinstance(path, ObjectPath):
        return path.size()  # no ranged reads of every object's trailer only to order the work
    try:
        size = path.stat().st_size if path.is_file() else 0
        kind = _stream_kind(path)
        if kind == "text" or size < 18:
            return size
        with open(path, "rb") as handle:
            if kind == "gzip":
                handle.seek(-4, os.SEEK_END)
                return max(size, int.from_bytes(handle.read(4), "little"))
            content_size = zstandard.frame_content_size(handle.read(18))
    except (OSError, zstandard.ZstdError):
        return 0
    return max(size, content_size)


def _stream_kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(".gz"):
        return "gzip"
    return "zstd" if name.endswith((".zst", ".zstd")) else "text"


def _decompressed_chunks(path: Path | ObjectPath) -> Iterator[bytes]:
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
