"""Arrow token shards: write (atomic, deterministic), read (memory-mapped, zero-copy), index, verify.

A shard is an uncompressed Arrow IPC *file* at ``shards/split=<split>/source=<source>/part-NNNNN.arrow``
(schema: :func:`core.schemas.shard_schema`); ``shards/index.parquet`` has one row per shard.

A run dir is data from whoever made it: every path read from it (an index row, a folder under ``shards/``)
must be in that layout and stay inside the run dir (:func:`index_path_fault`, :func:`scan_shard_files`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from core.errors import ShardFormatError
from core.files.atomic import TEMP_PREFIX
from core.files.digests import file_sha256
from core.layout import RELATIVE, SHARD_FILE_NAME, run_key
from core.layout import SHARD_LAYOUT as SHARD_LAYOUT  # re-exported: pipeline.query, pipeline.remote_run
from core.rundir import RunPaths, path_inside_run
from core.schemas import FORMAT_VERSION, NAME_PATTERN, SHARD_INDEX_SCHEMA, shard_schema
from core.shards.chat_schema import chat_shard_schema, verify_loss_masks

REQUIRED_METADATA = ("format_version", "tokenizer_sha256", "seq_len", "vocab_size", "dtype", "split", "source")
SHARD_SPLITS = ("train", "val")
"""The splits tokenmill writes shards for (``pipeline.filters.screen.assign_split``); a folder of another split is not
its."""
_SHARD_FILE_NAME = SHARD_FILE_NAME
_SOURCE_NAME = re.compile(NAME_PATTERN)
_FOLDER_LEVELS = ("split", "source")


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_relpath(split: str, source: str, part: int) -> str:
    """Path of shard number ``part`` relative to the run dir (hive-style folders)."""
    return run_key(RELATIVE.shard(split, source, part))


@dataclass(frozen=True)
class ShardRows:
    """Packed rows ready to write: ``input_ids`` [num_rows, seq_len] plus per-row lineage."""

    input_ids: np.ndarray
    doc_ids: list[list[int]]
    doc_starts: list[list[int]]
    first_doc_offset: list[int]
    num_tokens: list[int]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ShardInfo:
    """What the index records about one written shard."""

    path: str
    split: str
    source: str
    num_rows: int
    num_tokens: int
    sha256: str
    tokenizer_sha256: str
    seq_len: int


def write_shard(run_dir: Path, relpath: str, rows: ShardRows, *, split: str, source: str,
                tokenizer_sha256: str, vocab_size: int) -> ShardInfo:
    """Write one shard atomically; the same rows and settings always give the same bytes."""
    num_rows, seq_len = rows.input_ids.shape
    dtype = token_dtype_for_vocab(vocab_size)
    metadata = {
        "format_version": str(FORMAT_VERSION), "tokenizer_sha256": tokenizer_sha256,
        "seq_len": str(seq_len), "vocab_size": str(vocab_size), "dtype": dtype.name,
        "split": split, "source": source,
    }
    schema = shard_schema(pa.from_numpy_dtype(dtype), seq_len, metadata)
    flat = pa.array(np.ascontiguousarray(rows.input_ids, dtype=dtype).reshape(-1))
    batch = pa.record_batch(
        [
            pa.FixedSizeListArray.from_arrays(flat, type=schema.field("input_ids").type),
            pa.array(rows.doc_ids, type=pa.list_(pa.int64())),
            pa.array(rows.doc_starts, type=pa.list_(pa.int32())),
            pa.array(rows.first_doc_offset, type=pa.int32()),
            pa.array(rows.num_tokens, type=pa.int32()),
        ],
        schema=schema,
    )
    target = run_dir / relpath
    with (RunPaths(run_dir).atomic_write(target, size_hint_bytes=batch.nbytes) as tmp,
          ipc.new_file(tmp, schema, options=ipc.IpcWriteOptions(compression=None)) as out):
        out.write_batch(batch)
    # remembered: the pack stage's skip check and the readers of this process do not hash it again
    return ShardInfo(relpath, split, source, num_rows, int(sum(rows.num_tokens)), file_sha256(target),
                     tokenizer_sha256, seq_len)


def shard_metadata(path: Path) -> dict[str, str]:
    """A shard's schema metadata as str -> str; raises ShardFormatError when keys are missing."""
    try:
        with pa.memory_map(str(path)) as source:
            raw = ipc.open_file(source).schema.metadata or {}
    except (pa.ArrowInvalid, OSError) as err:
        run_dir = path.parents[3] if len(path.parents) > 3 else "RUN_DIR"  # <run>/shards/split=*/source=*/part
        raise ShardFormatError(f"{path}: not a readable Arrow IPC shard ({err}); it is damaged or truncated: "
                               f"`tokenmill shards verify {run_dir}` lists every damaged shard, and `tokenmill "
                               "prepare` on a fresh run dir writes them again.") from None
    metadata = {key.decode(): value.decode() for key, value in raw.items()}
    missing = [key for key in REQUIRED_METADATA if key not in metadata]
    if missing:
        raise ShardFormatError(f"{path}: shard metadata lacks {missing}; it was not written by tokenmill.")
    if metadata["format_version"] != str(FORMAT_VERSION):
        raise ShardFormatError(
            f"{path}: shard format version {metadata['format_version']}, this tokenmill reads "
            f"{FORMAT_VERSION}; re-run `tokenmill prepare` with a fresh run dir."
        )
    return metadata


