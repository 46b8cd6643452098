"""Whether ``tokenmill eval`` has anything to do, decided without Prefect, torch or lm-eval.

When an evaluation ends without a failed result, a marker records what it read and wrote (by file stats) and
which checkpoints and tasks it covered. A later evaluation asking for no more than that, on unchanged files, has
every result cached: ``tokenmill eval`` answers from the results before starting a Prefect server (~10 s of a
cached call went there), and the flow checks the same marker (a deployment or a Python caller has no command in
front of it). The checkpoints are compared as steps, not as the words naming them: ``--checkpoint last`` after a
run that evaluated ``eval.checkpoints: last`` is the same step.
"""

from __future__ import annotations

from typing import Any

from core.eval_results import failed_results
from core.layout import RELATIVE
from core.rundir import file_stats, fingerprint
from flows.recipe import ResolvedRun
from flows.run_code import eval_task_folders
from trainer.checkpoint_layout import chosen_checkpoints

EVAL_STAGE = "evaluate"
EVAL_FILES = (RELATIVE.recipe, RELATIVE.shard_index, RELATIVE.tokenizer_dir, RELATIVE.checkpoints, RELATIVE.model,
              RELATIVE.eval)


def evaluation_fingerprint(run: ResolvedRun) -> str:
    """What the evaluation reads and writes (its settings, the checkpoints, the results, the task folders, by
    file stats): equal to the one recorded after the last evaluation without failures, none of it changed."""
    paths = run.paths
    include = [folder for folder in eval_task_folders(run)
               if not folder.is_relative_to(paths.root)]  # eval/tasks is among EVAL_FILES already
    stats = [file_stats(paths.root, paths.root / name) for name in EVAL_FILES]
    stats += [file_stats(folder, folder) for folder in include]
    return fingerprint(EVAL_STAGE, run.recipe.eval.model_dump(mode="json"), run.recipe.train.precision,
                       [str(folder) for folder in include], stats)


def _asked_steps(run: ResolvedRun, checkpoint: str | None) -> list[int]:
    """The steps ``checkpoint`` (``last``, ``all``, a step; default the recipe's ``eval.checkpoints``) names."""
    return [step for step, _ in chosen_checkpoints(run.paths, checkpoint or run.recipe.eval.checkpoints)]


def evaluation_is_cached(run: ResolvedRun, checkpoint: str | None, task: str | None) -> bool:
    """True when the last evaluation without failures covered these steps and ``task`` (None: every task) and
    nothing it reads or writes changed since. Call it holding the run dir's lock."""
    done = run.paths.done_summary(EVAL_STAGE, evaluation_fingerprint(run))
    steps = done.get("steps") if isinstance(done, dict) else None
    if not isinstance(steps, list) or not all(isinstance(step, int) for step in steps):
        return False  # a marker not as written here (damaged, hand-edited): evaluate, which rewrites it
    return set(_asked_steps(run, checkpoint)) <= set(steps) and done.get("task") in (None, task)


def record_evaluation(run: ResolvedRun, checkpoint: str | None, task: str | None) -> None:
    """Mark the evaluation of these steps and ``task`` done on the run dir as it is now."""
    run.paths.mark_done(EVAL_STAGE, evaluation_fingerprint(run),
                        {"steps": _asked_steps(run, checkpoint), "task": task})


def cached_evaluation(run: ResolvedRun, checkpoint: str | None, task: str | None) -> dict[str, Any] | None:
    """The evaluate flow's summary (results, failures, report) when every result is cached; else None.

    Call it holding the run dir's lock. The report is brought up to date as ``tokenmill report`` does (nothing
    to do when it is current); no Prefect artifact is written, since nothing changed since the flow wrote them.
    """
    if not evaluation_is_cached(run, checkpoint, task):
        return None
    from flows.report import write_report
    from pipeline.query import eval_results_table

    report = str(write_report(run.paths))
    return {"results": eval_results_table(run.paths.root), "failed": failed_results(run.paths), "report": report}
