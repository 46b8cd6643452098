"""Preference shards: chat shards whose rows hold whole pairs, each as two consecutive conversations of one doc id.

A preference shard is a chat shard (:mod:`core.shards.chat`: token columns, ``loss_mask``, ``num_loss_tokens``)
whose schema metadata has ``records: preference`` (:data:`RECORDS_KEY`). In each row, every pair lies whole: its
chosen side, then its rejected side, two entries of ``doc_starts`` with the same ``doc_ids`` value (the pair's
document: the preference record it was rendered from). ``loss_mask`` covers each side's completion only, so the
summed log-prob of a side is the sum over its masked tokens. Positions restart at each side's start (document
masking, as for SFT rows), so each side's logits in a packed row are those it has alone.

Why this layout and not a table of pairs: the shard index, ``shards verify``, the ``sequences`` view, lineage to
``documents``, the trainer's loader (global sample order, exact resume, elastic resume, data-parallel split) and
document masking all read chat shards already; a pair per two documents adds only the rule above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import ShardFormatError

RECORDS_KEY = "records"
PREFERENCE_RECORDS = "preference"
"""Schema metadata ``records: preference`` marks a preference shard (chat shards have no ``records`` key)."""


@dataclass(frozen=True)
class RowPair:
    """One pair in a row: its doc id and the token spans [start, end) of its chosen and rejected sides."""

    doc_id: int
    chosen: tuple[int, int]
    rejected: tuple[int, int]


def is_preference_shard(path: Path) -> bool:
    """True when the shard at ``path`` says ``records: preference`` in its schema metadata."""
    with pa.memory_map(str(path)) as source:
        metadata = ipc.open_file(source).schema.metadata or {}
    return metadata.get(RECORDS_KEY.encode()) == PREFERENCE_RECORDS.encode()


def row_pairs(doc_ids: list[int], doc_starts: list[int], num_tokens: int) -> list[RowPair]:
    """The pairs of one row from its ``doc_ids``, ``doc_starts`` and ``num_tokens``, in row order.

    Raises ValueError saying what is wrong when the row does not hold whole pairs (an odd number of sides, two
    consecutive sides of different documents, an empty side): callers name the shard and row.
    """
    if len(doc_ids) != len(doc_starts):
        raise ValueError(f"{len(doc_ids)} doc_ids for {len(doc_starts)} doc_starts")
    if len(doc_ids) % 2:
        raise ValueError(f"{len(doc_ids)} sides: a row holds whole pairs (chosen, rejected), an even number")
    ends = [*doc_starts[1:], num_tokens]
    pairs = []
    for index in range(0, len(doc_ids), 2):
        if doc_ids[index] != doc_ids[index + 1]:
            raise ValueError(f"sides {index} and {index + 1} belong to documents {doc_ids[index]} and "
                             f"{doc_ids[index + 1]}: a pair's two sides are one document")
        chosen = (int(doc_starts[index]), int(ends[index]))
        rejected = (int(doc_starts[index + 1]), int(ends[index + 1]))
        if chosen[1] <= chosen[0] or rejected[1] <= rejected[0]:
            raise ValueError(f"document {doc_ids[index]} has an empty side")
        pairs.append(RowPair(int(doc_ids[index]), chosen, rejected))
    return pairs


def side_ids(pairs: list[RowPair], seq_len: int, first_pair: int = 0) -> np.ndarray:
    """int64 [seq_len]: which side each token of a row is, numbering a batch's sides as
    :mod:`trainer.preference.pair_batch` does for ``num_pairs`` pairs: ``2 * k`` for pair ``first_pair + k``'s
    chosen side and ``2 * k + 1`` for its rejected side, -1 for padding. (Interleaved, not chosen-first: the
    caller maps them with :func:`chosen_first`.)"""
    ids = np.full(seq_len, -1, dtype=np.int64)
    for offset, pair in enumerate(pairs):
        number = first_pair + offset
        ids[pair.chosen[0]:pair.chosen[1]] = 2 * number
        ids[pair.rejected[0]:pair.rejected[1]] = 2 * number + 1
    return ids


def chosen_first(interleaved: np.ndarray, num_pairs: int) -> np.ndarray:
    """Interleaved side ids (``2k`` chosen, ``2k + 1`` rejected) -> the pair_batch numbering (``k`` chosen,
    ``num_pairs + k`` rejected); -1 stays -1."""
    out = np.where(interleaved % 2 == 0, interleaved // 2, num_pairs + interleaved // 2)
    return np.where(interleaved < 0, -1, out)


def check_preference_rows(path: Path, table: pa.Table) -> list[str]:
    """``shards verify``'s faults of a preference shard: rows that do not hold whole pairs, sides with no loss token
    (none: all good)."""
    faults = []
    seq_len = table.schema.field("loss_mask").type.list_size
    mask = table.column("loss_mask").combine_chunks().values.to_numpy(zero_copy_only=False).reshape(-1, seq_len)
    doc_ids = table.column("doc_ids").to_pylist()
    doc_starts = table.column("doc_starts").to_pylist()
    num_tokens = table.column("num_tokens").to_pylist()
    for row in range(table.num_rows):
        try:
            pairs = row_pairs(doc_ids[row], doc_starts[row], num_tokens[row])
        except ValueError as err:
            faults.append(f"{path}: row {row}: {err}")
            continue
        for pair in pairs:
            for side, (start, end) in (("chosen", pair.chosen), ("rejected", pair.rejected)):
                if not mask[row, start:end].any():
                    faults.append(f"{path}: row {row}: the {side} side of document {pair.doc_id} has no loss token")
    return faults


def read_row_pairs(path: Path) -> list[list[RowPair]]:
    """Every row's pairs of the preference shard at ``path``; ShardFormatError naming the shard and row otherwise."""
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all().select(["doc_ids", "doc_starts", "num_tokens"])
    rows = []
    for row, (ids, starts, tokens) in enumerate(zip(*(table.column(name).to_pylist() for name in table.column_names),
                                                    strict=True)):
        try:
            rows.append(row_pairs(ids, starts, tokens))
        except ValueError as err:
            raise ShardFormatError(f"{path}: row {row}: {err}; it is not a preference shard tokenmill wrote, "
                                   "re-run `tokenmill prepare`.") from None
    return rows
