"""Masked pairs -> one model batch (padded or packed rows) -> the summed log-probs of each pair's two sides.

Padded (``pad_pairs``): one sequence per row, the chosen sides first and then the rejected ones, right-padded to
the longest (TRL's ``DataCollatorForPreference`` layout; causal attention keeps the padding out of every real
token's logits). Packed (``pack_pairs``): sequences placed whole, in order, into rows of ``seq_len`` tokens, with
positions restarting at 0 where each begins: the packed-sequence convention the trainer's document masking and
transformers read, so each sequence's logits are those it has alone and no row carries padding it could avoid.
Either way ``sequence_ids`` says which sequence each token is: ``k`` for pair k's chosen side, ``num_pairs + k``
for its rejected side, -1 for padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokenization.chat.masks import MaskedConversation
from tokenization.preference.masks import MaskedPair
from trainer.preference.dpo_loss import PairLogps, sum_per_sequence, token_logps

NO_SEQUENCE = -1


@dataclass(frozen=True)
class PairBatch:
    """int64 [rows, seq_len] tensors of a batch of pairs; ``position_ids`` only for packed rows."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    sequence_ids: torch.Tensor
    num_pairs: int
    position_ids: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> PairBatch:
        """The same batch on ``device`` (every tensor: the sums per side index the model's outputs there)."""
        positions = None if self.position_ids is None else self.position_ids.to(device)
        return PairBatch(self.input_ids.to(device), self.loss_mask.to(device), self.sequence_ids.to(device),
                         self.num_pairs, positions)

    def model_kwargs(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        kwargs = {"input_ids": self.input_ids.to(device)}
        if self.position_ids is not None:
            kwargs["position_ids"] = self.position_ids.to(device)
        return kwargs


def pad_pairs(pairs: Sequence[MaskedPair], pad_id: int) -> PairBatch:
    """One row per side: rows 0..n-1 the chosen sides, rows n..2n-1 the rejected ones, right-padded."""
    sides = _sides(pairs)
    seq_len = max(len(side.input_ids) for side in sides)
    input_ids = torch.full((len(sides), seq_len), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros((len(sides), seq_len), dtype=torch.int64)
    sequence_ids = torch.full((len(sides), seq_len), NO_SEQUENCE, dtype=torch.int64)
    for row, side in enumerate(sides):
        length = len(side.input_ids)
        input_ids[row, :length] = torch.tensor(side.input_ids)
        loss_mask[row, :length] = torch.tensor(side.loss_mask)
        sequence_ids[row, :length] = row
    return PairBatch(input_ids, loss_mask, sequence_ids, len(pairs))


def pack_pairs(pairs: Sequence[MaskedPair], seq_len: int, pad_id: int) -> PairBatch:
    """Sides placed whole, in order, into rows of ``seq_len`` (a new row when the next side does not fit)."""
    sides = _sides(pairs)
    too_long = [len(side.input_ids) for side in sides if len(side.input_ids) > seq_len]
    if too_long:
        raise ValueError(f"a side of {too_long[0]} tokens cannot be packed into rows of {seq_len} tokens; "
                         "mask the pairs with max_tokens=seq_len")
    rows: list[list[int]] = [[]]
    filled = 0
    for index, side in enumerate(sides):
        if filled + len(side.input_ids) > seq_len:
            rows.append([])
            filled = 0
        rows[-1].append(index)
        filled += len(side.input_ids)
    shape = (len(rows), seq_len)
    input_ids = torch.full(shape, pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(shape, dtype=torch.int64)
    sequence_ids = torch.full(shape, NO_SEQUENCE, dtype=torch.int64)
    position_ids = torch.zeros(shape, dtype=torch.int64)
    for row, members in enumerate(rows):
        start = 0
        for index in members:
            end = start + len(sides[index].input_ids)
            input_ids[row, start:end] = torch.tensor(sides[index].input_ids)
            loss_mask[row, start:end] = torch.tensor(sides[index].loss_mask)
            sequence_ids[row, start:end] = index
            position_ids[row, start:end] = torch.arange(end - start)
            start = end
        position_ids[row, start:] = torch.arange(seq_len - start)  # padding: a last "document" of its own
    return PairBatch(input_ids, loss_mask, sequence_ids, len(pairs), position_ids)


def pair_logps(model: nn.Module, batch: PairBatch) -> PairLogps:
    """Summed log-probs of each pair's chosen and rejected completion under ``model`` (with gradients, unless the
    caller runs it under ``torch.no_grad()``)."""
    kwargs = batch.model_kwargs(batch.input_ids.device)
    if batch.position_ids is not None and getattr(getattr(model, "config", None), "use_cache", False):
        # transformers reads packed positions only without a key/value cache (masking_utils, 5.x): a model with
        # use_cache on would attend across the packed sequences without a word
        kwargs["use_cache"] = False
    output = model(**kwargs)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    per_token = token_logps(logits, batch.input_ids)
    summed = sum_per_sequence(per_token, batch.loss_mask, batch.sequence_ids, 2 * batch.num_pairs)
    return PairLogps(*summed.chunk(2))


def num_loss_tokens(batch: PairBatch) -> PairLogps:
    """Each side's number of loss tokens, float32 [pairs] per side (SimPO's length normalisation)."""
    ones = torch.ones_like(batch.loss_mask, dtype=torch.float32)
    return PairLogps(*sum_per_sequence(ones, batch.loss_mask, batch.sequence_ids, 2 * batch.num_pairs).chunk(2))


def _sides(pairs: Sequence[MaskedPair]) -> list[MaskedConversation]:
    return [pair.chosen for pair in pairs] + [pair.rejected for pair in pairs]
