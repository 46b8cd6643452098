"""Arrow token shards -> a Hugging Face ``datasets.Dataset`` over the memory-mapped files, without a copy.

``datasets.Dataset.from_file`` reads only the Arrow IPC *stream* format, and a shard is an IPC *file* (it
fails with "Expected to read ... metadata bytes"); ``load_dataset("arrow", data_files=...)`` reads files
but copies them into its cache. Here each shard named by the index is memory-mapped with pyarrow and the
tables are handed to ``datasets.Dataset`` as they are: the token buffers stay the pages of the files.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import ConfigError, ShardFormatError
from core.shards.check import checked_shard_path
from core.shards.store import ShardInfo, read_shard_index, shard_metadata

if TYPE_CHECKING:
    import datasets


def shards_as_dataset(run_dir: str | Path, split: str = "train", source: str | None = None) -> datasets.Dataset:
    """The rows of the run's ``split`` shards (of ``source``, or of every source) as a ``datasets.Dataset``.

    Rows come in index order (by shard path, then row). Columns are the shard's: ``input_ids`` (a
    fixed-length list of uint16/uint32 ids), ``doc_ids``, ``doc_starts``, ``first_doc_offset``,
    ``num_tokens``. Nothing is copied: the columns are views of the memory-mapped shards (keep the run dir
    in place while the dataset is used). The fingerprint is derived from the shards' sha256 in the index,
    so ``datasets`` never hashes (and so never serialises) the tokens. A ``map(num_proc=N > 1)`` pickles the
    table to its workers: that is a copy per worker.

    Raises ConfigError when no shard has that split and source, ShardFormatError when the index is missing or
    a shard is unreadable, of another format version, of other columns than the rest, or not the bytes the
    index recorded (its sha256, hashed once per file version: :mod:`core.shards.check`).
    """
    import datasets  # datasets (~1 s): only the datasets bridge needs it

    run_dir = Path(run_dir)
    infos = [info for info in read_shard_index(run_dir) if info.split == split and source in (None, info.source)]
    if not infos:
        raise ConfigError(f"{run_dir}: no shards with split={split!r}, source={source!r}; "
                          "`tokenmill shards stats RUN_DIR` lists the run's splits and sources.")
    table = _concatenated(run_dir, [_mapped_shard(run_dir, info) for info in infos])
    return datasets.Dataset(table, split=datasets.NamedSplit(split), fingerprint=_fingerprint(infos))


def _mapped_shard(run_dir: Path, info: ShardInfo) -> pa.Table:
    """One shard's rows, memory-mapped, without its schema metadata (split and source differ per shard)."""
    path = run_dir / info.path
    shard_metadata(path)  # the format version and required keys, before a row is read
    try:
        table = ipc.open_file(pa.memory_map(str(path))).read_all().replace_schema_metadata(None)
    except (pa.ArrowException, OSError) as err:
        raise ShardFormatError(f"{path}: not a readable Arrow IPC shard ({err}); `tokenmill shards verify` "
                               "lists every damaged shard.") from None
    checked_shard_path(run_dir, info)
    return table


def _concatenated(run_dir: Path, tables: list[pa.Table]) -> pa.Table:
    """One table of the shards' chunks (concat_tables copies nothing); ShardFormatError if columns differ."""
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as err:
        raise ShardFormatError(f"{run_dir}/shards: shards have different columns ({err}); every shard of a run "
                               "comes from one tokenizer and seq_len: re-run `tokenmill prepare` on a fresh "
                               "run dir.") from None


def _fingerprint(infos: list[ShardInfo]) -> str:
    """The shards' identity, for ``datasets``' cache keys: their paths and sha256 in the index."""
    digest = hashlib.sha256()
    for info in infos:
        digest.update(f"{info.path}\0{info.sha256}\n".encode())
    return digest.hexdigest()[:16]
