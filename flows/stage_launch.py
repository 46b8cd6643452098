"""How the flows show the work of stages that launch a child process or log a result (the stages' hooks).

The stages in trainer/ are Prefect-free: they run a launched trainer or evaluator through their ``launcher``
and log through their ``log``. In a flow these put the child's lines and the results on the task run's log
(console and Prefect UI) and feed the bars: training's from the metrics files (with the ``training-progress``
artifact), an evaluator's from its progress lines (:mod:`core.progress_lines`).
"""

from __future__ import annotations

from collections.abc import Sequence

from core.stage import Progress, Stage
from flows.progress.bars import stage_logger, stage_meter
from flows.progress.training import training_progress
from flows.runtime.subprocess_log import run_streaming
from trainer.eval.stages import EvalStage
from trainer.parallel.launch import launched_env, launched_fds
from trainer.train_stage import TrainStage


def launch_training(argv: Sequence[str], stage: TrainStage, on_progress: Progress) -> None:
    """The training stage's launcher: the bar (the stage's own row, with the loss and tokens/s notes and the
    resumed step) and the artifact follow the metrics files, so ``on_progress`` is not needed."""
    with stage_meter(stage.bar(None), stage.progress_unit) as meter, \
            training_progress(stage.paths.metrics, meter, stage.until_step):
        run_streaming(argv, stage_logger(), deadline_s=stage.deadline_s, env=launched_env(),
                      pass_fds=launched_fds(stage.paths))


def launch_evaluator(argv: Sequence[str], stage: Stage, on_progress: Progress) -> None:
    """An evaluation stage's launcher: its progress lines (rows scored) feed the unit's bar."""
    run_streaming(argv, stage_logger(), deadline_s=None, env=launched_env(), pass_fds=launched_fds(stage.paths),
                  on_progress=lambda line: on_progress(line.done, line.total))


def log_on_task_run(message: str) -> None:
    """A result line on the running task run's page (a plain logger outside a run)."""
    stage_logger().info("%s", message)


def in_flow(stages: Sequence[Stage]) -> list[Stage]:
    """``stages`` with their hooks set to the flow's (the others keep theirs); a launched trainer or evaluator
    reads the configuration the flow wrote before launching (:func:`flows.recipe.write_launch_config`)."""
    for stage in stages:
        if isinstance(stage, TrainStage):
            stage.launcher, stage.resolved_config = launch_training, True
        elif isinstance(stage, EvalStage):
            stage.launcher, stage.log, stage.resolved_config = launch_evaluator, log_on_task_run, True
    return list(stages)
