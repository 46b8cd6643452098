"""The full evaluation as stages: each (checkpoint, val split), (checkpoint, downstream task) and export is a unit.

A unit's inputs are the checkpoint's identity (its ``manifest.json``, which lists the sha256 of every other
file), the settings and data the scores depend on, and, for a downstream task, the task's fingerprint (from the
eval-tasks stage); its output is the result file ``eval/results/step-NNNNNNN/<task>.json`` that the report and
the ``eval_results`` view read (or the export's folder). :func:`core.stage.run_stage` skips a unit whose marker
holds these inputs and whose output is there. A unit whose result is a failure raises :class:`EvaluationFailed`
after writing it: it gets no marker, so the next run tries it again, and the flow goes on with the others.

Prefect-free and torch-free at import (``tokenmill status`` and ``tokenmill eval``'s cached check build them):
how a launched evaluator's lines are shown, and where a downstream result is logged, are the flow's
(:attr:`EvalStage.launcher`, :attr:`EvalStage.log`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import TokenmillError
from core.eval_results import VAL_SPLIT_TASK, checkpoint_fingerprint, describe, read_result, write_result
from core.files.atomic import read_json
from core.layout import checkpoint_step
from core.rundir import RunPaths, file_stats
from core.stage import Inputs, Progress, Stage
from trainer.checkpoint.layout import (
    MANIFEST_NAME,
    chosen_checkpoints,
    export_state_file,
    exported_step,
    manifest_file,
    step_dir_name,
)
from trainer.config import EvalConfig
from trainer.eval.downstream import run_downstream_task
from trainer.eval.run_mode import dpo_settings, is_sft
from trainer.parallel.launch import eval_launch_command
from trainer.train_stage import Launcher, run_child


class EvaluationFailed(TokenmillError):
    """A unit's result is a recorded failure (its one line says what to fix); the unit is tried again next run."""


@dataclass(frozen=True)
class EvalScope:
    """What one evaluation covers and how: the checkpoints, the val split or not, the downstream tasks."""

    steps: tuple[int, ...]
    val_split: bool
    tasks: Mapping[str, str]
    """Downstream task name -> its fingerprint (:func:`trainer.eval.downstream.checked_tasks`)."""
    config: EvalConfig
    precision: str
    document_masking: bool
    num_processes: int = 1
    trust_remote_code: bool = False
    include: tuple[Path, ...] = ()
    trusted: tuple[Path, ...] = field(default_factory=tuple)
    sft: bool = False
    """A supervised fine-tuning run (``train.mode: sft``): the val split's loss is over the trained tokens only, and
    the downstream tasks' prompts go through the export's chat template (:mod:`trainer.eval.run_mode`)."""
    dpo: Mapping[str, Any] | None = None
    """A DPO run's ``train.dpo`` settings (:func:`trainer.eval.run_mode.dpo_settings`), None for other modes: its
    val split is scored as pairs (:mod:`trainer.eval.preference_stage`), not as token losses."""

    @classmethod
    def recorded(cls, run: Any) -> EvalScope:
        """The recipe's evaluation (``eval.checkpoints``, every ``eval.tasks``) with the task fingerprints the
        eval-tasks stage recorded: what ``tokenmill status`` compares with (no lm-eval import)."""
        recipe = run.recipe
        try:
            steps = tuple(step for step, _ in chosen_checkpoints(run.paths, recipe.eval.checkpoints))
        except TokenmillError:  # no checkpoint yet: nothing to evaluate
            steps = ()
        tasks = recorded_task_fingerprints(run.paths)
        return cls(steps, True, {name: tasks.get(name, "unchecked") for name in recipe.eval.tasks}, recipe.eval,
                   recipe.train.precision, recipe.train.document_masking, recipe.train.num_processes,
                   sft=is_sft(recipe.train), dpo=dpo_settings(recipe.train))


def recorded_task_fingerprints(paths: RunPaths) -> dict[str, str]:
    """``{task: fingerprint}`` as the eval-tasks stage's marker records them (empty before it ran)."""
    marker = paths.marker("eval-tasks")
    try:
        summary = read_json(marker).get("summary") if marker.is_file() else None
    except (OSError, ValueError, AttributeError):
        summary = None
    tasks = summary.get("tasks") if isinstance(summary, dict) else None
    return {str(name): str(fp) for name, fp in tasks.items()} if isinstance(tasks, dict) else {}