class ShardTokens:
    """Zero-copy, memory-mapped view of one shard's ``input_ids`` as a read-only [rows, seq_len] array."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.metadata = shard_metadata(path)
        self.seq_len = int(self.metadata["seq_len"])
        self._mmap = pa.memory_map(str(path))
        try:
            reader = ipc.open_file(self._mmap)
            token_type = _checked_token_type(path, reader.schema, self.seq_len)
            arrays = [reader.get_batch(i).column("input_ids") for i in range(reader.num_record_batches)]
        except BaseException:
            self._mmap.close()
            raise
        # ``.values`` ignores slice offsets (docs/library-facts.md); batches written by write_shard are never sliced.
        views = [arr.values.to_numpy(zero_copy_only=True).reshape(-1, self.seq_len) for arr in arrays]
        if not views:
            views = [np.zeros((0, self.seq_len), dtype=token_type.to_pandas_dtype())]
        self.tokens = views[0] if len(views) == 1 else np.concatenate(views)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def close(self) -> None:
        self._mmap.close()


def _checked_token_type(path: Path, schema: pa.Schema, seq_len: int) -> pa.DataType:
    """The id type of ``input_ids``; ShardFormatError unless it is fixed_size_list<unsigned int>[seq_len]."""
    field = schema.field("input_ids") if "input_ids" in schema.names else None
    if (field is None or not pa.types.is_fixed_size_list(field.type) or field.type.list_size != seq_len
            or not pa.types.is_unsigned_integer(field.type.value_type)):
        found = "no input_ids column" if field is None else f"input_ids {field.type}"
        raise ShardFormatError(f"{path}: {found}, expected fixed_size_list<uint16|uint32>[{seq_len}]; "
                               "it was not written by tokenmill's packer, re-run `tokenmill prepare`.")
    return field.type.value_type


def write_shard_index(run_dir: Path, infos: list[ShardInfo]) -> None:
    """Write ``shards/index.parquet`` atomically, rows sorted by path (deterministic bytes)."""
    ordered = sorted(infos, key=lambda info: info.path)
    columns = {name: [getattr(info, name) for info in ordered] for name in SHARD_INDEX_SCHEMA.names}
    table = pa.table(columns, schema=SHARD_INDEX_SCHEMA)
    paths = RunPaths(run_dir)
    with paths.atomic_write(paths.shard_index) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_shard_index(run_dir: Path) -> list[ShardInfo]:
    """The shard index as ShardInfo rows, every row safe to open (:func:`index_row_fault`).

    Raises ShardFormatError when the index is missing or malformed, or when a row names a path outside the
    shard layout or the run dir (absolute, ``..``, a symlink out): the loader and ``shards sample`` read
    nothing such an index points to.
    """
    run_dir = Path(run_dir)
    infos = _read_index_rows(run_dir)
    for info in infos:
        fault = index_row_fault(run_dir, info)
        if fault is not None:
            raise ShardFormatError(f"{RunPaths(run_dir).shard_index}: {fault}; "
                                   f"an index may name only shards inside its run dir ({SHARD_LAYOUT}): "
                                   "re-run `tokenmill prepare` on a fresh run dir.")
    return infos


def _read_index_rows(run_dir: Path) -> list[ShardInfo]:
    """The index's rows as they are (unchecked); raises ShardFormatError when the file is missing or malformed."""
    path = RunPaths(run_dir).shard_index
    if not path.is_file():
        raise ShardFormatError(f"{path}: no shard index; run `tokenmill prepare` first.")
    if not path_inside_run(run_dir, path):
        raise ShardFormatError(f"{path}: the shard index resolves (through a symlink) outside the run dir; "
                               "re-run `tokenmill prepare` on a fresh run dir.")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ShardFormatError(f"{path}: not a readable Parquet shard index ({first_line}); "
                               "re-run `tokenmill prepare`.") from None
    missing = [name for name in SHARD_INDEX_SCHEMA.names if name not in table.column_names]
    if missing:
        raise ShardFormatError(f"{path}: shard index lacks columns {missing}; re-run `tokenmill prepare`.")
    return [ShardInfo(**{name: row[name] for name in SHARD_INDEX_SCHEMA.names}) for row in table.to_pylist()]



