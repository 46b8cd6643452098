"""The data-to-model flow: the stages in order, one line each (see docs/architecture.md for the data path)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from core.errors import ShardFormatError
from core.eval_results import VAL_SPLIT_TASK, failed_results
from core.layout import RELATIVE
from core.rundir import RunPaths, file_stats, fingerprint
from core.shards import read_shard_index, verify_shards
from core.stage import StageResult
from flows.artifacts import publish_evaluation, publish_funnel, publish_training, publish_training_failure
from flows.evaluation_state import evaluation_is_cached, record_evaluation
from flows.recipe import ResolvedRun, as_resolved, record_run, write_launch_config
from flows.recipe_flow import recipe_flow
from flows.report_plots import import_in_background as import_plotting_in_background
from flows.run_code import eval_task_folders, refuse_untrusted_code, refuse_untrusted_model_code, trusted_folders
from flows.stage_list import PREPARE_STAGES, build_stages
from flows.stage_processes import stage_processes
from flows.stage_task import stage_results, submit_stages
from flows.tasks import downstream_task, eval_checkpoint_task, report_task, train_task
from pipeline.ingest import INGEST_PRELOAD, IngestStage, parts_to_ingest
from trainer.checkpoint_layout import MANIFEST_NAME, chosen_checkpoints, list_checkpoints
from trainer.downstream import check_tasks
from trainer.eval_tasks import prepare_eval_tasks, write_builtin_task
from trainer.next_line_task import TASK_NAME as NEXT_LINE_TASK


@recipe_flow(name="prepare-data", task_runner=ThreadPoolTaskRunner(max_workers=os.cpu_count() or 2))
def prepare_data(recipe: str | ResolvedRun, run_dir: str | None = None) -> dict[str, Any]:
    """Corpus files -> documents -> dedupe -> decontaminate -> tokenizer -> Arrow shards + index (skip-if-done).

    ``recipe``: a recipe path (a deployment; ``run_dir`` overrides its run dir) or the run its caller resolved.
    The stages are :data:`flows.stage_list.PREPARE_STAGES`, each unit one task run of the generic stage task.
    """
    run = as_resolved(recipe, run_dir)
    paths = run.paths
    import_plotting_in_background()  # for the report at the end
    with paths.lock():
        record_run(run)
        stages = build_stages(PREPARE_STAGES, run)
        ingest = stages[0]
        assert isinstance(ingest, IngestStage)
        parts = ingest.plan()  # docs/plan.json: the sources' new files planned into new parts
        # Ingest is mostly pure Python (it holds the GIL): its parts run in worker processes, one per core
        # and at most one per part still to do (a re-run with every part done starts none).
        workers = min(os.cpu_count() or 1, len(parts_to_ingest(parts, run.recipe.data.val_fraction, paths,
                                                                ingest.loaded)))
        with stage_processes(workers, preload=INGEST_PRELOAD):
            futures = submit_stages([ingest])
            wait([future for submitted in futures.values() for future in submitted])
            stage_results(futures)  # a failed part raises here, once every part has finished
        results = stage_results(submit_stages(stages[1:], futures))
    summary = _prepare_summary(paths, results)
    publish_funnel(paths.root, summary, summary["report"])
    return summary


def _prepare_summary(paths: RunPaths, results: dict[str, list[StageResult]]) -> dict[str, Any]:
    """The summary ``tokenmill prepare`` prints (and seals): each stage's own, as the stages returned them."""
    def one(name: str) -> dict[str, Any] | None:
        return results[name][0].as_summary() if name in results else None

    indexed = results["shard-index"][0].summary
    return {"run_dir": str(paths.root), "parts_ingested": sum(not result.skipped for result in results["ingest"]),
            "dedupe": one("dedupe"), "decontaminate": one("decontaminate"),
            "eval_tasks": one("eval-tasks"),
            "base_model": one("base-model"), "tokenizer": one("tokenizer"), "num_shards": indexed["num_shards"],
            "num_tokens": indexed["num_tokens"], "report": str(paths.root / results["report"][0].summary["index"])}


