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

Here: the dispatch by format, the rule for which paths are read, the text and jsonl readers. Beside it,
:mod:`pipeline.ingest.table_readers` reads the Arrow-backed formats (parquet, hf_disk, hf_local),
:mod:`pipeline.ingest.streams` the bytes under them all, and :mod:`pipeline.ingest.records` holds what they yield.
"""

from __future__ import annotations

import codecs
import dataclasses
import stat
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath

from core.errors import SourceReadError
from pipeline.ingest.records import Record, Reject, backslash_escaped, is_utf8, parse_json_line, too_long
from pipeline.ingest.streams import (
    TOO_LONG_RAW_BYTES,
    UnreadableFileError,
    describe_error,
    file_kind,
    iter_lines,
    open_regular,
    record_byte_limit,
    stream_size,
)
from pipeline.ingest.table_readers import read_hf_disk, read_hf_local, read_parquet
from pipeline.manifest import FilterConfig, SourceConfig
from pipeline.objects import ObjectPath

DEFAULT_MAX_CHARS = FilterConfig().max_chars


def read_file(path: Path | ObjectPath, rel: str, source: SourceConfig,
              max_chars: int = DEFAULT_MAX_CHARS) -> Iterator[Record | Reject]:
    """Yield every record of one source file in file order; ``rel`` (posix, relative) builds the uris.

    ``path`` is ``<source folder>/<rel>``. A path that must not be read (a link leading outside the source
    folder, anything but a regular file), or that is gone since it was planned, is one reject, checked here when
    the file is read, so it holds even if the file changed after planning. A record longer than
    ``record_byte_limit(max_chars)`` bytes is a ``too_long`` reject with a truncated ``raw``. Every string yielded
    is valid UTF-8 (:func:`storable`).

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


def refusal(path: Path | ObjectPath, rel: str, source: SourceConfig) -> Reject | None:
    """The reject for a path no reader may open, or None: the rule for every file and folder of a source.

    ``outside_source``: the path resolves (through symbolic links) outside the source folder, which is
    ``path`` with ``rel`` taken off; ``not_a_regular_file``: a FIFO, socket, device (or a folder, but for an
    hf_disk dataset). Neither is opened (opening a FIFO blocks; a device never ends), whatever ``on_error``
    says: nothing in them is a record. A ``rel`` that is absolute or climbs with ``..`` (a hostile
    ``docs/plan.json`` could hold one) is outside by definition.

    ``missing_file``: the file was planned but is gone (deleted or renamed before its part was read), also
    whatever ``on_error`` says. Failing would leave the run stuck, because a planned file stays in its part, and
    a file the user removed (perhaps as an earlier error advised) holds no records to lose; the reject keeps
    its name in the funnel. A path that does not resolve for another reason (a symlink loop, no permission)
    raises ``UnreadableFileError``.
    """
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or ".." in parts:
        return Reject(rel, "outside_source", "the planned path is absolute or climbs out with '..'; not read", None)
    if isinstance(path, ObjectPath):  # a key under the prefix: no links, no special files
        return None if path.exists() else Reject(rel, "missing_file", "planned for this part, but no longer in the "
                                                 "bucket (deleted or renamed); nothing was read", None)
    folder = path
    for _ in parts:
        folder = folder.parent
    try:
        resolved = path.resolve(strict=True)
        mode = resolved.stat().st_mode
        inside = resolved.is_relative_to(folder.resolve(strict=True))
    except FileNotFoundError:
        return Reject(rel, "missing_file", "planned for this part, but no longer in the source folder (deleted or "
                      "renamed, or a link whose target is gone); nothing was read", None)
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop, up to Python 3.12
        raise UnreadableFileError(f"cannot be read ({describe_error(err, path, rel)})", rel, None) from None
    if not inside:
        return Reject(rel, "outside_source", f"a symbolic link to a {file_kind(mode)} outside the source folder, "
                      "not read; copy what it points to into the folder, or make that a source of its own", None)
    if stat.S_ISREG(mode) or (stat.S_ISDIR(mode) and source.format == "hf_disk"):
        return None
    return Reject(rel, "not_a_regular_file", f"a {file_kind(mode)}, not a regular file; only regular files are "
                  "read: remove it or add it to the source's exclude", None)


