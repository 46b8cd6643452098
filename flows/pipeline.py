"""The data-to-model flow: the stages in order, one line each (see docs/architecture.md for the data path)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.futures import wait
from prefect.task_runners import ThreadPoolTaskRunner

from core.errors import ShardFormatError
from core.eval_results import VAL_SPLIT_TASK
from core.rundir import RunPaths
from core.shards.store import read_shard_index, verify_shards
from core.stage import StageResult, stage_status
from flows.evaluation_state import evaluation_stages
from flows.recipe import ResolvedRun, as_resolved, check_chat_template, record_run, write_launch_config
from flows.recipe_flow import recipe_flow
from flows.report.artifacts import publish_evaluation, publish_funnel, publish_training, publish_training_failure
from flows.report.plots import import_in_background as import_plotting_in_background
from flows.report.stage import ReportStage
from flows.run_code import eval_task_folders, refuse_untrusted_code, refuse_untrusted_model_code
from flows.runtime.stage_processes import stage_processes
from flows.stage_launch import in_flow
from flows.stage_list import PREPARE_STAGES, build_stages
from flows.stage_task import Submitted, stage_results, stage_task, submit_stage, submit_stages
from pipeline.ingest.stage import INGEST_PRELOAD, IngestStage, parts_to_ingest
from trainer.eval.downstream import check_tasks
from trainer.eval.next_line_task import TASK_NAME as NEXT_LINE_TASK
from trainer.eval.stages import EvalStage
from trainer.eval.tasks import prepare_eval_tasks, write_builtin_task
from trainer.preference.reference_stage import ReferenceStage
from trainer.train_stage import TrainStage


@recipe_flow(name="prepare-data", task_runner=ThreadPoolTaskRunner(max_workers=os.cpu_count() or 2))
def prepare_data(recipe: str | ResolvedRun, run_dir: str | None = None) -> dict[str, Any]:
    """Corpus files -> documents -> dedupe -> decontaminate -> tokenizer -> Arrow shards + index (skip-if-done).

    ``recipe``: a recipe path (a deployment; ``run_dir`` overrides its run dir) or the run its caller resolved.
    The stages are :data:`flows.stage_list.PREPARE_STAGES`, each unit one task run of the generic stage task.
    """
    run = as_resolved(recipe, run_dir)
    paths = run.paths
    import_plotting_in_background()  # for the report at the end
    check_chat_template(run)  # one line before any work, as the CLI's own checks
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
    # a recipe with chat or preference sources: each (split, source)'s conversations or pairs
    chat = {name: {str(result.unit): result.as_summary() for result in results[name]}
            for name in ("sft_data", "preference_data") if name in results}
    return {"run_dir": str(paths.root), "parts_ingested": sum(not result.skipped for result in results["ingest"]),
            "dedupe": one("dedupe"), "decontaminate": one("decontaminate"),
            "eval_tasks": one("eval-tasks"),
            "base_model": one("base-model"), "tokenizer": one("tokenizer"), **chat,
            "num_shards": indexed["num_shards"], "num_tokens": indexed["num_tokens"],
            "report": str(paths.root / results["report"][0].summary["index"])}


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
        reference = run_reference_stage(run)  # a dpo run's reference log-probs, before the train stage is judged
        train = TrainStage.build(run, refresh=refresh)
        if stage_status(train).state == "done":
            get_run_logger().info("train: at step %d already, nothing changed since: skipped (up to date)",
                                  train.until_step)
        else:
            refuse_untrusted_model_code(run)
            write_launch_config(run)  # what the launched trainer reads, in place of run.yaml
        train_runs = submit_stage(*in_flow([train]), reference)
        try:
            for future in train_runs:
                future.result()
        except Exception as failure:  # diverged, past its deadline, crashed: the report shows how far it got
            _report_failed_training(paths, failure)
            raise
        if not loaded.eval.enabled:
            report = _report(paths, {train.name: train_runs})
    # The full evaluation first (it writes the report too): the summary's final val loss is the whole split's.
    # Its units run in this flow run, after the train task run (Prefect's graph draws the edge).
    evaluation = _evaluation(run, None, None, {train.name: train_runs}) if loaded.eval.enabled else None
    trained = publish_training(paths.root, evaluation["report"] if evaluation is not None else report)
    if evaluation is not None:
        trained["eval"] = evaluation
    return trained


def run_reference_stage(run: ResolvedRun) -> list[Submitted]:
    """Every unit of the reference stage (none unless the run is a dpo run on stored reference log-probs), finished:
    the first failure raises."""
    stage = ReferenceStage.build(run)
    if stage is None:
        return []
    submitted = submit_stage(stage)
    stage_results({stage.name: submitted})
    return submitted


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
    """Checkpoints -> the whole val split (per source, bits per byte) and the downstream tasks, each unit cached.

    ``checkpoint``: ``last``, ``all`` or a step (default the recipe's ``eval.checkpoints``); ``task``: only this
    task (``val_split`` or a downstream task name; default the whole split and every ``eval.tasks``). Every
    (checkpoint, task) and export is a unit of a stage (:mod:`trainer.eval.stages`): a re-run evaluates only the
    units whose inputs changed or whose result is missing or failed.
    """
    return _evaluation(as_resolved(recipe, run_dir), checkpoint, task)


def _evaluation(run: ResolvedRun, checkpoint: str | None, task: str | None,
                upstream: dict[str, list[Submitted]] | None = None) -> dict[str, Any]:
    """The evaluation's units in the running flow (after ``upstream``: ``{stage: its task runs}``), the report."""
    paths = run.paths
    with paths.lock():
        refuse_untrusted_code(run, task)  # a flow called from Python gets the refusal the CLI gives
        stages = evaluation_stages(run, checkpoint, task, *evaluation_tasks(run, task))
        if any(stage.launches and stage_status(stage, unit).state != "done" for stage in stages
               for unit in stage.units()):
            write_launch_config(run)  # what each launched evaluator reads, in place of run.yaml
        _evaluate(stages, upstream or {})
        report = _report(paths)
    return publish_evaluation(paths.root, report)


def _evaluate(stages: list[EvalStage], upstream: dict[str, list[Submitted]]) -> None:
    """Run every unit, one at a time (each launch may take every device), each skipped when done; a failed one
    is recorded in its result and logged, the others go on (a downstream task waits only for the exports)."""
    logger = get_run_logger()
    futures: dict[str, list[Submitted]] = dict(upstream)
    for stage in in_flow(stages):
        upstream = [future for name in stage.reads for future in futures.get(name, [])]
        named = stage_task.with_options(name=stage.name)
        futures[stage.name] = []
        for unit in stage.units():
            future = named.submit(stage, unit, wait_for=upstream)
            future.wait()
            futures[stage.name].append(future)
            if not future.state.is_completed():
                logger.error("%s failed: %s", stage.label(unit), future.state.message)


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


def _report(paths: RunPaths, upstream: Mapping[str, list[Submitted]] | None = None) -> str:
    """The report stage through the generic task, after the units in ``upstream`` (``{stage: its task runs}``,
    those that succeeded: Prefect would not start a task after a failed one); returns the page's path."""
    stage_results(submit_stages([ReportStage(paths)], upstream))
    return str(paths.report_page)


def _report_failed_training(paths: RunPaths, failure: Exception) -> None:
    """Write the report after a failed training run; never raises, so the flow fails with the training error."""
    try:
        publish_training_failure(paths.root, _report(paths), failure)
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


def _num_indexed_shards(paths: RunPaths) -> int:
    return len(read_shard_index(paths.root)) if paths.shard_index.is_file() else 0
