"""The flows' stage lists: tuples of Stage classes in run order (Prefect-free: ``tokenmill status`` reads them).

A flow builds each with ``cls.build(run)`` (None: the recipe leaves it out) and hands them to
:func:`flows.stage_task.run_stages`, which draws Prefect's edges from what each stage reads.
"""

from __future__ import annotations

from core.stage import Stage
from trainer.eval_stages import DownstreamStage, ExportStage, ValSplitStage
from trainer.train_stage import TrainStage

TRAIN_STAGES: tuple[type[Stage], ...] = (TrainStage,)
EVAL_STAGES: tuple[type[Stage], ...] = (ValSplitStage, ExportStage, DownstreamStage)
