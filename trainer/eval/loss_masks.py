"""The loss masks of a split's chat shards, for scoring only the tokens a supervised fine-tuning run trains on.

An SFT run's validation loss is the loss of the tokens whose ``loss_mask`` is 1 (:mod:`core.shards.chat`): the
assistant's replies with their end-of-turn token under ``chat.loss: assistant``. Scored over every token, the number
would mostly measure how well the model predicts the user's questions and the template's headers, which it is
not trained to do. Whether a run is SFT is its recipe's ``train.mode`` (:func:`train_mode`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from core.eval_results import SCORED_TOKENS
from core.shards.chat import ShardLossMask

if TYPE_CHECKING:  # torch: this module is read by the torch-free evaluation stages too
    from trainer.loader.batches import SplitRows

SFT_MODE = "sft"


def train_mode(train: Any) -> str:
    """``train.mode`` of a TrainConfig: ``pretrain`` or ``sft``; ``pretrain`` for a config without the key (read with
    a default so evaluation works with every TrainConfig, those written before SFT included)."""
    return str(getattr(train, "mode", "pretrain"))


def is_sft(train: Any) -> bool:
    return train_mode(train) == SFT_MODE


def scored_tokens(recipe: dict[str, Any]) -> str:
    """The tokens an SFT run's loss is over, for labels: the recipe's ``chat.loss`` (``assistant`` by default).

    ``recipe``: the run's recorded recipe (run.yaml), read as data: only one of
    :data:`core.eval_results.SCORED_TOKENS` comes back (anything else reads as ``loss_mask``, the column the scores
    follow)."""
    chat = recipe.get("chat") if isinstance(recipe, dict) else None
    loss = chat.get("loss", "assistant") if isinstance(chat, dict) else "assistant"
    return loss if loss in SCORED_TOKENS else "loss_mask"


class SplitLossMasks:
    """Row numbers of a split (:class:`trainer.loader.batches.SplitRows`) -> their loss masks, [rows, seq_len] uint8.

    Each shard's ``loss_mask`` column is memory-mapped on first use; a shard without one (packed for pretraining)
    raises ShardFormatError naming it: an SFT run is scored only on chat shards.
    """

    def __init__(self, rows: SplitRows) -> None:
        self.rows = rows
        self._masks: dict[int, ShardLossMask] = {}

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        shard_ids, local_rows = self.rows.locate(indices)
        out = np.empty((len(indices), self.rows.seq_len), dtype=np.uint8)
        for position, (shard_id, row) in enumerate(zip(shard_ids.tolist(), local_rows.tolist(), strict=True)):
            out[position] = self._shard(shard_id).mask[row]
        return out

    def _shard(self, shard_id: int) -> ShardLossMask:
        if shard_id not in self._masks:
            shard = self.rows.shards[shard_id]
            self._masks[shard_id] = ShardLossMask(shard.path, self.rows.seq_len)
        return self._masks[shard_id]

    def close(self) -> None:
        for mask in self._masks.values():
            mask.close()
        self._masks.clear()
