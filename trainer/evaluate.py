"""Evaluation: validation shards -> val loss and perplexity on a fixed subset, comparable across steps and runs.

The subset is the first ``eval_batches * micro_batch_size`` val rows in index order (never shuffled).
Each data-parallel replica scores a contiguous share; the summed token losses and token counts are
gathered, so the result is the token-weighted mean over the whole subset whatever the number of
processes. Under FSDP every forward all-gathers parameters, so there a rank with a smaller share runs
(and discards) extra forwards until every rank has run as many as the largest share needs. Under
tensor parallelism the processes of a TP group are one replica: they score the same rows together,
and only the group's first process counts them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn

from trainer.data import TokenRows, make_batch
from trainer.model import IGNORE_INDEX, next_token_loss
from trainer.model_spec import output_logits
from trainer.parallel import data_parallel_coordinates, is_sharded, tensor_parallel_rank


class Evaluator:
    """Scores a model on this rank's share of the fixed validation subset."""

    def __init__(self, rows: TokenRows | None, micro_batch_size: int, eval_batches: int,
                 accelerator: Accelerator,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        """``autocast``: the training precision's autocast context (MixedPrecision.autocast)."""
        self.rows, self.micro_batch_size, self.accelerator = rows, micro_batch_size, accelerator
        self.autocast = autocast
        self.num_rows = 0 if rows is None else min(rows.num_rows, eval_batches * micro_batch_size)
        num_replicas, replica = data_parallel_coordinates(accelerator)
        shares = np.array_split(np.arange(self.num_rows, dtype=np.int64), num_replicas)
        self.rank_rows = shares[replica]
        self.reports_totals = tensor_parallel_rank(accelerator) == 0  # one process per TP group reports
        # array_split puts the larger shares first: shares[0] is the largest.
        share = len(shares[0]) if is_sharded(accelerator) else len(self.rank_rows)
        self.num_forwards = -(-share // micro_batch_size)

    def evaluate(self, model: nn.Module) -> dict[str, float] | None:
        """{"val_loss", "val_ppl", "val_tokens"} over the subset, or None when there are no val rows.

        Runs on the unwrapped module: a DDP forward may broadcast buffers, and ranks can hold a
        different number of val batches, so only the final gather is collective (and, under FSDP,
        every forward, which is why ranks then run the same number of them; under TP every forward
        within a TP group, whose processes score the same rows).
        """
        if self.num_rows == 0:
            return None
        module = self.accelerator.unwrap_model(model)
        was_training = module.training
        module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.accelerator.device)
        with torch.no_grad(), self.autocast():
            for start in range(0, self.num_forwards * self.micro_batch_size, self.micro_batch_size):
                row_ids = self.rank_rows[start:start + self.micro_batch_size]
                if len(row_ids):
                    totals += self._score(module, row_ids)
                else:  # FSDP lockstep: take part in the all-gathers, count nothing
                    self._score(module, np.zeros(1, dtype=np.int64))
        module.train(was_training)
        if not self.reports_totals:
            totals.zero_()
        loss_sum, num_tokens = self.accelerator.gather(totals).view(-1, 2).sum(dim=0).tolist()
        val_loss = loss_sum / max(num_tokens, 1.0)
        return {"val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0)), "val_tokens": int(num_tokens)}

    def _score(self, module: nn.Module, row_ids: np.ndarray) -> torch.Tensor:
        batch = make_batch(self.rows.rows(row_ids), self.rows.pad_id, self.rows.pad_is_eos)
        input_ids = batch.input_ids.to(self.accelerator.device)
        labels = batch.labels.to(self.accelerator.device)
        loss_sum = next_token_loss(output_logits(module(input_ids)), labels, reduction="sum")
        num_tokens = (labels[:, 1:] != IGNORE_INDEX).sum()
        return torch.stack([loss_sum.double(), num_tokens.double()])
