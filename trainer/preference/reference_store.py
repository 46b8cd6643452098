"""The stored reference log-probs: one Parquet file of per-pair values, its schema, writer and checked reader.

Torch-free, so a stage can declare and fingerprint its output and ``tokenmill status`` can import it without torch
(the computing side is :mod:`trainer.preference.reference`). The file is plain Parquet: a DuckDB view reads it as
it is (``read_parquet``), and each row names the reference model by :func:`reference_model_sha256`, so a file
computed with another model is refused, never silently used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import ShardFormatError
from core.files.digests import file_sha256
from core.rundir import RunPaths
from trainer.model.hf_files import config_file, weight_files

REFERENCE_FORMAT_VERSION = 2
"""2: a pair is named by its doc id, split and source (1 had a string pair id)."""
REFERENCE_LOGPS_SCHEMA = pa.schema(
    [
        pa.field("doc_id", pa.int64(), nullable=False),
        pa.field("split", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("chosen_logp", pa.float32(), nullable=False),
        pa.field("rejected_logp", pa.float32(), nullable=False),
        pa.field("reference_sha256", pa.string(), nullable=False),
    ],
    metadata={"format": "tokenmill.reference_logps", "format_version": str(REFERENCE_FORMAT_VERSION)},
)
"""One row per pair: its doc id (the pair's document in ``documents``, as the preference shards' ``doc_ids`` name
it), split and source, the reference model's summed
log-probs (float32, exactly as computed) of the chosen and rejected completion, and that model's
:func:`reference_model_sha256`."""


@dataclass(frozen=True)
class PairKey:
    """Which pair a row of log-probs belongs to: its document (doc id), in which split and source."""

    doc_id: int
    split: str
    source: str


def reference_model_sha256(model_dir: Path) -> str:
    """Hex sha256 over the names and sha256 of a model dir's config and safetensors weights (what decides its
    logits; not its tokenizer: the pairs are token ids): changes when any weight changes, whatever the timestamps.
    Raises ConfigError naming the folder when it has no config or weights (:mod:`trainer.model.hf_files`)."""
    digest = hashlib.sha256()
    for path in [config_file(Path(model_dir)), *weight_files(Path(model_dir))]:
        digest.update(f"{path.name}\0{file_sha256(path)}\n".encode())
    return digest.hexdigest()


def reference_table(keys: Sequence[PairKey], chosen_logps: np.ndarray, rejected_logps: np.ndarray,
                    reference_sha256: str) -> pa.Table:
    """The rows of :data:`REFERENCE_LOGPS_SCHEMA` for ``keys`` and their log-probs (float32 [pairs], same order)."""
    if not len(keys) == len(chosen_logps) == len(rejected_logps):
        raise ValueError(f"{len(keys)} pair keys for {len(chosen_logps)} chosen and {len(rejected_logps)} rejected "
                         "log-probs")
    columns = {"doc_id": [key.doc_id for key in keys], "split": [key.split for key in keys],
               "source": [key.source for key in keys],
               "chosen_logp": np.asarray(chosen_logps, dtype=np.float32),
               "rejected_logp": np.asarray(rejected_logps, dtype=np.float32),
               "reference_sha256": [reference_sha256] * len(keys)}
    return pa.Table.from_pydict(columns, schema=REFERENCE_LOGPS_SCHEMA)


def write_reference_logps(paths: RunPaths, path: Path, table: pa.Table) -> None:
    """Write ``table`` to ``path`` in the run dir ``paths`` atomically (temporary file, fsync, rename)."""
    if not table.schema.equals(REFERENCE_LOGPS_SCHEMA, check_metadata=True):
        raise ValueError(f"{path}: reference log-probs must have REFERENCE_LOGPS_SCHEMA, not {table.schema}")
    with paths.atomic_write(path, size_hint_bytes=table.nbytes) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def read_reference_logps(path: Path, reference_sha256: str) -> pa.Table:
    """The table at ``path``, checked: its format version and columns, and that the reference model it was
    computed with is ``reference_sha256``. Raises ShardFormatError naming the file and what to do otherwise."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise ShardFormatError(f"{path}: cannot read reference log-probs ({err}); recompute them") from None
    version = (table.schema.metadata or {}).get(b"format_version", b"?").decode()
    if version != str(REFERENCE_FORMAT_VERSION) or not table.schema.equals(REFERENCE_LOGPS_SCHEMA):
        raise ShardFormatError(f"{path}: not reference log-probs of format version {REFERENCE_FORMAT_VERSION} "
                               f"(version {version}, columns {table.schema.names}); recompute them")
    found = set(table.column("reference_sha256").to_pylist())
    if found - {reference_sha256}:
        raise ShardFormatError(f"{path}: computed with reference model {sorted(found)[0][:12]}, not "
                               f"{reference_sha256[:12]}; recompute the reference log-probs for this model")
    return table


def stored_logps(table: pa.Table, keys: Sequence[PairKey]) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) float32 [len(keys)]: the stored log-probs of ``keys``, in their order. ShardFormatError
    naming the first pair the table does not hold."""
    return StoredLogps(table).lookup(keys)


class StoredLogps:
    """A checked table's log-probs by pair, indexed once: what the training step and the evaluator look up."""

    def __init__(self, table: pa.Table) -> None:
        keys = zip(table.column("doc_id").to_pylist(), table.column("split").to_pylist(),
                   table.column("source").to_pylist(), strict=True)
        self._row = {PairKey(int(doc_id), split, source): row for row, (doc_id, split, source) in enumerate(keys)}
        self._chosen = table.column("chosen_logp").to_numpy()
        self._rejected = table.column("rejected_logp").to_numpy()

    def __len__(self) -> int:
        return len(self._row)

    def update(self, other: StoredLogps) -> None:
        """Add ``other``'s pairs (another (split, source) file)."""
        offset = len(self._chosen)
        self._row.update({key: offset + row for key, row in other._row.items()})
        self._chosen = np.concatenate([self._chosen, other._chosen])
        self._rejected = np.concatenate([self._rejected, other._rejected])

    def lookup(self, keys: Sequence[PairKey]) -> tuple[np.ndarray, np.ndarray]:
        """(chosen, rejected) float32 [len(keys)] in the keys' order; ShardFormatError naming a missing pair."""
        rows = [self._row.get(key) for key in keys]
        if None in rows:
            missing = keys[rows.index(None)]
            raise ShardFormatError(f"no reference log-probs for pair (doc id {missing.doc_id}) of split "
                                   f"{missing.split!r}, source {missing.source!r}; recompute the reference log-probs "
                                   "for this data (`tokenmill train` runs the reference stage)")
        index = np.asarray(rows, dtype=np.int64)
        return self._chosen[index], self._rejected[index]
