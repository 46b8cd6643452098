"""Preference shards (:mod:`core.shards.preference`): pairs packed whole by :mod:`tokenization.preference.pack`,
read back pair by pair, and the faults ``shards verify`` reports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from core.shards.chat import write_chat_shard
from core.shards.preference import (
    check_preference_rows,
    chosen_first,
    is_preference_shard,
    read_row_pairs,
    row_pairs,
    side_ids,
)
from tokenization.chat.masks import MaskedConversation
from tokenization.preference.masks import MaskedPair
from tokenization.preference.pack import pack_pairs


def _pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> MaskedPair:
    def side(completion: list[int]) -> MaskedConversation:
        return MaskedConversation(prompt + completion, [0] * len(prompt) + [1] * len(completion), "prefix_diff")
    return MaskedPair(side(chosen), side(rejected), len(prompt))


PAIRS = [(10, _pair([1, 2, 3], [4, 5], [6])), (11, _pair([7, 8], [9, 9, 9, 9], [5, 5])),
         (12, _pair([3], [2], [1, 1]))]


def test_pairs_are_packed_whole_and_read_back_with_their_sides(tmp_path: Path) -> None:
    chat = pack_pairs(PAIRS, seq_len=12, pad_id=0, dtype=np.dtype(np.uint16))
    info = write_chat_shard(tmp_path, "shards/split=train/source=p/shard-00000.arrow", chat, split="train",
                            source="p", tokenizer_sha256="t", vocab_size=100, records="preference")
    path = tmp_path / info.path
    assert is_preference_shard(path)
    rows = read_row_pairs(path)
    by_doc = {pair.doc_id: (row, pair) for row, pairs in enumerate(rows) for pair in pairs}
    assert sorted(by_doc) == [10, 11, 12]
    for doc_id, masked in PAIRS:
        row, pair = by_doc[doc_id]
        for span, side in ((pair.chosen, masked.chosen), (pair.rejected, masked.rejected)):
            assert chat.rows.input_ids[row, span[0]:span[1]].tolist() == side.input_ids
            assert chat.loss_mask[row, span[0]:span[1]].tolist() == side.loss_mask
    assert check_preference_rows(path, _table(path)) == []


def test_a_chat_shard_is_not_a_preference_shard(tmp_path: Path) -> None:
    chat = pack_pairs(PAIRS[:1], seq_len=12, pad_id=0, dtype=np.dtype(np.uint16))
    info = write_chat_shard(tmp_path, "s.arrow", chat, split="train", source="p", tokenizer_sha256="t",
                            vocab_size=100)
    assert not is_preference_shard(tmp_path / info.path)


@pytest.mark.parametrize(("doc_ids", "starts", "message"), [
    ([1, 1, 2], [0, 3, 5], "an even number"),
    ([1, 2], [0, 3], "a pair's two sides are one document"),
    ([1, 1], [0, 3], None),
])
def test_rows_that_do_not_hold_whole_pairs_are_refused(doc_ids: list[int], starts: list[int],
                                                       message: str | None) -> None:
    if message is None:
        assert [pair.rejected for pair in row_pairs(doc_ids, starts, 6)] == [(3, 6)]
        return
    with pytest.raises(ValueError, match=message):
        row_pairs(doc_ids, starts, 6)


def test_side_ids_number_the_sides_as_pair_batch_does() -> None:
    pairs = row_pairs([5, 5, 6, 6], [0, 2, 3, 5], 7)
    interleaved = side_ids(pairs, seq_len=8)
    assert interleaved.tolist() == [0, 0, 1, 2, 2, 3, 3, -1]
    assert chosen_first(interleaved, num_pairs=2).tolist() == [0, 0, 2, 1, 1, 3, 3, -1]


def _table(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as source:
        return ipc.open_file(source).read_all()


def test_packed_rows_give_each_pair_the_log_probs_it_has_alone() -> None:
    """The shard rows' batch (:func:`trainer.preference.shard_rows.rows_pair_batch`) against one padded row per side
    (:func:`trainer.preference.pair_batch.pad_pairs`), under a tiny transformers Llama."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.preference.pair_batch import pad_pairs, pair_logps
    from trainer.preference.shard_rows import rows_pair_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, use_cache=False)).eval()
    chat = pack_pairs(PAIRS, seq_len=12, pad_id=0, dtype=np.dtype(np.uint16))
    rows = chat.rows
    batch, doc_ids = rows_pair_batch(rows.input_ids, chat.loss_mask, rows.doc_ids, rows.doc_starts, rows.num_tokens)
    with torch.no_grad():
        packed = pair_logps(model, batch)
        alone = pair_logps(model, pad_pairs([pair for _, pair in PAIRS], pad_id=0))
    order = [doc_id - 10 for doc_id in doc_ids]
    torch.testing.assert_close(packed.chosen, alone.chosen[order], rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.rejected, alone.rejected[order], rtol=0, atol=1e-5)
    assert not torch.equal(packed.chosen, packed.rejected)
