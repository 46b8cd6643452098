"""Pack step for chat data: masked conversations -> fixed-length rows with a loss mask, no cross-contamination.

Unlike pretraining's :class:`tokenization.pack.Packer` (a document stream cut every ``seq_len`` tokens), a
conversation is never split across rows: the tokens it trains on need its whole prompt before them. Conversations
are placed whole into rows by best-fit decreasing (TRL's ``packing_strategy="bfd"``: longest first, each into
the open row with the least room that still holds it), so rows are nearly full and padding is left only at row
ends. Each row's ``doc_starts`` are the conversations' starts: with ``train.document_masking`` the trainer builds
from them positions restarting at 0 and attention within each conversation (:mod:`trainer.loader.document_mask`), so a
conversation's logits in a packed row are its logits alone. ``packed=False`` is the fallback for a model whose
attention cannot take that mask: one conversation per row, padded.

The loss mask is stored beside the tokens (:mod:`core.shards.chat`): a conversation's own mask, except its first
token, which is never a target (the logits before it belong to the previous conversation); padding carries none.
No EOS is added: the template's end-of-turn tokens end each conversation, as the model will see it in chat.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from core.shards.chat import ChatRows
from core.shards.store import ShardRows
from tokenization.chat.masks import MaskedConversation


def pack_conversations(conversations: Sequence[tuple[int, MaskedConversation]], seq_len: int, pad_id: int,
                       dtype: np.dtype, packed: bool = True) -> ChatRows:
    """``(doc_id, conversation)`` pairs -> rows of ``seq_len`` tokens stored as ``dtype``; deterministic.

    ``packed``: best-fit decreasing (see the module doc); False: one conversation per row, in the given order.
    Raises ValueError for a conversation longer than ``seq_len`` or with ids ``dtype`` cannot hold: masks are
    made with ``max_tokens=seq_len`` (:func:`tokenization.chat.masks.mask_conversation`), which rejects those.
    """
    lengths = [len(conversation.input_ids) for _, conversation in conversations]
    _check_fits(conversations, lengths, seq_len, np.dtype(dtype))
    placement = best_fit_decreasing(lengths, seq_len) if packed else [[index] for index in range(len(lengths))]
    input_ids = np.full((len(placement), seq_len), pad_id, dtype=dtype)
    loss_mask = np.zeros((len(placement), seq_len), dtype=np.uint8)
    doc_ids: list[list[int]] = []
    doc_starts: list[list[int]] = []
    for row, members in enumerate(placement):
        starts = np.concatenate([[0], np.cumsum([lengths[index] for index in members])]).tolist()
        for index, start, end in zip(members, starts[:-1], starts[1:], strict=True):
            conversation = conversations[index][1]
            input_ids[row, start:end] = conversation.input_ids
            loss_mask[row, start + 1:end] = conversation.loss_mask[1:]
        doc_ids.append([conversations[index][0] for index in members])
        doc_starts.append(starts[:-1])
    num_tokens = [sum(lengths[index] for index in members) for members in placement]
    rows = ShardRows(input_ids=input_ids, doc_ids=doc_ids, doc_starts=doc_starts,
                     first_doc_offset=[0] * len(placement), num_tokens=num_tokens)
    return ChatRows(rows, loss_mask)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of ``capacity``: longest first (ties in input order), each into the
    bin with the least room left that holds it, else a new bin. Bins in opening order, members in placement order."""
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin number), sorted: the best fit is the first that holds
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        length = lengths[index]
        position = bisect.bisect_left(open_bins, (length, -1))
        if position < len(open_bins):
            room, number = open_bins.pop(position)
        else:
            room, number = capacity, len(bins)
            bins.append([])
        bins[number].append(index)
        if room - length > 0:
            bisect.insort(open_bins, (room - length, number))
    return bins


def _check_fits(conversations: Sequence[tuple[int, MaskedConversation]], lengths: list[int], seq_len: int,
                dtype: np.dtype) -> None:
    max_id = int(np.iinfo(dtype).max)
    for (doc_id, conversation), length in zip(conversations, lengths, strict=True):
        if not 0 < length <= seq_len:
            raise ValueError(f"conversation {doc_id} has {length} tokens; a row holds 1 to {seq_len} (mask it with "
                             "max_tokens=seq_len: longer ones are rejected or truncated there)")
        if max(conversation.input_ids) > max_id or min(conversation.input_ids) < 0:
            raise ValueError(f"conversation {doc_id} has token ids outside {dtype.name}: use token_dtype_for_vocab")