class EvalStage(Stage):
    """What the three evaluation stages share: a scope, units named by checkpoint, the launcher and the log."""

    reads: tuple[str, ...] = ("train",)
    launches = True
    """Whether a unit launches ``trainer.eval.checkpoint`` (which reads ``stages/launch.json``)."""

    def __init__(self, paths: RunPaths, scope: EvalScope) -> None:
        super().__init__(paths)
        self.scope = scope
        self.launcher: Launcher = run_child
        self.log: Callable[[str], None] = logging.getLogger("tokenmill.eval").info
        self.resolved_config = False
        """Whether the launched evaluator reads ``stages/launch.json`` (a flow writes it before launching)."""

    @classmethod
    def build(cls, run: Any) -> EvalStage | None:
        return cls(run.paths, EvalScope.recorded(run)) if run.recipe.eval.enabled else None

    def checkpoint_files(self, step: int) -> dict[str, str]:
        """The checkpoint's identity: its manifest's digest (a copied run dir has the same one)."""
        manifest = manifest_file(self.paths.checkpoint(step))
        return {name: digest for name, _, digest in file_stats(self.paths.root, manifest)} or {str(step): "none"}

    def launch(self, step: int, on_progress: Progress, *, score: bool, export: bool, pairs: bool = False) -> None:
        argv = eval_launch_command(self.paths.root, self.scope.num_processes, step, score=score, export=export,
                                   trust_remote_code=self.scope.trust_remote_code, resolved=self.resolved_config,
                                   pairs=pairs)
        self.launcher(argv, self, on_progress)


def step_of(unit: str | None) -> int:
    """The checkpoint step of a unit (``step-NNNNNNN`` or ``step-NNNNNNN/<task>``)."""
    step = checkpoint_step(Path(str(unit).split("/")[0]))
    if step is None:
        raise ValueError(f"not an evaluation unit: {unit!r}")
    return step


class ValSplitStage(EvalStage):
    """The whole val split of one checkpoint (``accelerate launch … -m trainer.eval.checkpoint --score``).

    None for a DPO run: its val rows are pairs, whose token loss would mix the completions training pushes up with
    those it pushes down (it rises as DPO works); :class:`trainer.eval.preference_stage.PreferenceEvalStage` scores
    them as pairs instead, and each pair's log-probs give a side's loss in SQL (``preference_pairs``)."""

    name = "evaluate"
    progress_unit = "rows"

    def units(self) -> Sequence[str | None]:
        wanted = self.scope.val_split and self.scope.dpo is None
        return [step_dir_name(step) for step in self.scope.steps] if wanted else []

    def label(self, unit: str | None) -> str:
        return f"evaluate step {step_of(unit)}"

    def inputs(self, unit: str | None) -> Inputs:
        files = self.checkpoint_files(step_of(unit))
        for path in (self.paths.shard_index, self.paths.tokenizer):
            files.update({name: digest for name, _, digest in file_stats(self.paths.root, path)})
        settings = {"precision": self.scope.precision, "document_masking": self.scope.document_masking}
        if self.scope.sft:  # only then: a pretraining run's recorded inputs stay as they were
            settings["scored_tokens"] = "trained"
        return Inputs(settings=settings, files=files)

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.eval_result(step_of(unit), VAL_SPLIT_TASK)]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        step = step_of(unit)
        if refused_checkpoint(self.paths, step, {VAL_SPLIT_TASK: ""}):
            raise_if_failed(self.paths, step, VAL_SPLIT_TASK)
        self.launch(step, on_progress, score=True, export=False)
        return raise_if_failed(self.paths, step, VAL_SPLIT_TASK)


