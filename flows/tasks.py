"""The hand-written Prefect tasks left: training, evaluation and the report as those flows call it. The data
stages run through the one generic task (:mod:`flows.stage_task`); these go the same way as they become stages.

Each takes the run dir as the :class:`core.rundir.RunPaths` the flow resolved once (a frozen dataclass of one
path: Prefect hashes and Dask pickles it like the string it replaces).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from core.eval_results import describe
from core.rundir import RunPaths
from flows.progress import reports_progress, shows_bar, stage_meter
from flows.report import write_report
from flows.settings import retry_unless_user_error
from flows.stage_times import times_stage
from flows.subprocess_log import run_streaming
from flows.training_progress import training_progress
from trainer.config import EvalConfig
from trainer.launch import eval_launch_command, launch_command, launched_env, launched_fds


@task(name="train", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_unless_user_error)
@times_stage("train")
def train_task(paths: RunPaths, num_processes: int, until_step: int, deadline_s: float | None,
               trust_remote_code: bool = False) -> None:
    """Run ``accelerate launch … -m trainer.train``; a retry resumes from the newest checkpoint.

    The bar and the ``training-progress`` artifact follow the metrics files; the child's lines go to the log.
    ``trust_remote_code``: the command's decision (:mod:`core.code_trust`), handed to the trainer as a flag.
    """
    argv = launch_command(paths.root, num_processes, until_step, trust_remote_code=trust_remote_code,
                          resolved=True)  # the flow wrote stages/launch.json before (flows.recipe.write_launch_config)
    with stage_meter("train", "steps") as meter, training_progress(paths.metrics, meter, until_step):
        run_streaming(argv, get_run_logger(), deadline_s=deadline_s, env=launched_env(),
                      pass_fds=launched_fds(paths))


@task(name="eval-checkpoint", task_run_name="eval-checkpoint-{step}")
@times_stage("evaluate")
def eval_checkpoint_task(paths: RunPaths, num_processes: int, step: int, score: bool, export: bool,
                         trust_remote_code: bool = False) -> None:
    """``accelerate launch … -m trainer.eval_checkpoint``: the whole val split of one checkpoint, and its export.

    On a terminal its bar counts the rows scored (the evaluator's progress lines); a log gets its result line.
    """
    argv = eval_launch_command(paths.root, num_processes, step, score=score, export=export,
                               trust_remote_code=trust_remote_code, resolved=True)  # stages/launch.json: as train
    bar = (f"evaluate step {step}", "rows") if score else (f"export step {step}", None)  # export only: a spinner
    with stage_meter(*bar) as meter:
        run_streaming(argv, get_run_logger(), deadline_s=None, env=launched_env(), pass_fds=launched_fds(paths),
                      on_progress=lambda line: meter.update(completed=line.done, total=line.total))


@task(name="downstream", task_run_name="downstream-{task_name}-step-{step}")
@times_stage("evaluate")
def downstream_task(paths: RunPaths, step: int, task_name: str, checkpoint_fp: str, task_fp: str,
                    include: list[str], config: EvalConfig, trusted: list[str] = ()) -> dict[str, Any]:
    """One lm-eval task on one checkpoint's export; its result is logged here, on this task run's page."""
    from trainer.eval_plan import run_downstream_task  # imports torch: only when evaluating

    with stage_meter(f"{task_name} step {step}", "requests") as meter:
        result = run_downstream_task(paths, step, task_name, checkpoint_fp, task_fp, [Path(p) for p in include],
                                     config, [Path(p) for p in trusted],
                                     on_progress=lambda done, total: meter.update(completed=done, total=total))
    get_run_logger().info("%s", describe(result))
    return result


@task(name="report")
@reports_progress("report", rates=False)
@shows_bar("report")
def report_task(paths: RunPaths) -> str:
    return str(write_report(paths))