@recipe_flow(name="train-model")
def train_model(recipe: str | ResolvedRun, run_dir: str | None = None, refresh: bool = False) -> dict[str, Any]:
    """Shards -> ``accelerate launch -m trainer.train`` (checkpoints, eval, export), then the full evaluation.

    ``recipe``: a recipe path (a deployment; ``run_dir`` overrides its run dir) or the run its caller resolved.
    ``refresh=True`` (new data arrived) trains ``train.steps_per_refresh`` more steps from the newest
    checkpoint (past ``max_steps`` if need be, at the schedule's floor LR); otherwise to ``max_steps``.
    """
    run = as_resolved(recipe, run_dir)
    loaded, paths = run.recipe, run.paths
    import_plotting_in_background()  # for the report at the end
    with paths.lock():
        _refuse_corrupt_shards(paths)  # also fails with "run `tokenmill prepare` first" when there are no shards
        record_run(run)
        until_step = _until_step(paths, loaded.train.max_steps, loaded.train.steps_per_refresh, refresh)
        deadline_s = None if loaded.train.deadline_minutes is None else loaded.train.deadline_minutes * 60
        if paths.done_summary(TRAIN_STAGE, training_fingerprint(paths, until_step)) is not None:
            get_run_logger().info("train: at step %d already, nothing changed since: skipped (up to date)", until_step)
        else:
            refuse_untrusted_model_code(run)
            write_launch_config(run)  # what the launched trainer reads, in place of run.yaml
            try:
                train_task(paths, loaded.train.num_processes, until_step, deadline_s, run.trust.model_code)
            except Exception as failure:  # diverged, past its deadline, crashed: the report shows how far it got
                _report_failed_training(paths, failure)
                raise
            paths.mark_done(TRAIN_STAGE, training_fingerprint(paths, until_step), {"step": until_step})
        if not loaded.eval.enabled:
            report = report_task(paths)
    # The full evaluation first (it writes the report too): the summary's final val loss is the whole split's.
    evaluation = evaluate_model(run) if loaded.eval.enabled else None
    trained = publish_training(paths.root, evaluation["report"] if evaluation is not None else report)
    if evaluation is not None:
        trained["eval"] = evaluation
    return trained


@recipe_flow(name="data-to-model")
def data_to_model(recipe: str | ResolvedRun, run_dir: str | None = None,
                  dask_address: str | None = None) -> dict[str, Any]:
    """The whole path: prepare the data, then train and evaluate; a re-run skips what is done.

    ``recipe``: a recipe path (a deployment; ``run_dir`` overrides its run dir) or the run its caller resolved;
    read here once, the sub-flows get the resolved run. ``dask_address`` (or the recipe's ``dask_address``) runs
    the data tasks on that Dask cluster.
    """
    run = as_resolved(recipe, run_dir)
    before = _num_indexed_shards(run.paths)
    prepared = prepare_on(run, dask_address=dask_address)
    refresh = before > 0 and prepared["num_shards"] > before
    trained = train_model(run, refresh=refresh)  # evaluates too (the recipe's eval section)
    return {"prepare": prepared, "train": trained}


@recipe_flow(name="evaluate-model")
def evaluate_model(recipe: str | ResolvedRun, run_dir: str | None = None, checkpoint: str | None = None,
                   task: str | None = None) -> dict[str, Any]:
    """Checkpoints -> the whole val split (per source, bits per byte) and the downstream tasks, each result cached.

    ``checkpoint``: ``last``, ``all`` or a step (default the recipe's ``eval.checkpoints``); ``task``: only this
    task (``val_split`` or a downstream task name; default the whole split and every ``eval.tasks``). Every
    (checkpoint, task) result is keyed by both fingerprints: a re-run evaluates only what is missing.
    """
    run = as_resolved(recipe, run_dir)
    paths = run.paths
    logger = get_run_logger()
    with paths.lock():
        if evaluation_is_cached(run, checkpoint, task):
            logger.info("evaluate: every result is current and nothing changed since: skipped (up to date)")
            return publish_evaluation(paths.root, report_task(paths))
        _evaluate(run, checkpoint, task)
        if not failed_results(paths):  # a failed result is retried by the next run
            record_evaluation(run, checkpoint, task)
        report = report_task(paths)  # after the marker: the report reads stages/, and would be stale at once
    return publish_evaluation(paths.root, report)


def _evaluate(run: ResolvedRun, checkpoint: str | None, task: str | None) -> None:
    """Plan the missing or stale (checkpoint, task) results and compute them; a failure is recorded and logged."""
    from trainer.eval_checkpoint import val_split_task_fingerprint  # imports torch: only when evaluating
    from trainer.eval_plan import has_export, plan_evaluation  # imports torch

    config, paths = run.recipe.eval, run.paths
    logger = get_run_logger()
    refuse_untrusted_code(run, task)  # a flow called from Python gets the refusal the CLI gives
    task_fps, include = evaluation_tasks(run, task)
    val_fp = val_split_task_fingerprint(paths, run.recipe.train.precision, run.recipe.train.document_masking)
    plans = plan_evaluation(paths, chosen_checkpoints(paths, checkpoint or config.checkpoints), val_fp,
                            task_fps, val_split=task in (None, VAL_SPLIT_TASK))
    if any(plan.score_val_split or (plan.needs_export and not has_export(paths, plan.step)) for plan in plans):
        write_launch_config(run)  # what each launched evaluator reads, in place of run.yaml
    for plan in plans:
        export = plan.needs_export and not has_export(paths, plan.step)
        if plan.score_val_split or export:
            try:
                eval_checkpoint_task(paths, run.recipe.train.num_processes, plan.step, plan.score_val_split,
                                     export, run.trust.model_code)
            except Exception as err:  # recorded as a failed result when it was the checkpoint; go on
                logger.error("evaluating step %s failed: %s", plan.step, err)
                continue
        for name in plan.tasks:  # each task run logs its own result
            downstream_task(paths, plan.step, name, plan.fingerprint, task_fps[name],
                            [str(folder) for folder in include], config, trusted_folders(run))


