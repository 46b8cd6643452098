"""The reference stage: a dpo run's indexed preference shards of one (split, source) -> the reference model's
summed log-probs of each pair, ``reference/split=<split>/source=<source>.parquet``.

The reference model is the run's base model (``base_model/``, the recipe's ``model.from_pretrained``: the model the
preference tuning continues from). Each pair's values are computed once, under the run's ``train.precision`` (on the
GPU when there is one), in eval mode without gradients
(:func:`trainer.preference.reference.compute_unit_reference`), through the same shard-row batching the training step
uses, and stored with :mod:`trainer.preference.reference_store` (Parquet, one row per pair, keyed by its doc id,
split and source). The fingerprint is the reference model's :func:`reference_model_sha256` and the unit's shards'
sha256s from the index: a re-run skips, a changed base model or changed shards recompute it, and ``tokenmill
status`` names which. Built only for ``train.mode: dpo`` with ``train.dpo.loss: sigmoid`` and ``precompute`` on; the
training step then never loads the reference model.

Prefect-free and torch-free at import (``tokenmill status`` builds every stage): the computing side is imported
inside :meth:`ReferenceStage.run`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.errors import ConfigError, TokenmillError
from core.layout import pack_unit, pack_unit_pair
from core.rundir import RunPaths
from core.shards.preference import is_preference_shard
from core.shards.store import ShardInfo, read_shard_index
from core.stage import Inputs, Progress, Stage
from trainer.config import ModelConfig
from trainer.preference.reference_store import reference_model_sha256

STATE_VERSION = 1
"""Bumped when the same reference model and shards give other stored values."""
REFERENCE_MODEL_KEY = "reference_model"
"""The input naming the reference model's weights (``tokenmill status``: ``file changed: reference_model``)."""


class ReferenceStage(Stage):
    """Reference log-probs of the preference pairs; a unit per (split, preference source) of the shard index."""

    name = "reference"
    reads = ("shard-index", "base-model")
    progress_unit = "pairs"

    def __init__(self, paths: RunPaths, model: ModelConfig, precision: str = "fp32") -> None:
        """``precision``: ``train.precision``; the reference forward runs under the same autocast as the policy's, so
        the stored values are those the training step would compute itself (``precompute: false``)."""
        super().__init__(paths)
        self.model, self.precision = model, precision

    @classmethod
    def build(cls, run: Any) -> ReferenceStage | None:
        """The stage of a dpo run whose loss reads stored reference log-probs; None otherwise."""
        train = run.recipe.train
        if train.mode != "dpo" or train.dpo is None or not train.dpo.stored_reference:
            return None
        return cls(run.paths, run.recipe.model.model_copy(update={"trust_remote_code": run.trust.model_code}),
                   train.precision)

    def units(self) -> list[str]:
        """One per (split, source) of the indexed preference shards (none before the index exists)."""
        return sorted({pack_unit(info.split, info.source) for info in self._preference_shards()})

    def label(self, unit: str | None) -> str:
        split, source = pack_unit_pair(str(unit))
        return f"reference {split}/{source}"

    def inputs(self, unit: str | None) -> Inputs:
        split, source = pack_unit_pair(str(unit))
        files = {REFERENCE_MODEL_KEY: self.reference_sha256() or "missing"}
        files.update({info.path: info.sha256 for info in self._preference_shards()
                      if (info.split, info.source) == (split, source)})
        return Inputs(settings={"precision": self.precision}, files=files, version=str(STATE_VERSION))

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.reference_logps(*pack_unit_pair(str(unit)))]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        from trainer.preference.reference import compute_unit_reference  # torch: here, not at import

        if self.model.from_pretrained is None:
            raise ConfigError("train.mode dpo with train.dpo.loss sigmoid needs model.from_pretrained: the reference "
                              "model is the run's base model (the SFT model it continues from); set "
                              "model.from_pretrained, or use train.dpo.loss: simpo (reference-free)")
        split, source = pack_unit_pair(str(unit))
        return compute_unit_reference(self.paths, self.model, split, source,
                                      reference_model_sha256(self.paths.base_model), on_progress, self.precision)

    def reference_sha256(self) -> str | None:
        """The base model's :func:`reference_model_sha256` (cached per file version); None while it has no weights
        (``tokenmill prepare`` has not copied it yet)."""
        try:
            return reference_model_sha256(self.paths.base_model)
        except TokenmillError:
            return None

    def _preference_shards(self) -> list[ShardInfo]:
        if not self.paths.shard_index.is_file():
            return []
        try:
            infos = read_shard_index(self.paths.root)
        except TokenmillError:
            return []  # the train stage names what is wrong with the index
        return [info for info in infos if (self.paths.root / info.path).is_file()
                and is_preference_shard(self.paths.root / info.path)]
