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

REFERENCE_FORMAT_VERSION = 1
REFERENCE_LOGPS_SCHEMA = pa.schema(
    [
        pa.field("pair_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("chosen_logp", pa.float32(), nullable=False),
        pa.field("rejected_logp", pa.float32(), nullable=False),
        pa.field("reference_sha256", pa.string(), nullable=False),
    ],
    metadata={"format": "tokenmill.reference_logps", "format_version": str(REFERENCE_FORMAT_VERSION)},
)
"""One row per pair: its id and source (as in ``rejects`` and ``documents``), the reference model's summed
log-probs (float32, exactly as computed) of the chosen and rejected completion, and that model's
:func:`reference_model_sha256`."""


@dataclass(frozen=True)
class PairKey:
    """Which pair a row of log-probs belongs to."""

    pair_id: str
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
    columns = {"pair_id": [key.pair_id for key in keys], "source": [key.source for key in keys],
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
    index = {(pair_id, source): row for row, (pair_id, source)
             in enumerate(zip(table.column("pair_id").to_pylist(), table.column("source").to_pylist(), strict=True))}
    missing = [key for key in keys if (key.pair_id, key.source) not in index]
    if missing:
        raise ShardFormatError(f"no reference log-probs for pair {missing[0].pair_id!r} of source "
                               f"{missing[0].source!r}; recompute the reference log-probs for this data")
    rows = pa.array([index[(key.pair_id, key.source)] for key in keys], type=pa.int64())
    return (table.column("chosen_logp").take(rows).to_numpy(zero_copy_only=False),
            table.column("rejected_logp").take(rows).to_numpy(zero_copy_only=False))
