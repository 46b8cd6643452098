"""Evaluation: validation shards -> val loss and perplexity on a fixed subset, comparable across steps and runs.

The subset is the first ``eval_batches * micro_batch_size`` val rows in index order (never shuffled).
Each rank scores a contiguous share; the summed token losses and token counts are gathered, so the
result is the token-weighted mean over the whole subset whatever the number of processes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn

from trainer.data import TokenRows, make_batch
from trainer.model import IGNORE_INDEX, next_token_loss


class Evaluator:
    """Scores a model on this rank's share of the fixed validation subset."""

    def __init__(self, rows: TokenRows | None, micro_batch_size: int, eval_batches: int,
                 accelerator: Accelerator) -> None:
        self.rows, self.micro_batch_size, self.accelerator = rows, micro_batch_size, accelerator
        self.num_rows = 0 if rows is None else min(rows.num_rows, eval_batches * micro_batch_size)
        subset = np.arange(self.num_rows, dtype=np.int64)
        self.rank_rows = np.array_split(subset, accelerator.num_processes)[accelerator.process_index]

    def evaluate(self, model: nn.Module) -> dict[str, float] | None:
        """{"val_loss", "val_ppl", "val_tokens"} over the subset, or None when there are no val rows.

        Runs on the unwrapped module: a DDP forward may broadcast buffers, and ranks can hold a
        different number of val batches, so only the final gather is collective.
        """
        if self.num_rows == 0:
            return None
        module = self.accelerator.unwrap_model(model)
        was_training = module.training
        module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        with torch.no_grad(), self.accelerator.autocast():
            for start in range(0, len(self.rank_rows), self.micro_batch_size):
                totals += self._score(module, self.rank_rows[start:start + self.micro_batch_size])
        module.train(was_training)
        loss_sum, num_tokens = self.accelerator.gather(totals).view(-1, 2).sum(dim=0).tolist()
        val_loss = loss_sum / max(num_tokens, 1.0)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_tokens": int(num_tokens)}

    def _score(self, module: nn.Module, row_ids: np.ndarray) -> torch.Tensor:
        batch = make_batch(self.rows.rows(row_ids))
        input_ids = batch.input_ids.to(self.accelerator.device)
        labels = batch.labels.to(self.accelerator.device)
        loss_sum = next_token_loss(module(input_ids), labels, reduction="sum")
        num_tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        return torch.stack([loss_sum.double(), num_tokens.double()])
