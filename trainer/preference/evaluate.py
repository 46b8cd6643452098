"""In-loop evaluation of a dpo run: the fixed subset of val preference rows -> the val pairs' loss and rewards.

The subset is the in-loop evaluator's (:func:`trainer.eval.evaluate.fixed_subset`: ``eval_batches *
micro_batch_size`` val rows shared among the sources, never shuffled); each data-parallel replica scores a contiguous
share, and the summed per-pair losses and rewards are reduced, so the result is the mean over every pair of the
subset whatever the number of processes. ``val_loss`` is the preference loss (as training computes it, with the val
reference log-probs), beside ``rewards/accuracy``, ``rewards/margin`` (and the mean chosen and rejected rewards) and
``val_pairs``. Under FSDP the ranks run the same number of forwards (a smaller share runs empty ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch import nn

from trainer.eval.evaluate import fixed_subset
from trainer.loader.pair_rows import PairRows
from trainer.parallel.accelerator import data_parallel_coordinates, is_sharded
from trainer.preference.objective import PreferenceObjective, reward_metrics, reward_sums


class PairEvaluator:
    """Scores a model on this rank's share of the fixed subset of val preference rows."""

    def __init__(self, pairs: PairRows | None, micro_batch_size: int, eval_batches: int, accelerator: Accelerator,
                 objective: PreferenceObjective,
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.pairs, self.micro_batch_size, self.accelerator = pairs, micro_batch_size, accelerator
        self.objective, self.autocast = objective, autocast
        _, subset, _ = fixed_subset(None if pairs is None else pairs.rows, eval_batches * micro_batch_size)
        self.num_rows = len(subset)
        num_replicas, replica = data_parallel_coordinates(accelerator)
        shares = np.array_split(subset, num_replicas)
        self.rank_rows = shares[replica]
        share = len(shares[0]) if is_sharded(accelerator) else len(self.rank_rows)
        self.num_forwards = -(-share // micro_batch_size)

    def evaluate(self, model: nn.Module) -> dict[str, float] | None:
        """``val_loss`` (the mean preference loss of the subset's pairs), ``val_pairs``, ``val_rows`` and the
        rewards; None without val rows. Runs on the unwrapped module (only the final reduce is collective, and every
        forward under FSDP)."""
        if self.num_rows == 0:
            return None
        module = self.accelerator.unwrap_model(model)
        was_training = module.training
        module.eval()
        device = self.accelerator.device
        totals = torch.zeros(6, dtype=torch.float64, device=device)  # loss sum, then the reward sums
        with torch.no_grad(), self.autocast():
            for start in range(0, self.num_forwards * self.micro_batch_size, self.micro_batch_size):
                row_ids = self.rank_rows[start:start + self.micro_batch_size]
                counted = len(row_ids) > 0
                micro = self.pairs.micro_batch(row_ids if counted else self.rank_rows[:1] if len(self.rank_rows)
                                               else np.zeros(1, dtype=np.int64)).to(device)
                result = self.objective.loss(module, micro)
                if counted:  # an FSDP lockstep forward takes part in the all-gathers and counts nothing
                    totals += torch.cat([result.per_pair.double().sum()[None], reward_sums(result)])
        module.train(was_training)
        totals = self.accelerator.reduce(totals, reduction="sum")
        loss_sum, *sums = totals.tolist()
        return {"val_loss": loss_sum / max(sums[-1], 1.0), "val_pairs": int(sums[-1]), "val_rows": self.num_rows,
                **reward_metrics(sums)}