def evaluation_tasks(run: ResolvedRun, task: str | None) -> tuple[dict[str, str], list[Path]]:
    """``({downstream task: fingerprint}, include folders)``: the recipe's ``eval.tasks`` through the eval-tasks
    stage (cached), or the one ``task`` asked for, checked on its own."""
    config, paths = run.recipe.eval, run.paths
    if task == VAL_SPLIT_TASK or (task is None and not config.tasks):
        return {}, []

    include, trusted = eval_task_folders(run), run.trust.task_folders
    if task is None:
        return prepare_eval_tasks(paths, config, run.base, include, trusted)["tasks"], include
    if task == NEXT_LINE_TASK and paths.eval_tasks not in include:
        write_builtin_task(paths, config)
        include = [*include, paths.eval_tasks]
    return check_tasks([task], include, trusted, data_root=paths.root), include


def prepare_on(recipe: str | ResolvedRun, run_dir: str | None = None,
               dask_address: str | None = None) -> dict[str, Any]:
    """Run ``prepare-data`` on local threads, or on a Dask scheduler (argument, else the recipe's)."""
    run = as_resolved(recipe, run_dir)
    address = dask_address or run.recipe.dask_address
    if address is None:
        return prepare_data(run)
    from prefect_dask import DaskTaskRunner  # dask.distributed (~1 s): only with a Dask address

    return prepare_data.with_options(task_runner=DaskTaskRunner(address=address))(run)


def _report_failed_training(paths: RunPaths, failure: Exception) -> None:
    """Write the report after a failed training run; never raises, so the flow fails with the training error."""
    try:
        publish_training_failure(paths.root, report_task(paths), failure)
    except Exception:
        get_run_logger().exception("Could not write the report of the failed training run in %s; the training "
                                   "error follows", paths.root)


def _refuse_corrupt_shards(paths: RunPaths) -> None:
    """Raise ShardFormatError naming the first shard that does not match the index (sha256, schema, ids < vocab).

    The trainer memory-maps shards without checking them, so a flipped byte would train silently. This reads
    every shard once per training launch, about what one epoch reads.
    """
    faults = verify_shards(paths.root)
    if faults:
        more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
        raise ShardFormatError(f"{paths.shards}: {faults[0]}{more}; training refuses corrupt shards: see "
                               f"`tokenmill shards verify {paths.root}`, then re-run `tokenmill prepare` in a fresh "
                               "run dir.")


TRAIN_STAGE = "train"
TRAINING_FILES = (RELATIVE.recipe, RELATIVE.shard_index, RELATIVE.tokenizer_dir, RELATIVE.base_model,
                  RELATIVE.checkpoints, RELATIVE.model)
"""What a launched trainer reads and writes, relative to the run dir (the shards are named by the index)."""


def training_fingerprint(paths: RunPaths, until_step: int) -> str:
    """The target step and the stats of every file in TRAINING_FILES: when it equals the one recorded after
    the last training, a launch would only restore the checkpoint to say "nothing to train" (~5 s), so the
    flow skips it. Any change (a new checkpoint or shard, a deleted export, an edited recipe) launches."""
    return fingerprint(TRAIN_STAGE, until_step, [file_stats(paths.root, paths.root / name) for name in TRAINING_FILES])


def _until_step(paths: RunPaths, max_steps: int, steps_per_refresh: int | None, refresh: bool) -> int:
    current = _latest_checkpoint_step(paths)
    if refresh and steps_per_refresh is not None and current is not None:
        return current + steps_per_refresh
    return max_steps


def _latest_checkpoint_step(paths: RunPaths) -> int | None:
    """Step of the newest complete checkpoint (``checkpoints/step-NNNNNNN`` with its manifest written last)."""
    steps = [step for step, folder in list_checkpoints(paths.checkpoints)
             if (folder / MANIFEST_NAME).is_file()]
    return max(steps, default=None)


def _num_indexed_shards(paths: RunPaths) -> int:
    return len(read_shard_index(paths.root)) if paths.shard_index.is_file() else 0
