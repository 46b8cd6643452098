"""The training step's preference loss: a micro-batch of pairs -> policy log-probs, reference log-probs, the loss.

The reference values come from one of two places, as ``train.dpo`` says: the files the reference stage stored
(:class:`StoredReference`, looked up by each pair's key: the reference model is never loaded), or the reference
model run under ``torch.no_grad()`` in eval mode on the same batch (:class:`ModelReference`): a second copy of the
base model, or under LoRA the policy itself with its adapters disabled (peft's ``disable_adapter()``: no second
copy). SimPO has no reference. The rewards of every pair are summed into five numbers per step
(:func:`reward_sums`), so the metrics over all ranks are one all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from core.errors import ConfigError
from core.rundir import RunPaths
from tokenization.special_tokens import read_special_tokens
from trainer.config import DpoConfig
from trainer.loader.batches import SplitRows
from trainer.loader.pair_rows import PairMicroBatch
from trainer.model.spec import model_spec
from trainer.preference.dpo_loss import PairLogps, PreferenceLoss, dpo_loss, mean_logps, simpo_loss
from trainer.preference.pair_batch import num_loss_tokens, pair_logps
from trainer.preference.reference_store import StoredLogps, read_reference_logps, reference_model_sha256

REWARD_SUMS = ("chosen", "rejected", "correct", "margin", "pairs")
"""The summed quantities of :func:`reward_sums`, in order."""


class ReferenceLogps(Protocol):
    """Where a micro-batch's reference log-probs come from."""

    def logps(self, policy: nn.Module, micro: PairMicroBatch) -> PairLogps:
        """The reference model's summed log-probs of each pair of ``micro`` (float32 [pairs] per side)."""
        ...


class StoredReference:
    """Reference log-probs read from the reference stage's files, by pair key (``train.dpo.precompute``)."""

    def __init__(self, paths: RunPaths, units: list[tuple[str, str]]) -> None:
        """``units``: the (split, source) pairs whose files are read. ConfigError naming a missing file;
        ShardFormatError (:func:`read_reference_logps`) for a file of another reference model or format."""
        sha256 = reference_model_sha256(paths.base_model)
        self.values: StoredLogps | None = None
        for split, source in units:
            path = paths.reference_logps(split, source)
            if not path.is_file():
                raise ConfigError(f"{path}: missing; the reference log-probs are computed by the reference stage "
                                  "before training (`tokenmill train` runs it), or set train.dpo.precompute: false")
            stored = StoredLogps(read_reference_logps(path, sha256))
            if self.values is None:
                self.values = stored
            else:
                self.values.update(stored)

    def logps(self, policy: nn.Module, micro: PairMicroBatch) -> PairLogps:
        assert self.values is not None, "no reference files read"
        chosen, rejected = self.values.lookup(micro.keys)
        device = micro.batch.input_ids.device
        return PairLogps(torch.from_numpy(chosen.copy()).to(device), torch.from_numpy(rejected.copy()).to(device))


class ModelReference:
    """Reference log-probs computed on the fly (``train.dpo.precompute: false``), in eval mode without gradients.

    ``model``: the reference model (a frozen copy of the base model); None: the policy with its LoRA adapters
    disabled. ``unwrap``: the policy's module under its DDP wrapper (the reference forward must not take part in
    gradient synchronisation).
    """

    def __init__(self, model: nn.Module | None, unwrap: Callable[[nn.Module], nn.Module],
                 autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        self.model, self.unwrap, self.autocast = model, unwrap, autocast
        if model is not None:
            model.eval().requires_grad_(False)

    def logps(self, policy: nn.Module, micro: PairMicroBatch) -> PairLogps:
        with torch.no_grad(), self.autocast(), self._reference(policy) as model:
            return pair_logps(model, micro.batch)

    @contextlib.contextmanager
    def _reference(self, policy: nn.Module) -> Iterator[nn.Module]:
        if self.model is not None:
            yield self.model
            return
        module = self.unwrap(policy)
        was_training = module.training
        module.eval()
        try:
            with module.disable_adapter():
                yield module
        finally:
            module.train(was_training)


@dataclass
class PreferenceObjective:
    """``train.dpo``'s loss of a micro-batch of pairs; ``reference`` None for SimPO."""

    dpo: DpoConfig
    reference: ReferenceLogps | None

    def loss(self, model: nn.Module, micro: PairMicroBatch, step_pairs: int | None = None) -> PreferenceLoss:
        """The micro-batch's loss (its per-pair losses over ``step_pairs``; None: their mean) with its rewards."""
        policy = pair_logps(model, micro.batch)
        dpo = self.dpo
        if not dpo.uses_reference:
            mean = mean_logps(policy, num_loss_tokens(micro.batch))
            return simpo_loss(mean, dpo.beta, dpo.gamma, dpo.label_smoothing, step_pairs)
        assert self.reference is not None, "sigmoid DPO needs a reference"
        return dpo_loss(policy, self.reference.logps(model, micro), dpo.beta, dpo.label_smoothing, step_pairs)


def reward_sums(result: PreferenceLoss) -> torch.Tensor:
    """float64 [5] (:data:`REWARD_SUMS`): summed chosen and rejected rewards, pairs ranked right, summed margins, and
    pairs; summed over micro-batches and ranks, :func:`reward_metrics` turns them into the means."""
    chosen, rejected = result.chosen_rewards.double(), result.rejected_rewards.double()
    margins = chosen - rejected
    return torch.stack([chosen.sum(), rejected.sum(), (margins > 0).double().sum(), margins.sum(),
                        torch.tensor(float(margins.numel()), dtype=torch.float64, device=margins.device)])


def reward_metrics(sums: torch.Tensor | list[float]) -> dict[str, float]:
    """``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracy``, ``rewards/margin`` from :func:`reward_sums`
    (as :meth:`PreferenceLoss.metrics` gives them for one batch)."""
    chosen, rejected, correct, margin, pairs = (float(value) for value in sums)
    pairs = max(pairs, 1.0)
    return {"rewards/chosen": chosen / pairs, "rewards/rejected": rejected / pairs,
            "rewards/accuracy": correct / pairs, "rewards/margin": margin / pairs}


def reference_units(splits: tuple[SplitRows, ...]) -> list[tuple[str, str]]:
    """The (split, source) pairs of the opened splits' shards (each one reference file)."""
    return sorted({(rows.split, source) for rows in splits for source in rows.shard_sources})


def build_objective(paths: RunPaths, config: Any, splits: tuple[SplitRows, SplitRows], accelerator: Any,
                    autocast: Callable[[], contextlib.AbstractContextManager[Any]]) -> PreferenceObjective | None:
    """A dpo run's loss with its reference (``config``: the trainer's sections): the stored log-probs (precompute),
    the policy with adapters off (LoRA), or a frozen copy of the base model on the accelerator's device; None unless
    ``train.mode`` is dpo."""
    train = config.train
    if train.mode != "dpo" or train.dpo is None:
        return None
    dpo = train.dpo
    if not dpo.uses_reference:
        return PreferenceObjective(dpo, None)
    if dpo.stored_reference:
        return PreferenceObjective(dpo, StoredReference(paths, reference_units(splits)))
    if train.lora is not None:
        return PreferenceObjective(dpo, ModelReference(None, accelerator.unwrap_model, autocast))
    special = read_special_tokens(paths)
    spec = model_spec(config.model, paths, splits[0].vocab_size, splits[0].seq_len, special.eos_id, special.pad_id)
    reference = spec.build(train.seed).to(accelerator.device)
    return PreferenceObjective(dpo, ModelReference(reference, accelerator.unwrap_model, autocast))

