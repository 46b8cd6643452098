"""Full evaluation, the pieces the stages run: a downstream task's result, and the plan of what is missing.

The flow runs each (checkpoint, task) and export as a unit of :mod:`trainer.eval_stages`, skipped by its
marker. :func:`plan_evaluation` lists the (checkpoint, task) pairs without a current result from the result
files alone (each keyed by the checkpoint's fingerprint and the task's, :mod:`core.eval_results`), for a caller
without markers. A downstream task runs here on the checkpoint's Hugging Face export (``model/`` when it holds
that step, else ``eval/models/step-N/``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import TokenmillError
from core.eval_results import VAL_SPLIT_TASK, checkpoint_fingerprint, is_current, read_result, write_result
from core.rundir import RunPaths
from trainer.config import EvalConfig
from trainer.downstream import run_task
from trainer.eval_stages import model_folder, refused_checkpoint


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


def run_downstream_task(paths: RunPaths, step: int, task: str, checkpoint_fp: str, task_fp: str,
                        include: list[Path], config: EvalConfig, trusted: Collection[Path] = (),
                        on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Evaluate ``task`` on the export of ``step`` with lm-eval and record the result (or the failure, in one
    line saying what to fix: a task error never loses the results already computed). ``trusted``: the include
    folders whose code may run (:func:`trainer.downstream.run_task`); ``on_progress(requests scored, requests)``
    while lm-eval runs."""
    try:
        results = run_task(model_folder(paths, step), task, include, trusted=trusted, batch_size=config.batch_size,
                           limit=config.limit, data_root=paths.root, on_progress=on_progress)
    except TokenmillError as err:
        return write_result(paths, step, task, checkpoint_fp, task_fp, error=str(err))
    except Exception as err:  # lm-eval or the task's own code failed: record it, keep going with the others
        reason = " ".join(str(err).split())[:300]
        return write_result(paths, step, task, checkpoint_fp, task_fp,
                            error=f"task {task} failed on step {step} ({type(err).__name__}: {reason}); fix the "
                                  "task (see the log) and re-run `tokenmill eval`.")
    rows = [{"task": result.task, "metric": result.metric, "value": result.value, "stderr": result.stderr,
             "num_samples": result.num_samples, "source": None} for result in results]
    return write_result(paths, step, task, checkpoint_fp, task_fp, rows=rows)
