"""Preference loss: logits and each side's loss mask -> summed log-probs per sequence -> the DPO (or SimPO) loss.

A side's log-prob is the sum, over its loss tokens (the completion's, :mod:`tokenization.preference.masks`), of
log p(token | the tokens before it): position t's logits score token t + 1, as in the SFT loss. Rows may hold one
sequence each (``sequence_ids=None``) or several packed ones (``sequence_ids`` says which sequence each token
belongs to; with document masking their logits are those they would have alone).

Sigmoid DPO (Rafailov et al. 2023), with ``label_smoothing`` ε as conservative DPO (cDPO, Mitchell 2023):
``Δ = (π_c − ref_c) − (π_r − ref_r)``, ``loss = −(1 − ε)·log σ(βΔ) − ε·log σ(−βΔ)``, averaged over pairs. At ε = 0
it is TRL 1.16's ``DPOTrainer`` ``loss_type="sigmoid"``; TRL 1.16 dropped ε from that loss type and keeps the cDPO
form only in ``"aot"``, which for one pair is the same expression. The rewards are ``β·(π − ref)`` of each side,
and the metrics are TRL's (``rewards/accuracies`` and ``rewards/margins`` there, named in the singular here).

SimPO (Meng et al. 2024), reference-free: the mean log-prob per loss token of each side replaces ``π − ref`` and a
target margin γ is subtracted, ``loss = −log σ(β(avg_c − avg_r) − γ)`` (TRL's ``CPOTrainer`` with
``loss_type="simpo"``, ``cpo_alpha=0``); its rewards are ``β·avg``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PairLogps:
    """One value per pair for each side, float32 [pairs]: summed (or mean) log-probs of the completions."""

    chosen: torch.Tensor
    rejected: torch.Tensor


@dataclass(frozen=True)
class PreferenceLoss:
    """The loss of a batch of pairs and the per-pair rewards its metrics come from (rewards carry no gradient)."""

    loss: torch.Tensor
    """Scalar: the per-pair losses summed and divided by the step's number of pairs (their mean for one batch)."""
    per_pair: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def metrics(self) -> dict[str, float]:
        """``rewards/chosen``, ``rewards/rejected`` (mean rewards), ``rewards/accuracy`` (share of pairs whose chosen
        reward is strictly higher) and ``rewards/margin`` (mean chosen − rejected reward)."""
        margins = self.chosen_rewards - self.rejected_rewards
        return {"rewards/chosen": self.chosen_rewards.mean().item(),
                "rewards/rejected": self.rejected_rewards.mean().item(),
                "rewards/accuracy": (margins > 0).float().mean().item(),
                "rewards/margin": margins.mean().item()}


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """float32 [rows, seq]: at position t, log p(input_ids[t] | tokens before t) from ``logits`` [rows, seq, vocab];
    0 at position 0 (no logits score a row's first token)."""
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    scored = torch.gather(shifted, -1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return F.pad(scored, (1, 0), value=0.0)


def sum_per_sequence(values: torch.Tensor, loss_mask: torch.Tensor, sequence_ids: torch.Tensor | None = None,
                     num_sequences: int | None = None) -> torch.Tensor:
    """float32 [sequences]: ``values`` [rows, seq] summed over each sequence's loss tokens (``loss_mask`` 1).

    ``sequence_ids`` [rows, seq] int64: which sequence (0 .. num_sequences − 1) each token of a packed row belongs
    to; None: row i is sequence i. Tokens outside the mask (prompt, padding) add nothing whatever their id.
    """
    mask = loss_mask.bool()
    if sequence_ids is None:
        return torch.where(mask, values, 0.0).sum(dim=1)
    sums = values.new_zeros(num_sequences if num_sequences is not None else int(sequence_ids.max()) + 1)
    return sums.index_add(0, sequence_ids[mask], values[mask])


def dpo_loss(policy: PairLogps, reference: PairLogps, beta: float, label_smoothing: float = 0.0,
             step_pairs: int | None = None) -> PreferenceLoss:
    """Sigmoid DPO on summed log-probs; ``step_pairs``: the pairs of the whole optimizer step (the loss of each
    micro-batch is then its share of the step's mean), None for this batch's own."""
    chosen_logratios = policy.chosen - reference.chosen
    rejected_logratios = policy.rejected - reference.rejected
    per_pair = _smoothed_sigmoid_loss(beta * (chosen_logratios - rejected_logratios), label_smoothing)
    return _preference_loss(per_pair, beta * chosen_logratios, beta * rejected_logratios, step_pairs)


def simpo_loss(policy_mean: PairLogps, beta: float, gamma: float, label_smoothing: float = 0.0,
               step_pairs: int | None = None) -> PreferenceLoss:
    """SimPO on mean log-probs per loss token (:func:`mean_logps`); no reference model."""
    per_pair = _smoothed_sigmoid_loss(beta * (policy_mean.chosen - policy_mean.rejected) - gamma, label_smoothing)
    return _preference_loss(per_pair, beta * policy_mean.chosen, beta * policy_mean.rejected, step_pairs)


def mean_logps(summed: PairLogps, num_loss_tokens: PairLogps) -> PairLogps:
    """Summed log-probs divided by each side's number of loss tokens (SimPO's length normalisation)."""
    return PairLogps(summed.chosen / num_loss_tokens.chosen.clamp(min=1),
                     summed.rejected / num_loss_tokens.rejected.clamp(min=1))


def _smoothed_sigmoid_loss(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """−(1 − ε)·log σ(x) − ε·log σ(−x): the preference is trusted with probability 1 − ε."""
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def _preference_loss(per_pair: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                     step_pairs: int | None) -> PreferenceLoss:
    divisor = max(step_pairs if step_pairs is not None else per_pair.numel(), 1)
    return PreferenceLoss(per_pair.sum() / divisor, per_pair, chosen_rewards.detach(), rejected_rewards.detach())
