"""Preference shard rows -> the ``PairBatch`` the log-prob and loss functions take, with each pair's doc id.

Rows read from preference shards (:mod:`core.shards.preference`: whole pairs, each side a document of the row) are
already packed: this only numbers their sides as :mod:`trainer.preference.pair_batch` does (pair ``k``'s chosen
side ``k``, its rejected side ``num_pairs + k``, in row order) and restarts positions at each side, so
:func:`trainer.preference.pair_batch.pair_logps` gives each pair's summed log-probs under a model. The reference
stage, the training step and the per-checkpoint scoring all go through here, so they agree on which value is whose.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from core.shards.preference import chosen_first, row_pairs, side_ids
from trainer.loader.document_mask import position_ids
from trainer.preference.pair_batch import PairBatch


def rows_pair_batch(input_ids: np.ndarray, loss_mask: np.ndarray, doc_ids: Sequence[Sequence[int]],
                    doc_starts: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> tuple[PairBatch, list[int]]:
    """Rows [rows, seq_len] of preference shards and their lineage -> (the batch, each pair's doc id in batch order).

    ValueError (from :func:`core.shards.preference.row_pairs`) when a row does not hold whole pairs.
    """
    seq_len = int(input_ids.shape[1])
    interleaved = np.empty(input_ids.shape, dtype=np.int64)
    pair_doc_ids: list[int] = []
    for row in range(input_ids.shape[0]):
        pairs = row_pairs(list(doc_ids[row]), list(doc_starts[row]), int(num_tokens[row]))
        interleaved[row] = side_ids(pairs, seq_len, first_pair=len(pair_doc_ids))
        pair_doc_ids.extend(pair.doc_id for pair in pairs)
    num_pairs = len(pair_doc_ids)
    positions = position_ids([np.asarray(starts, dtype=np.int64) for starts in doc_starts], seq_len)
    batch = PairBatch(input_ids=torch.from_numpy(np.asarray(input_ids, dtype=np.int64)),
                      loss_mask=torch.from_numpy(np.asarray(loss_mask, dtype=np.int64)),
                      sequence_ids=torch.from_numpy(chosen_first(interleaved, num_pairs)),
                      num_pairs=num_pairs, position_ids=torch.from_numpy(positions))
    return batch, pair_doc_ids