def shard_layout_fault(relpath: str) -> str | None:
    """Why ``relpath`` is not a place tokenmill writes a shard (:data:`SHARD_LAYOUT`); None when it is one."""
    parts = relpath.split("/")
    if relpath.startswith("/"):
        return "is an absolute path"
    if ".." in parts:
        return "contains '..'"
    if len(parts) != 4 or parts[0] != RELATIVE.shards.name:
        return f"is not at {SHARD_LAYOUT}"
    for name, key in zip(parts[1:3], _FOLDER_LEVELS, strict=True):
        expected = _expected_folder(name, key)
        if expected is not None:
            return f"has folder {name!r}, expected {expected}"
    if not _SHARD_FILE_NAME.fullmatch(parts[3]):
        return f"has file name {parts[3]!r}, expected part-NNNNN.arrow"
    return None


def _expected_folder(name: str, key: str) -> str | None:
    """What a ``split=``/``source=`` folder tokenmill writes looks like, when ``name`` is not one; else None."""
    value = name.removeprefix(f"{key}=") if name.startswith(f"{key}=") else None
    if key == "split" and value not in SHARD_SPLITS:
        return "split=train or split=val"
    if key == "source" and (value is None or not _SOURCE_NAME.fullmatch(value)):
        return f"source=<name> with a source name tokenmill accepts ({NAME_PATTERN})"
    return None


def index_path_fault(run_dir: Path, relpath: object) -> str | None:
    """Why the path an index row names must not be opened, or None: the one check of every path an index names.

    Faults: not a string, not in :data:`SHARD_LAYOUT` (absolute, ``..``, other folders), resolving outside the
    run dir through a symlink, or not a regular file (a FIFO would block its reader). A missing file passes:
    readers and ``verify`` report it as missing.
    """
    if not isinstance(relpath, str):
        return f"index path {relpath!r} is not a string"
    fault = shard_layout_fault(relpath)
    path = Path(run_dir) / relpath
    if fault is None and not path_inside_run(run_dir, path):
        fault = "resolves (through a symlink) outside the run dir"
    if fault is None and path.exists() and not path.is_file():
        fault = "is not a regular file"
    return None if fault is None else f"index path {relpath!r} {fault}"


def index_row_fault(run_dir: Path, info: ShardInfo) -> str | None:
    """Why an index row must not be used, or None: :func:`index_path_fault`, or split/source columns that
    disagree with the path's folders (the loader weights sources by those columns)."""
    fault = index_path_fault(run_dir, info.path)
    if fault is None and _folder_values(info.path) != (info.split, info.source):
        split, source = _folder_values(info.path)
        fault = (f"index path {info.path!r} lies in split={split}/source={source}, the row says "
                 f"split={info.split!r}, source={info.source!r}")
    return fault


def _folder_values(relpath: str) -> tuple[str, str]:
    """(split, source) of a path in :data:`SHARD_LAYOUT`."""
    split, source = (folder.split("=", 1)[1] for folder in relpath.split("/")[1:3])
    return split, source


def scan_shard_files(run_dir: Path) -> tuple[list[Path], list[str]]:
    """The shard files under ``shards/`` (sorted) and one fault line per entry tokenmill would not have written.

    Faults: a folder other than ``split=train|val`` / ``source=<name>``, a folder below the source level, an
    ``.arrow`` file elsewhere or not named part-NNNNN.arrow, one that is not a regular file, anything that
    resolves (through a symlink) outside the run dir. Those are never returned as shards. Other files
    (``index.parquet``, ``state.json``) and temporary files of unfinished writes are not shards: passed over.
    """
    run_dir = Path(run_dir)
    files: list[Path] = []
    faults: list[str] = []
    shards = RunPaths(run_dir).shards
    if shards.is_dir():
        _scan_folder(run_dir, shards, 0, files, faults)
    return sorted(files), faults


def _scan_folder(run_dir: Path, folder: Path, depth: int, files: list[Path], faults: list[str]) -> None:
    """One level of :func:`scan_shard_files` (depth 0 = ``shards/``, 1 = a split folder, 2 = a source folder)."""
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(TEMP_PREFIX) or not (entry.is_dir() or entry.suffix == ".arrow"):
            continue  # not a shard: index.parquet, state.json, an unfinished write
        fault = _entry_fault(run_dir, entry, depth)
        if fault is not None:
            faults.append(fault)
        elif entry.is_dir():
            _scan_folder(run_dir, entry, depth + 1, files, faults)
        else:
            files.append(entry)


