"""``shards verify`` on preference shards: a row that does not hold whole pairs (an odd side, two sides of different
documents) or a side with no loss token is a fault naming the shard and row; well-formed pairs pass, and a chat shard
(no ``records: preference``) is not held to the pair rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from core.shards.chat import ChatRows, write_chat_shard
from core.shards.store import ShardRows, shard_relpath, verify_shards, write_shard_index

SEQ_LEN = 12


def rows(doc_ids: list[int], doc_starts: list[int], num_tokens: int, trained: list[int]) -> ChatRows:
    """One row of ``num_tokens`` tokens whose sides start at ``doc_starts``; loss on the positions ``trained``."""
    input_ids = np.zeros((1, SEQ_LEN), dtype=np.uint16)
    input_ids[0, :num_tokens] = np.arange(1, num_tokens + 1)
    mask = np.zeros((1, SEQ_LEN), dtype=np.uint8)
    mask[0, trained] = 1
    return ChatRows(ShardRows(input_ids, [doc_ids], [doc_starts], [0], [num_tokens]), mask)


def verify(tmp_path: Path, chat: ChatRows, records: str | None = "preference") -> list[str]:
    info = write_chat_shard(tmp_path, shard_relpath("train", "pairs", 0), chat, split="train", source="pairs",
                            tokenizer_sha256="0" * 64, vocab_size=100, records=records)
    write_shard_index(tmp_path, [info])
    return verify_shards(tmp_path)


def test_whole_pairs_with_loss_on_each_side_pass(tmp_path: Path) -> None:
    assert verify(tmp_path, rows([7, 7, 9, 9], [0, 3, 6, 9], 12, [2, 5, 8, 11])) == []


def test_an_odd_side_is_a_fault(tmp_path: Path) -> None:
    (fault,) = verify(tmp_path, rows([7, 7, 9], [0, 3, 6], 9, [2, 5, 8]))
    assert "part-00000.arrow: row 0: 3 sides: a row holds whole pairs" in fault


def test_sides_of_two_documents_are_a_fault(tmp_path: Path) -> None:
    (fault,) = verify(tmp_path, rows([7, 8], [0, 3], 6, [2, 5]))
    assert "row 0: sides 0 and 1 belong to documents 7 and 8" in fault


def test_a_side_without_a_loss_token_is_a_fault_and_a_chat_shard_is_not_held_to_pairs(tmp_path: Path) -> None:
    (fault,) = verify(tmp_path / "preference", rows([7, 7], [0, 3], 6, [2]))
    assert "row 0: the rejected side of document 7 has no loss token" in fault
    assert verify(tmp_path / "chat", rows([7, 8, 9], [0, 3, 6], 9, [2]), records=None) == []