def storable(item: Record | Reject) -> Record | Reject:
    """``item`` with every string valid UTF-8, the one check before anything reaches a Parquet row.

    A text holding a lone surrogate (a JSON ``\\ud800`` escape) is no document: it becomes an
    ``invalid_utf8`` reject. A uri made from a file name that is not UTF-8 shows its bytes as ``\\xNN``
    (the document is kept, and its ``doc_id`` comes from that uri, stable across runs); a detail or
    ``source_id`` shows a lone surrogate as ``\\udNNN``.
    """
    if isinstance(item, Record) and not (is_utf8(item.text) and (item.record is None or is_utf8(item.record))):
        raw = item.raw if item.raw is not None else item.text.encode("utf-8", "surrogatepass")
        item = Reject(item.uri, "invalid_utf8", "the text has a lone surrogate escape (\\ud8xx)", raw, item.source_id)
    changes: dict[str, str] = {}
    if not is_utf8(item.uri):
        changes["uri"] = escape_file_name(item.uri)
    if item.source_id is not None and not is_utf8(item.source_id):
        changes["source_id"] = backslash_escaped(item.source_id)
    if isinstance(item, Reject) and not is_utf8(item.detail):
        changes["detail"] = backslash_escaped(item.detail)
    return dataclasses.replace(item, **changes) if changes else item


def escape_file_name(name: str) -> str:
    """A file name (or a uri made from one) as valid UTF-8: bytes that are not UTF-8 become ``\\xNN``.

    ``os.walk`` hands such bytes on as surrogate escapes (``\\udcff`` for byte 0xff); other lone surrogates
    become ``\\udNNN``.
    """
    try:
        data = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return backslash_escaped(name)
    return data.decode("utf-8", "backslashreplace")


def _read_text(path: Path | ObjectPath, rel: str, source: SourceConfig,
               max_bytes: int) -> Iterator[Record | Reject]:
    """One document per file, UTF-8 (a leading BOM is dropped); a file above ``max_bytes`` is read no further."""
    try:
        with open_regular(path) as handle:
            num_bytes = stream_size(handle)
            data = handle.read(TOO_LONG_RAW_BYTES if num_bytes > max_bytes else num_bytes + 1)
            if num_bytes < len(data) <= max_bytes:  # it grew while being read: read on, up to the limit
                data += handle.read(max_bytes + 1 - len(data))
    except OSError as err:
        raise UnreadableFileError(f"cannot read the file ({describe_error(err, path, rel)})", rel, None) from None
    if num_bytes > max_bytes or len(data) > max_bytes:
        yield too_long(rel, data, max(num_bytes, len(data)), max_bytes)
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        yield Reject(rel, "invalid_utf8", f"byte {err.start}: {err.reason}; save the file as UTF-8", data)
        return
    yield Record(rel, text.removeprefix("\ufeff"), None, data)


def _read_jsonl(path: Path | ObjectPath, rel: str, source: SourceConfig,
                max_bytes: int) -> Iterator[Record | Reject]:
    """One JSON object per line; blank lines carry no record and are skipped."""
    for line_no, line, num_bytes in iter_lines(path, rel, max_bytes):
        if num_bytes > len(line):
            yield too_long(f"{rel}:{line_no}", line, num_bytes, max_bytes)
            continue
        if line_no == 1 and line.startswith(codecs.BOM_UTF8):
            line = line[len(codecs.BOM_UTF8) :]
        if line.strip():
            yield parse_json_line(line, f"{rel}:{line_no}", source)


_READERS: dict[str, Callable[[Path, str, SourceConfig, int], Iterator[Record | Reject]]] = {
    "text": _read_text,
    "jsonl": _read_jsonl,
    "parquet": read_parquet,
    "hf_disk": read_hf_disk,
    "hf_local": read_hf_local,
}
