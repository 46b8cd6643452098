"""A DPO run's evaluation as a stage: each kept checkpoint's preference pairs scored, one unit per checkpoint.

The unit launches ``trainer.eval.checkpoint --pairs`` (:mod:`trainer.eval.preference`), which writes every pair's
summed log-probs under the checkpoint (``eval/results/step-N/preference_logps.parquet``, read by the
``preference_pairs`` view) and the val pairs' DPO loss and rewards (``eval/results/step-N/preference.json``, read by
``eval_results`` and the report). Its inputs are the checkpoint's identity (as :class:`ValSplitStage`'s), the shard
index (which holds every shard's sha256), the reference stage's files (the val result's loss and rewards are
relative to them) and the settings the numbers depend on (precision, ``train.dpo``'s beta, label smoothing, loss
and SimPO's gamma): a new checkpoint, new pairs, a recomputed reference or another beta re-scores it, and
``tokenmill status`` names which. Torch-free at import, as :mod:`trainer.eval.stages` is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from core.eval_results import PREFERENCE_TASK, RESULT_VERSION
from core.rundir import RunPaths, file_stats, fingerprint
from core.stage import Inputs, Progress
from trainer.checkpoint.layout import step_dir_name
from trainer.eval.stages import EvalStage, raise_if_failed, refused_checkpoint, step_of


class PreferenceEvalStage(EvalStage):
    """Every preference pair of both splits under one checkpoint, and the val pairs' DPO result (DPO runs only)."""

    name = "evaluate-pairs"
    reads = ("train", "reference")
    progress_unit = "rows"

    def units(self) -> Sequence[str | None]:
        wanted = self.scope.val_split and self.scope.dpo is not None
        return [step_dir_name(step) for step in self.scope.steps] if wanted else []

    def label(self, unit: str | None) -> str:
        return f"score pairs step {step_of(unit)}"

    def inputs(self, unit: str | None) -> Inputs:
        files = self.checkpoint_files(step_of(unit))
        files.update(_digests(self.paths))
        return Inputs(settings={"precision": self.scope.precision, **(self.scope.dpo or {})}, files=files)

    def outputs(self, unit: str | None) -> list[Path]:
        step = step_of(unit)
        return [self.paths.preference_scores(step), self.paths.eval_result(step, PREFERENCE_TASK)]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        step = step_of(unit)
        if refused_checkpoint(self.paths, step, {PREFERENCE_TASK: ""}):
            raise_if_failed(self.paths, step, PREFERENCE_TASK)
        self.launch(step, on_progress, score=False, export=False, pairs=True)
        return raise_if_failed(self.paths, step, PREFERENCE_TASK)


def _digests(paths: RunPaths) -> dict[str, str]:
    """``{file: digest}`` of the shard index and every reference file (none before the reference stage ran)."""
    return {name: digest for top in (paths.shard_index, paths.reference)
            for name, _, digest in file_stats(paths.root, top)}


def preference_task_fingerprint(paths: RunPaths, precision: str, settings: Mapping[str, Any] | None) -> str:
    """The ``preference`` result's task fingerprint: the pairs (shard index), the reference files, the precision and
    the ``train.dpo`` settings (:func:`trainer.eval.run_mode.dpo_settings`)."""
    return fingerprint("eval-preference-pairs", RESULT_VERSION, sorted(_digests(paths).items()), precision,
                       dict(settings or {}))
