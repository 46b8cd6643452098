"""Supervised fine-tuning loss: chat rows and their loss mask -> a batch, and the mean loss over its trained tokens.

Labels are the row's tokens where ``loss_mask`` is 1 and ``IGNORE_INDEX`` elsewhere (:mod:`core.shards.chat`), so
the loss is the trainer's own :func:`trainer.model.llama.next_token_loss`: position t's logits against ``labels[t +
1]``.

Normalisation, as TRL 1.16's ``SFTTrainer`` (``loss_type="nll"``) and transformers' ``Trainer`` do it: the loss of
an optimizer step is the sum of the per-token losses of every micro-batch divided by the number of trained tokens
in the whole step (``num_items_in_batch``: ``labels[..., 1:] != -100`` counted over the step's micro-batches, and
over the data-parallel ranks, each rank's loss then multiplied by their number since DDP averages gradients).
Not the mean of per-micro-batch means, which the pretraining loop takes (its rows are full, so the two agree
there): chat rows carry very different numbers of trained tokens, and a mean of means would weigh a token of a
sparse micro-batch more than one of a dense micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from trainer.loader.batches import Batch
from trainer.loader.document_mask import position_ids
from trainer.model.llama import IGNORE_INDEX, next_token_loss


def sft_batch(input_ids: np.ndarray, loss_mask: np.ndarray, doc_starts: list[np.ndarray] | None = None) -> Batch:
    """Rows [rows, seq_len] and their loss mask as a trainer :class:`trainer.loader.batches.Batch`.

    ``doc_starts``: each row's conversation starts (document masking: the batch carries restarting positions);
    None for padded rows of one conversation each (padding only follows the conversation, so causal attention
    already keeps it out).
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    labels = np.where(np.asarray(loss_mask) != 0, ids, IGNORE_INDEX)
    positions = None if doc_starts is None else torch.from_numpy(position_ids(doc_starts, ids.shape[1]))
    return Batch(torch.from_numpy(ids), torch.from_numpy(labels), positions)


def num_loss_tokens(batches: Sequence[Batch]) -> int:
    """Trained tokens of a step's micro-batches, counted as the loss counts them (a row's first label is never a
    target); the divisor of :func:`sft_loss` for every micro-batch of that step."""
    return sum(int((batch.labels[:, 1:] != IGNORE_INDEX).sum()) for batch in batches)


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, step_loss_tokens: int | None = None) -> torch.Tensor:
    """Summed next-token loss over this micro-batch's trained tokens, divided by ``step_loss_tokens`` (the step's
    :func:`num_loss_tokens`): summing it over the step's micro-batches gives the step's per-token mean. None:
    this micro-batch's own count (the mean of one batch). A batch without trained tokens gives 0, not NaN."""
    if step_loss_tokens is None:
        step_loss_tokens = int((labels[:, 1:] != IGNORE_INDEX).sum())
    return next_token_loss(logits, labels, reduction="sum") / max(step_loss_tokens, 1)
