"""The plan of a full evaluation from its result files alone: what is missing.

The flow runs each (checkpoint, task) and export as a unit of :mod:`trainer.eval.stages`, skipped by its
marker. :func:`plan_evaluation` lists the (checkpoint, task) pairs without a current result from the result
files alone (each keyed by the checkpoint's fingerprint and the task's, :mod:`core.eval_results`), for a caller
without markers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from core.eval_results import VAL_SPLIT_TASK, checkpoint_fingerprint, is_current, read_result
from core.rundir import RunPaths
from trainer.eval.stages import refused_checkpoint


@dataclass
class CheckpointPlan:
    """One checkpoint's missing work."""

    step: int
    fingerprint: str
    score_val_split: bool
    tasks: list[str] = field(default_factory=list)
    """Downstream tasks without a current result."""


def plan_evaluation(paths: RunPaths, checkpoints: list[tuple[int, Path]], val_split_fp: str,
                    task_fps: dict[str, str], *, val_split: bool = True) -> list[CheckpointPlan]:
    """The checkpoints with missing results (the whole val split too when ``val_split``). A checkpoint failing
    its manifest check gets a failed result for every task (naming the folder and what is wrong) and no plan:
    it cannot be evaluated until restored."""
    plans = []
    for step, folder in checkpoints:
        if refused_checkpoint(paths, step, ({VAL_SPLIT_TASK: val_split_fp} if val_split else {}) | task_fps):
            continue
        checkpoint_fp = checkpoint_fingerprint(folder)
        stored = read_result(paths.eval_result(step, VAL_SPLIT_TASK))
        score = val_split and not is_current(stored, checkpoint_fp, val_split_fp)
        missing = [task for task, task_fp in sorted(task_fps.items())
                   if not is_current(read_result(paths.eval_result(step, task)), checkpoint_fp, task_fp)]
        if score or missing:
            plans.append(CheckpointPlan(step, checkpoint_fp, score, missing))
    return plans
