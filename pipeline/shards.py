"""Arrow token shards: write (atomic, deterministic), read (memory-mapped, zero-copy), index, verify.

A shard is an uncompressed Arrow IPC *file* at ``shards/split=<split>/source=<source>/part-NNNNN.arrow``
(schema: :func:`pipeline.schemas.shard_schema`); ``shards/index.parquet`` has one row per shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from pipeline.atomic import atomic_path, sha256_file
from pipeline.errors import ShardFormatError
from pipeline.schemas import FORMAT_VERSION, SHARD_INDEX_SCHEMA, shard_schema

REQUIRED_METADATA = ("format_version", "tokenizer_sha256", "seq_len", "vocab_size", "dtype", "split", "source")


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_relpath(split: str, source: str, part: int) -> str:
    """Path of shard number ``part`` relative to the run dir (hive-style folders)."""
    return f"shards/split={split}/source={source}/part-{part:05d}.arrow"


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
    with (atomic_path(target, size_hint_bytes=batch.nbytes) as tmp,
          ipc.new_file(tmp, schema, options=ipc.IpcWriteOptions(compression=None)) as out):
        out.write_batch(batch)
    return ShardInfo(relpath, split, source, num_rows, int(sum(rows.num_tokens)), sha256_file(target),
                     tokenizer_sha256, seq_len)


def shard_metadata(path: Path) -> dict[str, str]:
    """A shard's schema metadata as str -> str; raises ShardFormatError when keys are missing."""
    try:
        with pa.memory_map(str(path)) as source:
            raw = ipc.open_file(source).schema.metadata or {}
    except (pa.ArrowInvalid, OSError) as err:
        raise ShardFormatError(f"{path}: not a readable Arrow IPC shard ({err}); re-run `tokenmill prepare`.") from None
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
        # ``.values`` ignores slice offsets (FACTS.md); batches written by write_shard are never sliced.
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
    with atomic_path(run_dir / "shards" / "index.parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_shard_index(run_dir: Path) -> list[ShardInfo]:
    """The shard index as ShardInfo rows; raises ShardFormatError when it is missing or malformed."""
    path = run_dir / "shards" / "index.parquet"
    if not path.is_file():
        raise ShardFormatError(f"{path}: no shard index; run `tokenmill prepare` first.")
    table = pq.read_table(path)
    missing = [name for name in SHARD_INDEX_SCHEMA.names if name not in table.column_names]
    if missing:
        raise ShardFormatError(f"{path}: shard index lacks columns {missing}; re-run `tokenmill prepare`.")
    return [ShardInfo(**{name: row[name] for name in SHARD_INDEX_SCHEMA.names}) for row in table.to_pylist()]


def verify_shards(run_dir: Path) -> list[str]:
    """Check every shard against the index: presence, sha256, schema, metadata, ids < vocab.

    Returns one human-readable line per fault (empty list = all good); also reports shard files on
    disk that the index does not list.
    """
    run_dir = Path(run_dir)
    faults: list[str] = []
    infos = read_shard_index(run_dir)
    listed = {info.path for info in infos}
    for extra in sorted(p.relative_to(run_dir).as_posix() for p in (run_dir / "shards").rglob("*.arrow")):
        if extra not in listed:
            faults.append(f"{extra}: shard file not in the index (extra file)")
    for info in infos:
        faults.extend(_verify_one(run_dir, info))
    return faults


def _verify_one(run_dir: Path, info: ShardInfo) -> list[str]:
    path = run_dir / info.path
    if not path.is_file():
        return [f"{info.path}: listed in the index but missing on disk"]
    if sha256_file(path) != info.sha256:
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
    vocab_size = int(metadata["vocab_size"])
    expected = shard_schema(pa.from_numpy_dtype(token_dtype_for_vocab(vocab_size)), info.seq_len, {})
    with pa.memory_map(str(path)) as source:
        actual = ipc.open_file(source).schema.remove_metadata()
    if not actual.equals(expected):
        # Rows are read only from a shard of the contract's layout (another one may not even have token rows).
        return [*faults, f"{info.path}: schema differs from the shard contract"]
    return faults + _verify_rows(path, info, vocab_size)


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
