"""Pack step for preference data: masked pairs -> fixed-length rows holding whole pairs, sides side by side.

Each pair is placed whole (chosen side, then rejected side, both under its doc id) by best-fit decreasing over pair
lengths, as conversations are (:func:`tokenization.chat.pack.best_fit_decreasing`); the row layout is
:mod:`core.shards.preference`'s. Each side's first token carries no loss (it is a prompt token anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.shards.chat import ChatRows
from core.shards.store import ShardRows
from tokenization.chat.pack import best_fit_decreasing
from tokenization.preference.masks import MaskedPair


def pair_length(pair: MaskedPair) -> int:
    """Tokens the pair takes in a row: both sides."""
    return len(pair.chosen.input_ids) + len(pair.rejected.input_ids)


def pack_pairs(pairs: Sequence[tuple[int, MaskedPair]], seq_len: int, pad_id: int, dtype: np.dtype) -> ChatRows:
    """``(doc_id, pair)`` -> rows of ``seq_len`` tokens stored as ``dtype``; deterministic. ValueError for a pair
    longer than ``seq_len`` (the stage rejects those first)."""
    lengths = [pair_length(pair) for _, pair in pairs]
    for (doc_id, _), length in zip(pairs, lengths, strict=True):
        if length > seq_len:
            raise ValueError(f"pair {doc_id} has {length} tokens; a row holds {seq_len}")
    placement = best_fit_decreasing(lengths, seq_len)
    input_ids = np.full((len(placement), seq_len), pad_id, dtype=dtype)
    loss_mask = np.zeros((len(placement), seq_len), dtype=np.uint8)
    doc_ids: list[list[int]] = []
    doc_starts: list[list[int]] = []
    for row, members in enumerate(placement):
        start, ids, starts = 0, [], []
        for index in members:
            doc_id, pair = pairs[index]
            for side in (pair.chosen, pair.rejected):
                end = start + len(side.input_ids)
                input_ids[row, start:end] = side.input_ids
                loss_mask[row, start + 1:end] = side.loss_mask[1:]
                ids.append(doc_id)
                starts.append(start)
                start = end
        doc_ids.append(ids)
        doc_starts.append(starts)
    num_tokens = [sum(lengths[index] for index in members) for members in placement]
    rows = ShardRows(input_ids=input_ids, doc_ids=doc_ids, doc_starts=doc_starts,
                     first_doc_offset=[0] * len(placement), num_tokens=num_tokens)
    return ChatRows(rows, loss_mask)