def _entry_fault(run_dir: Path, entry: Path, depth: int) -> str | None:
    """Why a folder or ``.arrow`` file at ``depth`` under ``shards/`` is not what tokenmill writes; else None."""
    relpath = entry.relative_to(run_dir).as_posix()
    if not path_inside_run(run_dir, entry):
        return f"{relpath!r} resolves (through a symlink) outside the run dir"
    if entry.is_dir():
        if depth == len(_FOLDER_LEVELS):
            return f"folder {relpath!r} is below the source level of {SHARD_LAYOUT}"
        expected = _expected_folder(entry.name, _FOLDER_LEVELS[depth])
        return None if expected is None else f"folder {relpath!r} is not one tokenmill writes (expected {expected})"
    fault = shard_layout_fault(relpath) or (None if entry.is_file() else "is not a regular file")
    return None if fault is None else f"shard file {relpath!r} {fault}"


def verify_shards(run_dir: Path) -> list[str]:
    """Check every shard against the index: safe path, presence, sha256, schema (a token shard's or a chat shard's,
    :mod:`core.shards.chat`), metadata, ids < vocab, a chat shard's loss masks (0/1, their sums recorded), and a
    preference shard's rows (whole pairs, each side with a loss token: :mod:`core.shards.preference`).

    Returns one human-readable line per fault (empty list = all good); also reports shard files on
    disk that the index does not list and entries under ``shards/`` outside the layout. An index row whose
    path is outside the layout or the run dir (:func:`index_path_fault`) is a fault and is not opened; the
    path's split/source folders, the shard's metadata and the index row must all agree.
    """
    run_dir = Path(run_dir)
    infos = _read_index_rows(run_dir)
    on_disk, faults = scan_shard_files(run_dir)
    listed = {info.path for info in infos}
    for extra in (path.relative_to(run_dir).as_posix() for path in on_disk):
        if extra not in listed:
            faults.append(f"{extra}: shard file not in the index (extra file)")
    for info in infos:
        fault = index_path_fault(run_dir, info.path)
        faults.extend([fault] if fault is not None else _verify_one(run_dir, info))
    return faults


def _verify_one(run_dir: Path, info: ShardInfo) -> list[str]:
    path = run_dir / info.path
    if not path.is_file():
        return [f"{info.path}: listed in the index but missing on disk"]
    # hashed now, whatever is remembered, then remembered: the trainer launched after `train`'s check hashes nothing
    if file_sha256(path, trust_cache=False) != info.sha256:
        return [f"{info.path}: sha256 differs from the index (corrupted or modified)"]
    try:
        metadata = shard_metadata(path)
    except ShardFormatError as err:
        return [str(err)]
    if not metadata["vocab_size"].isdigit() or not metadata["seq_len"].isdigit():
        return [f"{info.path}: metadata vocab_size={metadata['vocab_size']!r}, seq_len={metadata['seq_len']!r} "
                "are not whole numbers"]
    faults = [f"{info.path}: metadata {key}={metadata[key]!r}, index says {want!r}"
              for key, want in (("split", info.split), ("source", info.source),
                                ("tokenizer_sha256", info.tokenizer_sha256), ("seq_len", str(info.seq_len)))
              if metadata[key] != want]
    if _folder_values(info.path) != (metadata["split"], metadata["source"]):
        faults.append(f"{info.path}: lies in the folders of another split/source than its metadata "
                      f"(split={metadata['split']!r}, source={metadata['source']!r})")
    vocab_size = int(metadata["vocab_size"])
    token_type = pa.from_numpy_dtype(token_dtype_for_vocab(vocab_size))
    expected = shard_schema(token_type, info.seq_len, {})
    with pa.memory_map(str(path)) as source:
        actual = ipc.open_file(source).schema.remove_metadata()
    is_chat = actual.equals(chat_shard_schema(token_type, info.seq_len, {}))
    if not (actual.equals(expected) or is_chat):
        # Rows are read only from a shard of the contract's layout (another one may not even have token rows).
        return [*faults, f"{info.path}: schema differs from the shard contract"]
    return faults + _verify_rows(path, info, vocab_size) + (verify_loss_masks(path, info) if is_chat else [])


def _verify_rows(path: Path, info: ShardInfo, vocab_size: int) -> list[str]:
    """Row count against the index and every token id against the vocab size."""
    try:
        shard = ShardTokens(path)
    except ShardFormatError as err:
        return [str(err)]
    faults = []
    if len(shard) != info.num_rows:
        faults.append(f"{info.path}: {len(shard)} rows, index says {info.num_rows}")
    if len(shard) and int(shard.tokens.max()) >= vocab_size:
        faults.append(f"{info.path}: token id {int(shard.tokens.max())} >= vocab size {vocab_size}")
    shard.close()
    return faults
