"""The evaluation's stages for one ``tokenmill eval``, and whether it has anything to do: Prefect-, torch- and
lm-eval-free.

Each (checkpoint, val split), export and (checkpoint, downstream task) is a unit of the stages in
:mod:`trainer.eval.stages`, skipped by its marker. ``tokenmill eval`` asks the same stages' status before
starting a Prefect server (~10 s of a cached call went there): when every unit asked for is done and the task
folders are as the eval-tasks stage last checked them, it answers from the results. The checkpoints are
compared as steps, not as the words naming them: ``--checkpoint last`` after a run that evaluated
``eval.checkpoints: last`` is the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.eval_results import VAL_SPLIT_TASK, failed_results
from core.stage import read_marker, stage_status
from flows.recipe import ResolvedRun
from flows.run_code import eval_task_folders
from trainer.checkpoint.layout import chosen_checkpoints
from trainer.eval.preference_stage import PreferenceEvalStage
from trainer.eval.run_mode import dpo_settings, is_sft
from trainer.eval.stages import DownstreamStage, EvalScope, EvalStage, ExportStage, ValSplitStage
from trainer.eval.tasks import EvalTasksStage


def evaluation_stages(run: ResolvedRun, checkpoint: str | None, task: str | None, task_fps: Mapping[str, str],
                      include: list[Path]) -> list[EvalStage]:
    """The stages of evaluating ``checkpoint`` (``last``, ``all``, a step; default the recipe's
    ``eval.checkpoints``) on ``task`` (None: the val split and every task of ``task_fps``)."""
    recipe, paths = run.recipe, run.paths
    steps = tuple(step for step, _ in chosen_checkpoints(paths, checkpoint or recipe.eval.checkpoints))
    scope = EvalScope(steps, task in (None, VAL_SPLIT_TASK), dict(task_fps), recipe.eval, recipe.train.precision,
                      recipe.train.document_masking, recipe.train.num_processes, run.trust.model_code,
                      tuple(include), tuple(sorted(run.trust.task_folders)), is_sft(recipe.train),
                      dpo_settings(recipe.train))
    return [ValSplitStage(paths, scope), PreferenceEvalStage(paths, scope), ExportStage(paths, scope),
            DownstreamStage(paths, scope)]


def unchanged_task_fingerprints(run: ResolvedRun, task: str | None) -> tuple[dict[str, str], list[Path]] | None:
    """``({downstream task: fingerprint}, include folders)`` when the eval-tasks stage is done (nothing it read
    changed since its check; none for the val split alone), else None: only the flow can check them again
    (lm-eval imports slowly)."""
    if task == VAL_SPLIT_TASK or (task is None and not run.recipe.eval.tasks):
        return {}, []
    stage = EvalTasksStage(run.paths, run.recipe.eval, eval_task_folders(run), run.trust.task_folders)
    recorded = read_marker(run.paths, stage.name)
    if recorded is None or stage_status(stage).state != "done":
        return None
    tasks = dict(recorded["summary"].get("tasks", {}))
    if task is not None and task not in tasks:
        return None
    return (tasks if task is None else {task: tasks[task]}), stage.include


def evaluation_is_cached(run: ResolvedRun, checkpoint: str | None, task: str | None) -> bool:
    """True when every unit of this evaluation is done (its marker matches, its result is there) and the task
    folders did not change since they were checked. Call it holding the run dir's lock."""
    tasks = unchanged_task_fingerprints(run, task)
    if tasks is None:
        return False
    stages = evaluation_stages(run, checkpoint, task, *tasks)
    return all(stage_status(stage, unit).state == "done" for stage in stages for unit in stage.units())


def cached_evaluation(run: ResolvedRun, checkpoint: str | None, task: str | None) -> dict[str, Any] | None:
    """The evaluate flow's summary (results, failures, report) when every result is cached; else None.

    Call it holding the run dir's lock. The report is brought up to date as ``tokenmill report`` does (nothing
    to do when it is current); no Prefect artifact is written, since nothing changed since the flow wrote them.
    """
    if not evaluation_is_cached(run, checkpoint, task):
        return None
    from flows.report.stage import write_report  # DuckDB, pandas (~1 s): only for a cached evaluation
    from pipeline.sql.query import eval_results_table  # DuckDB (~0.9 s): as above

    report = str(write_report(run.paths))
    return {"results": eval_results_table(run.paths.root), "failed": failed_results(run.paths), "report": report}
