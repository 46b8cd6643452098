"""The stage lists: which stages each flow runs, in run order (Prefect-free: ``tokenmill status`` reads them too).

A flow builds each with ``cls.build(run)`` (None: the recipe leaves it out) and hands them to
:func:`flows.stage_task.run_stages`, which orders them by what each :attr:`~core.stage.Stage.reads` and draws
Prefect's edges from it. Adding a stage is one module (a :class:`core.stage.Stage` in the package that owns its
work) and one line here.
"""

from __future__ import annotations

from typing import Any

from core.stage import Stage
from flows.report.stage import ReportStage
from pipeline.dedupe.decontaminate import DecontaminateStage
from pipeline.dedupe.stage import DedupeStage
from pipeline.ingest.stage import IngestStage
from tokenization.chat.stage import SftDataStage
from tokenization.preference.stage import PreferenceDataStage
from tokenization.shard_index import ShardIndexStage
from tokenization.stage import PackStage
from tokenization.train_tokenizer import TokenizerStage
from trainer.eval.preference_stage import PreferenceEvalStage
from trainer.eval.stages import DownstreamStage, ExportStage, ValSplitStage
from trainer.eval.tasks import EvalTasksStage
from trainer.model.base_model import BaseModelStage
from trainer.preference.reference_stage import ReferenceStage
from trainer.train_stage import TrainStage

PREPARE_STAGES: tuple[type[Stage], ...] = (
    IngestStage,  # source files -> docs/, rejects/, attributes/ (one unit per planned part)
    DedupeStage,  # docs/ -> dedupe/duplicates.parquet
    EvalTasksStage,  # eval.tasks -> eval/tasks/, eval/texts/ (checked before anything is trained)
    DecontaminateStage,  # kept train documents vs val / eval files / eval tasks -> rejects/contaminated.parquet
    BaseModelStage,  # model.hf_config / model.from_pretrained -> base_model/
    TokenizerStage,  # train documents, a given file or the model's -> tokenizer/tokenizer.json
    PackStage,  # kept documents of text sources -> shards/split=*/source=*/ (one unit per (split, source))
    SftDataStage,  # kept conversations of chat sources -> chat shards there too, rejects/sft-*.parquet (same units)
    PreferenceDataStage,  # kept pairs of preference sources -> preference shards, rejects/preference-*.parquet
    ShardIndexStage,  # the pack, chat and preference states -> shards/index.parquet
    ReportStage,  # the run dir -> report/
)
"""``tokenmill prepare``'s stages, in run order."""

TRAIN_STAGES: tuple[type[Stage], ...] = (
    ReferenceStage,  # (split, preference source) -> reference/: the base model's log-probs of each pair (dpo)
    TrainStage,  # shards -> checkpoints/, model/
)
"""``tokenmill train``'s stages (the report follows them)."""

EVAL_STAGES: tuple[type[Stage], ...] = (
    ValSplitStage,  # (checkpoint) -> eval/results/step-N/val_split.json: the whole validation split
    PreferenceEvalStage,  # (checkpoint) -> eval/results/step-N/preference*: a DPO run's pairs scored (in its place)
    ExportStage,  # (checkpoint) -> eval/models/step-N/: the Hugging Face export a downstream task loads
    DownstreamStage,  # (checkpoint, task) -> eval/results/step-N/<task>.json: lm-eval
)
"""``tokenmill eval``'s stages (the recipe's ``eval.checkpoints`` and ``eval.tasks``)."""

ALL_STAGES: tuple[type[Stage], ...] = (*PREPARE_STAGES[:-1], *TRAIN_STAGES, *EVAL_STAGES, ReportStage)
"""Every stage of ``tokenmill run``, in run order: what ``tokenmill status`` reports on."""


def build_stages(stage_classes: tuple[type[Stage], ...], run: Any) -> list[Stage]:
    """Each stage built from the resolved run, less those the recipe leaves out."""
    return [stage for cls in stage_classes if (stage := cls.build(run)) is not None]
