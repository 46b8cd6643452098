"""tokenization/chat/pack.py and core/shards/chat.py: conversations packed whole into rows with their loss masks,
stored as data the existing shard readers read, and no conversation seeing another in the trainer's forward."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
import torch

from core.errors import ShardFormatError
from core.schemas import shard_schema
from core.shards.chat import ShardLossMask, write_chat_shard
from core.shards.store import ShardTokens, shard_relpath, write_shard
from tests.tokenization.chat.sft_data import masked_records, tiny_hf_llama, tiny_tokenmill_llama
from tokenization.chat.masks import MaskedConversation
from tokenization.chat.pack import best_fit_decreasing, pack_conversations
from tokenization.chat.template import load_chat_template
from trainer.loader.document_mask import ShardDocStarts
from trainer.loader.sft_loss import sft_batch
from trainer.model.spec import output_logits

SEQ_LEN = 256
PAD_ID = 0


def synthetic(length: int, first_loss: int = 0) -> MaskedConversation:
    """Ids 10.. of ``length`` tokens, loss on the second half (and on the first token when ``first_loss``)."""
    mask = [first_loss] + [int(index >= length // 2) for index in range(1, length)]
    return MaskedConversation(list(range(10, 10 + length)), mask, "all_tokens")


def test_each_conversation_lies_whole_in_one_row_with_its_mask_and_padding_carries_no_loss() -> None:
    lengths = [6, 4, 7, 3, 5, 5]
    conversations = [(100 + index, synthetic(length)) for index, length in enumerate(lengths)]
    chat = pack_conversations(conversations, seq_len=10, pad_id=PAD_ID, dtype=np.uint16)
    rows = chat.rows
    found = {}
    for row in range(len(chat)):
        assert rows.first_doc_offset[row] == 0
        ends = [*rows.doc_starts[row][1:], rows.num_tokens[row]]
        for doc_id, start, end in zip(rows.doc_ids[row], rows.doc_starts[row], ends, strict=True):
            found[doc_id] = (rows.input_ids[row, start:end].tolist(), chat.loss_mask[row, start:end].tolist())
        assert not chat.loss_mask[row, rows.num_tokens[row]:].any()
        assert (rows.input_ids[row, rows.num_tokens[row]:] == PAD_ID).all()
    assert found == {doc_id: (c.input_ids, c.loss_mask) for doc_id, c in conversations}
    assert len(chat) == 3  # 30 tokens in rows of 10: best fit leaves no room unused
    assert chat.num_loss_tokens == chat.loss_mask.sum(axis=1).tolist()


def test_a_conversations_first_token_never_carries_loss_in_a_packed_row() -> None:
    """The logits before it are the previous conversation's last: training on it would cross conversations."""
    conversations = [(1, synthetic(4, first_loss=1)), (2, synthetic(5, first_loss=1))]
    chat = pack_conversations(conversations, seq_len=9, pad_id=PAD_ID, dtype=np.uint16)
    assert chat.rows.doc_starts == [[0, 5]]
    assert chat.loss_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_padded_fallback_gives_one_conversation_per_row_in_order() -> None:
    conversations = [(7, synthetic(3)), (8, synthetic(6)), (9, synthetic(2))]
    chat = pack_conversations(conversations, seq_len=8, pad_id=PAD_ID, dtype=np.uint16, packed=False)
    assert chat.rows.doc_ids == [[7], [8], [9]]
    assert chat.rows.doc_starts == [[0], [0], [0]]
    assert chat.rows.num_tokens == [3, 6, 2]


def test_best_fit_decreasing_puts_each_item_where_least_room_is_left() -> None:
    assert best_fit_decreasing([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    assert best_fit_decreasing([10, 10], 10) == [[0], [1]]


def test_a_conversation_longer_than_a_row_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="conversation 42 has 11 tokens"):
        pack_conversations([(42, synthetic(11))], seq_len=10, pad_id=PAD_ID, dtype=np.uint16)


def test_chat_shards_are_read_by_the_trainers_shard_readers(tmp_path: Path) -> None:
    conversations = [(index, synthetic(length)) for index, length in enumerate([5, 9, 3, 7])]
    chat = pack_conversations(conversations, seq_len=10, pad_id=PAD_ID, dtype=np.uint16)
    relpath = shard_relpath("train", "chat", 0)
    info = write_chat_shard(tmp_path, relpath, chat, split="train", source="chat", tokenizer_sha256="t",
                            vocab_size=600)
    assert (info.num_rows, info.num_tokens) == (len(chat), 24)
    tokens, starts, mask = ShardTokens(tmp_path / relpath), ShardDocStarts(tmp_path / relpath, 10), \
        ShardLossMask(tmp_path / relpath, 10)
    assert np.array_equal(tokens.tokens, chat.rows.input_ids)
    assert [starts.row(row).tolist() for row in range(len(chat))] == chat.rows.doc_starts
    assert np.array_equal(mask.mask, chat.loss_mask)
    with pa.memory_map(str(tmp_path / relpath)) as source:
        table = ipc.open_file(source).read_all()
    assert table.column("num_loss_tokens").to_pylist() == chat.loss_mask.sum(axis=1).tolist()
    plain_columns = shard_schema(pa.uint16(), 10, {})
    assert table.select(plain_columns.names).schema.remove_metadata().equals(plain_columns)  # a token shard inside
    tokens.close()
    mask.close()
    plain = shard_relpath("train", "text", 0)
    write_shard(tmp_path, plain, chat.rows, split="train", source="text", tokenizer_sha256="t", vocab_size=600)
    with pytest.raises(ShardFormatError, match=r"no loss_mask column.*not a chat shard"):
        ShardLossMask(tmp_path / plain, 10)


@pytest.mark.parametrize("family", ["chatml_marked", "llama3"])
@pytest.mark.parametrize("build", [tiny_hf_llama, tiny_tokenmill_llama], ids=["transformers", "tokenmill"])
def test_a_conversations_logits_in_a_packed_row_equal_its_logits_alone(family: str, build, model_dirs) -> None:
    template = load_chat_template(model_dirs[family])
    conversations = list(enumerate(masked_records(template)))
    chat = pack_conversations(conversations, seq_len=SEQ_LEN, pad_id=PAD_ID, dtype=np.uint16)
    assert len(chat) < len(conversations)  # several conversations share a row
    model = build(len(template.tokenizer), SEQ_LEN)
    batch = sft_batch(chat.rows.input_ids, chat.loss_mask, [np.array(s) for s in chat.rows.doc_starts])
    with torch.no_grad():
        packed = output_logits(model(**batch.model_kwargs(torch.device("cpu"))))
        for row, (doc_ids, starts) in enumerate(zip(chat.rows.doc_ids, chat.rows.doc_starts, strict=True)):
            for doc_id, start in zip(doc_ids, starts, strict=True):
                ids = conversations[doc_id][1].input_ids
                alone = output_logits(model(input_ids=torch.tensor([ids])))[0]
                torch.testing.assert_close(packed[row, start:start + len(ids)], alone, rtol=1e-5, atol=1e-5)
