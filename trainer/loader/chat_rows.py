"""Chat rows: a split's chat shards -> each row's loss mask, and the check that the shards fit ``train.mode``.

Supervised fine-tuning reads chat shards (:mod:`core.shards.chat`: a token shard plus ``loss_mask``), preference
tuning reads preference shards (chat shards of whole pairs, :mod:`core.shards.preference`), pretraining reads token
shards. Each is refused on the other modes, in one line naming the shard: pretraining on chat shards would train on
prompts and padding without a word, SFT on preference shards would train on the rejected answers too, and SFT or DPO
on token shards has no mask (or pairs) to train by.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from core.errors import ConfigError
from core.shards.chat import ShardLossMask
from core.shards.preference import is_preference_shard
from trainer.config import TrainMode
from trainer.loader.document_mask import ShardDocStarts


def is_chat_shard(path: Path) -> bool:
    """True when the shard at ``path`` has a ``loss_mask`` column (its type is checked when the mask is read)."""
    with pa.memory_map(str(path)) as source:
        return "loss_mask" in ipc.open_file(source).schema.names


def check_shards_fit_mode(paths: list[Path], mode: TrainMode) -> None:
    """ConfigError naming the first shard that ``mode`` cannot train on, and what to change."""
    for path in paths:
        chat = is_chat_shard(path)
        preference = chat and is_preference_shard(path)
        fault = _mode_fault(mode, chat, preference)
        if fault is not None:
            raise ConfigError(f"{path}: {fault}")


def _mode_fault(mode: TrainMode, chat: bool, preference: bool) -> str | None:
    """Why a shard of this kind cannot be trained on with ``mode`` (None: it can)."""
    if mode == "dpo" and not preference:
        kind = "a chat shard (conversations, not pairs)" if chat else "a token shard (no loss_mask column)"
        return (f"{kind}, but train.mode is dpo: preference tuning trains on preference shards (chosen/rejected pairs "
                "packed by the preference data stage); give the recipe preference sources (records: preference), "
                f"or set train.mode: {'sft' if chat else 'pretrain'}.")
    if mode != "dpo" and preference:
        return (f"a preference shard (chosen/rejected pairs), but train.mode is {mode}, which would train on the "
                "rejected answers too; set train.mode: dpo.")
    if mode == "sft" and not chat:
        return ("a token shard (no loss_mask column), but train.mode is sft: supervised fine-tuning trains on chat "
                "shards (conversations packed with their loss masks by the chat data stage); give the recipe chat "
                "sources, or set train.mode: pretrain.")
    if mode == "pretrain" and chat:
        return ("a chat shard (conversations with a loss_mask column), but train.mode is pretrain, which would train "
                "on every token, prompts and padding included; set train.mode: sft.")
    return None


def check_one_conversation_per_row(paths: list[Path], seq_len: int) -> None:
    """ConfigError naming the first chat shard with a row of several conversations: without document masking they
    would attend to each other (SFT with ``train.document_masking: false`` needs rows packed one per row)."""
    for path in paths:
        counts = np.diff(ShardDocStarts(path, seq_len).offsets)
        if (counts > 1).any():
            row = int(np.argmax(counts > 1))
            raise ConfigError(f"{path}: row {row} packs {int(counts[row])} conversations and train.document_masking "
                              "is false, so they would attend to each other; set train.document_masking: true (the "
                              "default with train.mode: sft), or, for a model whose attention cannot be masked, pack "
                              "one conversation per row (chat.packed: false).")


class LossMasks:
    """The loss masks of a list of chat shards, each memory-mapped on first use (zero-copy, uint8 [rows, seq_len])."""

    def __init__(self, paths: list[Path], seq_len: int) -> None:
        self.paths, self.seq_len = paths, seq_len
        self._open: dict[int, ShardLossMask] = {}

    def rows(self, shard_ids: list[int], rows: list[int]) -> np.ndarray:
        """uint8 [len(rows), seq_len]: row ``rows[i]`` of shard ``shard_ids[i]``, copied into one array."""
        out = np.empty((len(rows), self.seq_len), dtype=np.uint8)
        for i, (shard_id, row) in enumerate(zip(shard_ids, rows, strict=True)):
            if shard_id not in self._open:
                self._open[shard_id] = ShardLossMask(self.paths[shard_id], self.seq_len)
            out[i] = self._open[shard_id].mask[row]
        return out

    def close(self) -> None:
        for mask in self._open.values():
            mask.close()
        self._open.clear()
