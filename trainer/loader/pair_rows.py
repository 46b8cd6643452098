"""Pair rows: a split's preference shards -> micro-batches of whole pairs, each pair named by (split, source, doc id).

The loader's global sample order, rank slicing and resume position are those of any other row
(:class:`trainer.loader.batches.TrainLoader`); only what a row becomes differs. A preference row
(:mod:`core.shards.preference`) holds whole pairs, so a micro-batch of rows is a
:class:`trainer.preference.pair_batch.PairBatch` (:func:`trainer.preference.shard_rows.rows_pair_batch`) plus each
pair's :class:`trainer.preference.reference_store.PairKey`, by which its stored reference log-probs are found. The
number of pairs of a row is half its number of documents, so every rank counts the pairs of the whole step (the
divisor of its loss) from the rows alone, without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from core.errors import ShardFormatError
from core.shards.preference import row_pairs
from trainer.loader.batches import SplitRows
from trainer.preference.pair_batch import PairBatch
from trainer.preference.reference_store import PairKey
from trainer.preference.shard_rows import rows_pair_batch


@dataclass(frozen=True)
class PairMicroBatch:
    """One micro-batch of pairs: the model batch and each pair's key, in the batch's pair order."""

    batch: PairBatch
    keys: list[PairKey]

    @property
    def num_pairs(self) -> int:
        return self.batch.num_pairs

    def to(self, device: torch.device) -> PairMicroBatch:
        return PairMicroBatch(self.batch.to(device), self.keys)


class ShardLineage:
    """The ``doc_ids`` and ``num_tokens`` columns of one shard, read once (a pair's doc id names its values)."""

    def __init__(self, path: Path) -> None:
        with pa.memory_map(str(path)) as source:
            table = ipc.open_file(source).read_all().select(["doc_ids", "num_tokens"])
        column = table.column("doc_ids").combine_chunks()
        self.offsets = column.offsets.to_numpy().astype(np.int64)
        self.values = column.values.to_numpy().astype(np.int64)
        self.num_tokens = table.column("num_tokens").to_numpy().astype(np.int64)

    def doc_ids(self, row: int) -> np.ndarray:
        return self.values[self.offsets[row]:self.offsets[row + 1]]


class PairRows:
    """Pairs of the preference shards of one split (:class:`SplitRows` opened with ``mode="dpo"``)."""

    def __init__(self, rows: SplitRows) -> None:
        self.rows = rows
        self._lineage: dict[int, ShardLineage] = {}

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    def num_pairs(self, row_ids: np.ndarray) -> int:
        """Pairs in rows ``row_ids`` (half their documents)."""
        return sum(len(starts) for starts in self.rows.doc_starts(np.asarray(row_ids, dtype=np.int64))) // 2

    def micro_batch(self, row_ids: np.ndarray) -> PairMicroBatch:
        """Rows ``row_ids`` as one batch of pairs; ShardFormatError naming the shard and row that holds no whole
        pairs (:func:`core.shards.preference.row_pairs`)."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        shard_ids, local = self.rows.locate(row_ids)
        doc_ids = [self._shard_lineage(shard).doc_ids(row) for shard, row in zip(shard_ids.tolist(), local.tolist(),
                                                                                  strict=True)]
        num_tokens = [int(self._shard_lineage(shard).num_tokens[row])
                      for shard, row in zip(shard_ids.tolist(), local.tolist(), strict=True)]
        doc_starts = self.rows.doc_starts(row_ids)
        try:
            batch, pair_doc_ids = rows_pair_batch(self.rows.rows(row_ids), self.rows.loss_mask(row_ids), doc_ids,
                                                  doc_starts, num_tokens)
        except ValueError:
            raise self._row_fault(shard_ids, local, doc_ids, doc_starts, num_tokens) from None
        sources = [self.rows.shard_sources[shard] for shard, starts in zip(shard_ids.tolist(), doc_starts, strict=True)
                   for _ in range(len(starts) // 2)]
        keys = [PairKey(doc_id, self.rows.split, source) for doc_id, source in zip(pair_doc_ids, sources, strict=True)]
        return PairMicroBatch(batch, keys)

    def _shard_lineage(self, shard: int) -> ShardLineage:
        if shard not in self._lineage:
            self._lineage[shard] = ShardLineage(self.rows.shards[shard].path)
        return self._lineage[shard]

    def _row_fault(self, shard_ids: np.ndarray, local: np.ndarray, doc_ids: list[np.ndarray],
                   doc_starts: list[np.ndarray], num_tokens: list[int]) -> ShardFormatError:
        for index, (shard, row) in enumerate(zip(shard_ids.tolist(), local.tolist(), strict=True)):
            try:
                row_pairs(doc_ids[index].tolist(), doc_starts[index].tolist(), num_tokens[index])
            except ValueError as err:
                return ShardFormatError(f"{self.rows.shards[shard].path}: row {row}: {err}; it is not a preference "
                                        "shard tokenmill wrote, re-run `tokenmill prepare`.")
        return ShardFormatError(f"{self.rows.shards[int(shard_ids[0])].path}: rows that hold no whole pairs; re-run "
                                "`tokenmill prepare`.")