class ExportStage(EvalStage):
    """A checkpoint's Hugging Face export for the downstream tasks (``model/`` when it holds that step)."""

    name = "export"

    def units(self) -> Sequence[str | None]:
        return [step_dir_name(step) for step in self.scope.steps] if self.scope.tasks else []

    def label(self, unit: str | None) -> str:
        return f"export step {step_of(unit)}"

    def inputs(self, unit: str | None) -> Inputs:
        return Inputs(files=self.checkpoint_files(step_of(unit)))

    def outputs(self, unit: str | None) -> list[Path]:
        return [export_state_file(model_folder(self.paths, step_of(unit)))]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        step = step_of(unit)
        folder = model_folder(self.paths, step)
        if folder == self.paths.model:  # the trainer's own export holds this step
            return {"step": step, "model": folder.relative_to(self.paths.root).as_posix()}
        if refused_checkpoint(self.paths, step, self.scope.tasks):
            raise EvaluationFailed(f"step {step}: the checkpoint is damaged; see its results")
        self.launch(step, on_progress, score=False, export=True)
        return {"step": step, "model": model_folder(self.paths, step).relative_to(self.paths.root).as_posix()}


class DownstreamStage(EvalStage):
    """One lm-eval task on one checkpoint's export."""

    name = "downstream"
    reads = ("eval-tasks", "export")
    launches = False
    progress_unit = "requests"

    def units(self) -> Sequence[str | None]:
        return [f"{step_dir_name(step)}/{task}" for step in self.scope.steps for task in sorted(self.scope.tasks)]

    def label(self, unit: str | None) -> str:
        return f"downstream-{_task_of(unit)}-step-{step_of(unit)}"

    def bar(self, unit: str | None) -> str:
        return f"{_task_of(unit)} step {step_of(unit)}"

    def inputs(self, unit: str | None) -> Inputs:
        config = self.scope.config
        settings = {"task": self.scope.tasks[_task_of(unit)], "batch_size": config.batch_size, "limit": config.limit}
        if self.scope.sft:  # only then: a pretraining run's recorded inputs stay as they were
            settings["chat_template"] = True
        return Inputs(settings=settings, files=self.checkpoint_files(step_of(unit)))

    def outputs(self, unit: str | None) -> list[Path]:
        return [self.paths.eval_result(step_of(unit), _task_of(unit))]

    def run(self, unit: str | None, on_progress: Progress) -> dict[str, Any]:
        step, task = step_of(unit), _task_of(unit)
        folder = self.paths.checkpoint(step)
        checkpoint_fp = checkpoint_fingerprint(folder) if (folder / MANIFEST_NAME).is_file() else ""
        result = run_downstream_task(self.paths, model_folder(self.paths, step), step, task, checkpoint_fp,
                                     self.scope.tasks[task], list(self.scope.include), self.scope.config,
                                     self.scope.trusted, on_progress=on_progress, chat_template=self.scope.sft)
        self.log(describe(result))
        return raise_if_failed(self.paths, step, task)


def _task_of(unit: str | None) -> str:
    return str(unit).split("/", 1)[1]


def model_folder(paths: RunPaths, step: int) -> Path:
    """The Hugging Face export of ``step``: ``model/`` when it holds that step, else ``eval/models/step-N/``."""
    return paths.model if exported_step(paths.model) == step else paths.eval_model(step)


def refused_checkpoint(paths: RunPaths, step: int, tasks: Mapping[str, str]) -> bool:
    """True (and a failed result for each task, naming the folder and what is wrong) when the checkpoint fails
    its manifest check: it cannot be evaluated until restored."""
    from trainer.checkpoint.checkpointer import verify_checkpoint  # imports torch

    folder = paths.checkpoint(step)
    problem = verify_checkpoint(folder)
    if problem is None:
        return False
    message = f"{folder}: {problem}; restore a good copy of the checkpoint (or delete it) and re-run `tokenmill eval`."
    for task, task_fp in tasks.items():
        write_result(paths, step, task, "", task_fp, error=message)
    return True


def raise_if_failed(paths: RunPaths, step: int, task: str) -> dict[str, Any]:
    """The unit's summary when its result is ``ok``; EvaluationFailed (no marker: tried again) otherwise."""
    result = read_result(paths.eval_result(step, task))
    if result is None or result.get("status") != "ok":
        error = result.get("error") if result is not None else "no result written"
        raise EvaluationFailed(f"{task} @ step {step}: {error}")
    return {"step": step, "task": task, "num_rows": len(result.get("rows", []))}
